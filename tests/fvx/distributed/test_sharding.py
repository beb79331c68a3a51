"""fvx.distributed.sharding: layout and padding (pure), single-process behaviour, and one 2-process gloo run
(tests/helpers/dist_worker.py) whose gradients, optimizer step, EMA, frozen bf16 teacher and checkpoint views must equal
a single process's."""
import math

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from fvx.core import ema, grad, optim, role, tree
from fvx.core.tree import global_norm
from fvx.distributed import gather_schedule, gathers, processes, sharding
from fvx.storage import checkpoint
from fvx_models import build, wan

import dist_worker as worker  # noqa: E402
from gloo import assert_close_rel, launch_workers  # noqa: E402

REL = 1e-6  # fp32: the 2-process sums differ from one process's only in reduction order
ADAM_REL = 1e-5  # after AdamW steps (see test_two_process_adamw_step_and_ema_on_local_shards_equal_one_process)


# ---------------------------------------------------------------------------------------------------- layout (pure)


def test_plan_shards_dim0_then_the_first_divisible_dim_then_pads_dim0():
    shapes = {"w": (6, 4), "table": (1, 6, 96), "odd": (5, 7), "bias": (5120,), "conv": (3, 16, 1, 2, 2)}
    assert sharding.plan(shapes, 2) == {
        "w": (shapes["w"], 0, 6), "table": (shapes["table"], 1, 6), "odd": (shapes["odd"], 0, 6),
        "bias": (shapes["bias"], 0, 5120), "conv": (shapes["conv"], 1, 16)}
    world3 = sharding.plan(shapes, 3)
    assert world3["w"] == ((6, 4), 0, 6) and world3["table"] == ((1, 6, 96), 1, 6)
    assert world3["odd"] == ((5, 7), 0, 6) and world3["bias"] == ((5120,), 0, 5121)
    assert world3["conv"] == ((3, 16, 1, 2, 2), 0, 3)
    assert sharding.plan(shapes, 4)["table"] == ((1, 6, 96), 2, 96)
    assert world3["odd"].local_shape(3) == (2, 7) and world3["odd"].padded_shape() == (6, 7)


def test_local_slices_are_even_and_the_last_ones_hold_the_zero_padding():
    full = torch.arange(35.0).reshape(5, 7)
    spec = sharding.shard_spec(full.shape, 3)
    slices = [sharding.local_slice(full, spec, i, 3) for i in range(3)]
    assert [tuple(s.shape) for s in slices] == [(2, 7)] * 3
    torch.testing.assert_close(torch.cat(slices), torch.cat([full, torch.zeros(1, 7)]), rtol=0, atol=0)
    spec = sharding.shard_spec((1, 3), 4)  # more ranks than rows: whole shards of padding
    slices = [sharding.local_slice(torch.ones(1, 3), spec, i, 4) for i in range(4)]
    assert [s.sum().item() for s in slices] == [3.0, 0.0, 0.0, 0.0]


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="'scalar'.*0-dim"):
        sharding.plan({"scalar": ()}, 2)
    with pytest.raises(ValueError, match="shard_size"):
        sharding.plan({"w": (4,)}, 0)


# ------------------------------------------------------------------------------------------------- single process


def test_init_distributed_without_torchrun_is_a_single_process():
    d = processes.init_distributed({})
    assert (d.rank, d.world, d.local_rank, d.backend) == (0, 1, 0, None)
    assert processes.init_jax_distributed(d) is False


@pytest.mark.parametrize("env, culprit", [
    ({"WORLD_SIZE": "2"}, "RANK"),
    ({"WORLD_SIZE": "2", "RANK": "x"}, "RANK='x'"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, "MASTER_ADDR"),
])
def test_init_distributed_names_the_bad_variable(env, culprit):
    with pytest.raises(ValueError, match=culprit):
        processes.init_distributed(env)


def test_make_mesh_needs_torch_distributed():
    with pytest.raises(ValueError, match="not initialised"):
        processes.make_mesh(1, 2)


