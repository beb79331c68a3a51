"""DiffusionNFT on fvx's toy world: does the reward rise, and where does an outer step's time go? (issue 27)

Runs ``experiments/diffusion_nft.py`` (the README's scenario: the exported ``runs/teacher`` fine-tuned for its
4-step Euler samples, rewarded by the world's ``exp(-MSE / HIT)``) for ``--steps`` steps with a full student and with
the recipe ``world_lora``'s LoRA student, in this process, and prints the reward (``reward/avg``, the old policy's
samples) per block of iterations beside the time split of an outer step: sampling (the old policy's rollouts),
decoding (the VAE), scoring (the rewards) and training (advantages, the inner epochs, the old policy's update), each
summed over the steps.
    python bench/nft_toy.py [--steps 150] [--skip-lora] [field=value ...]
"""
from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # the repository root, not bench/
EXPERIMENT = str(ROOT / "experiments" / "diffusion_nft.py")
BLOCK = 10  # iterations per printed reward


class Timer:
    """Seconds spent in each wrapped part, summed."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - began
        return timed


@contextlib.contextmanager
def timed_parts(timer: Timer):
    """Time the step's sampling and scoring where the method calls them, and the VAE's decode."""
    from fvx.data import toy_world
    from fvx_methods import diffusion_nft
    from fvx_methods.rewards import reward

    saved = diffusion_nft.sample_, reward.scores, toy_world.Codec.decode
    diffusion_nft.sample_ = timer.wrap("sampling", saved[0])
    reward.scores = timer.wrap("scoring", saved[1])
    toy_world.Codec.decode = timer.wrap("decoding", saved[2])
    try:
        yield
    finally:
        diffusion_nft.sample_, reward.scores, toy_world.Codec.decode = saved


def run(target: str, steps: int, overrides: list[str], out: pathlib.Path) -> tuple[list[float], dict[str, float]]:
    """Rewards per step and the time split of ``steps`` steps of ``target``."""
    from fvx.config import apply_overrides, load_experiment
    from fvx.training import experiment, loop, tracking

    config = apply_overrides(load_experiment(target), [f"run.output_dir={out}", f"run.steps={steps}",
                                                       "run.progress=false", "validation.every=0",
                                                       "run.checkpoint.every=0", "run.checkpoint.final=false",
                                                       *overrides])
    timer = Timer()
    with timed_parts(timer):  # from the build, which binds the VAE's decode
        prepared = experiment.prepare(config)
        began = time.perf_counter()
        loop.train(config, prepared)
        total = time.perf_counter() - began
    rewards = [value for _, value in tracking.read_scalars(out / "tb")["reward/avg"]]
    parts = dict(timer.seconds)
    parts["training"] = total - sum(parts.values())
    return rewards, parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--skip-lora", action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.manual_seed(0)  # nothing in fvx reads it; set so that a library that does cannot vary the figures
    targets = [("full", EXPERIMENT)] + ([] if args.skip_lora else [("lora", f"{EXPERIMENT}:world_lora")])
    with tempfile.TemporaryDirectory() as tmp:
        for name, target in targets:
            rewards, parts = run(target, args.steps, args.overrides, pathlib.Path(tmp) / name)
            blocks = [sum(rewards[i:i + BLOCK]) / len(rewards[i:i + BLOCK]) for i in range(0, len(rewards), BLOCK)]
            total = sum(parts.values())
            print(f"{name}: reward/avg per {BLOCK} iterations: " + " ".join(f"{r:.3f}" for r in blocks))
            print(f"{name}: {args.steps} steps in {total:.1f} s: " + ", ".join(
                f"{part} {seconds:.1f} s ({100 * seconds / total:.0f}%)" for part, seconds in parts.items()))


if __name__ == "__main__":
    main()
