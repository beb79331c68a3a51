"""Does DMD2 work? A toy a tiny Wan learns on a CPU: pretrain a teacher, distil a 4-step student, compare samples.

Data: P prompts; prompt p is a mixture of M Gaussian clusters on a circle in its own 2-D plane of a [16, 1, 2, 2]
latent (64 numbers, one token), wide within the plane and thin off it; a prompt's text embedding is a fixed random
[2, 32] matrix. The teacher is fine-tuned on it (fvx_methods.finetune), exported, and used as teacher, critic and
student initialisation for DMD2 (fvx_methods.dmd2: simulate rollout, steps [1000, 750, 500, 250], interval 5, no
guidance). Every sampler then draws N samples per prompt and the table reports, averaged over prompts:

    sw        sliced Wasserstein-1 distance to held-out data (128 fixed directions)
    cov_err   |cov(samples) - cov(data)|_F / |cov(data)|_F (a few-step sampler's last jump is a posterior mean,
              which shrinks each cluster)
    plane_d   mean distance, within the prompt's plane, from a sample to its nearest cluster centre (samples left
              between clusters raise it)
    mode_tv   total-variation distance between the samples' nearest-cluster histogram and the true weights

The "data" row compares two independent data draws: the noise floor. DMD2 works when the student's 4-step samples
are much closer to the data than the teacher's 4-step samples (same SDE sampler: predict x0, re-noise, repeat).
Run: ``python bench/dmd2_toy.py`` (about 3.5 minutes on 2 shared cores; ``--quick`` for a smoke run).
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys
import tempfile
import time

import torch

sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])  # the repository root, not bench/
from fvx.core import flow, random  # noqa: E402
from fvx.core.optim_config import AdamWConfig  # noqa: E402
from fvx_methods.dmd2 import DMD2  # noqa: E402
from fvx_methods.finetune import Finetune  # noqa: E402
from fvx_methods.library import distribution_matching as dm  # noqa: E402
from fvx_models.wan import WanConfig  # noqa: E402

SHAPE = (16, 1, 2, 2)
DIM = math.prod(SHAPE)
TEXT_LEN, TEXT_DIM = 2, 32
STEPS = (1000, 750, 500, 250)


# ------------------------------------------------------------------------------------------------------- the data


class Toy:
    """P prompts; prompt p's M clusters sit on a circle of ``radius`` in its own random 2-D plane of the D-dim latent
    (around a random offset), spread ``plane_std`` within the plane and ``std`` off it, with uneven weights.
    centres [P, M, D], planes [P, D, 2] (orthonormal), weights [P, M], text [P, 2, 32]."""

    def __init__(self, key: torch.Tensor, prompts: int, modes: int, radius: float, plane_std: float, std: float):
        plane_key, offset_key, text_key, weight_key = random.split(key, 4)
        planes, _ = torch.linalg.qr(random.normal(plane_key, (prompts, DIM, 2)))
        angles = 2 * math.pi * torch.arange(modes) / modes
        circle = radius * torch.stack([angles.cos(), angles.sin()], dim=-1)  # [M, 2]
        offsets = 0.5 * random.normal(offset_key, (prompts, 1, DIM))
        self.centres = torch.einsum("mk,pdk->pmd", circle, planes) + offsets
        self.text = random.normal(text_key, (prompts, TEXT_LEN, TEXT_DIM))
        self.weights = torch.softmax(random.normal(weight_key, (prompts, modes)) * 0.3, dim=-1)
        self.planes, self.plane_std, self.std, self.prompts = planes, plane_std, std, prompts

    def prompt_of(self, sample_index: torch.Tensor) -> torch.Tensor:
        return sample_index % self.prompts

    def batch(self, key: torch.Tensor, sample_index: torch.Tensor) -> dict:
        """Latents [B, 16, 1, 2, 2] for ``sample_index`` (prompt = index mod P) drawn from ``key``, and their text."""
        prompts = self.prompt_of(sample_index)
        mode_key, plane_key, noise_key = random.split(key, 3)
        u = random.uniform(mode_key, (len(prompts),))
        cumulative = torch.cumsum(self.weights[prompts], dim=-1)
        modes = (u[:, None] >= cumulative).sum(-1).clamp(max=self.weights.shape[1] - 1)
        in_plane = torch.einsum("bdk,bk->bd", self.planes[prompts], random.normal(plane_key, (len(prompts), 2)))
        latents = (self.centres[prompts, modes] + self.plane_std * in_plane
                   + self.std * random.normal(noise_key, (len(prompts), DIM)))
        return {"latents": latents.reshape(-1, *SHAPE), "text": self.text[prompts],
                "text_mask": torch.ones(len(prompts), TEXT_LEN), "sample_index": sample_index}

    def prompt_batch(self, prompt: int, n: int) -> dict:
        return {"text": self.text[prompt].expand(n, -1, -1), "text_mask": torch.ones(n, TEXT_LEN)}


# ------------------------------------------------------------------------------------------------------ the metrics


def sliced_w1(a: torch.Tensor, b: torch.Tensor, directions: torch.Tensor) -> float:
    """Mean over unit ``directions`` [K, D] of the 1-D Wasserstein-1 distance of the projected samples (same count)."""
    pa, _ = torch.sort(a @ directions.T, dim=0)
    pb, _ = torch.sort(b @ directions.T, dim=0)
    return float((pa - pb).abs().mean())


def metrics(samples: torch.Tensor, reference: torch.Tensor, toy: Toy, prompt: int,
            directions: torch.Tensor) -> dict[str, float]:
    """The table's columns for ``samples`` [N, D] of ``prompt`` against ``reference`` data [N, D]."""
    nearest = torch.cdist(samples, toy.centres[prompt]).argmin(dim=1)
    histogram = torch.bincount(nearest, minlength=toy.centres.shape[1]).float() / len(samples)
    in_plane = (samples[:, None, :] - toy.centres[prompt][None]) @ toy.planes[prompt]  # [N, M, 2]
    cov_s, cov_r = torch.cov(samples.T), torch.cov(reference.T)
    return {"sw": sliced_w1(samples, reference, directions),
            "cov_err": float((cov_s - cov_r).norm() / cov_r.norm()),
            "plane_d": float(in_plane.norm(dim=-1).min(dim=1).values.mean()),
            "mode_tv": 0.5 * float((histogram - toy.weights[prompt]).abs().sum())}


