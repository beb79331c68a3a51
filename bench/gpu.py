"""Wan 2.1 T2V 1.3B (random init) fine-tuning step on one GPU: the eager PyTorch baseline against fvx eager and fvx
with ``compile: blocks``, in one run; bf16 compute, fp32 masters, remat, batch 1, 81x480x832 (latent 21x60x104, 32760
tokens) or the largest size that fits. Prints step time, peak memory, MFU (analytic FLOPs of bench/flops.py over
989 TFLOP/s) and the dry-run estimate of the peak beside the measured one.

    python bench/gpu.py                      # on a CUDA GPU: about 5-8 minutes (inductor compiles the block once)
    python bench/gpu.py --check              # on a CPU: tiny model and video, every variant once (imports, shapes)
    python bench/gpu.py --dry-run            # no device: the memory table of 14B three-role DMD2 on 8 ranks

Baseline: the diffusers module with its own gradient checkpointing, ``torch.autocast(bf16)``, ``loss.backward()``,
``clip_grad_norm_(foreach=True)``, ``torch.optim.AdamW(fused=True)``. fvx: ``WanConfig(...).build().apply`` (bf16
compute, remat), ``fvx.grad.value_and_grad``, ``fvx.optim`` clip + AdamW in place; ``compile: blocks`` routes the
30 blocks through one inductor-compiled function. Same initial params and batch for all.
"""
from __future__ import annotations

import argparse
import functools
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

import torch  # noqa: E402
from diffusers import WanTransformer3DModel  # noqa: E402

from bench import flops  # noqa: E402
from fvx import grad, memory, optim  # noqa: E402
from fvx_models import wan  # noqa: E402

VIDEOS = ((81, 480, 832), (49, 480, 832), (33, 480, 832), (17, 480, 832))
VAE_STRIDE, TEXT_LEN = (4, 8, 8), 512
LR, MAX_NORM = 1e-5, 1.0


def kwargs_of(preset: str) -> dict:
    return dict(wan.WAN.preset(preset).kwargs)


def make_batch(preset: str, video: tuple[int, int, int], text_len: int, device: torch.device, seed: int = 0) -> dict:
    kwargs = kwargs_of(preset)
    grid = memory.latent_grid(*video, vae_stride=VAE_STRIDE, patch=kwargs["patch_size"])
    shape = (1, kwargs["in_channels"], grid.frames, grid.height, grid.width)
    g = torch.Generator(device).manual_seed(seed)
    text = torch.randn(1, text_len, kwargs["text_dim"], generator=g, device=device)
    return {"x": torch.randn(shape, generator=g, device=device), "t": torch.tensor([500.0], device=device),
            "cond": {"text": text, "text_mask": torch.ones(1, text_len, device=device)},
            "target": torch.randn(shape, generator=g, device=device), "tokens": grid.tokens}


def initial_module(preset: str, device: torch.device) -> WanTransformer3DModel:
    """The diffusers module with torch's default init under a fixed seed (global RNG state restored)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        with device:
            return WanTransformer3DModel(**kwargs_of(preset))


# -------------------------------------------------------------------------------------------------------- variants


def baseline_step(module, optimizer, batch, compute_dtype):
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(batch["x"].device.type, dtype=compute_dtype):
        v = module(batch["x"], batch["t"], batch["cond"]["text"], return_dict=False)[0]
    loss = ((v.float() - batch["target"]) ** 2).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), MAX_NORM, foreach=True)
    optimizer.step()
    return loss.detach()


def fvx_step(model, tx, params, opt_state, batch):
    def loss_fn(p):
        v = model.apply(p, batch["x"], batch["t"], batch["cond"])
        return ((v - batch["target"]) ** 2).mean()

    loss, grads = grad.value_and_grad(loss_fn)(params)
    optim.step_(tx, params, grads, opt_state)
    return loss


def measure(step, steps: int, warmup: int, device: torch.device) -> dict:
    """Median seconds per step over ``steps`` after ``warmup`` (compiles happen there), the peak memory of the timed
    steps, and the loss of the first step (fvx compiled continues from fvx eager's params)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    first = step().item()
    for _ in range(warmup - 1):
        step()
    sync()
    warm_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else float("nan")
    return {"s": statistics.median(times), "peak": peak, "warmup_s": warm_s, "loss0": first}


def run_size(args, video, device, compute_dtype) -> list[dict]:
    """Every variant at one video size, baseline first (then freed), then fvx eager and compiled."""
    batch = make_batch(args.preset, video, args.text_len, device)
    rows = []
    module = initial_module(args.preset, device)
    params = {n: p.detach().to("cpu", copy=True) for n, p in module.named_parameters()}  # off the GPU meanwhile
    module.enable_gradient_checkpointing()
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR, fused=fused, foreach=not fused)
    step = functools.partial(baseline_step, module, optimizer, batch, compute_dtype)
    rows.append({"variant": "baseline eager", **measure(step, args.steps, args.warmup, device)})
    del module, optimizer, step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    params = {n: p.to(device) for n, p in params.items()}
    tx = optim.chain(optim.clip_by_global_norm(MAX_NORM), optim.adamw(LR))
    opt_state = tx.init(params)
    dtype = {torch.bfloat16: "bf16", torch.float32: "fp32"}[compute_dtype]
    for mode in ("none", "blocks"):
        if time.perf_counter() - args.start > args.budget_s:
            print(f"  skipping fvx {mode}: past the {args.budget_s} s budget", flush=True)
            continue
        model = wan.WanConfig(preset=args.preset, remat=True, compute_dtype=dtype, compile=mode,
                              compile_backend=args.backend).build()
        result = measure(lambda: fvx_step(model, tx, params, opt_state, batch), args.steps, args.warmup, device)
        graphs = 0 if model.compile_stats is None else model.compile_stats.graphs
        name = "fvx eager" if mode == "none" else f"fvx compile: blocks ({graphs} graphs)"
        rows.append({"variant": name, **result})
    for row in rows:
        row["tokens"], row["video"] = batch["tokens"], video
    return rows