def test_single_process_gather_casts_and_returns_fp32_grads():
    w = torch.linspace(-1, 1, 12).reshape(3, 4)
    spec = sharding.shard_spec(w.shape, 1)
    (g,) = torch.autograd.grad(gathers.gather(w.requires_grad_(), spec, processes.Group(), torch.bfloat16).sum(), [w])
    assert g.dtype == torch.float32 and torch.equal(g, torch.ones(3, 4))


def test_single_process_norm_equals_the_unsharded_one():
    grads = {"a": torch.linspace(-3, 2, 10), "b": torch.linspace(0, 1, 6).reshape(2, 3)}
    torch.testing.assert_close(processes.global_norm_sharded(grads, processes.Group()), global_norm(grads))
    assert processes.dp_max(3, processes.Group()) == 3


def test_unit_gathers_need_units_of_one_structure_and_sharded_call_needs_routed_units():
    layout = sharding.plan({"blocks.0.w": (4, 2), "blocks.1.w": (2, 4)}, 2)
    with pytest.raises(ValueError, match="'blocks.1.' is laid out unlike"):
        gather_schedule.UnitGathers({"blocks": ["blocks.0.", "blocks.1."]}, layout, processes.Group())
    with pytest.raises(ValueError, match="'blocks.2.' has no params"):
        gather_schedule.UnitGathers({"blocks": ["blocks.0.", "blocks.2."]}, layout, processes.Group())
    schedule = gather_schedule.UnitGathers({"blocks": ["blocks.0."]}, layout, processes.Group())
    with pytest.raises(ValueError, match="install_units"):
        gathers.sharded_call(build.skeleton(wan.WanConfig()), {}, {}, gathers=schedule)


def test_shards_carry_their_layout_through_tree_maps_and_gradients():
    layout = sharding.plan({"a": (4, 2), "b": (3,)}, 2)
    shards = sharding.Shards({"a": torch.ones(2, 2), "b": torch.zeros(2)}, layout)
    doubled = tree.map_tensors(lambda x: 2 * x, shards)
    assert isinstance(doubled, sharding.Shards) and doubled.layout == layout and torch.equal(doubled["a"], 2 * shards["a"])
    _, grads = grad.value_and_grad(lambda p: (p["a"] ** 2).sum() + p["b"].sum())(shards)
    assert isinstance(grads, sharding.Shards) and grads.layout == layout
    part = shards.select(["b"])
    assert list(part) == ["b"] and part.layout == {"b": layout["b"]} and part["b"] is shards["b"]
    with pytest.raises(ValueError, match="no layout for"):
        sharding.Shards({"c": torch.ones(1)}, layout)


# --------------------------------------------------------------------------------------------------- two processes


# The two-process tests share one launch of 2 processes (imports and compiling: about 15 s on 2 idle cores): slow.


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    """Launch 2 gloo ranks of dist_worker.py once; what rank 0 saved."""
    out = tmp_path_factory.mktemp("dist")
    with checkpoint.Checkpoints(out / "ck1", checkpoint.CheckpointConfig(async_save=False)) as saving:
        saving.save(worker.single_process_state(), config={"config": {}}, meta={"world_size": 1})
    return launch_workers(worker.__file__, out, 2), out


@pytest.fixture(scope="module")
def reference():
    """Single-process loss, grads, AdamW step and EMA on the whole global batch."""
    params, batch = worker.problem()
    module = build.skeleton(wan.WanConfig())

    def loss_fn(p):
        return worker.mse(worker.forward(module, p, batch), batch["target"])

    loss, grads = grad.value_and_grad(loss_fn)(params)
    tx = optim.adamw(worker.LR, weight_decay=worker.WEIGHT_DECAY)
    norm = global_norm(grads)
    clipped = role.clip_({n: g.clone() for n, g in grads.items()}, norm, worker.MAX_NORM)
    stepped, opt_state = optim.step_(tx, {n: p.clone() for n, p in params.items()}, clipped, tx.init(params))
    shadow = ema.ema_update(ema.ema_init(params), stepped, worker.EMA_DECAY)
    return dict(params=params, batch=batch, module=module, loss=loss, grads=grads, norm=norm, stepped=stepped,
                shadow=shadow, mu=opt_state[0].mu)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["grads_rematFalse_none_reshardTrue", "grads_rematFalse_none_reshardFalse",
                                 "grads_rematTrue_none_reshardTrue", "grads_rematFalse_blocks_reshardTrue",
                                 "grads_rematFalse_blocks_reshardFalse", "grads_compiled", "grads_replicated"])
