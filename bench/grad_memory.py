"""Peak memory and time of fvx.core.grad.value_and_grad (plain and with remat) against loss.backward() and
torch.func.grad.

One 8-layer tiny Wan at a few thousand tokens. Each variant runs in a fresh subprocess so that its peak resident memory
(CPU) or peak allocated memory (CUDA) is its own; ratios are to loss.backward() measured in the same run.
    python bench/grad_memory.py [--tokens-side 48] [--frames 4] [--repeats 3] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from common import current_rss_bytes, peak_rss_bytes, timed  # noqa: E402

VARIANTS = ("module_backward", "fvx_value_and_grad", "fvx_value_and_grad_remat", "torch_func_grad")
WAN = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=16, out_channels=16,
           text_dim=64, freq_dim=32, ffn_dim=256, num_layers=8, rope_max_seq_len=1024)


def run_variant(name: str, frames: int, side: int, repeats: int, device: str) -> dict:
    import torch
    from diffusers import WanTransformer3DModel
    from torch.func import functional_call

    from fvx.core import grad as fgrad

    torch.manual_seed(0)
    model = WanTransformer3DModel(**WAN).to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, frames, side, side, generator=g).to(device)
    t = torch.tensor([500.0], device=device)
    ctx = torch.randn(1, 32, 64, generator=g).to(device)
    target = torch.randn(x.shape, generator=g).to(device)
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss_fn(p):
        out = functional_call(model, (p, buffers), (x, t, ctx), {"return_dict": False})[0]
        return ((out.float() - target) ** 2).mean()

    if name == "module_backward":
        def step():
            model.zero_grad(set_to_none=True)
            loss = ((model(x, t, ctx, return_dict=False)[0].float() - target) ** 2).mean()
            loss.backward()
    elif name == "torch_func_grad":
        grad_fn = torch.func.grad(loss_fn)
        def step():
            grad_fn(params)
    else:
        if name.endswith("remat"):
            model.enable_gradient_checkpointing(fgrad.remat)
        vg = fgrad.value_and_grad(loss_fn)
        def step():
            vg(params)

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = current_rss_bytes()
    times = [timed(step, sync) for _ in range(repeats)]
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = peak_rss_bytes() - base
    tokens = frames * (side // 2) ** 2
    return {"variant": name, "peak_mb": peak / 2**20, "time_s": statistics.median(times[1:] or times), "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=4)
    parser.add_argument("--tokens-side", type=int, default=48, help="latent H = W (tokens = frames * (side/2)^2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.frames, args.tokens_side, args.repeats, args.device)))
        return
    rows = []
    for name in VARIANTS:
        cmd = [sys.executable, __file__, "--variant", name, "--frames", str(args.frames),
               "--tokens-side", str(args.tokens_side), "--repeats", str(args.repeats), "--device", args.device]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    base = rows[0]
    print(f"8-layer tiny Wan, {base['tokens']} tokens, device {args.device}, median of {args.repeats} steps")
    print(f"{'variant':28} {'peak MB':>9} {'time s':>8} {'mem ratio':>10} {'time ratio':>10}")
    for r in rows:
        print(f"{r['variant']:28} {r['peak_mb']:9.1f} {r['time_s']:8.3f} {r['peak_mb'] / base['peak_mb']:10.2f} "
              f"{r['time_s'] / base['time_s']:10.2f}")


if __name__ == "__main__":
    main()
