"""One rank of the 2-process (gloo) checks of fvx.distributed.sharding; tests/fvx/distributed/test_sharding.py launches
two and reads back what rank 0 saved. Importable without side effects: the test computes its single-process references
from the same functions (tiny models, global batches, losses).

    WORLD_SIZE=2 RANK=r LOCAL_RANK=r MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/helpers/dist_worker.py OUT_DIR
"""
from __future__ import annotations

import gc
import math
import sys
import traceback
import weakref
from typing import NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.func import functional_call

from fvx.core import ema, grad, optim, random, role, tree
from fvx.core.optim_config import AdamWConfig
from fvx.core.state import RoleState, TrainState
from fvx.distributed import compile as fvx_compile, gather_schedule, gathers, processes, sharding
from fvx.storage import checkpoint
from fvx_methods import dmd2, finetune
from fvx_models import build, wan, wan_causal

from family_cases import CASES, FAMILIES, causal_loss_and_grads, raw_batch  # noqa: E402

UNITS = ("blocks.0.", "blocks.1.")
BATCH = 2  # global
LR, WEIGHT_DECAY, MAX_NORM, EMA_DECAY = 1e-3, 0.01, 0.05, 0.9
ODD_SHAPE = (5, 3)  # no dimension divisible by 2: sharded with padding
TINY = wan.WanConfig(preset="tiny")


def problem() -> tuple[dict, dict]:
    """The tiny Wan params and the global batch (x, t, text, target) every process derives from fixed keys."""
    k = random.split(random.key(1), 5)
    batch = dict(x=random.normal(k[0], (BATCH, 16, 2, 4, 6)), t=torch.tensor([30.0, 910.5]),
                 text=random.normal(k[1], (BATCH, 5, 32)), target=random.normal(k[2], (BATCH, 16, 2, 4, 6)),
                 odd_x=random.normal(k[3], (4, ODD_SHAPE[0])))
    return TINY.build().weights.init(random.key(0)), batch


def odd_param(params: dict) -> torch.Tensor:
    return params["proj_out.weight"][: ODD_SHAPE[0], : ODD_SHAPE[1]].clone()


def single_process_state() -> TrainState:
    """A full train state (params, AdamW moments, an adapter-like dict of other names with the padded ``odd`` param)
    that the test saves in one process and the workers restore as shards."""
    params, _ = problem()
    extra = {"odd": odd_param(params), "lora_A": torch.arange(24.0).reshape(4, 6)}
    adamw = optim.ScaleByAdamState(torch.tensor(4), {n: 2 * p for n, p in params.items()},
                                   {n: p * p for n, p in params.items()})
    return TrainState(torch.tensor(4), random.key(5), {"student": RoleState(params, (optim.EmptyState(), adamw)),
                                                       "adapter": RoleState(extra, optim.EmptyState())})


def as_shards(state: TrainState, mesh) -> TrainState:
    """``state`` with each role's params (and params-like moments) sharded over ``mesh``, each dict by its own plan."""
    def place(node):
        if isinstance(node, dict) and node and all(isinstance(v, torch.Tensor) for v in node.values()):
            return sharding.shard(node, mesh)
        return node

    return tree.tree_map(place, state, is_leaf=lambda n: isinstance(n, dict) and n and
                         all(isinstance(v, torch.Tensor) for v in n.values()), none_is_leaf=True)


def teacher_dtypes(names) -> dict[str, torch.dtype]:
    """bf16, except the params diffusers keeps in fp32."""
    return {n: d for n, d in build.dtypes_for(build.skeleton(TINY), torch.bfloat16).items() if n in names}


def local_batch(batch: dict, rank: int, world: int) -> dict:
    return {k: v.chunk(world)[rank] for k, v in batch.items()}


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out.float() - target) ** 2).mean()


def odd_loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return ((x @ w) ** 2).mean()


def forward(module, params, b, dtype=None):
    x, text = (b["x"], b["text"]) if dtype is None else (b["x"].to(dtype), b["text"].to(dtype))
    inputs = {"hidden_states": x, "timestep": b["t"], "encoder_hidden_states": text, "return_dict": False}
    return functional_call(module, (params, dict(module.named_buffers())), (), inputs)[0]


