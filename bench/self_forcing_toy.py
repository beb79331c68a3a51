"""Does Self-Forcing work, and what do block-at-a-time gradients cost? Two measurements on fvx's toy world.

Quality: the README's scenario (the toy teacher, exported to ``runs/teacher``; the causal student KD distils from
it, exported to ``runs/kd_causal_student``) is trained with ``experiments/self_forcing_causal_t2v.py`` for
``--steps`` steps; then every sampler draws 8 clips per prompt from the same noise and the table reports the world's
sample-quality figures of the decoded clips (``nearest_mse``, ``hit_rate``, ``prompt_match``:
``fvx.data.toy_world``) and a temporal-consistency figure, ``continuation``: the pixel MSE of a clip's later blocks
to the true clip its first block is nearest (low: the stream continues the motion it started). Samplers: the
teacher's many-step (20-step Euler) and few-step (the student's steps, SDE, whole clip) samples, the causal student
before (the KD export) and after Self-Forcing (its EMA), each streamed block by block on the student's steps.
Self-Forcing works when its student beats the teacher's samples of as many steps. The default run is the
experiment's (one step per block); ``field=value`` arguments override its config (and the samplers' schedule).

Memory: one generator-gradient computation of the tiny causal Wan (batch 2, blocks of 1 latent frame of 32x32, 4
steps, every block exiting at its last), in one graph and block at a time, over 3, 7 and 21 blocks, each in a fresh
process for its peak resident memory; the ratio block/single, and how each grows per block.
    python bench/self_forcing_toy.py [--steps 400] [--skip-quality] [--skip-memory] [field=value ...]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # the repository root, not bench/
sys.path.insert(1, str(ROOT / "bench"))
from common import current_rss_bytes, peak_rss_bytes, reset_peak_rss, timed  # noqa: E402

EXPERIMENT = str(ROOT / "experiments" / "self_forcing_causal_t2v.py")
PER_PROMPT = 8
SIDE = 32  # the memory measurement's latent side: 256 tokens per frame


# --------------------------------------------------------------------------------------------------- quality


def continuation(videos: torch.Tensor, prompts: torch.Tensor, references: torch.Tensor, block: int) -> float:
    """Mean pixel MSE of frames ``[block:]`` of each clip ``[N, 3, T, H, W]`` to those of the true clip of its prompt
    (``references [P, S, 3, T, H, W]``) whose frames ``[:block]`` are nearest its own."""
    refs = references[prompts]  # [N, S, 3, T, H, W]
    first = ((refs[:, :, :, :block] - videos[:, None, :, :block]) ** 2).flatten(2).mean(-1)  # [N, S]
    chosen = refs[torch.arange(len(prompts)), first.argmin(-1)]
    return float(((chosen[:, :, block:] - videos[:, :, block:]) ** 2).mean())


def quality(steps: int, teacher_path: str, student_path: str, overrides: list[str]) -> list[dict]:
    import msgspec

    from fvx import config as fconfig, run
    from fvx.core import flow, random
    from fvx.data import datasets
    from fvx.training import validation
    from fvx_methods import self_forcing as sf
    from fvx_models import streaming

    config = fconfig.apply_overrides(fconfig.load_experiment(EXPERIMENT), overrides)
    world = datasets.open_dataset(config.data, random.key(0))
    prompts = len(world.prompts)
    indices = [p + prompts * i for p in range(prompts) for i in range(PER_PROMPT)]
    student = msgspec.structs.replace(config.models["student"], path=student_path)
    teacher = msgspec.structs.replace(config.models["teacher"], path=teacher_path)
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        args = [EXPERIMENT, "--out", str(out / "run"), "--steps", str(steps), "run.progress=false",
                "validation.every=0", f"models.student.path={student_path}", f"models.teacher.path={teacher_path}",
                *overrides]
        assert run.main(args) == 0
        assert run.main(["export", str(out / "run"), "--ema", "--out", str(out / "trained")]) == 0
        trained = msgspec.structs.replace(student, path=str(out / "trained"))
        student_model, teacher_model, trained_model = student.build(), teacher.build(), trained.build()
        raw = world.read(indices)
        batch = student_model.batch(raw)
        noise = random.normal(random.key(1), tuple(batch["latents"].shape))
        keys = random.split(random.key(2), len(indices))
        timesteps, sigmas = sf.student_schedule(config.method)
        stream = streaming.draw(student_model.causal, sigmas, sampler="sde", timesteps=timesteps)
        many = validation.many_step_sigmas(20, config.validation.flow_shift)
        teacher_params, k = teacher_model.weights.load(teacher_path), len(timesteps)
        samplers = {
            "teacher, 20-step ODE": lambda: flow.euler_sample(teacher_model.apply, teacher_params, noise, many,
                                                              cond=batch["cond"]),
            f"teacher, {k}-step SDE": lambda: flow.sde_sample(teacher_model.apply, teacher_params, noise, sigmas,
                                                              random.key(3), cond=batch["cond"], timesteps=timesteps),
            "student before (KD), streamed": lambda: stream(
                student_model.weights.load(student_path), noise, batch["cond"], keys),
            "student after Self-Forcing (EMA), streamed": lambda: streaming.draw(
                trained_model.causal, sigmas, sampler="sde", timesteps=timesteps)(
                trained_model.weights.load(str(out / "trained")), noise, batch["cond"], keys),
        }
        codec = config.vae.build()
        rows = []
        for name, draw in samplers.items():
            with torch.no_grad():
                videos = codec.decode(student_model.latents.denormalize(draw()))
            figures = world.sample_quality(videos, indices)
            figures["continuation"] = continuation(videos, torch.tensor(indices) % prompts, world.references(),
                                                   config.method.chunk_size)
            rows.append({"name": name, **figures})
            print(f"  {name:44s} " + "  ".join(f"{k}={v:.4f}" for k, v in figures.items()), flush=True)
        truth = world.references()[torch.tensor(indices) % prompts, 0]
        rows.append({"name": "data", **world.sample_quality(truth, indices)})
    return rows


# ---------------------------------------------------------------------------------------------------- memory


def memory_variant(blocks: int, block_at_a_time: bool, repeats: int) -> dict:
    """One process's peak resident memory above its state before the call, and the median seconds per call."""
    from fvx.core import random
    from fvx.core.optim_config import AdamWConfig
    from fvx_methods import self_forcing as sf
    from fvx_methods.library import distribution_matching as dm
    from fvx_models.wan import WanConfig
    from fvx_models.wan_causal import WanCausalConfig

    student = WanCausalConfig(preset="tiny", num_frames_per_block=1).build()
    critic = WanConfig(preset="tiny").build()
    config = sf.SelfForcing(chunk_size=1, last_step_only=True, optim=AdamWConfig(lr=1e-4),
                            critic_optim=AdamWConfig(lr=1e-4))
    roles = dm.Roles(student, critic, critic, config.optim.role(1), config.critic_optim.role(1))
    grads = sf.student_grads(roles, config, block_at_a_time=block_at_a_time)
    g = torch.Generator().manual_seed(0)
    batch = {"sample_index": torch.arange(2), "latents": torch.zeros(2, 16, blocks, SIDE, SIDE),
             "cond": {"text": torch.randn(2, 8, 32, generator=g), "text_mask": torch.ones(2, 8)}}
    params, critic_params = student.weights.init(random.key(1)), critic.weights.init(random.key(2))

    def call():
        return grads({}, params, batch, 1, critic_params, critic_params, random.key(3))

    before = current_rss_bytes()
    reset_peak_rss()
    call()  # the first call's peak: later ones reuse what the allocator kept
    peak = peak_rss_bytes() - before
    seconds = [timed(call) for _ in range(repeats)]
    return {"peak_bytes": peak, "seconds": statistics.median(seconds)}


