"""One rank of the 2-process (gloo) checks of fvx.sharding; tests/fvx/test_sharding.py launches two and reads back
what rank 0 saved. Importable without side effects: the test computes its single-process references from the same
``problem`` (tiny Wan params, global batch, loss).

    WORLD_SIZE=2 RANK=r LOCAL_RANK=r MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/fvx/dist_worker.py OUT_DIR
"""
from __future__ import annotations

import sys
import traceback

import optree
import torch

from fvx import checkpoint
from fvx import compile as fvx_compile
from fvx import ema, grad, optim, random, sharding
from fvx.optim_config import AdamWConfig
from fvx.state import RoleState, TrainState
from fvx_methods import dmd2
from fvx_models import wan

UNITS = ("blocks.0.", "blocks.1.")
BATCH = 2  # global
LR, WEIGHT_DECAY, MAX_NORM, EMA_DECAY = 1e-3, 0.01, 0.05, 0.9
ODD_SHAPE = (5, 3)  # no dimension divisible by 2: sharded with padding


def problem() -> tuple[dict, dict]:
    """The tiny Wan params and the global batch (x, t, text, target) every process derives from fixed keys."""
    module = wan.skeleton("tiny")
    k = random.split(random.key(1), 5)
    batch = dict(x=random.normal(k[0], (BATCH, 16, 2, 4, 6)), t=torch.tensor([30.0, 910.5]),
                 text=random.normal(k[1], (BATCH, 5, wan.PRESETS["tiny"]["text_dim"])),
                 target=random.normal(k[2], (BATCH, 16, 2, 4, 6)), odd_x=random.normal(k[3], (4, ODD_SHAPE[0])))
    return wan.init(module, random.key(0)), batch


def odd_param(params: dict) -> torch.Tensor:
    return params["proj_out.weight"][: ODD_SHAPE[0], : ODD_SHAPE[1]].clone()


def checkpoint_layout(params: dict, shard_size: int) -> sharding.Layout:
    """The tiny Wan's layout plus the padded ``odd`` param."""
    return sharding.plan({**{n: p.shape for n, p in params.items()}, "odd": ODD_SHAPE}, shard_size)


def single_process_state() -> TrainState:
    """A full train state (params with the padded ``odd`` one, AdamW moments, no EMA) that the test saves in one
    process and the workers restore as shards."""
    params, _ = problem()
    params = {**params, "odd": odd_param(params)}
    adamw = optim.AdamWState(torch.tensor(4), {n: 2 * p for n, p in params.items()}, {n: p * p for n, p in params.items()})
    return TrainState(torch.tensor(4), random.key(5), {"student": RoleState(params, (optim.EmptyState(), adamw))})


def map_params(fn, state, layout: sharding.Layout):
    """``fn`` applied to every sub-dict of ``state`` keyed like ``layout``."""
    names = set(layout)

    def is_params(node):
        return isinstance(node, dict) and set(node) == names

    return optree.tree_map(lambda node: fn(node) if is_params(node) else node, state, is_leaf=is_params,
                           none_is_leaf=True)


def teacher_dtypes(names) -> dict[str, torch.dtype]:
    """bf16, except the params diffusers keeps in fp32."""
    module = wan.skeleton("tiny")
    return {n: torch.float32 if wan._keeps_fp32(module, n) else torch.bfloat16 for n in names}


def local_batch(batch: dict, rank: int, world: int) -> dict:
    return {k: v.chunk(world)[rank] for k, v in batch.items()}


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out.float() - target) ** 2).mean()


def odd_loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return ((x @ w) ** 2).mean()