def sharded_forward(net, local, b, dtype=None):
    x, text = (b["x"], b["text"]) if dtype is None else (b["x"].to(dtype), b["text"].to(dtype))
    inputs = {"hidden_states": x, "timestep": b["t"], "encoder_hidden_states": text, "return_dict": False}
    (out,) = gathers.sharded_call(net.module, local, dict(net.module.named_buffers()), (), inputs,
                                   gathers=net.gathers)
    return out


class Sharded(NamedTuple):
    """A tiny Wan skeleton whose blocks gather their shards through ``gathers``; ``calls`` records each unit's
    gather (grad mode), ``full`` weak references to the full params each unit computed with."""

    module: torch.nn.Module
    gathers: gather_schedule.UnitGathers
    stats: fvx_compile.CompileStats
    calls: list
    full: list


def sharded_module(remat: bool, mode: str, layout, group, compute_dtypes=None, reshard: bool = True) -> Sharded:
    module = build.skeleton(wan.WanConfig(preset="tiny", remat=remat))
    gathers = gather_schedule.UnitGathers({"blocks": UNITS}, layout, group, compute_dtypes,
                                          reshard_after_forward=reshard, remat=remat)
    calls, full = [], []

    def counted(prefix, local, compute):
        calls.append(torch.is_grad_enabled())
        return gathers(prefix, local, lambda params: (full.extend(map(weakref.ref, params.values())),
                                                      compute(params))[1])

    stats = fvx_compile.install_units(module, {"blocks": UNITS}, mode=mode, backend="aot_eager", gather=counted)
    return Sharded(module, gathers, stats, calls, full)


def grads_of(net, local, b, mesh):
    """(dp-mean loss, full grads, local grads) of the MSE on this rank's batch slice."""
    loss, g = grad.value_and_grad(lambda p: mse(sharded_forward(net, p, b), b["target"]))(local)
    return processes.dp_mean(loss, net.gathers.group), sharding.unshard(g, mesh), g


def alive_after_forward(net, local, b) -> tuple[int, int]:
    """How many of the full params the units computed with are still alive between the forward and the backward, of
    how many."""
    net.full.clear()
    loss = mse(sharded_forward(net, {n: t.detach().requires_grad_() for n, t in local.items()}, b), b["target"])
    gc.collect()
    alive = sum(ref() is not None for ref in net.full)
    loss.backward()
    return alive, len(net.full)


