"""Wan 2.1 T2V fine-tuning steps on GPUs (random init), fvx against the usual PyTorch ways in one run: per row the
median step time, tokens/s, MFU (the analytic FLOPs of bench/flops.py of the blocks actually run, over 989 TFLOP/s dense
bf16), peak memory (``torch.cuda.max_memory_allocated``, the highest rank) beside fvx.distributed.memory's dry-run
estimate, and the ratios of time per sample to the baselines of the same case. bf16 compute, fp32 master params, remat,
AdamW (weight decay 0.01), global-norm clip 1.0, one sample per data-parallel rank, 512 text tokens; the same initial
params (seed 0) and batch for every variant, so their first losses agree to bf16 noise.

    python bench/gpu.py --write-results      # one H200: appends bench/RESULTS.md; the whole-model compiles (compiled,
                                             # fvx-model) took over 4 min each at 81x480x832 on 2026-12-04: in a
                                             # 15-min lease add --variants eager,fvx,fvx-blocks,fsdp2
    python bench/gpu.py --check              # a CPU: tiny preset, every variant once, and the --layers path
    python bench/gpu.py --check --preset wan2.1-t2v-1.3b --layers 1 --video 5x32x32   # a CPU: real widths, 1 block
    torchrun --nproc-per-node 2 bench/gpu.py --check --fsdp 2     # a CPU, gloo: fvx sharded beside FSDP2
    torchrun --nproc-per-node 2 bench/gpu.py --check --sp 2       # a CPU, gloo: fvx sequence parallel (Ulysses)
    torchrun --nproc-per-node 8 bench/gpu.py --fsdp 8 [--preset wan2.1-t2v-14b] [--write-results]
    torchrun --nproc-per-node 8 bench/gpu.py --fsdp 4 --sp 2 --preset wan2.1-t2v-14b --video 81x720x1280
    python bench/gpu.py --preset wan2.1-t2v-14b --layers 4 [--video 81x480x832] [--variants eager,fvx]
    python bench/gpu.py --dry-run [--preset P] [--world N] [--roles finetune|dmd2] [--video FxHxW]
    python bench/gpu.py --vsa [--write-results]  # Video Sparse Attention against dense SDPA at Wan 1.3B 480p
    python bench/gpu.py --vsa --check            # a CPU: the same rows at a tiny grid

VSA mode (``--vsa``): one self-attention call of Wan 2.1 1.3B at 81x480x832 (a 21x30x52 token grid, 12 heads of 128,
bf16, forward + backward), dense SDPA against VSA at sparsity 0.8 and 0.9 through each implementation usable here
(fastvideo-kernel's CUDA kernel when installed, compiled flex-attention, the PyTorch reference), with
``bench/attention.py``'s analytic FLOPs.

Session mode (no --preset, --layers, --fsdp or --sp, one process): Wan 1.3B at the largest of VIDEOS whose dry-run
estimate fits the GPU, then Wan 14B's dims with --layers 4: its first 4 of 40 blocks at full width (fp32 masters,
grads and AdamW moments of all 40 take 16 B x 14 G params = 224 GB: no single GPU holds them), reported per block.
A row whose predicted end (steps x the last step time of its case, plus --compile-s for a compiled row) passes
--budget-s is skipped and said so; a row that fails (out of memory, say) is reported and the run goes on.

Variants:
  eager       the diffusers module, its own gradient checkpointing, torch.autocast(bf16), loss.backward(),
              clip_grad_norm_(foreach), torch.optim.AdamW(fused)
  fsdp2       FastVideo's way: fully_shard per block + root over all ranks, MixedPrecisionPolicy(param_dtype=bf16,
              reduce_dtype=fp32) (bf16 params in compute, no autocast), diffusers' gradient checkpointing,
              clip_grad_norm_, AdamW(fused); in one process on a 1-rank group; under --sp still data-parallel over
              every rank (one sample each: compare tokens/s)
  fvx         WanConfig(remat, bf16).build(mesh).apply, fvx.core.grad.value_and_grad, fvx.core.role's clip + AdamW in
              place; under torchrun on fvx.distributed.processes.make_mesh(sp=...): params, grads and AdamW sharded
              over every rank, bucketed per-block gathers, Ulysses groups of --sp ranks sharing one sample
  fvx-blocks  the same with compile="blocks": every block through one inductor-compiled function
  compiled    one process: the eager row with the diffusers module under torch.compile
  fvx-model   one process: fvx with compile="model", the whole forward as one inductor graph

Needs torch (CUDA) and the repository's Python packages (diffusers, msgspec, optree); a bare GPU machine may lack the
last three: install them (as wheels) before the run.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import importlib.util
import os
import pathlib
import statistics
import sys
import time
import traceback
import warnings
from typing import Any, Callable, NamedTuple

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from diffusers import WanTransformer3DModel  # noqa: E402

from bench import flops  # noqa: E402
from bench.common import free_port  # noqa: E402
from fvx.core import grad, optim, role  # noqa: E402
from fvx.distributed import memory, processes, sharding  # noqa: E402
from fvx_models import wan  # noqa: E402
from fvx_models.family import Preset  # noqa: E402

VIDEOS = ((81, 480, 832), (49, 480, 832), (33, 480, 832), (17, 480, 832))
CHECK_VIDEO, CHECK_TEXT_LEN = (5, 32, 32), 8
SESSION = (("wan2.1-t2v-1.3b", None), ("wan2.1-t2v-14b", 4))  # (preset, layers) of the default mode
SINGLE_VARIANTS = ("eager", "fsdp2", "fvx", "fvx-blocks", "compiled", "fvx-model")  # (the budget drops the last first)
SHARDED_VARIANTS = ("fsdp2", "fvx", "fvx-blocks")
COMPILED = ("fvx-blocks", "compiled", "fvx-model")  # rows that compile in their first warm-up step
LR, WEIGHT_DECAY, MAX_NORM = 1e-5, 0.01, 1.0
FIT_FRACTION = 0.85  # of the GPU's memory a video's dry-run estimate may take
RESULTS = pathlib.Path(__file__).with_name("RESULTS.md")

# Known and harmless here, once per step otherwise: FSDP2 on the view diffusers' Wan returns (the loss reads it out of
# place), and rms_norm's fallback under autocast (bf16 input, fp32 weight: the eager baseline as users run it).
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")


# ---------------------------------------------------------------------------------------------------- the run


class Ctx(NamedTuple):
    """Where the run stands: this process's rank of ``world``, the sequence-parallel degree, the device, fvx's mesh
    (None in one process), whether torchrun launched it, and the time it started."""

    rank: int
    world: int
    sp: int
    device: torch.device
    mesh: Any
    torchrun: bool
    start: float

    @property
    def dp(self) -> int:
        return self.world // self.sp

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


class Case(NamedTuple):
    """One model at one video size: ``preset`` is the registered preset run (``base`` cut to ``layers`` blocks)."""

    preset: str
    base: str
    layers: int
    total_layers: int
    video: tuple[int, int, int]
    variants: tuple[str, ...]

    @property
    def title(self) -> str:
        cut = "" if self.layers == self.total_layers else f" (first {self.layers} of {self.total_layers} blocks)"
        return f"{self.base}{cut} {'x'.join(map(str, self.video))}"


def log(ctx: Ctx, message: str) -> None:
    if ctx.rank == 0:
        print(f"[{time.perf_counter() - ctx.start:6.1f} s] {message}", flush=True)


def start_processes(args, start: float) -> Ctx:
    """The process group: torchrun's (fvx's mesh over every rank, SP groups of ``--sp``), or a 1-rank group of this
    process for the FSDP2 row (fvx then runs unsharded)."""
    torchrun = "WORLD_SIZE" in os.environ
    env = os.environ if torchrun else {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    try:
        d = processes.init_distributed(env)
    except Exception as error:  # one process: the other rows need no group (the fsdp2 rows then fail, and say so)
        if torchrun:
            raise
        print(f"no 1-rank process group ({type(error).__name__}: {str(error)[:160]})", flush=True)
        d = processes.init_distributed({})
    if d.device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // d.world))
    mesh = processes.make_mesh(sp=args.sp) if torchrun else None
    return Ctx(d.rank, d.world, args.sp, d.device, mesh, torchrun, start)


def agree(ctx: Ctx, flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (so all ranks skip or run a row alike)."""
    if ctx.world == 1:
        return flag
    value = torch.tensor([int(flag)], device=ctx.device if ctx.cuda else "cpu")
    dist.broadcast(value, 0)
    return bool(value.item())


