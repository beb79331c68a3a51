"""fvx.distributed.memory (dry-run bytes per rank) against hand numbers and the skeleton's own sizes (what a unit saves
is measured per family in tests/fvx_models/test_families.py); bench/flops.py against hand numbers and torch's FLOP
counter."""
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from bench import flops
from fvx.core import random
from fvx.distributed import memory
from fvx_models import wan


def spec_of(preset: str, **kwargs) -> memory.ModelSpec:
    return wan.WanConfig(preset=preset, **kwargs).build().memory_spec()


def shapes_of(preset: str) -> dict:
    return dict(spec_of(preset).shapes)


HAND = flops.DitDims(layers=3, dim=4, ffn_dim=8, text_len=3, text_dim=5, in_channels=2, out_channels=2,
                     patch=(1, 2, 2), freq_dim=6)
PER_TOKEN = memory.BlockActivations(fp32_dim=1, compute_dim=2, compute_ffn=3)
HAND_SPEC = memory.ModelSpec(shapes={"w": (4, 4)}, units=(), groups=(memory.UnitGroup("blocks", 3, 4, 8, PER_TOKEN),),
                             dim=4, text_len=3, vae_stride=(4, 8, 8), patch=(1, 2, 2), compute_bytes=2, remat=True)


# ------------------------------------------------------------------------------------------------------ video size


def test_latent_grid_of_81x480x832_under_wan_vae_and_patch():
    grid = memory.latent_grid(81, 480, 832, vae_stride=(4, 8, 8), patch=(1, 2, 2))
    assert grid == (21, 60, 104, 21 * 30 * 52)


@pytest.mark.parametrize("video, culprit", [((80, 480, 832), "frames must be 1"), ((81, 484, 832), "height"),
                                            ((81, 488, 832), "divisible by the patch")])
def test_latent_grid_refuses_sizes_that_do_not_divide(video, culprit):
    with pytest.raises(ValueError, match=culprit):
        memory.latent_grid(*video, vae_stride=(4, 8, 8), patch=(1, 2, 2))


# ----------------------------------------------------------------------------------------------------------- roles


@pytest.mark.parametrize("preset", ["tiny", "wan2.1-t2v-1.3b"])
def test_param_count_is_the_skeletons_and_bytes_scale_as_one_over_world(preset):
    spec = spec_of(preset)
    numel = sum(math.prod(shape) for shape in spec.shapes.values())
    assert memory.local_numel(spec.shapes, 1) == numel
    role = memory.Role("student", spec, trainable=True, ema=True)
    one = memory.role_bytes(role, 1)
    assert one == (4 * numel, 4 * numel, 8 * numel, 4 * numel) and one.total == 20 * numel
    for world in (2, 4, 8):
        assert memory.role_bytes(role, world).total * world == one.total  # every param has a dim 8 divides


def test_padding_rounds_up_per_param():
    shapes = {"odd": (5, 7), "even": (6, 4)}
    assert memory.local_numel(shapes, 3) == 2 * 7 + 2 * 4  # odd is padded to 6 rows
    teacher = memory.Role("teacher", HAND_SPEC._replace(shapes=shapes), trainable=False, param_bytes=2)
    assert memory.role_bytes(teacher, 3) == (2 * 22, 0, 0, 0)


# ----------------------------------------------------------------------------------------------------- activations


def test_activation_formulas_by_hand():
    (group,) = HAND_SPEC.groups
    block = memory.block_activation_bytes(group, tokens=10, compute_bytes=2)
    assert block == 10 * (4 * 1 * 4 + 2 * (2 * 4 + 3 * 8))
    root = 10 * 16 * 4
    remat = memory.activation_bytes(HAND_SPEC, 10, batch=2)
    assert remat == 2 * (3 * 10 * 4 * 2 + 2 * block + root)
    eager = memory.activation_bytes(HAND_SPEC, 10, batch=2, remat=False)
    assert eager == 2 * (4 * block + root)


def test_a_mask_over_the_joint_sequence_adds_a_pair_term():
    """A unit that saves p compute-dtype elements per pair of its S = video + joint tokens (HunyuanVideo 1.5's [B, 1,
    S, S] mask): its linear bytes plus c p S^2."""
    (group,) = HAND_SPEC.groups
    masked = group._replace(saved=group.saved._replace(pairs=1.5, joint_tokens=6))
    linear = memory.block_activation_bytes(group, tokens=10, compute_bytes=2)
    assert memory.block_activation_bytes(masked, tokens=10, compute_bytes=2) == linear + 2 * 1.5 * 16 ** 2


def test_activations_sum_over_unit_groups_and_text_groups_count_text_tokens():
    refiner = memory.UnitGroup("refiner", 2, 4, 8, memory.BlockActivations(1, 0, 0), text_tokens=True)
    spec = HAND_SPEC._replace(groups=HAND_SPEC.groups + (refiner,))
    blocks = memory.block_activation_bytes(HAND_SPEC.groups[0], 10, 2)
    text = memory.block_activation_bytes(refiner, 3, 2)
    assert text == 3 * 4 * 4
    assert memory.activation_bytes(spec, 10, batch=1, remat=False) == 3 * blocks + 2 * text + blocks + 10 * 16 * 4
    assert memory.activation_bytes(spec, 10, batch=1) == (3 * 10 + 2 * 3) * 4 * 2 + 2 * blocks + 10 * 16 * 4