def sharded_model(remat: bool, mode: str, layout, group, compute_dtypes=None, calls: list | None = None):
    """A tiny Wan skeleton whose blocks gather their shards (what fvx_models.wan does once integrated); each gather
    of a unit appends to ``calls`` (eager mode)."""
    module = wan.skeleton("tiny", remat=remat)
    gather = sharding.unit_gather(layout, UNITS, group, compute_dtypes)
    if calls is not None:
        def counted(local, gather=gather):
            calls.append(torch.is_grad_enabled())
            return gather(local)
    stats = fvx_compile.install_units(module, UNITS, mode=mode, backend="aot_eager",
                                      gather=gather if calls is None else counted)
    return module, stats


def apply(module, local, b, layout, group, compute_dtypes=None, dtype=None):
    kwargs = dict(hidden_states=b["x"] if dtype is None else b["x"].to(dtype), timestep=b["t"],
                  encoder_hidden_states=b["text"] if dtype is None else b["text"].to(dtype), return_dict=False)
    (out,) = sharding.sharded_call(module, local, dict(module.named_buffers()), (), kwargs, layout=layout, group=group,
                                   compute_dtypes=compute_dtypes)
    return out


def grads_of(module, sharded, b, layout, group, mesh):
    """(dp-mean loss, full grads) of the MSE on this rank's batch slice."""
    def loss_fn(local):
        return mse(apply(module, local, b, layout, group), b["target"])

    loss, g = grad.value_and_grad(loss_fn)(sharding.to_local(sharded))
    return sharding.dp_mean(loss, group), sharding.unshard(sharding.from_local(g, mesh, layout), layout), g