def test_two_process_grads_equal_one_process(run2, reference, key):
    results, _ = run2
    assert_close_rel(results[key], reference["grads"])
    loss_key = "loss" + key.removeprefix("grads")
    torch.testing.assert_close(results[loss_key], reference["loss"], rtol=REL, atol=0)


@pytest.mark.slow
def test_two_process_many_gathers_in_flight_give_the_full_params(run2):
    results, _ = run2
    assert results["many_in_flight"]


@pytest.mark.slow
def test_two_process_shards_are_even_halves_and_compile_one_block_graph(run2, reference):
    results, _ = run2
    full_bytes = sum(p.numel() * p.element_size() for p in reference["params"].values())
    assert results["local_shapes_equal"]
    assert results["local_bytes"] == full_bytes // 2
    assert results["compiled_graphs"] == 1  # both blocks, two steps, forward and recompute: one graph
    # Bucketed: the root and each block gather once and reduce-scatter once; the blocks gather again in the backward
    # unless their full params were kept (reshard_after_forward=False). Under remat the again is the recompute's.
    # Prefetched: every forward gather is issued ahead (the first beside the root's); in the backward only the first
    # unit to run (the last block) gathers on demand, and issues the one before it.
    for key, units, collectives, ahead in (("rematFalse_none_reshardTrue", 2, 8, (3, 1)),
                                           ("rematFalse_none_reshardFalse", 2, 6, (2, 0)),
                                           ("rematTrue_none_reshardTrue", 4, 8, (3, 1)),
                                           ("rematFalse_blocks_reshardTrue", 2, 8, (3, 1)),
                                           ("rematFalse_blocks_reshardFalse", 2, 6, (2, 0))):
        assert (results[f"unit_gathers_{key}"], results[f"collectives_{key}"]) == (units, collectives), key
        assert tuple(results[f"ahead_{key}"].values()) == ahead, (key, results[f"ahead_{key}"])
        alive, full = results[f"alive_{key}"]  # the units' full params alive between the forward and the backward
        assert full == units * len([n for n in reference["params"] if n.startswith("blocks.0.")]), key
        assert alive == 0 if key.endswith("reshardTrue") else alive > 0, (key, alive, full)  # kept: the weights
    assert results["dist"][:2] == (0, 2) and results["dist"][4] == "gloo"


@pytest.mark.slow
def test_two_process_adamw_step_and_ema_on_local_shards_equal_one_process(run2, reference):
    results, _ = run2
    torch.testing.assert_close(results["grad_norm"], reference["norm"], rtol=REL, atol=0)
    assert reference["norm"] > worker.MAX_NORM  # the clip bites, so its global norm matters
    # Adam divides by sqrt(nu): where a gradient is tiny its reduction-order rounding grows, hence ADAM_REL here
    # (measured on one thread: 3e-7 of the largest, 3.1e-5 in norm for the zero-initialised blocks.0.norm2.bias).
    assert_close_rel(results["params_after_step"], reference["stepped"], rel=ADAM_REL)
    assert_close_rel(results["ema_after_step"], reference["shadow"], rel=ADAM_REL)
    assert results["moments_are_shards"]  # AdamW's moments and the EMA carry the params' layout