# ------------------------------------------------------------------------------------------------------ the samplers


def draw(model, params, toy: Toy, prompt: int, n: int, key: torch.Tensor, sigmas, sampler: str) -> torch.Tensor:
    cond = toy.prompt_batch(prompt, n)
    noise = random.normal(key, (n, *SHAPE))
    with torch.no_grad():
        x = flow.sample(model.apply, params, noise, sigmas, random.fold_in(key, 1), cond=cond, sampler=sampler)
    return x.reshape(n, DIM)


def evaluate(name: str, model, params, toy: Toy, n: int, key: torch.Tensor, sigmas, sampler: str,
             references: list[torch.Tensor], directions: torch.Tensor) -> dict[str, float]:
    rows = [metrics(draw(model, params, toy, p, n, random.fold_in(key, p), sigmas, sampler), references[p], toy, p,
                    directions) for p in range(toy.prompts)]
    return {"name": name, **{k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}}


def batch_normalised_dmd_loss(x0_gen, x0_fake, x0_real):
    """``dm.dmd_loss`` with one normaliser for the whole (single-process) batch: the ablation of
    ``--batch-normaliser``."""
    x0_gen = x0_gen.float()
    with torch.no_grad():
        normalizer = (x0_gen - x0_real.float()).abs().mean()
        target = x0_gen - torch.nan_to_num((x0_fake.float() - x0_real.float()) / normalizer)
    return 0.5 * torch.mean((x0_gen - target) ** 2), normalizer.expand(x0_gen.shape[0])


# ----------------------------------------------------------------------------------------------------------- main