def memory(repeats: int) -> list[dict]:
    rows = []
    for blocks in (3, 7, 21):
        row = {"blocks": blocks}
        for mode in ("single", "block"):
            out = subprocess.run([sys.executable, __file__, "--variant", f"{blocks},{mode},{repeats}"],
                                 capture_output=True, text=True, check=True).stdout
            row[mode] = json.loads(out.strip().splitlines()[-1])
        row["memory_ratio"] = row["block"]["peak_bytes"] / row["single"]["peak_bytes"]
        row["time_ratio"] = row["block"]["seconds"] / row["single"]["seconds"]
        print(f"  {blocks:2d} blocks: peak MiB single {row['single']['peak_bytes'] / 2**20:7.1f}  block "
              f"{row['block']['peak_bytes'] / 2**20:7.1f}  (ratio {row['memory_ratio']:.2f});  s/call single "
              f"{row['single']['seconds']:.3f}  block {row['block']['seconds']:.3f}  (ratio {row['time_ratio']:.2f})",
              flush=True)
        rows.append(row)
    for mode in ("single", "block"):
        first, last = rows[0][mode], rows[-1][mode]
        print(f"  {mode}: {(last['peak_bytes'] - first['peak_bytes']) / 18 / 2**20:.2f} MiB and "
              f"{(last['seconds'] - first['seconds']) / 18:.3f} s more per block (3 -> 21 blocks)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--teacher", default="runs/teacher")
    parser.add_argument("--student", default="runs/kd_causal_student")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("overrides", nargs="*", help="field=value overrides of the Self-Forcing run")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        blocks, mode, repeats = args.variant.split(",")
        print(json.dumps(memory_variant(int(blocks), mode == "block", int(repeats))))
        return
    if not args.skip_quality:
        for path in (args.teacher, args.student):
            if not pathlib.Path(path).is_dir():
                sys.exit(f"{path} is not a folder: run the README's Self-Forcing scenario first (or pass --teacher, "
                         "--student)")
        print(f"quality ({args.steps} Self-Forcing steps, {PER_PROMPT} clips per prompt):")
        quality(args.steps, args.teacher, args.student, args.overrides)
    if not args.skip_memory:
        print("generator gradients, one graph vs block at a time (tiny causal Wan, batch 2, blocks of 1 32x32 frame):")
        memory(args.repeats)


if __name__ == "__main__":
    main()