@pytest.mark.slow
def test_two_process_frozen_bf16_teacher_matches_one_process(run2, reference):
    results, _ = run2
    params, batch, module = reference["params"], reference["batch"], reference["module"]
    dtypes = worker.teacher_dtypes(params)
    sharded_bytes = sum(p.numel() * (4 if dtypes[n] == torch.float32 else 2) for n, p in params.items()) // 2
    assert results["teacher_local_bytes"] == sharded_bytes
    with torch.no_grad():
        want = worker.forward(module, {n: p.to(dtypes[n]) for n, p in params.items()}, batch, dtype=torch.bfloat16)
    torch.testing.assert_close(results["teacher_out"], want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load in this (single) process
def test_two_process_padded_param_gradient_and_checkpoint(run2, reference):
    results, out = run2
    odd = reference["params"]["proj_out.weight"][: worker.ODD_SHAPE[0], : worker.ODD_SHAPE[1]]
    assert results["odd_local_shape"] == (3, 3)
    w = odd.clone().requires_grad_()
    (want,) = torch.autograd.grad(worker.odd_loss(w, reference["batch"]["odd_x"]), [w])
    assert_close_rel({"odd": results["odd_grad"]}, {"odd": want})
    padded = results["odd_grad_padded"]
    assert padded.shape == (6, 3) and torch.equal(padded[5], torch.zeros(3))
    assert torch.equal(results["odd_view_full"], odd)
    # The checkpoint (saved after the AdamW step, from views of the updated shards) holds unpadded tensors: one
    # process loads it into plain full-shaped tensors.
    stepped = results["params_after_step"]
    loaded = {"params": {n: torch.zeros_like(p) for n, p in stepped.items()}, "odd": torch.zeros(worker.ODD_SHAPE),
              "mu": {n: torch.zeros_like(p) for n, p in stepped.items()}, "count": torch.zeros((), dtype=torch.int64)}
    dcp.load(loaded, checkpoint_id=str(out / "dcp"), no_dist=True)
    assert torch.equal(loaded["odd"], odd) and loaded["count"].item() == 1
    for name, p in stepped.items():
        assert torch.equal(loaded["params"][name], p), name
    assert_close_rel(loaded["mu"], reference["mu"])


@pytest.mark.slow
def test_two_process_jax_distributed_sees_both_processes(run2):
    results, _ = run2
    assert results["jax_started"] is True and results["jax_process_count"] == 2


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load in this (single) process
def test_two_process_checkpoint_of_params_outside_the_models_layout_restores_on_one_and_two_processes(run2):
    """fvx.storage.checkpoint on a mesh (orbax + DCP) of a state whose second role's params have names and a layout of
    their own (an adapter with a padded param): saved on 2 ranks, restored exactly on 2 (the workers compared, layouts
    kept) and in this process as full tensors (padding stripped); a single-process checkpoint restores exactly as
    shards."""
    results, out = run2
    assert results["ck_2to2_equal"] and results["ck_1to2_equal"]
    want = results["ck_saved_full"]
    with checkpoint.Checkpoints(out / "ck2") as reading:
        assert reading.steps() == [7] and reading.is_sharded(7)
        assert reading.read_json(7, "meta") == {"world_size": 2, "step": 7}
        assert reading.specs(7)["roles.adapter.params.odd"] == checkpoint.TensorSpec(worker.ODD_SHAPE, np.float32)
        got = reading.restore(7, tree.map_tensors(torch.zeros_like, want))
        assert torch.equal(reading.read(7, ("roles", "adapter", "params"))["odd"], want.roles["adapter"].params["odd"])
    leaves = tree.tensor_leaves(got)
    assert len(leaves) == len(tree.tensor_leaves(want)) and tuple(got.roles["adapter"].params["odd"].shape) == (5, 3)
    assert all(torch.equal(a, b) for a, b in zip(leaves, tree.tensor_leaves(want)))


@pytest.mark.slow
def test_two_process_dmd2_with_a_teacher_of_another_size_equals_one_process(run2):
    """Three DMD2 steps (critic, student and critic, critic) with a tiny-deep teacher on 2 ranks of 2 micro-batches
    each: the same metrics (per-sample exits, score timesteps and normalisers), student, critic and EMA as one
    process on the whole batch in one."""
    results, _ = run2
    metrics, roles = worker.dmd2_run()
    assert [m["update_student"] for m in metrics] == [0.0, 1.0, 0.0]
    for got, want in zip(results["dmd2_metrics"], metrics):
        assert got.keys() == want.keys()
        for name in want:
            assert math.isclose(got[name], want[name], rel_tol=REL, abs_tol=1e-9), (name, got[name], want[name])
    assert metrics[1]["grad_norm/student"] > 0.05 and metrics[0]["grad_norm/critic"] > 0.05  # the clips bite
    assert roles.keys() == results["dmd2_roles"].keys() == {"student.params", "student.ema", "critic.params"}
    # Adam divides by sqrt(nu), so near-zero gradients amplify reduction-order rounding element by element (measured
    # after 3 steps: up to 1.3e-5 of the largest element, critic); each role as a whole differs by 5e-7 at most.
    for name, want in roles.items():
        got = results["dmd2_roles"][name]
        assert list(got) == list(want)
        scale = max(w.abs().max() for w in want.values())
        assert max((got[n] - want[n]).abs().max() for n in want) <= 3e-5 * scale, name
        distance = math.sqrt(sum(float(((got[n] - want[n]) ** 2).sum()) for n in want))
        assert distance <= 2e-6 * math.sqrt(sum(float((w ** 2).sum()) for w in want.values())), name


@pytest.mark.slow
@pytest.mark.parametrize("name", worker.FAMILIES)
def test_two_process_fine_tuning_of_every_family_equals_one_process_on_half_the_state(run2, name):
    results, _ = run2
    losses, local_bytes, whole = results["families"][name]
    want, _, _ = worker.family_run(name)
    # the first loss is before any update (REL); later ones follow AdamW steps, which grow the rounding (ADAM_REL)
    for step, (got, expected) in enumerate(zip(losses, want)):
        assert math.isclose(got, expected, rel_tol=REL if step == 0 else ADAM_REL), (name, losses, want)
    assert abs(2 * local_bytes - whole) <= 0.01 * whole, (local_bytes, whole)  # half, up to padding and the counts


@pytest.mark.slow
def test_two_process_experts_run_on_every_rank_even_without_samples_of_their_side(run2):
    """Wan 2.2 A14B's routing on 2 ranks, rank 0 holding only high-noise samples and rank 1 only low-noise ones:
    every rank runs both experts (the idle one on zero weight), so the gathers match and the loss and gradients of
    both experts equal one process's."""
    results, _ = run2
    loss, grads = results["moe"]
    want_loss, want_grads = worker.moe_run()
    assert math.isclose(loss, want_loss, rel_tol=REL)
    assert_close_rel(grads, want_grads)
    assert grads["transformer.proj_out.weight"].abs().sum() > 0 and grads["transformer_2.proj_out.weight"].abs().sum() > 0


@pytest.mark.slow
def test_two_process_joint_video_audio_fine_tuning_equals_one_process(run2):
    """MiniMax-H3 (video and audio, one sample per forward): one sample a rank on 2 ranks equals 2 micro-batches of one
    in one process: the summed loss, each modality's, and the params after the steps."""
    results, _ = run2
    metrics, params = results["joint"]
    want_metrics, want_params = worker.joint_run()
    for got, want in zip(metrics, want_metrics):
        for name in ("loss", "video_finetune_loss", "audio_finetune_loss"):
            assert math.isclose(got[name], want[name], rel_tol=REL), (name, got, want)
    assert_close_rel(params, want_params)


@pytest.mark.slow
def test_two_process_block_causal_wan_equals_one_process(run2):
    """The block-causal Wan's per-frame, teacher-forced and KV-cached forwards on sharded, compiled units, against
    one process's eager units (compiled units equal eager ones: tests/fvx_models/test_wan_causal.py)."""
    results, _ = run2
    loss, grads = results["causal"]
    want_loss, want_grads = worker.causal_run(compile="none")
    assert math.isclose(loss, want_loss, rel_tol=REL)
    assert_close_rel(grads, want_grads)