def train(program, batches, steps: int, label: str, every: int, seed: int = 0) -> tuple:
    state, frozen = program.init(random.key(seed)), program.frozen(random.key(seed))
    start = time.perf_counter()
    for step in range(steps):
        state, m = program.step_(state, frozen, program.model.batch(batches(step)))
        if step % every == 0 or step == steps - 1:
            shown = ", ".join(f"{k}={float(v):.4g}" for k, v in m.items() if not k.startswith(("lr", "grad")))
            print(f"  {label} step {step:5d}: {shown}", flush=True)
    return state, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (numbers not meaningful)")
    parser.add_argument("--teacher-steps", type=int, default=1200)
    parser.add_argument("--dmd-steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-5, help="the student's learning rate")
    parser.add_argument("--critic-lr", type=float, default=2e-4)
    parser.add_argument("--samples", type=int, default=256, help="samples per prompt")
    parser.add_argument("--interval", type=int, default=5, help="DMD2 generator_update_interval")
    parser.add_argument("--seed", type=int, default=0, help="the DMD2 run's key (its rollouts, timesteps and noise)")
    parser.add_argument("--batch-normaliser", action="store_true",
                        help="ablation: normalise the DMD gradient by the whole batch's mean|x0_gen - x0_real| "
                             "(fvx before it took the paper's per-sample normaliser)")
    args = parser.parse_args()
    if args.batch_normaliser:
        dm.dmd_loss = batch_normalised_dmd_loss
    if args.quick:
        args.teacher_steps, args.dmd_steps, args.samples = 50, 20, 32
    torch.set_num_threads(1)  # a model this small is per-op-overhead bound: one thread is fastest
    toy = Toy(random.key(2024), prompts=4, modes=4, radius=1.5, plane_std=0.25, std=0.05)
    model_config = WanConfig(preset="tiny")
    model = model_config.build()
    data_key = random.key(7)
    batch_size = args.batch

    def batches(step: int) -> dict:
        return toy.batch(random.fold_in(data_key, step), torch.arange(step * batch_size, (step + 1) * batch_size))

    print(f"teacher: fine-tuning {args.teacher_steps} steps, batch {batch_size}")
    finetune = Finetune(optim=AdamWConfig(lr=1e-3, weight_decay=0.0, schedule="cosine",
                                           warmup_steps=min(100, args.teacher_steps)),
                        flow_shift=3.0)
    teacher_state, teacher_s = train(finetune.build({"student": model}, total_steps=args.teacher_steps), batches,
                                     args.teacher_steps, "finetune", max(1, args.teacher_steps // 10))
    teacher = teacher_state.roles["student"].params

    with tempfile.TemporaryDirectory() as tmp:
        folder = str(pathlib.Path(tmp) / "teacher")
        model.export.folder(teacher, folder)
        student_model = WanConfig(preset="tiny", path=folder).build()
        roles = {"student": student_model, "critic": student_model, "teacher": student_model}
        dmd = DMD2(rollout_mode="simulate", denoising_steps=STEPS, generator_update_interval=args.interval,
                   guidance_scale=1.0, timestep_shift=3.0, flow_shift=3.0,
                   optim=AdamWConfig(lr=args.lr, betas=(0.0, 0.999), weight_decay=0.0, max_grad_norm=1.0),
                   critic_optim=AdamWConfig(lr=args.critic_lr, betas=(0.0, 0.999), weight_decay=0.0,
                                            max_grad_norm=1.0),
                   ema_decay=0.99)
        print(f"student: DMD2 {args.dmd_steps} steps, batch {batch_size}, interval {args.interval}")
        student_state, dmd_s = train(dmd.build(roles, total_steps=args.dmd_steps), batches, args.dmd_steps,
                                     "dmd2", max(1, args.dmd_steps // 10), seed=args.seed)

    student = student_state.roles["student"]
    n, eval_key = args.samples, random.key(99)
    references = [toy.batch(random.key(5), torch.arange(p, p + toy.prompts * n, toy.prompts))["latents"].reshape(n, DIM)
                  for p in range(toy.prompts)]
    directions = random.normal(random.key(11), (128, DIM))
    directions = directions / directions.norm(dim=1, keepdim=True)
    many = flow.shift_sigma(torch.linspace(1, 0, 51)[:-1], 3.0)
    few = torch.tensor(STEPS, dtype=torch.float32) / 1000
    data_row = [metrics(toy.batch(random.key(6), torch.arange(p, p + toy.prompts * n, toy.prompts))["latents"]
                        .reshape(n, DIM), references[p], toy, p, directions) for p in range(toy.prompts)]
    rows = [{"name": "data (fresh draw)", **{k: sum(r[k] for r in data_row) / len(data_row) for k in data_row[0]}}]
    rows += [
        evaluate("teacher 50-step ODE", model, teacher, toy, n, eval_key, many, "ode", references, directions),
        evaluate("teacher 4-step ODE", model, teacher, toy, n, eval_key, few, "ode", references, directions),
        evaluate("teacher 4-step SDE", model, teacher, toy, n, eval_key, few, "sde", references, directions),
        evaluate("student 4-step SDE", model, student.params, toy, n, eval_key, few, "sde", references, directions),
        evaluate("student EMA 4-step SDE", model, student.ema, toy, n, eval_key, few, "sde", references, directions),
    ]
    print(f"\n{toy.prompts} prompts x {toy.centres.shape[1]} clusters in D={DIM}; {n} samples per prompt; teacher "
          f"{args.teacher_steps} steps ({teacher_s:.0f} s), DMD2 {args.dmd_steps} steps ({dmd_s:.0f} s)")
    columns = ("sw", "cov_err", "plane_d", "mode_tv")
    print(f"| {'sampler':<24} | " + " | ".join(f"{c:>8}" for c in columns) + " |")
    print(f"|{'-' * 26}|" + "|".join("-" * 10 for _ in columns) + "|")
    for row in rows:
        print(f"| {row['name']:<24} | " + " | ".join(f"{row[c]:8.4f}" for c in columns) + " |")


if __name__ == "__main__":
    main()