def count_collectives(net, local, b) -> int:
    """Collectives one forward and backward issue (gathers and reduce-scatters, as the profiler sees them)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        grad.value_and_grad(lambda p: mse(sharded_forward(net, p, b), b["target"]))(local)
    names = ("c10d::_allgather_base_", "_c10d_functional::reduce_scatter_tensor")
    return sum(event.count for event in prof.key_averages() if event.key in names)


IN_FLIGHT, GATHER_ROUNDS = 3, 20


def many_in_flight(mesh) -> bool:
    """Whether gathers of params of many sizes (up to 600k elements), in fp32 and bf16, with compute between issues
    and the oldest waited on once more than IN_FLIGHT are pending, for GATHER_ROUNDS rounds of 32, each give back the
    full param."""
    sizes = torch.randint(1, 300_000, (32,), generator=torch.Generator().manual_seed(3)).tolist()
    full = {f"p{i}": torch.arange(2 * n, dtype=torch.float32).reshape(2, n) / n for i, n in enumerate(sizes)}
    local, group = sharding.shard(full, mesh), processes.group_of(mesh)
    operand = torch.linspace(-1, 1, 128 * 128).reshape(128, 128)  # the compute between issues

    def landed(name, dtype, issued) -> bool:
        return torch.equal(gathers.regather(issued)[name], full[name] if dtype is None else full[name].to(dtype))

    ok = True
    for _ in range(GATHER_ROUNDS):
        pending = []
        for i, name in enumerate(full):
            dtype = torch.bfloat16 if i % 3 == 0 else None
            pending.append((name, dtype, gathers.issue_gather({name: local[name]}, local.layout, group, dtype)))
            operand @ operand
            if len(pending) > IN_FLIGHT:
                ok &= landed(*pending.pop(0))
        ok &= all([landed(*p) for p in pending])
    return ok


def core(out_dir: str, d) -> dict:
    """Gathers, gradients, AdamW and EMA on shards, a frozen bf16 teacher and a padded param, against one process."""
    params, batch = problem()
    b = local_batch(batch, d.rank, d.world)
    results: dict = {"dist": tuple(d)}
    mesh = processes.make_mesh(1, 2)  # FSDP over both ranks
    group = processes.group_of(mesh)
    local = sharding.shard(params, mesh)
    layout = local.layout
    results["layout"] = layout
    results["local_bytes"] = sharding.local_bytes(local)
    results["local_shapes_equal"] = all(tuple(v.shape) == layout[n].local_shape(2) for n, v in local.items())
    results["many_in_flight"] = many_in_flight(mesh)
    for remat, mode, reshard in ((False, "none", True), (False, "none", False), (True, "none", True),
                                 (False, "blocks", True), (False, "blocks", False)):
        key = f"remat{remat}_{mode}_reshard{reshard}"
        net = sharded_module(remat, mode, layout, group, reshard=reshard)
        steps = 2 if mode == "blocks" else 1  # (compiled: the second step runs the graphs the first compiled)
        for _ in range(steps):
            results[f"loss_{key}"], results[f"grads_{key}"], _ = grads_of(net, local, b, mesh)
        results[f"unit_gathers_{key}"] = len(net.calls) // steps
        results[f"ahead_{key}"] = {k: v // steps for k, v in net.gathers.counts.items()}
        results[f"collectives_{key}"] = count_collectives(net, local, b)
        results[f"alive_{key}"] = alive_after_forward(net, local, b)
    net = sharded_module(True, "blocks", layout, group)
    for _ in range(2):
        results["loss_compiled"], results["grads_compiled"], local_grads = grads_of(net, local, b, mesh)
    results["compiled_graphs"] = net.stats.graphs
    assert isinstance(local_grads, sharding.Shards) and local_grads.layout == layout  # grads carry the layout

    # One AdamW step (with a global-norm clip that bites) on the local shards, then an EMA update.
    opt = role.RoleOptimizer(optim.adamw(LR, weight_decay=WEIGHT_DECAY), MAX_NORM, group)
    shadow = ema.ema_init(local)
    measured = role.measure(opt, role.init(opt, local), local_grads)
    results["grad_norm"] = measured.norm
    opt_state = role.update_(opt, role.init(opt, local), measured, 0).opt_state
    results["params_after_step"] = sharding.unshard(local, mesh)
    ema.ema_update_(shadow, local, EMA_DECAY)
    results["ema_after_step"] = sharding.unshard(shadow, mesh)
    results["moments_are_shards"] = all(isinstance(m, sharding.Shards) and m.layout == layout
                                        for m in (opt_state[0].mu, opt_state[0].nu, shadow))

    # HSDP with a replicate dim of 2 and shards of 1 (DDP through the replicate all-reduce).
    ddp_mesh = processes.make_mesh(2, 1)
    ddp_group = processes.group_of(ddp_mesh)
    ddp_local = sharding.shard(params, ddp_mesh)
    net = sharded_module(True, "none", ddp_local.layout, ddp_group)
    results["loss_replicated"], results["grads_replicated"], _ = grads_of(net, ddp_local, b, ddp_mesh)

    # A frozen teacher: bf16 shards (fp32 where diffusers keeps fp32), bf16 compute, no grad, no optimizer state.
    dtypes = teacher_dtypes(params)
    teacher = sharding.shard(params, mesh, dtype=dtypes)
    results["teacher_local_bytes"] = sharding.local_bytes(teacher)
    net = sharded_module(False, "none", layout, group, dtypes)
    with torch.no_grad():
        out = sharded_forward(net, teacher, b, dtype=torch.bfloat16).float()
    everyone = [torch.empty_like(out) for _ in range(d.world)]
    torch.distributed.all_gather(everyone, out)
    results["teacher_out"] = torch.cat(everyone)

    # A param no dimension of which 2 divides: zero-padded even shards; gradient and checkpoint view strip the pad.
    odd = sharding.shard({"odd": odd_param(params)}, mesh)
    results["odd_local_shape"] = tuple(odd["odd"].shape)
    _, odd_grad = grad.value_and_grad(
        lambda p: odd_loss(gathers.gather(p["odd"], p.layout["odd"], group), b["odd_x"]))(odd)
    results["odd_grad_padded"] = sharding._dtensors(odd_grad, mesh)["odd"].full_tensor()
    results["odd_grad"] = sharding.unshard(odd_grad, mesh)["odd"]
    results["odd_view_full"] = sharding.checkpoint_view(odd, mesh)["odd"].full_tensor()
    adamw = opt_state[0]
    saved = {"params": sharding.checkpoint_view(local, mesh), "odd": sharding.checkpoint_view(odd, mesh)["odd"],
             "mu": sharding.checkpoint_view(adamw.mu, mesh), "count": adamw.count}
    dcp.save(saved, checkpoint_id=f"{out_dir}/dcp")
    return results


def sharded_checkpoints(out_dir: str, mesh) -> dict:
    """fvx.storage.checkpoint on a mesh, for a state holding a role whose params have names and a layout of their own
    (an adapter, with a padded param): saved (for the test to read in one process: 2 -> 1), restored here (2 -> 2), and
    the test's single-process checkpoint restored as shards (1 -> 2)."""
    whole = single_process_state()
    state = as_shards(whole, mesh)
    state = state._replace(step=torch.tensor(7), roles={**state.roles, "student": state.roles["student"]._replace(
        ema=tree.map_tensors(torch.neg, state.roles["student"].params))})
    config = checkpoint.CheckpointConfig(every=1, async_save=True)
    donated = tree.map_tensors(torch.clone, state)  # (shards may be views of `whole`)
    with checkpoint.Checkpoints(f"{out_dir}/ck2", config, mesh=mesh) as saving:
        saving.save(donated, config={"config": {}}, meta={"world_size": 2})
        for leaf in tree.tensor_leaves(donated):  # a donating step goes on while the save is written
            leaf.add_(1)
    with checkpoint.Checkpoints(f"{out_dir}/ck2", mesh=mesh) as reading:
        back = reading.restore(7, tree.map_tensors(torch.zeros_like, state))
    same = [torch.equal(a, b) for a, b in zip(tree.tensor_leaves(back), tree.tensor_leaves(state))]
    layouts_kept = (back.roles["adapter"].params.layout == state.roles["adapter"].params.layout
                    and back.roles["student"].params.layout == state.roles["student"].params.layout)

    def full(node):
        return sharding.unshard(node, mesh) if isinstance(node, sharding.Shards) else node

    saved_full = tree.tree_map(full, state, is_leaf=lambda n: isinstance(n, sharding.Shards), none_is_leaf=True)
    with checkpoint.Checkpoints(f"{out_dir}/ck1", mesh=mesh) as reading:
        sliced = reading.restore(4, as_shards(whole, mesh))
    want = as_shards(whole, mesh)
    same_sliced = [torch.equal(a, b) for a, b in zip(tree.tensor_leaves(sliced), tree.tensor_leaves(want))]
    return {"ck_saved_full": saved_full, "ck_2to2_equal": same_everywhere(all(same) and len(same) > 0 and layouts_kept),
            "ck_1to2_equal": same_everywhere(all(same_sliced) and len(same_sliced) > 0)}