def model_spec(preset: str, text_len: int) -> memory.ModelSpec:
    """The dry run's view of the preset under remat and bf16, at ``text_len`` text tokens."""
    spec = wan.WanConfig(preset=preset, remat=True, compute_dtype="bf16").build().memory_spec()
    return spec._replace(text_len=text_len)


def estimated_peak(preset: str, tokens: int, text_len: int) -> int:
    """fvx.memory's estimate for one process holding the whole model (shard size 1), remat, bf16."""
    role = memory.Role("student", model_spec(preset, text_len), trainable=True)
    return memory.estimate([role], shard_size=1, tokens=tokens, batch_per_rank=1, capacity=1 << 62).total


def report(rows: list[dict], preset: str, text_len: int, peak_flops: float) -> None:
    tokens, video = rows[0]["tokens"], rows[0]["video"]
    step_flops = flops.training_flops(flops.wan_dims(preset, text_len), tokens)
    base = rows[0]["s"]
    print(f"\n{preset}, video {'x'.join(map(str, video))} ({tokens} tokens), text {text_len}, batch 1, bf16, remat; "
          f"{step_flops / 1e12:.1f} TFLOP per step (3x forward); dry-run estimate of the peak: "
          f"{estimated_peak(preset, tokens, text_len) / 2**30:.1f} GiB")
    print(f"| {'variant':31} | {'step s':>7} | {'vs baseline':>11} | {'MFU %':>6} | {'peak GiB':>8} | "
          f"{'warmup s':>8} | {'first loss':>11} |")
    print(f"|{'-' * 33}|{'-' * 9}|{'-' * 13}|{'-' * 8}|{'-' * 10}|{'-' * 10}|{'-' * 13}|")
    for row in rows:
        print(f"| {row['variant']:31} | {row['s']:7.3f} | {row['s'] / base:10.2f}x | "
              f"{100 * flops.mfu(step_flops, row['s'], peak_flops):6.1f} | {row['peak'] / 2**30:8.2f} | "
              f"{row['warmup_s']:8.1f} | {row['loss0']:11.5f} |")


def dry_run(args) -> None:
    """The dry-run table: ``--roles`` of ``--preset`` sharded over ``--world`` ranks at ``--video``."""
    spec = model_spec(args.preset, args.text_len)
    video = tuple(int(v) for v in args.video.split("x"))
    grid = memory.latent_grid(*video, vae_stride=VAE_STRIDE, patch=spec.patch)
    roles = [memory.Role("student", spec, trainable=True, ema=True)]
    if args.roles == "dmd2":
        roles = [memory.Role("generator (+EMA)", spec, trainable=True, ema=True),
                 memory.Role("critic (fake score)", spec, trainable=True),
                 memory.Role("teacher (real score, bf16)", spec, trainable=False, param_bytes=2)]
    est = memory.estimate(roles, shard_size=args.world, tokens=grid.tokens, batch_per_rank=1)
    print(memory.format_table(est, f"{args.preset} {args.roles}, {args.world} ranks (FSDP), video {args.video} "
                                   f"-> latent {grid.frames}x{grid.height}x{grid.width} = {grid.tokens} tokens, "
                                   "batch 1 per rank, bf16 compute, remat"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="CPU: tiny preset and video, every variant once")
    parser.add_argument("--dry-run", action="store_true", help="print the memory estimate and exit")
    parser.add_argument("--preset", default=None)
    parser.add_argument("--video", default="81x480x832", help="frames x height x width (dry run)")
    parser.add_argument("--world", type=int, default=8, help="shard size (dry run)")
    parser.add_argument("--roles", choices=("finetune", "dmd2"), default="dmd2", help="dry run")
    parser.add_argument("--text-len", type=int, default=TEXT_LEN)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip what would start after this")
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    args.start = time.perf_counter()
    if args.dry_run:
        args.preset = args.preset or "wan2.1-t2v-14b"
        dry_run(args)
        return 0
    if args.check:
        args.preset, args.text_len, args.steps, args.warmup = args.preset or "tiny", 8, 1, 1
        args.backend = "aot_eager" if args.backend == "inductor" else args.backend
        rows = run_size(args, (5, 32, 32), torch.device("cpu"), torch.bfloat16)
        report(rows, args.preset, args.text_len, flops.H200_BF16_DENSE)
        print("check passed (CPU: times and MFU mean nothing here)")
        return 0
    if not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA GPU; run with --check on a CPU to validate it, or --dry-run for memory")
        return 0
    args.preset = args.preset or "wan2.1-t2v-1.3b"
    device = torch.device("cuda", 0)
    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB", flush=True)
    for video in VIDEOS:
        try:
            rows = run_size(args, video, device, torch.bfloat16)
        except torch.cuda.OutOfMemoryError as error:
            print(f"{'x'.join(map(str, video))}: out of memory ({str(error)[:120]}); trying a smaller video", flush=True)
            torch.cuda.empty_cache()
            continue
        report(rows, args.preset, args.text_len, flops.H200_BF16_DENSE)
        return 0
    print("no video size fitted")
    return 1


if __name__ == "__main__":
    sys.exit(main())
