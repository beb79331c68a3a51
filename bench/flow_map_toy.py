"""Flow maps on fvx's toy world, and what their derivative costs (issue 28).

Quality: runs ``experiments/anyflow_pretrain.py``, ``experiments/meanflow.py``, ``experiments/scm.py`` and
``experiments/anyflow.py`` (the README's scenario: students started from the exported ``runs/teacher``) for their
default steps, in this process, and prints each student's validation figures (``nearest_mse``: the samples' distance to the nearest true clip of their
prompt; ``hit_rate``) at step 0 and at the end, per number of jumps, beside the teacher's own Euler samples at 1, 2,
4 and 20 steps on the same prompts and noise.
Cost: one training step of tiny Wan (batch 2, 4x32x32 latents: 1024 tokens) by plain flow matching, by sCM (``dual``)
and by MeanFlow with its derivative by ``torch.func.jvp`` (ad), dual tensors (dual) and central differences (finite_difference):
median seconds over alternating repeats, and the peak resident memory of one step above its start (each in a fresh
process, so no allocator cache hides it), as ratios of the plain step's.
    python bench/flow_map_toy.py [--skip-quality] [--skip-cost] [--repeats 5]
"""
from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # the repository root, not bench/
sys.path.insert(1, str(ROOT / "bench"))

from common import alternate, peak_rss_bytes, reset_peak_rss  # noqa: E402

STUDENTS = {"anyflow_pretrain.py": "student_{n}step", "meanflow.py": "student_{n}step", "scm.py": "student_{n}step",
            "anyflow.py": "student_ema"}
QUIET = ["run.progress=false", "run.checkpoint.every=0"]


def figures(folder: pathlib.Path, tag: str) -> dict[int, tuple[float, float]]:
    """Step -> (nearest_mse, hit_rate) of one validation tag."""
    from fvx.training import tracking

    scalars = tracking.read_scalars(folder / "tb")
    return {step: (value, dict(scalars[f"validation/{tag}/hit_rate"])[step])
            for step, value in scalars[f"validation/{tag}/nearest_mse"]}


def quality(out: pathlib.Path) -> None:
    from fvx import run

    print("teacher (Euler, guided as validation guides it)    steps  nearest_mse  hit_rate")
    for steps in (1, 2, 4, 20):
        folder = out / f"teacher_{steps}"
        assert run.main([str(ROOT / "experiments" / "finetune_wan.py"), "--out", str(folder), "--steps", "1",
                         "models.student.path=runs/teacher", "validation.every=1", f"validation.num_steps={steps}",
                         *QUIET]) == 0
        mse, hit = figures(folder, "model")[0]
        print(f"{'':50s} {steps:5d}  {mse:11.4f}  {hit:8.3f}")
    for experiment, tag in STUDENTS.items():
        folder = out / experiment.removesuffix(".py")
        assert run.main([str(ROOT / "experiments" / experiment), "--out", str(folder), *QUIET]) == 0
        print(f"{experiment:50s} jumps  step  nearest_mse  hit_rate")
        tags = {n: tag.format(n=n) for n in (1, 2, 4)} if "{n}" in tag else {2: tag}
        for n, name in tags.items():
            for step, (mse, hit) in sorted(figures(folder, name).items()):
                print(f"{'':50s} {n:5d} {step:5d}  {mse:11.4f}  {hit:8.3f}")


def steps():
    """Name -> one training step (value and gradients) of tiny Wan, plain or MeanFlow by each derivative."""
    from fvx.core import flow, grad, random
    from fvx_methods import meanflow, scm
    from fvx_models.wan import WanConfig
    from fvx_models.wan_two_time import REmbedder

    model = WanConfig(preset="tiny", r_embedder=REmbedder()).build()
    params = model.weights.init(random.key(0))
    batch = {"latents": random.normal(random.key(1), (2, 16, 4, 32, 32)), "sample_index": torch.arange(2),
             "cond": {"text": random.normal(random.key(2), (2, 8, 32)), "text_mask": torch.ones(2, 8)}}

    def plain(p, b, key):
        x0 = b["latents"]
        noise = random.normal(key, x0.shape)
        sigma = torch.tensor([0.3, 0.7])
        v = model.apply(p, flow.add_noise(x0, noise, sigma), 1000 * sigma, b["cond"])
        return ((v - flow.velocity_target(x0, noise)) ** 2).mean(), {}

    losses = {"plain": plain, "scm_dual": lambda p, b, key: scm.loss_fn(
        p, b, key, model=model, config=scm.SCM(), step=torch.tensor(0), weights=torch.ones(32))}
    for mode in ("ad", "dual", "finite_difference"):
        losses[f"meanflow_{mode}"] = (lambda config: lambda p, b, key: meanflow.loss_fn(
            p, b, key, model=model, config=config))(meanflow.MeanFlow(derivative=mode))
    return {name: (lambda loss: lambda: grad.value_and_grad(loss, has_aux=True)(params, batch, random.key(3)))(loss)
            for name, loss in losses.items()}


def peak(name: str) -> None:
    """Print the peak resident bytes of one step of ``name`` above the process's memory before it."""
    step = steps()[name]
    reset_peak_rss()
    start = peak_rss_bytes()
    step()
    print(peak_rss_bytes() - start)


def cost(repeats: int) -> None:
    seconds = alternate(steps(), repeats)
    peaks = {name: int(subprocess.run([sys.executable, __file__, "--peak", name], capture_output=True, text=True,
                                      check=True).stdout.split()[-1]) for name in seconds}
    print(f"{'tiny Wan, one step':28s} {'seconds':>8s} {'x plain':>8s} {'peak MiB':>9s} {'x plain':>8s}")
    for name in seconds:
        print(f"{name:28s} {seconds[name]:8.3f} {seconds[name] / seconds['plain']:8.2f} "
              f"{peaks[name] / 2**20:9.1f} {peaks[name] / max(peaks['plain'], 1):8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.peak:
        return peak(args.peak)
    if not args.skip_cost:
        cost(args.repeats)
    if not args.skip_quality:
        with tempfile.TemporaryDirectory() as out:
            quality(pathlib.Path(out))


if __name__ == "__main__":
    main()