FAMILY_STEPS = 2


def family_run(name: str, mesh=None, rank: int = 0, world: int = 1) -> tuple[list[float], int, int]:
    """FAMILY_STEPS fine-tuning steps of a family's tiny model on this rank's slice of a global batch of 4: (losses,
    this rank's state bytes, the whole state's bytes)."""
    model = CASES[name].config.build(mesh=mesh)
    program = finetune.Finetune(optim=AdamWConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=0.5)).build(
        {"student": model}, total_steps=FAMILY_STEPS, **({} if mesh is None else {"ranks": processes.group_of(mesh)}))
    state, frozen = program.init(random.key(0)), program.frozen(random.key(0))  # frozen: what a mode leaves unused
    losses = []
    for step in range(FAMILY_STEPS):
        raw = raw_batch(model, random.key(20 + step), batch=4, first=4 * step)
        local = {k: v.chunk(world)[rank] for k, v in raw.items()}
        state, metrics = program.step_(state, frozen, model.batch(local))
        losses.append(float(metrics["loss"]))
    shapes = model.memory_spec().shapes  # the trained params' (not a frozen branch's): params, mu, nu, fp32
    whole = sum(math.prod(shapes[name]) * 4 for name in model.weights.trained_names) * 3
    return losses, sharding.local_bytes(state.roles), whole