def test_gathered_bytes_by_hand():
    shapes = {"root.w": (4, 4), "blocks.0.w": (4, 8), "blocks.1.w": (4, 6), "blocks.2.w": (4, 2)}
    spec = HAND_SPEC._replace(shapes=shapes, units=("blocks.0.", "blocks.1.", "blocks.2."))
    trainable = memory.Role("student", spec, trainable=True)
    # root full + its fp32 grads, the two largest units' full params (computing, prefetched), one unit's grads
    assert memory.gathered_bytes(trainable, 2, compute_bytes=2) == 16 * (2 + 4) + (32 + 24) * 2 + 32 * (2 + 4)
    kept = memory.Role("student", spec._replace(reshard=False, remat=False), trainable=True)  # every unit's kept
    assert memory.gathered_bytes(kept, 2, compute_bytes=2) == 16 * (2 + 4) + (32 + 24 + 8) * 2 + 32 * (2 + 4)
    remat = memory.Role("student", spec._replace(reshard=False, remat=True), trainable=True)  # recomputes: regathers
    assert memory.gathered_bytes(remat, 2, compute_bytes=2) == memory.gathered_bytes(trainable, 2, compute_bytes=2)
    frozen = memory.Role("teacher", spec, trainable=False, param_bytes=2)
    assert memory.gathered_bytes(frozen, 2, compute_bytes=2) == 16 * 2 + (32 + 24) * 2
    assert memory.gathered_bytes(trainable, 1, compute_bytes=2) == (16 + 32 + 24 + 8) * 2
    assert memory.gathered_bytes(trainable, 1, compute_bytes=4) == 0


# -------------------------------------------------------------------------------------------------------- estimate


def test_estimate_sums_roles_activations_and_gathers_and_gives_a_verdict():
    spec = spec_of("tiny", compute_dtype="bf16", remat=True)
    deep = spec_of("tiny-deep", compute_dtype="bf16", remat=True)
    roles = [memory.Role("generator", spec, True, ema=True), memory.Role("teacher", deep, False, param_bytes=2)]
    est = memory.estimate(roles, shard_size=2, tokens=64, batch_per_rank=1)
    by_role = sum(memory.role_bytes(r, 2).total for r in roles)
    assert est.total == by_role + est.activations + est.gathered
    assert est.activations == memory.activation_bytes(spec, 64, 1)  # the trainable role's, not the frozen teacher's
    assert est.gathered == max(memory.gathered_bytes(r, 2) for r in roles)
    assert est.fits
    table = memory.format_table(est, "tiny")
    assert "generator" in table and "teacher" in table and table.splitlines()[-1].startswith("fits in")
    tight = est._replace(capacity=est.total - 1)
    assert not tight.fits and "does NOT fit" in memory.format_table(tight)
    with pytest.raises(ValueError, match="batch_per_rank"):
        memory.estimate(roles, shard_size=2, tokens=64, batch_per_rank=0)


def test_fourteen_b_dmd2_on_8_ranks_at_81x480x832():
    """The dry run's question: Wan 2.1 14B generator (+EMA), critic and bf16 teacher on 8 H200, remat, batch 1."""
    spec = spec_of("wan2.1-t2v-14b", compute_dtype="bf16", remat=True)
    grid = memory.latent_grid(81, 480, 832, vae_stride=(4, 8, 8), patch=(1, 2, 2))
    roles = [memory.Role("generator", spec, True, ema=True), memory.Role("critic", spec, True),
             memory.Role("teacher", spec, False, param_bytes=2)]
    est = memory.estimate(roles, shard_size=8, tokens=grid.tokens, batch_per_rank=1)
    numel = memory.local_numel(spec.shapes, 1)
    assert 14.0e9 < numel < 14.5e9
    assert sum(r.total for _, r in est.roles) == (20 + 16 + 2) * numel // 8
    assert est.fits


# ----------------------------------------------------------------------------------------------------------- FLOPs


def test_block_flops_by_hand():
    terms = flops.block_flops(HAND, tokens=2)
    assert terms == {"qkv": 6 * 2 * 16, "self_attention": 4 * 4 * 4, "self_out": 2 * 2 * 16,
                     "cross_q_out": 4 * 2 * 16, "cross_kv": 4 * 3 * 16, "cross_attention": 4 * 2 * 3 * 4,
                     "ffn": 4 * 2 * 4 * 8}
    assert flops.root_flops(HAND, 2) == {"patch_embedding": 2 * 2 * 4 * 2 * 4, "proj_out": 2 * 2 * 4 * 2 * 4,
                                         "text_embedder": 2 * 3 * (5 * 4 + 16), "time_embedder": 2 * (6 * 4 + 16)
                                         + 12 * 16}
    forward = 3 * sum(terms.values()) + sum(flops.root_flops(HAND, 2).values())
    assert flops.forward_flops(HAND, 2, batch=5) == 5 * forward
    assert flops.training_flops(HAND, 2, batch=5) == 15 * forward
    assert flops.mfu(989e12, 2.0) == 0.5


def test_forward_flops_equal_torchs_flop_counter_on_the_tiny_wan():
    model = wan.WanConfig(preset="tiny").build()
    params = model.weights.init(random.key(0))
    x = random.normal(random.key(1), (2, 16, 4, 8, 8))
    cond = {"text": random.normal(random.key(2), (2, 5, 32)), "text_mask": torch.ones(2, 5)}
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:  # math SDPA: counted matmuls
        model.apply(params, x, torch.tensor([1.0, 500.0]), cond)
    tokens = math.prod((4, 8 // 2, 8 // 2))
    assert counter.get_total_flops() == flops.forward_flops(flops.wan_dims("tiny", 5), tokens, batch=2)