def run(out_dir: str) -> None:
    d = sharding.init_distributed()
    torch.set_num_threads(1)
    params, batch = problem()
    b = local_batch(batch, d.rank, d.world)
    results: dict = {"dist": tuple(d)}

    mesh = sharding.make_mesh(1, 2)  # FSDP over both ranks
    group = sharding.group_of(mesh)
    layout = sharding.plan({n: p.shape for n, p in params.items()}, group.shard_size)
    sharded = sharding.shard(params, mesh)
    results["layout"] = layout
    results["local_bytes"] = sharding.local_bytes(sharded)
    results["local_shapes_equal"] = all(tuple(v.to_local().shape) == layout[n].local_shape(2) for n, v in sharded.items())

    for remat in (False, True):
        calls = []  # a unit gathers once per forward, and once more in the backward under remat
        module, _ = sharded_model(remat, "none", layout, group, calls=calls)
        results[f"loss_remat{remat}"], results[f"grads_remat{remat}"], _ = grads_of(module, sharded, b, layout, group,
                                                                                    mesh)
        results[f"unit_gathers_remat{remat}"] = len(calls)
    module, stats = sharded_model(True, "blocks", layout, group)
    for step in range(2):
        results["loss_compiled"], results["grads_compiled"], local_grads = grads_of(module, sharded, b, layout, group,
                                                                                   mesh)
    results["compiled_graphs"] = stats.graphs

    # One AdamW step (with a global-norm clip that bites) on the local shards, then an EMA update.
    tx = optim.chain(sharding.clip_by_global_norm(MAX_NORM, group), optim.adamw(LR, weight_decay=WEIGHT_DECAY))
    local_params = sharding.to_local(sharded)
    shadow = ema.ema_init(local_params)
    results["grad_norm"] = sharding.global_norm_sharded(local_grads, group)
    opt_state = tx.init(local_params)
    optim.step_(tx, local_params, local_grads, opt_state)
    results["params_after_step"] = sharding.unshard(sharded, layout)  # the DTensors saw the in-place update
    ema.ema_update_(shadow, local_params, EMA_DECAY)
    results["ema_after_step"] = sharding.unshard(sharding.from_local(shadow, mesh, layout), layout)
    results["opt_state_dtensor_leaves"] = sum(
        isinstance(x, torch.distributed.tensor.DTensor)
        for x in torch.utils._pytree.tree_leaves(sharding.dtensor_tree(opt_state, mesh, layout)))

    # HSDP with a replicate dim of 2 and shards of 1 (DDP through the replicate all-reduce).
    ddp_mesh = sharding.make_mesh(2, 1)
    ddp_group = sharding.group_of(ddp_mesh)
    ddp_layout = sharding.plan({n: p.shape for n, p in params.items()}, 1)
    module, _ = sharded_model(True, "none", ddp_layout, ddp_group)
    results["loss_replicated"], results["grads_replicated"], _ = grads_of(
        module, sharding.shard(params, ddp_mesh), b, ddp_layout, ddp_group, ddp_mesh)

    # A frozen teacher: bf16 shards (fp32 where diffusers keeps fp32), bf16 compute, no grad, no optimizer state.
    dtypes = teacher_dtypes(params)
    teacher = sharding.shard(params, mesh, dtype=dtypes)
    results["teacher_local_bytes"] = sharding.local_bytes(teacher)
    module, _ = sharded_model(False, "none", layout, group, dtypes)
    with torch.no_grad():
        out = apply(module, sharding.to_local(teacher), b, layout, group, dtypes, dtype=torch.bfloat16).float()
    everyone = [torch.empty_like(out) for _ in range(d.world)]
    torch.distributed.all_gather(everyone, out)
    results["teacher_out"] = torch.cat(everyone)

    # A param no dimension of which 2 divides: zero-padded even shards; gradient and checkpoint view strip the pad.
    odd = {"odd": odd_param(params)}
    odd_layout = sharding.plan({"odd": ODD_SHAPE}, group.shard_size)
    odd_sharded = sharding.shard(odd, mesh, layout=odd_layout)
    results["odd_local_shape"] = tuple(odd_sharded["odd"].to_local().shape)
    _, odd_grad = grad.value_and_grad(
        lambda local: odd_loss(sharding.gather(local["odd"], odd_layout["odd"], group), b["odd_x"]))(
        sharding.to_local(odd_sharded))
    odd_grad = sharding.from_local(odd_grad, mesh, odd_layout)
    results["odd_grad_padded"] = odd_grad["odd"].full_tensor()
    results["odd_grad"] = sharding.unshard(odd_grad, odd_layout)["odd"]
    view = sharding.checkpoint_view(odd_sharded, odd_layout)
    results["odd_view_full"] = view["odd"].full_tensor()
    import torch.distributed.checkpoint as dcp

    adamw = opt_state[1]  # (clip's empty state, AdamWState(count, mu, nu)) of local shards
    saved = {"params": sharding.checkpoint_tree(sharded, mesh, layout), "odd": view["odd"],
             "mu": sharding.checkpoint_tree(adamw.mu, mesh, layout), "count": adamw.count}
    dcp.save(saved, checkpoint_id=f"{out_dir}/dcp")

    results["jax_started"] = sharding.init_jax_distributed(d)
    import jax

    results["jax_process_count"] = jax.process_count()
    results.update(sharded_checkpoints(out_dir, mesh, params, local_params, opt_state, shadow,
                                       odd_sharded["odd"].to_local()))
    results["dmd2_metrics"], results["dmd2_roles"] = dmd2_run(mesh, d.rank, d.world)
    if d.rank == 0:
        torch.save(results, f"{out_dir}/results.pt")
    torch.distributed.barrier()
    jax.distributed.shutdown()
    torch.distributed.destroy_process_group()


DMD2_STEPS = 3  # critic only, then student and critic (interval 2), then critic only