def joint_run(mesh=None, rank: int = 0, world: int = 1) -> tuple[list[dict], dict]:
    """FAMILY_STEPS fine-tuning steps of MiniMax-H3's tiny joint model (video and audio, one sample per forward) on
    a global batch of 2: one sample a rank on 2 ranks, 2 micro-batches of 1 in one process. (per-step metrics: loss,
    video_finetune_loss, audio_finetune_loss; the final params, whole)."""
    from fvx_models.minimax_h3 import MiniMaxH3Config

    model = MiniMaxH3Config(preset="tiny").build(mesh=mesh)
    program = finetune.Finetune(grad_accum=2 // world, optim=AdamWConfig(lr=1e-3, max_grad_norm=0.5)).build(
        {"student": model}, total_steps=FAMILY_STEPS, **({} if mesh is None else {"ranks": processes.group_of(mesh)}))
    state, frozen = program.init(random.key(0)), program.frozen(random.key(0))
    metrics_of_steps = []
    for step in range(FAMILY_STEPS):
        k = random.split(random.key(40 + step), 3)
        raw = {"latents": random.normal(k[0], (2, 48, 2, 4, 4)), "audio_latents": random.normal(k[1], (2, 2, 32, 8)),
               "text": random.normal(k[2], (2, 5, 32)), "text_mask": torch.ones(2, 5),
               "sample_index": torch.arange(2 * step, 2 * step + 2)}
        local = {name: value.chunk(world)[rank] for name, value in raw.items()}
        batch = model.batch(local)
        program.check(batch)
        state, metrics = program.step_(state, frozen, batch)
        metrics_of_steps.append({name: float(value) for name, value in metrics.items() if value.dim() == 0})
    params = state.roles["student"].params
    return metrics_of_steps, params if mesh is None else sharding.unshard(params, mesh)


def moe_run(mesh=None, rank: int = 0, world: int = 1) -> tuple[float, dict]:
    """Loss and full gradients of Wan 2.2 A14B's tiny experts on a batch whose first half is all high-noise and
    second half all low-noise: on 2 ranks each rank runs one expert on its own samples and the other idle."""
    model = CASES["wan_moe"].config.build(**({} if mesh is None else {"mesh": mesh}))
    params = model.weights.init(random.key(0))
    raw = raw_batch(model, random.key(30), batch=4)
    t = torch.tensor([900.0, 950.0, 100.0, 200.0])
    target = random.normal(random.key(31), raw["latents"].shape)
    local = {k: v.chunk(world)[rank] for k, v in {**raw, "t": t, "target": target}.items()}
    cond = model.batch({k: local[k] for k in raw})["cond"]

    def loss_fn(p):
        return mse(model.apply(p, local["latents"], local["t"], cond), local["target"])

    loss, grads = grad.value_and_grad(loss_fn)(params)
    if mesh is not None:
        return float(processes.dp_mean(loss, processes.group_of(mesh))), sharding.unshard(grads, mesh)
    return float(loss), grads


