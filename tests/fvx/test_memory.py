"""fvx.memory (dry-run bytes per rank) against hand numbers, the skeleton's own sizes and a measurement of what a block
saves; bench/flops.py against hand numbers and torch's FLOP counter."""
import math

import pytest
import torch
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from bench import flops
from fvx import memory, random
from fvx_models import wan


def shapes_of(preset: str) -> dict:
    return {name: tuple(p.shape) for name, p in wan.skeleton(preset).named_parameters()}


HAND = memory.DitDims(layers=3, dim=4, ffn_dim=8, text_len=3, text_dim=5, in_channels=2, out_channels=2,
                      patch=(1, 2, 2), freq_dim=6)


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
    module = wan.skeleton(preset)
    shapes = shapes_of(preset)
    numel = sum(p.numel() for p in module.parameters())
    assert memory.local_numel(shapes, 1) == numel
    role = memory.Role("student", shapes, trainable=True, ema=True)
    one = memory.role_bytes(role, 1)
    assert one == (4 * numel, 4 * numel, 8 * numel, 4 * numel) and one.total == 20 * numel
    for world in (2, 4, 8):
        assert memory.role_bytes(role, world).total * world == one.total  # every param has a dim 8 divides


def test_padding_rounds_up_per_param():
    shapes = {"odd": (5, 7), "even": (6, 4)}
    assert memory.local_numel(shapes, 3) == 2 * 7 + 2 * 4  # odd is padded to 6 rows
    teacher = memory.Role("teacher", shapes, trainable=False, param_bytes=2)
    assert memory.role_bytes(teacher, 3) == (2 * 22, 0, 0, 0)


# ----------------------------------------------------------------------------------------------------- activations


def test_activation_formulas_by_hand():
    per_token = memory.BlockActivations(fp32_dim=1, compute_dim=2, compute_ffn=3)
    block = memory.block_activation_bytes(HAND, tokens=10, compute_bytes=2, per_token=per_token)
    assert block == 10 * (4 * 1 * 4 + 2 * (2 * 4 + 3 * 8))
    root = 10 * 16 * 4
    remat = memory.activation_bytes(HAND, 10, batch=2, compute_bytes=2, remat=True, per_token=per_token)
    assert remat == 2 * (3 * 10 * 4 * 2 + 2 * block + root)
    eager = memory.activation_bytes(HAND, 10, batch=2, compute_bytes=2, remat=False, per_token=per_token)
    assert eager == 2 * (4 * block + root)


def saved_bytes_of_one_block(tokens_shape=(1, 16, 4, 16, 16), text_len=5) -> tuple[int, int]:
    """(bytes a tiny Wan block saves for its backward in bf16, its tokens), measured with saved-tensor hooks; the
    block's params and inputs are not counted."""
    module = wan.skeleton("tiny")
    params = {n: p.to(torch.float32 if wan._keeps_fp32(module, n) else torch.bfloat16)
              for n, p in wan.init(module, random.key(0)).items()}
    x = random.normal(random.key(1), tokens_shape).to(torch.bfloat16)
    text = random.normal(random.key(2), (1, text_len, 32)).to(torch.bfloat16)
    captured = []
    hook = module.blocks[0].register_forward_pre_hook(lambda _, args: captured.append(args))
    with torch.no_grad():
        functional_call(module, (params, dict(module.named_buffers())), (x, torch.tensor([500.0]), text),
                        {"return_dict": False})
    hook.remove()
    hidden, enc, temb, rope = [a.detach() for a in captured[0][:3]] + [captured[0][3]]
    hidden.requires_grad_()
    block_params = {n[len("blocks.0."):]: p.detach().requires_grad_() for n, p in params.items()
                    if n.startswith("blocks.0.")}
    inputs = [*block_params.values(), hidden, enc, temb, *rope]
    skip = {t.untyped_storage().data_ptr() for t in inputs}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        functional_call(module.blocks[0], block_params, (hidden, enc, temb, rope))
    return sum(saved.values()), hidden.shape[1]