def dmd2_run(mesh=None, rank: int = 0, world: int = 1) -> tuple[list[dict], dict]:
    """DMD2 on the tiny Wan (CFG with zero uncond, a clip that bites, EMA) for DMD2_STEPS steps on this rank's slice of
    a fixed global batch of 4: (metrics per step as floats, every role's full params and EMA after the last step)."""
    g = random.split(random.key(11), 2)
    batch = {"latents": random.normal(g[0], (4, 16, 2, 4, 6)),
             "text": random.normal(g[1], (4, 5, wan.PRESETS["tiny"]["text_dim"])),
             "text_mask": torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 5, [1.0] * 4 + [0.0]]),
             "sample_index": torch.tensor([3, 8, 13, 21])}
    config = dmd2.DMD2(denoising_steps=(1000, 750, 500), generator_update_interval=2, guidance_scale=3.0,
                       cfg_uncond="zero", ema_decay=0.9, optim=AdamWConfig(lr=1e-3, max_grad_norm=0.05),
                       critic_optim=AdamWConfig(lr=2e-3, max_grad_norm=0.05))
    model = wan.WanConfig(preset="tiny").build(mesh=mesh)
    program = config.build(model, total_steps=DMD2_STEPS, mesh=mesh)
    state = program.init(random.key(7))
    local = {k: v.chunk(world)[rank] for k, v in batch.items()}
    metrics = []
    for _ in range(DMD2_STEPS):
        state, m = program.step_(state, local)
        metrics.append({name: float(value) for name, value in m.items()})
    roles = {f"{role}.{part}": getattr(state.roles[role], part) for role in state.roles for part in ("params", "ema")
             if getattr(state.roles[role], part) is not None}
    if mesh is not None:
        roles = {k: sharding.unshard(sharding.from_local(v, mesh, model.layout), model.layout) for k, v in roles.items()}
    return metrics, roles


def same_everywhere(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank."""
    value = torch.tensor(int(flag))
    torch.distributed.all_reduce(value, torch.distributed.ReduceOp.MIN)
    return bool(value)


def sharded_checkpoints(out_dir: str, mesh, params: dict, local_params: dict, opt_state, shadow: dict,
                        odd_local: torch.Tensor) -> dict:
    """fvx.checkpoint on a mesh: a sharded state saved (for the test to read in one process: 2 -> 1) and restored
    here (2 -> 2), and the test's single-process checkpoint restored as shards (1 -> 2)."""
    layout = checkpoint_layout(params, 2)
    adamw = opt_state[1]
    with_odd = lambda tree, odd: {**tree, "odd": odd}  # noqa: E731
    state = TrainState(torch.tensor(7), random.key(3), {"student": RoleState(
        with_odd(local_params, odd_local),
        (optim.EmptyState(), adamw._replace(mu=with_odd(adamw.mu, 2 * odd_local), nu=with_odd(adamw.nu, odd_local ** 2))),
        with_odd(shadow, -odd_local))})
    config = checkpoint.CheckpointConfig(every=1, async_save=True)  # a sharded save is synchronous regardless
    with checkpoint.Checkpoints(f"{out_dir}/ck2", config, mesh=mesh, layout=layout) as saving:
        saving.save(state, config={"config": {}}, meta={"world_size": 2})
    with checkpoint.Checkpoints(f"{out_dir}/ck2", mesh=mesh, layout=layout) as reading:
        back = reading.restore(7, optree.tree_map(torch.zeros_like, state, none_is_leaf=False))
    same = [torch.equal(a, b) for a, b in zip(optree.tree_leaves(back), optree.tree_leaves(state))]
    full = map_params(lambda d: sharding.unshard(sharding.from_local(d, mesh, layout), layout), state, layout)

    whole = single_process_state()
    with checkpoint.Checkpoints(f"{out_dir}/ck1", mesh=mesh, layout=layout) as reading:
        sliced = reading.restore(4, map_params(lambda d: sharding.to_local(sharding.shard(d, mesh, layout=layout)),
                                               whole, layout))
    want = map_params(lambda d: sharding.to_local(sharding.shard(d, mesh, layout=layout)), whole, layout)
    same_sliced = [torch.equal(a, b) for a, b in zip(optree.tree_leaves(sliced), optree.tree_leaves(want))]
    return {"ck_saved_full": full, "ck_2to2_equal": same_everywhere(all(same) and len(same) > 0),
            "ck_1to2_equal": same_everywhere(all(same_sliced) and len(same_sliced) > 0)}


if __name__ == "__main__":
    try:
        run(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