def causal_run(mesh=None, rank: int = 0, world: int = 1, compile: str = "blocks") -> tuple[float, dict]:
    """The tiny block-causal Wan's loss and gradients (``family_cases.causal_loss_and_grads``) with units compiled
    (``compile``), on this rank's slice of the batch."""
    config = wan_causal.WanCausalConfig(preset="tiny", num_frames_per_block=1, compile=compile,
                                        compile_backend="aot_eager")
    return causal_loss_and_grads(config, mesh, lambda batch: {k: v.chunk(world)[rank] for k, v in batch.items()})


DMD2_STEPS = 3  # critic only, then student and critic (interval 2), then critic only


def dmd2_run(mesh=None, rank: int = 0, world: int = 1, grad_accum: int = 1) -> tuple[list[dict], dict]:
    """DMD2 on the tiny Wan with a teacher of another size (tiny-deep; CFG with zero uncond, a clip that bites, EMA)
    for DMD2_STEPS steps on this rank's slice of a fixed global batch of 4, in ``grad_accum`` micro-batches: (metrics
    per step as floats, every trained role's full params and EMA after the last step)."""
    g = random.split(random.key(11), 2)
    raw = {"latents": random.normal(g[0], (4, 16, 2, 4, 6)), "text": random.normal(g[1], (4, 5, 32)),
           "text_mask": torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 5, [1.0] * 4 + [0.0]]),
           "sample_index": torch.tensor([3, 8, 13, 21])}
    config = dmd2.DMD2(denoising_steps=(1000, 750, 500), generator_update_interval=2, guidance_scale=3.0,
                       cfg_uncond="zero", ema_decay=0.9, optim=AdamWConfig(lr=1e-3, max_grad_norm=0.05),
                       critic_optim=AdamWConfig(lr=2e-3, max_grad_norm=0.05), grad_accum=grad_accum)
    on_mesh = {} if mesh is None else {"mesh": mesh}
    student = wan.WanConfig(preset="tiny").build(**on_mesh)
    models = {"student": student, "critic": student, "teacher": wan.WanConfig(preset="tiny-deep").build(**on_mesh)}
    ranks = {} if mesh is None else {"ranks": processes.group_of(mesh)}
    program = config.build(models, total_steps=DMD2_STEPS, **ranks)
    state, frozen = program.init(random.key(7)), program.frozen(random.key(7))
    batch = student.batch({k: v.chunk(world)[rank] for k, v in raw.items()})
    metrics = []
    for _ in range(DMD2_STEPS):
        state, m = program.step_(state, frozen, batch)
        metrics.append({name: float(value) for name, value in m.items()})
    roles = {f"{role}.{part}": getattr(state.roles[role], part) for role in state.roles for part in ("params", "ema")
             if getattr(state.roles[role], part) is not None}
    if mesh is not None:
        roles = {k: sharding.unshard(v, mesh) for k, v in roles.items()}
    return metrics, roles


def same_everywhere(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank."""
    value = torch.tensor(int(flag))
    torch.distributed.all_reduce(value, torch.distributed.ReduceOp.MIN)
    return bool(value)


def run(out_dir: str) -> None:
    d = processes.init_distributed()
    torch.set_num_threads(1)
    results = core(out_dir, d)
    mesh = processes.make_mesh(1, 2)
    results["jax_started"] = processes.init_jax_distributed(d)
    import jax

    results["jax_process_count"] = jax.process_count()
    results.update(sharded_checkpoints(out_dir, mesh))
    results["dmd2_metrics"], results["dmd2_roles"] = dmd2_run(mesh, d.rank, d.world, grad_accum=2)
    results["families"] = {name: family_run(name, mesh, d.rank, d.world) for name in FAMILIES}
    results["moe"] = moe_run(mesh, d.rank, d.world)
    results["joint"] = joint_run(mesh, d.rank, d.world)
    results["causal"] = causal_run(mesh, d.rank, d.world)
    if d.rank == 0:
        torch.save(results, f"{out_dir}/results.pt")
    torch.distributed.barrier()
    jax.distributed.shutdown()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    try:
        run(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