# ------------------------------------------------------------------------------------------------ model and batch


def layered(preset: str, layers: int | None) -> str:
    """The name of ``preset`` cut to its first ``layers`` blocks, registered as a bench-only preset (``preset``
    itself when it keeps them all)."""
    spec = wan.PRESETS[preset]
    total = spec.kwargs["num_layers"]
    if layers is None or layers == total:
        return preset
    if not 1 <= layers <= total:
        raise SystemExit(f"--layers {layers}: {preset} has {total} blocks; choose 1..{total}")
    name = f"{preset}@{layers}-blocks"
    wan.PRESETS[name] = Preset({**spec.kwargs, "num_layers": layers}, spec.latents, spec.text_len, spec.options)
    return name


def grid_of(preset: str, video: tuple[int, int, int]) -> memory.LatentGrid:
    spec = wan.PRESETS[preset]
    return memory.latent_grid(*video, vae_stride=spec.latents.vae_stride, patch=spec.kwargs["patch_size"])


def make_batch(preset: str, video: tuple[int, int, int], text_len: int, device: torch.device, seed: int) -> dict:
    """One sample: noisy latents, a timestep, a text embedding (all-ones mask) and a velocity target."""
    kwargs = wan.PRESETS[preset].kwargs
    grid = memory.latent_grid(*video, vae_stride=wan.PRESETS[preset].latents.vae_stride, patch=(1, 1, 1))
    shape = (1, kwargs["in_channels"], grid.frames, grid.height, grid.width)
    g = torch.Generator(device).manual_seed(seed)
    text = torch.randn(1, text_len, kwargs["text_dim"], generator=g, device=device)
    return {"x": torch.randn(shape, generator=g, device=device), "t": torch.tensor([500.0], device=device),
            "cond": {"text": text, "text_mask": torch.ones(1, text_len, device=device)},
            "target": torch.randn(shape, generator=g, device=device)}


