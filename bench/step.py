"""The fine-tuning step of fvx against an eager PyTorch baseline written the usual way, in one process.

Baseline: ``nn.Module`` forward, ``loss.backward()``, ``clip_grad_norm_(foreach=True)`` and
``torch.optim.AdamW(foreach=True)``. fvx: ``Finetune(...).build(model).step_`` (functional_call forward,
``fvx.grad.value_and_grad``, foreach clip + AdamW in place), eager and with ``compile=blocks`` (one inductor graph
shared by all transformer blocks). Same architecture, initial params, batch, noise and
timesteps: both steps draw the noise and timesteps with the same fvx keys inside their timing. Timings alternate
fvx / baseline; peak memory is measured per variant in a fresh subprocess.
    python bench/step.py [--repeats 10] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from common import alternate, current_rss_bytes, peak_rss_bytes  # noqa: E402

import torch  # noqa: E402
from diffusers import WanTransformer3DModel  # noqa: E402

from fvx import flow, random  # noqa: E402
from fvx.optim_config import AdamWConfig  # noqa: E402
from fvx_methods import finetune  # noqa: E402
from fvx_models import wan  # noqa: E402

# name -> (architecture on top of the tiny preset, latent [C, T, H, W], batch size)
CASES = {
    "tiny": ({}, (16, 2, 16, 16), 4),
    "cpu-4x256": ({"num_layers": 4, "num_attention_heads": 2, "attention_head_dim": 128, "ffn_dim": 1024,
                   "text_dim": 64, "rope_max_seq_len": 64}, (16, 4, 32, 32), 1),
}
TEXT_LEN = 16


def build(case: str, compile: str = "none"):
    """The fvx model and program, a baseline module and optimizer with the same initial params, and a batch."""
    arch, latent_shape, batch_size = CASES[case]
    preset = f"bench-{case}"
    wan.PRESETS[preset] = {**wan.PRESETS["tiny"], **arch}  # a bench-only architecture, registered in this process
    wan.METADATA[preset] = wan.METADATA["tiny"]
    model = wan.WanConfig(preset=preset, compile=compile).build()
    config = finetune.Finetune(optim=AdamWConfig(lr=1e-4, weight_decay=0.01, max_grad_norm=1.0))
    program = config.build(model, total_steps=1000)
    state = program.init(random.key(0))
    module = WanTransformer3DModel(**wan.PRESETS[preset])
    module.load_state_dict(state.roles["student"].params)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)
    g = torch.Generator().manual_seed(0)
    text_dim = wan.PRESETS[preset]["text_dim"]
    batch = {"latents": torch.randn(batch_size, *latent_shape, generator=g),
             "text": torch.randn(batch_size, TEXT_LEN, text_dim, generator=g),
             "text_mask": torch.ones(batch_size, TEXT_LEN), "sample_index": torch.arange(batch_size)}
    return model, config, program, state, module, optimizer, batch


def baseline_draws(config, batch, state, step: int):
    """The noise, sigma and t that fvx's step ``step`` draws, for the baseline to use."""
    key = random.fold_in(state.key, step)
    x0 = batch["latents"]
    noise, t_keys = finetune.per_sample_noise(key, batch["sample_index"], tuple(x0.shape[1:]), x0.device)
    grid = flow.training_sigmas(config.flow_shift)
    sigma, t = flow.sample_training_sigmas(t_keys, grid, config.weighting_scheme)
    return noise, sigma, t


def baseline_step(module, optimizer, batch, draws) -> torch.Tensor:
    noise, sigma, t = draws
    x0 = batch["latents"]
    x_t = flow.add_noise(x0, noise, sigma)
    optimizer.zero_grad(set_to_none=True)
    v = module(x_t, t, batch["text"], return_dict=False)[0]
    loss = torch.mean((v.float() - (noise - x0)) ** 2)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0, foreach=True)
    optimizer.step()
    return loss.detach()


def run_case(case: str, repeats: int) -> dict:
    model, config, program, state, module, optimizer, batch = build(case)
    compiled = build(case, compile="blocks")[2]
    holder = {"fvx": state, "fvx_blocks": compiled.init(random.key(0))}
    first_fvx = program.step_(holder["fvx"], batch)
    holder["fvx"] = first_fvx[0]
    first_base = baseline_step(module, optimizer, batch, baseline_draws(config, batch, state, 0))
    agree = abs(first_fvx[1]["loss"].item() - first_base.item())

    def fvx_step(name, prog):
        def step():
            holder[name], metrics = prog.step_(holder[name], batch)
            metrics["loss"].item()
        return step

    def base_step():
        draws = baseline_draws(config, batch, holder["fvx"], int(holder["fvx"].step))
        baseline_step(module, optimizer, batch, draws)

    times = alternate({"fvx": fvx_step("fvx", program), "fvx_blocks": fvx_step("fvx_blocks", compiled),
                       "baseline": base_step}, repeats=repeats, warmup=2)
    tokens = batch["latents"][0, 0].numel() // 4
    return {"case": case, "tokens": tokens, "batch": len(batch["sample_index"]), "loss_diff_step0": agree, **times}


def peak_memory(case: str, variant: str, steps: int) -> float:
    """Peak resident MB above the process's memory after setup, over ``steps`` steps of one variant."""
    model, config, program, state, module, optimizer, batch = build(case)
    if variant == "fvx":
        del module, optimizer
    base = current_rss_bytes()
    for step in range(steps):
        if variant == "fvx":
            state, _ = program.step_(state, batch)
        else:
            baseline_step(module, optimizer, batch, baseline_draws(config, batch, state, step))
    return (peak_rss_bytes() - base) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--memory", nargs=2, metavar=("CASE", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory:
        print(json.dumps(peak_memory(*args.memory, steps=3)))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats} alternating steps")
    print(f"{'case':10} {'tokens':>6} {'B':>2} {'base ms':>8} {'fvx ms':>8} {'ratio':>6} {'blocks ms':>9} {'ratio':>6} "
          f"{'base MB':>8} {'fvx MB':>8} {'ratio':>6} {'|dloss| step 0':>14}")
    for case in CASES:
        row = run_case(case, args.repeats)
        mem = {}
        for variant in ("fvx", "baseline"):
            cmd = [sys.executable, __file__, "--memory", case, variant]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            mem[variant] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        base = row["baseline"]
        print(f"{case:10} {row['tokens']:6d} {row['batch']:2d} {base * 1e3:8.1f} {row['fvx'] * 1e3:8.1f} "
              f"{row['fvx'] / base:6.2f} {row['fvx_blocks'] * 1e3:9.1f} {row['fvx_blocks'] / base:6.2f} "
              f"{mem['baseline']:8.1f} {mem['fvx']:8.1f} {mem['fvx'] / mem['baseline']:6.2f} "
              f"{row['loss_diff_step0']:14.2e}")


if __name__ == "__main__":
    main()
