"""One rank of the multi-process (gloo) checks of sequence parallelism; tests/fvx/distributed/test_sequence_parallel.py
launches 2 (SP 2) or 4 (SP 2 x data-parallel 2) and reads back what rank 0 saved. Importable without side effects: the
test computes its single-process references from the same functions (``mesh=None``).

    WORLD_SIZE=w RANK=r LOCAL_RANK=r MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/helpers/sp_worker.py OUT_DIR
"""
from __future__ import annotations

import sys
import traceback

import torch

from fvx.core import grad, random
from fvx.core.optim_config import AdamWConfig
from fvx.distributed import processes, sharding
from fvx_methods import finetune
from fvx_models import wan, wan_causal

from family_cases import causal_loss_and_grads, raw_batch  # noqa: E402

BATCH = 4  # global
STEPS = 2
FINETUNE = finetune.Finetune(optim=AdamWConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=0.5))
# name -> the model config of a fine-tuning variant (the tiny Wan: 2 heads, 2 x 2 x 2 = 8 tokens per sample)
VARIANTS = {
    "eager": wan.WanConfig(preset="tiny"),
    "remat": wan.WanConfig(preset="tiny", remat=True),
    "remat_blocks": wan.WanConfig(preset="tiny", remat=True, compile="blocks", compile_backend="aot_eager"),
    "ti2v": wan.WanConfig(preset="tiny-ti2v"),  # one timestep per token: the timesteps are split too
    "i2v": wan.WanConfig(preset="tiny-i2v"),  # the first frame on channels and CLIP tokens in the cross-attention
    "ti2v_first_frame": wan.WanConfig(preset="tiny-ti2v", first_frame=True),  # its frame's tokens at timestep 0
}
QUICK = ("eager",)  # the variants the 4-process run checks
CAUSAL = (("prefix", False), ("mask", True))  # (attention, remat) of the block-causal runs


def local_rows(batch: dict, mesh, rank: int, world: int) -> dict:
    """This data-parallel rank's rows of a global batch (the ranks of an SP group take the same rows)."""
    rank, world = processes.data_rank(mesh, rank, world)
    return {k: v.chunk(world)[rank] for k, v in batch.items()}


def finetune_run(config, mesh=None, rank: int = 0, world: int = 1) -> dict:
    """The fine-tuning loss and full gradients of the initial params on a global batch of 4, then STEPS fine-tuning
    steps: their metrics and the params after them; on ``mesh``, from this rank's rows (and tokens, under SP)."""
    model = config.build(**({} if mesh is None else {"mesh": mesh}))
    program = FINETUNE.build({"student": model}, total_steps=STEPS,
                             **({} if mesh is None else {"ranks": processes.group_of(mesh)}))
    state = program.init(random.key(0))
    batches = [model.batch(local_rows(raw_batch(model, random.key(20 + s), batch=BATCH, first=BATCH * s), mesh,
                                      rank, world)) for s in range(STEPS)]
    group = processes.Group() if mesh is None else processes.group_of(mesh)
    (loss, _), grads = grad.value_and_grad(finetune.loss_fn, has_aux=True)(
        state.roles["student"].params, batches[0], random.fold_in(state.key, 0), model=model, config=FINETUNE)
    out = {"loss": float(processes.dp_mean(loss, group)), "grads": grads, "metrics": []}
    for batch in batches:
        state, metrics = program.step_(state, {}, batch)
        out["metrics"].append({name: float(value) for name, value in metrics.items()})
    out["params"] = state.roles["student"].params
    if mesh is not None:
        out["grads"], out["params"] = sharding.unshard(out["grads"], mesh), sharding.unshard(out["params"], mesh)
        out["state_bytes"] = sharding.local_bytes(state.roles)
    return out


def causal_run(attention: str, remat: bool, mesh=None, rank: int = 0, world: int = 1) -> tuple[float, dict]:
    """The tiny block-causal Wan's loss and gradients (``family_cases.causal_loss_and_grads``), eager (its compiled
    blocks make a graph per sequence and cache length, slow to build on a CPU; compiled SP units are checked on the
    plain Wan), on this data-parallel rank's rows (and tokens, under SP)."""
    config = wan_causal.WanCausalConfig(preset="tiny", num_frames_per_block=1, block_attention=attention, remat=remat)
    return causal_loss_and_grads(config, mesh, lambda batch: local_rows(batch, mesh, rank, world))


def tokens_per_rank(mesh) -> int:
    """The tokens one block sees per sample in a forward of the tiny Wan on ``mesh`` (8 in one process)."""
    model = wan.WanConfig(preset="tiny").build(mesh=mesh)
    seen = []
    raw = raw_batch(model, random.key(50), batch=1)
    batch = model.batch(raw)
    params = model.weights.init(random.key(0))
    module = model.apply.args[1]  # the skeleton the model's apply is bound to
    hook = module.blocks[0].register_forward_pre_hook(lambda block, args: seen.append(args[0].shape[1]))
    with torch.no_grad():
        model.apply(params, batch["latents"], torch.tensor([500.0]), batch["cond"])
    hook.remove()
    return seen[0]


def run(out_dir: str) -> None:
    d = processes.init_distributed()
    torch.set_num_threads(1)
    results: dict = {"world": d.world}
    if d.world == 2:  # SP 2 on FSDP over both ranks
        mesh = processes.make_mesh(sp=2)
        results["group"] = tuple(processes.group_of(mesh))
        results["tokens_per_rank"] = tokens_per_rank(mesh)
        results["finetune"] = {name: finetune_run(config, mesh, d.rank, d.world) for name, config in VARIANTS.items()}
        results["causal"] = {case: causal_run(*case, mesh, d.rank, d.world) for case in CAUSAL}
    else:  # SP 2 x data-parallel 2: FSDP over all 4 ranks, and HSDP (2 replicas of 2 shards)
        for name, replicate in (("fsdp", 1), ("hsdp", 2)):
            mesh = processes.make_mesh(replicate, sp=2)
            results[name] = {"group": tuple(processes.group_of(mesh)),
                             **{v: finetune_run(VARIANTS[v], mesh, d.rank, d.world) for v in QUICK}}
    if d.rank == 0:
        torch.save(results, f"{out_dir}/results.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    try:
        run(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