def test_block_activation_estimate_matches_what_a_wan_block_saves():
    measured, tokens = saved_bytes_of_one_block()
    estimate = memory.block_activation_bytes(wan.dims("tiny", 5), tokens, compute_bytes=2)
    assert abs(estimate - measured) <= 0.05 * measured, (estimate, measured)


def test_gathered_bytes_by_hand():
    shapes = {"root.w": (4, 4), "blocks.0.w": (4, 8), "blocks.1.w": (4, 6)}
    units = ["blocks.0.", "blocks.1."]
    trainable = memory.Role("student", shapes, trainable=True)
    assert memory.gathered_bytes(trainable, units, 2, compute_bytes=2) == 16 * (2 + 4) + 32 * (2 + 2 + 4)
    frozen = memory.Role("teacher", shapes, trainable=False, param_bytes=2)
    assert memory.gathered_bytes(frozen, units, 2, compute_bytes=2) == 16 * 2 + 32 * 2
    assert memory.gathered_bytes(trainable, units, 1, compute_bytes=2) == (16 + 32 + 24) * 2
    assert memory.gathered_bytes(trainable, units, 1, compute_bytes=4) == 0


# -------------------------------------------------------------------------------------------------------- estimate


def test_estimate_sums_roles_activations_and_gathers_and_gives_a_verdict():
    shapes = shapes_of("tiny")
    roles = [memory.Role("generator", shapes, True, ema=True), memory.Role("teacher", shapes, False, param_bytes=2)]
    dims = wan.dims("tiny", 8)
    est = memory.estimate(roles, shard_size=2, dims=dims, tokens=64, batch_per_rank=1, units=["blocks.0.", "blocks.1."])
    by_role = sum(memory.role_bytes(r, 2).total for r in roles)
    assert est.total == by_role + est.activations + est.gathered
    assert est.activations == memory.activation_bytes(dims, 64, 1)
    assert est.fits
    table = memory.format_table(est, "tiny")
    assert "generator" in table and "teacher" in table and table.splitlines()[-1].startswith("fits in")
    tight = est._replace(capacity=est.total - 1)
    assert not tight.fits and "does NOT fit" in memory.format_table(tight)
    with pytest.raises(ValueError, match="batch_per_rank"):
        memory.estimate(roles, shard_size=2, dims=dims, tokens=64, batch_per_rank=0)


def test_fourteen_b_dmd2_on_8_ranks_at_81x480x832():
    """The dry run's question: Wan 2.1 14B generator (+EMA), critic and bf16 teacher on 8 H200, remat, batch 1."""
    shapes = shapes_of("wan2.1-t2v-14b")
    grid = memory.latent_grid(81, 480, 832, vae_stride=(4, 8, 8), patch=(1, 2, 2))
    roles = [memory.Role("generator", shapes, True, ema=True), memory.Role("critic", shapes, True),
             memory.Role("teacher", shapes, False, param_bytes=2)]
    est = memory.estimate(roles, shard_size=8, dims=wan.dims("wan2.1-t2v-14b", 512), tokens=grid.tokens,
                          batch_per_rank=1, units=[f"blocks.{i}." for i in range(40)])
    numel = memory.local_numel(shapes, 1)
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
    module = wan.skeleton("tiny")
    params = wan.init(module, random.key(0))
    x = random.normal(random.key(1), (2, 16, 4, 8, 8))
    text = random.normal(random.key(2), (2, 5, 32))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:  # math SDPA: counted matmuls
        wan.apply(module, params, x, torch.tensor([1.0, 500.0]), {"text": text})
    tokens = math.prod((4, 8 // 2, 8 // 2))
    assert counter.get_total_flops() == flops.forward_flops(wan.dims("tiny", 5), tokens, batch=2)