def initial_module(preset: str, device: torch.device) -> WanTransformer3DModel:
    """The diffusers module with torch's default init under seed 0 (the global RNG state restored)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        with device:
            return WanTransformer3DModel(**wan.PRESETS[preset].kwargs)


def torch_adamw(params) -> torch.optim.Optimizer:
    """The baselines' optimizer: torch's fused AdamW (CUDA and, since torch 2.4, CPU; DTensor params too)."""
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)


def mse(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((v.float() - target) ** 2).mean()


# -------------------------------------------------------------------------------------------------------- variants


def eager_step(ctx: Ctx, case: Case, batch: dict, args) -> Callable[[], torch.Tensor]:
    """The diffusers module trained the usual way on one GPU: autocast bf16 over fp32 params."""
    module = initial_module(case.preset, ctx.device)
    module.enable_gradient_checkpointing()
    optimizer = torch_adamw(module.parameters())

    return functools.partial(torch_step, module, optimizer, batch, autocast=ctx.device.type)


def compiled_step(ctx: Ctx, case: Case, batch: dict, args) -> Callable[[], torch.Tensor]:
    """The eager row with its module under ``torch.compile`` (what a user would try first for speed)."""
    module = initial_module(case.preset, ctx.device)
    module.enable_gradient_checkpointing()
    optimizer = torch_adamw(module.parameters())
    compiled = torch.compile(module, backend=args.backend)
    return functools.partial(torch_step, compiled, optimizer, batch, autocast=ctx.device.type)


def torch_step(module, optimizer, batch: dict, autocast: str | None = None) -> torch.Tensor:
    """One step of the PyTorch baselines: forward (under bf16 autocast on ``autocast``'s device type when given),
    ``loss.backward()``, ``clip_grad_norm_(foreach=True)``, the optimizer's step; the detached loss."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(autocast, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        v = module(batch["x"], batch["t"], batch["cond"]["text"], return_dict=False)[0]
    loss = mse(v, batch["target"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), MAX_NORM, foreach=True)
    optimizer.step()
    return loss.detach()


def fsdp2_step(ctx: Ctx, case: Case, batch: dict, args) -> Callable[[], torch.Tensor]:
    """FastVideo's FSDP2 recipe: every block and the root ``fully_shard``'ed over all ranks, bf16 params in compute
    and fp32 gradient reduction (``MixedPrecisionPolicy``), diffusers' gradient checkpointing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    module = initial_module(case.preset, ctx.device)
    module.enable_gradient_checkpointing()
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in module.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    optimizer = torch_adamw(module.parameters())

    return functools.partial(torch_step, module, optimizer, batch)


def fvx_step(ctx: Ctx, case: Case, batch: dict, args, compile: str = "none") -> Callable[[], torch.Tensor]:
    """fvx's step: the functional model (sharded on the run's mesh under torchrun), ``fvx.core.grad.value_and_grad``,
    the role update (global norm over every rank's shards, clip, AdamW in place)."""
    model = wan.WanConfig(preset=case.preset, remat=True, compute_dtype="bf16", compile=compile,
                          compile_backend=args.backend).build(mesh=ctx.mesh)
    full = {name: p.detach() for name, p in initial_module(case.preset, ctx.device).named_parameters()}
    params = full if ctx.mesh is None else sharding.shard(full, ctx.mesh)
    del full
    group = processes.Group() if ctx.mesh is None else processes.group_of(ctx.mesh)
    opt = role.RoleOptimizer(optim.adamw(LR, weight_decay=WEIGHT_DECAY), MAX_NORM, group)
    holder = {"state": role.init(opt, params)}

    def loss_fn(p):
        return mse(model.apply(p, batch["x"], batch["t"], batch["cond"]), batch["target"])

    def step():
        state = holder["state"]
        loss, grads = grad.value_and_grad(loss_fn)(state.params)
        holder["state"] = role.update_(opt, state, role.measure(opt, state, grads), 0)
        return loss

    step.model = model
    return step


VARIANTS = {"eager": eager_step, "fsdp2": fsdp2_step, "fvx": fvx_step,
            "fvx-blocks": functools.partial(fvx_step, compile="blocks"), "compiled": compiled_step,
            "fvx-model": functools.partial(fvx_step, compile="model")}


def samples_of(ctx: Ctx, variant: str) -> int:
    """Samples per step over all ranks: fvx's SP groups share one; FSDP2 and one process run one per rank."""
    return ctx.dp if variant.startswith("fvx") and ctx.mesh is not None else ctx.world


def seed_of(ctx: Ctx, variant: str) -> int:
    return ctx.rank // ctx.sp if variant.startswith("fvx") and ctx.mesh is not None else ctx.rank


def sp_of(ctx: Ctx, variant: str) -> int:
    return ctx.sp if variant.startswith("fvx") and ctx.mesh is not None else 1


# ------------------------------------------------------------------------------------------------------ measuring


def sync(ctx: Ctx) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()


def peak_bytes(ctx: Ctx) -> float:
    """The highest ``max_memory_allocated`` over the ranks (NaN on CPUs)."""
    if not ctx.cuda:
        return float("nan")
    peak = torch.tensor([torch.cuda.max_memory_allocated()], dtype=torch.float64, device=ctx.device)
    if ctx.world > 1:
        dist.all_reduce(peak, dist.ReduceOp.MAX)
    return float(peak.item())


def warmup_of(variant: str, args) -> int:
    """Warm-up steps: ``--warmup``, one more for a compiled row (its graphs compile in the first)."""
    return args.warmup + (variant in COMPILED)


def measure(ctx: Ctx, step: Callable[[], torch.Tensor], warmup: int, args) -> dict:
    """Median seconds per step over ``--steps`` after ``warmup`` steps (compilation happens there), the peak memory
    of the timed steps (reset after the warm-up: the steady state, AdamW's moments included), the first loss."""
    t0 = time.perf_counter()
    loss0 = step().item()
    for _ in range(warmup - 1):
        step()
    sync(ctx)
    warm_s = time.perf_counter() - t0
    log(ctx, f"  {warmup} warm-up step(s): {warm_s:.1f} s")
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        sync(ctx)
        t0 = time.perf_counter()
        step()
        sync(ctx)
        times.append(time.perf_counter() - t0)
    return {"s": statistics.median(times), "peak": peak_bytes(ctx), "warmup_s": warm_s, "loss0": loss0}


def release(ctx: Ctx) -> None:
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()


def model_spec(preset: str, text_len: int) -> memory.ModelSpec:
    """The dry run's view of the preset under remat and bf16, at ``text_len`` text tokens."""
    spec = wan.WanConfig(preset=preset, remat=True, compute_dtype="bf16").build().memory_spec()
    return spec._replace(text_len=text_len)


def estimated_peak(preset: str, tokens: int, text_len: int, shard: int) -> int:
    """fvx.distributed.memory's estimate per rank: the model trained with AdamW, sharded over ``shard`` ranks, one
    sample of ``tokens`` tokens per rank (this rank's share under SP), remat, bf16."""
    role_ = memory.Role("student", model_spec(preset, text_len), trainable=True)
    return memory.estimate([role_], shard_size=shard, tokens=tokens, batch_per_rank=1, capacity=1 << 62).total


def row_estimate(ctx: Ctx, preset: str, video: tuple[int, int, int], variant: str, args) -> int:
    """:func:`estimated_peak` for ``variant``'s sharding and tokens per rank in this run."""
    shard = 1 if variant in ("eager", "compiled") or (variant.startswith("fvx") and ctx.mesh is None) else ctx.world
    return estimated_peak(preset, grid_of(preset, video).tokens // sp_of(ctx, variant), args.text_len, shard)


def step_flops(case: Case, args) -> int:
    """Analytic FLOPs of one sample's training step through the blocks run (bench/flops.py)."""
    return flops.training_flops(flops.wan_dims(case.preset, args.text_len), grid_of(case.preset, case.video).tokens)


def predicted_s(ctx: Ctx, case: Case, variant: str, args, known_s: float | None) -> float:
    """How long a row will take: its steps at the case's last measured step time (else at 30 % MFU with remat's
    extra forward), a few seconds of set-up, and for a compiled row on a GPU the compile time (--compile-s until the
    fvx-blocks row has measured one)."""
    if known_s is None:
        known_s = step_flops(case, args) * 4 / 3 * samples_of(ctx, variant) / ctx.world / (0.3 * args.peak)
    # a whole model compiles for longer than a block: 3-15x on the CPU (design §3), so 3x the blocks' time at least
    compile_s = (args.compile_s * (1 if variant == "fvx-blocks" else 3)) if variant in COMPILED and ctx.cuda else 0.0
    return (warmup_of(variant, args) + args.steps) * known_s * 1.1 + 5.0 + compile_s


def run_row(ctx: Ctx, case: Case, variant: str, args) -> dict:
    batch = make_batch(case.preset, case.video, args.text_len, ctx.device, seed_of(ctx, variant))
    step = VARIANTS[variant](ctx, case, batch, args)
    result = measure(ctx, step, warmup_of(variant, args), args)
    model = getattr(step, "model", None)
    stats = None if model is None else model.kernels.compile_stats
    name = variant if stats is None else f"{variant} ({stats.graphs} graphs, {stats.recompiles} recompiles)"
    del step, model, batch
    release(ctx)
    return {"variant": name, "kind": variant, **result}


def run_case(ctx: Ctx, case: Case, args) -> list[dict]:
    """Every variant of ``case`` in turn, each built from scratch and freed after; rows past the budget skipped."""
    rows, known_s = [], None
    for variant in case.variants:
        elapsed = time.perf_counter() - ctx.start
        need = predicted_s(ctx, case, variant, args, known_s)
        if agree(ctx, elapsed + need > args.budget_s):
            log(ctx, f"{case.title}: skipping {variant}: it would start at {elapsed:.0f} s and take ~{need:.0f} s, "
                     f"past the {args.budget_s:.0f} s budget")
            rows.append({"variant": variant, "kind": variant, "skipped": f"skipped (budget {args.budget_s:.0f} s)"})
            continue
        log(ctx, f"{case.title}: {variant} ...")
        try:
            row = run_row(ctx, case, variant, args)
        except Exception as error:  # one process: say so and go on with the next row (the session runs once)
            if ctx.world > 1:  # the other ranks wait in a collective: let torchrun stop them all
                raise
            traceback.print_exc()
            what = "out of memory" if isinstance(error, torch.cuda.OutOfMemoryError) else type(error).__name__
            row = {"variant": variant, "kind": variant, "skipped": f"failed: {what}", "why": str(error)[:160]}
        if "skipped" in row:  # (outside the except: its traceback no longer holds the row's tensors)
            release(ctx)
            log(ctx, f"{case.title}: {variant} {row['skipped']} ({row['why']})")
            rows.append(row)
            continue
        known_s = row["s"]
        if variant == "fvx-blocks":  # what compiling took, for the next compiled rows' prediction
            args.compile_s = max(0.0, row["warmup_s"] - warmup_of(variant, args) * row["s"])
        log(ctx, f"{case.title}: {row['variant']}: {row['s']:.3f} s/step (warm-up {row['warmup_s']:.1f} s), "
                 f"peak {gib(row['peak'])} GiB, first loss {row['loss0']:.5f}")
        rows.append(row)
    for row in rows:
        row["case"], row["samples"] = case, samples_of(ctx, row["kind"])
        row["estimate"] = row_estimate(ctx, case.preset, case.video, row["kind"], args)
    return rows


# --------------------------------------------------------------------------------------------------------- plans


def capacity(ctx: Ctx) -> int:
    """Bytes of one device: the GPU's, or an H200's (fvx.distributed.memory's default) on a CPU."""
    return torch.cuda.get_device_properties(ctx.device).total_memory if ctx.cuda else memory.H200_BYTES


def pick_video(ctx: Ctx, preset: str, args, variants: tuple[str, ...]) -> tuple[int, int, int]:
    """The largest of VIDEOS whose dry-run estimate, for the hungriest variant, fits FIT_FRACTION of the GPU."""
    if args.video:
        return tuple(int(v) for v in args.video.split("x"))
    if not ctx.cuda:
        return CHECK_VIDEO
    for video in VIDEOS:
        if max(row_estimate(ctx, preset, video, v, args) for v in variants) <= FIT_FRACTION * capacity(ctx):
            return video
    return VIDEOS[-1]


def make_case(ctx: Ctx, preset: str, layers: int | None, variants: tuple[str, ...], args) -> Case:
    run = layered(preset, layers)
    total = wan.PRESETS[preset].kwargs["num_layers"]
    return Case(run, preset, wan.PRESETS[run].kwargs["num_layers"], total, pick_video(ctx, run, args, variants),
                variants)


def plan(ctx: Ctx, args) -> list[Case]:
    """What this invocation runs: the session (under --check: the tiny model whole and cut to 1 block), or the one
    case --preset / --layers name."""
    variants = tuple(args.variants.split(",")) if args.variants else (
        SHARDED_VARIANTS if ctx.torchrun else SINGLE_VARIANTS)
    if ctx.world > 1 and "eager" in variants:
        raise SystemExit("--variants eager: the unsharded baseline runs in one process (python bench/gpu.py)")
    if args.preset is None and args.layers is None:
        session = (("tiny", None), ("tiny", 1)) if args.check else SESSION
        return [make_case(ctx, preset, layers, variants, args) for preset, layers in session]
    return [make_case(ctx, args.preset or "wan2.1-t2v-1.3b", args.layers, variants, args)]


# --------------------------------------------------------------------------------------------------------- table


def gib(n: float) -> str:
    return "-" if n != n else f"{n / 2**30:.1f}"  # NaN: no CUDA peak on a CPU


def ratio(row: dict, ref: dict | None) -> str:
    """Time per sample of ``row`` over ``ref``'s (the step-time ratio when both run as many samples per step)."""
    if ref is None:
        return "-"
    return f"{(row['s'] / row['samples']) / (ref['s'] / ref['samples']):.2f}x"


def table(ctx: Ctx, rows: list[dict], args) -> list[str]:
    """The markdown table of every row, and its notes."""
    lines = ["| model, video | tokens/rank | variant | step s | tokens/s | vs eager | vs fsdp2 | vs compiled | MFU % "
             "| ms/block | peak GiB | est. GiB | warm-up s | first loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        case: Case = row["case"]
        tokens = grid_of(case.preset, case.video).tokens
        head = f"| {case.title} | {tokens // sp_of(ctx, row['kind'])} | {row['variant']} |"
        if "skipped" in row:
            lines.append(f"{head} {row['skipped']} |{' |' * 7} {row['estimate'] / 2**30:.1f} | | |")
            continue
        same = [r for r in rows if r["case"] == case and "s" in r]
        refs = {kind: next((r for r in same if r["kind"] == kind), None) for kind in ("eager", "fsdp2", "compiled")}
        total_flops = step_flops(case, args) * row["samples"]
        mfu = 100 * flops.mfu(total_flops / ctx.world, row["s"], args.peak)
        lines.append(
            f"{head} {row['s']:.3f} | {row['samples'] * tokens / row['s']:,.0f} | {ratio(row, refs['eager'])} "
            f"| {ratio(row, refs['fsdp2'])} | {ratio(row, refs['compiled'])} | {mfu:.1f} "
            f"| {1e3 * row['s'] / case.layers:.0f} | {gib(row['peak'])} | {row['estimate'] / 2**30:.1f} "
            f"| {row['warmup_s']:.1f} | {row['loss0']:.5f} |")
    return lines + [""] + notes(ctx, rows, args)


def notes(ctx: Ctx, rows: list[dict], args) -> list[str]:
    """What the table's columns mean, and what a cut model (--layers) or SP changes."""
    out = [f"{ctx.world} process(es){f', fvx SP {ctx.sp}' if ctx.sp > 1 else ''}; median of {args.steps} steps "
           f"after {args.warmup} warm-up step(s) ({args.warmup + 1} for compiled rows); batch 1 per data-parallel "
           f"rank, text {args.text_len} tokens, bf16, remat, AdamW + clip. MFU: analytic FLOPs (bench/flops.py, 3x "
           f"forward, remat not counted) of the blocks run and the root, per GPU, over {args.peak / 1e12:.0f} "
           "TFLOP/s. est.: fvx.distributed.memory's dry-run estimate of fvx's peak per rank for that row's sharding. "
           "vs eager / "
           "vs fsdp2 / vs compiled: time per sample against that row of the same case. ms/block: step time over the "
           "blocks run (the root included)."]
    for case in dict.fromkeys(row["case"] for row in rows if row["case"].layers != row["case"].total_layers):
        whole = estimated_peak(case.base, grid_of(case.base, case.video).tokens // ctx.sp, args.text_len, ctx.world)
        out.append(f"{case.base} runs its first {case.layers} of its {case.total_layers} blocks at full width "
                   f"(--layers {case.layers}): the whole model would need ~{whole / 2**30:.0f} GiB per rank here by "
                   f"the dry run (fp32 masters, grads, AdamW), {'more' if whole > capacity(ctx) else 'less'} than "
                   f"the {capacity(ctx) / 2**30:.0f} GiB of one {'GPU' if ctx.cuda else 'H200'}; ms/block and MFU "
                   "stand for its blocks.")
    if ctx.sp > 1:
        out.append(f"fvx rows: SP groups of {ctx.sp} ranks share one sample (tokens/rank is their share); fsdp2 "
                   "has no SP here and runs one sample per rank: compare tokens/s and the ratios (per sample).")
    return out


def command_line(ctx: Ctx) -> str:
    """This run's command, without ``--results PATH`` (where the table went, not what was measured)."""
    argv = sys.argv[1:]
    if "--results" in argv:
        at = argv.index("--results")
        argv = argv[:at] + argv[at + 2:]
    argv = [a for a in argv if not a.startswith("--results=")]
    launcher = f"torchrun --nproc-per-node {ctx.world}" if ctx.torchrun else "python"
    return f"{launcher} bench/gpu.py {' '.join(argv)}".strip()


def device_name(ctx: Ctx) -> str:
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        return f"{ctx.world}x {props.name} ({props.total_memory / 2**30:.0f} GiB)"
    return f"{ctx.world}x CPU ({torch.get_num_threads()} threads per process)"


def write_results(ctx: Ctx, lines: list[str], path: pathlib.Path) -> None:
    section = [f"\n## `{command_line(ctx)}` (issue 14 item 6, {datetime.date.today().isoformat()})", "",
               f"{device_name(ctx)}, torch {torch.__version__}"
               f"{f', CUDA {torch.version.cuda}' if ctx.cuda else ''}, elapsed "
               f"{time.perf_counter() - ctx.start:.0f} s.", "", *lines]
    with open(path, "a") as f:
        f.write("\n".join(section) + "\n")
    print(f"appended the table to {path}", flush=True)


# --------------------------------------------------------------------------------------------------------- dry run


def dry_run(args) -> None:
    """The dry-run table: ``--roles`` of ``--preset`` sharded over ``--world`` ranks at ``--video``."""
    spec = model_spec(args.preset, args.text_len)
    args.video = args.video or "81x480x832"
    video = tuple(int(v) for v in args.video.split("x"))
    grid = memory.latent_grid(*video, vae_stride=spec.vae_stride, patch=spec.patch)
    roles = [memory.Role("student", spec, trainable=True, ema=True)]
    if args.roles == "dmd2":
        roles = [memory.Role("generator (+EMA)", spec, trainable=True, ema=True),
                 memory.Role("critic (fake score)", spec, trainable=True),
                 memory.Role("teacher (real score, bf16)", spec, trainable=False, param_bytes=2)]
    est = memory.estimate(roles, shard_size=args.world, tokens=grid.tokens, batch_per_rank=1)
    print(memory.format_table(est, f"{args.preset} {args.roles}, {args.world} ranks (FSDP), video {args.video} "
                                   f"-> latent {grid.frames}x{grid.height}x{grid.width} = {grid.tokens} tokens, "
                                   "batch 1 per rank, bf16 compute, remat"))


# ------------------------------------------------------------------------------------------------------------ main


def vsa_rows(args) -> list[str]:
    """``--vsa``: the VSA rows (module docstring), as table lines."""
    from attention import vsa_vs_dense
    from fvx_models.attention import vsa
    device = "cuda" if torch.cuda.is_available() and not args.check else "cpu"
    grid, heads, head_dim = ((4, 8, 8), 2, 64) if args.check else ((21, 30, 52), 12, 128)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    usable = ["reference"] + (["flex"] if device == "cuda" else []) + \
        (["kernel"] if device == "cuda" and vsa.kernel_available() is None else [])
    lines = [f"| grid {'x'.join(map(str, grid))}, {heads} heads x {head_dim}, {dtype} | sparsity | dense ms | VSA ms "
             "| time x (dense / VSA) | FLOP x |", "|---|---|---|---|---|---|"]
    for implementation in usable:
        for sparsity in (0.8, 0.9):
            try:
                r = vsa_vs_dense(device, grid, heads, head_dim, sparsity, implementation, dtype=dtype,
                                 repeats=args.steps, backward=True)
            except Exception as error:  # one failing row (out of memory) must not lose the others
                lines.append(f"| VSA {implementation} | {sparsity} | failed: {type(error).__name__}: "
                             f"{str(error).splitlines()[0][:120]} | | | |")
                continue
            sparse = r["coarse_flops"] + r["fine_flops"]
            lines.append(f"| VSA {implementation} | {sparsity} | {r['dense_s'] * 1e3:.1f} | {r['vsa_s'] * 1e3:.1f} | "
                         f"{r['dense_s'] / r['vsa_s']:.2f} | {r['dense_flops'] / sparse:.2f} |")
    if vsa.kernel_available() is not None:
        lines.append(f"\nfastvideo-kernel row left out: {vsa.kernel_available()}")
    return lines


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="CPU: tiny preset and video, every variant once")
    parser.add_argument("--dry-run", action="store_true", help="print the memory estimate and exit")
    parser.add_argument("--vsa", action="store_true", help="VSA against dense SDPA at Wan 1.3B 480p (docstring)")
    parser.add_argument("--preset", default=None, help="wan2.1-t2v-1.3b (default), wan2.1-t2v-14b, ...")
    parser.add_argument("--layers", type=int, default=None, help="run only the first K blocks of the preset")
    parser.add_argument("--fsdp", type=int, default=None, help="data-parallel sharding degree (torchrun processes "
                                                               "/ --sp)")
    parser.add_argument("--sp", type=int, default=1, help="sequence-parallel degree (fvx rows)")
    parser.add_argument("--variants", default=None, help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--video", default=None, help="frames x height x width (default: the largest that fits)")
    parser.add_argument("--world", type=int, default=8, help="shard size (dry run)")
    parser.add_argument("--roles", choices=("finetune", "dmd2"), default="dmd2", help="dry run")
    parser.add_argument("--text-len", type=int, default=None, help="text tokens (default: the preset's, 512)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps (a compiled row runs one more)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="skip a row that would end after this (s)")
    parser.add_argument("--compile-s", type=float, default=100.0, help="a compiled row's compile time, predicted")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--peak-tflops", type=float, default=flops.H200_BF16_DENSE / 1e12)
    parser.add_argument("--write-results", action="store_true", help="append the table to --results")
    parser.add_argument("--results", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args()
    args.peak = args.peak_tflops * 1e12
    if args.variants and not set(args.variants.split(",")) <= set(VARIANTS):
        parser.error(f"--variants {args.variants}: choose among {', '.join(VARIANTS)}")
    return args


def refusal(args) -> str | None:
    """Why the flags cannot run here (one line), or None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.sp > 1 and importlib.util.find_spec("fvx.distributed.sequence_parallel") is None:
        return f"--sp {args.sp}: fvx has no sequence parallelism yet (fvx/distributed/sequence_parallel.py is missing)"
    if args.sp < 1 or (args.fsdp or 1) < 1:
        return f"--fsdp {args.fsdp} and --sp {args.sp} must be >= 1"
    if world > 1 and world % args.sp:
        return f"--sp {args.sp} must divide the {world} processes torchrun started"
    need = (args.fsdp or max(1, world // args.sp)) * args.sp
    if need != world:
        return (f"--fsdp {args.fsdp or 1} x --sp {args.sp} needs {need} processes: torchrun --nproc-per-node {need} "
                f"bench/gpu.py {' '.join(sys.argv[1:])} (this run has {world})")
    if not args.check and not torch.cuda.is_available():
        return "bench/gpu.py needs a CUDA GPU; run with --check on a CPU to validate it, or --dry-run for memory"
    return None


def main() -> int:
    start = time.perf_counter()
    args = parse()
    if args.dry_run:
        args.preset, args.text_len = args.preset or "wan2.1-t2v-14b", args.text_len or 512
        dry_run(args)
        return 0
    if args.vsa:
        lines = vsa_rows(args)
        print("\n".join(lines))
        if args.write_results and not args.check:
            with open(args.results, "a") as f:
                f.write(f"\n## `python bench/gpu.py --vsa` (issue 30, {datetime.date.today().isoformat()})\n\n"
                        f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n\n" + "\n".join(lines) + "\n")
        return 0
    why = refusal(args)
    if why:
        print(why)
        return 2
    if args.check:
        args.text_len = args.text_len or CHECK_TEXT_LEN
        args.steps, args.warmup = 1, 1  # (a compiled row warms up twice: the second step must not recompile)
        args.backend = "aot_eager" if args.backend == "inductor" else args.backend
    args.text_len = args.text_len or 512
    ctx = start_processes(args, start)
    if ctx.cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    log(ctx, f"{device_name(ctx)}, torch {torch.__version__}: {command_line(ctx)}")
    rows = [row for case in plan(ctx, args) for row in run_case(ctx, case, args)]
    lines = table(ctx, rows, args)
    failed = [f"{row['case'].title}: {row['variant']}" for row in rows if row.get("skipped", "").startswith("failed")]
    if ctx.rank == 0:
        print("\n" + "\n".join(lines), flush=True)
        if args.write_results:
            write_results(ctx, lines, args.results)
        if failed:
            print(f"{'check FAILED' if args.check else 'FAILED'}: {'; '.join(failed)}")
        elif args.check:
            print("check passed (CPU: times, MFU and ratios mean nothing here)")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
