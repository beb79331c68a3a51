"""Streaming long tuning: does a step's cost stay flat as the stream grows, and does tuning hold quality further
along a clip? Two measurements on fvx's toy world.

Cost: one stream of the tiny causal Wan (batch 2, blocks of 1 latent frame of 32x32, a window of 4 frames with 1
sink frame, chunks of 2 new frames after 1 of overlap, 2 student steps, the student updated every step), one chunk
per step over 30 latent frames; per chunk the step's seconds (the median of 3 timed copies) and the process's peak
resident memory so far (its high-water mark above the memory before the stream; the allocator keeps what it freed,
so a later step that needed more would raise it). Once the window is full both must stay flat: the cache is a
fixed-shape ring and the gradients are taken block at a time. Beside it the same stream under global attention
(window -1), whose attention grows with the stream.

Quality: the README's scenario's Self-Forcing student (its EMA exported to ``runs/sf_student``) is tuned with
``experiments/streaming_long_causal_t2v.py`` for ``--steps`` steps; both students then stream 8 clips per prompt of
12 latent frames (3x the 4 frames they were distilled on, window 4 and sink 2) from the same noise, and the table
reports the toy world's figures per window of 4 frames (``hit_rate``, ``nearest_mse``, ``prompt_match``).
    python bench/streaming_long.py [--steps 400] [--skip-quality] [--skip-cost] [field=value ...]
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import types

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # the repository root, not bench/
sys.path.insert(1, str(ROOT / "bench"))
from common import current_rss_bytes, peak_rss_bytes, reset_peak_rss, timed  # noqa: E402

EXPERIMENT = str(ROOT / "experiments" / "streaming_long_causal_t2v.py")
PER_PROMPT = 8
SIDE = 32  # the cost measurement's latent side: 256 tokens per frame
FRAMES = 30  # the tiny preset's RoPE table holds 32 frames
REPEATS = 3  # timed copies of each step (the median), before the step itself


# ------------------------------------------------------------------------------------------------------ cost


def cost(window: int) -> list[dict]:
    """Per chunk of one stream: its length after the chunk, the step's seconds and the peak memory so far."""
    from fvx.core import random
    from fvx.core.optim_config import AdamWConfig
    from fvx.core.state import copy
    from fvx_methods import streaming_long as sl
    from fvx_models.wan import WanConfig
    from fvx_models.wan_causal import WanCausalConfig

    student = WanCausalConfig(preset="tiny", num_frames_per_block=1, local_attn_size=window,
                              sink_size=1 if window > 0 else 0).build()
    critic = WanConfig(preset="tiny").build()
    config = sl.StreamingLong(chunk_size=1, streaming_chunk_size=2, streaming_fixed_overlap_latents=1,
                              latent_shape=(16, FRAMES, SIDE, SIDE), denoising_steps=(1000, 500), last_step_only=True,
                              optim=AdamWConfig(lr=1e-4), critic_optim=AdamWConfig(lr=1e-4))
    identity = types.SimpleNamespace(encode=lambda video: video, decode=lambda latents: latents)
    program = config.build({"student": student, "critic": critic, "teacher": critic}, total_steps=FRAMES,
                           vae=types.SimpleNamespace(build=lambda key: identity))
    g = torch.Generator().manual_seed(0)
    batch = {"sample_index": torch.arange(2),
             "cond": {"text": torch.randn(2, 8, 32, generator=g), "text_mask": torch.ones(2, 8)}}
    state, frozen = program.init(random.key(0)), program.frozen(random.key(0))
    state = state._replace(carry=program.carry(batch))
    rows, length, before = [], 0, current_rss_bytes()
    reset_peak_rss()
    while length < FRAMES:
        seconds = statistics.median(timed(lambda: program.step_(copy(state), frozen, batch)) for _ in range(REPEATS))
        state, metrics = program.step_(state, frozen, batch)
        length = int(metrics["streaming_current_length"])
        rows.append({"length": length, "seconds": seconds, "peak_bytes": peak_rss_bytes() - before})
    return rows


def print_cost(rows: list[dict], title: str) -> None:
    print(f"  {title}")
    for row in rows:
        print(f"    length {row['length']:3d}: {row['seconds']:.3f} s, "
              f"peak so far +{row['peak_bytes'] / 2**20:6.1f} MiB")
    full = [r for r in rows if r["length"] >= 8]  # the window (4) and a chunk past it
    third = len(full) // 3
    early, late = (statistics.median(r["seconds"] for r in part) for part in (full[:third], full[-third:]))
    print(f"    lengths {full[0]['length']}-{full[third - 1]['length']} -> {full[-third]['length']}-"
          f"{full[-1]['length']}: median time x{late / early:.2f}, peak "
          f"+{(full[-1]['peak_bytes'] - full[0]['peak_bytes']) / 2**20:.1f} MiB")


# --------------------------------------------------------------------------------------------------- quality


def quality(steps: int, student_path: str, teacher_path: str, overrides: list[str]) -> list[dict]:
    import msgspec

    from fvx import config as fconfig, run
    from fvx.core import random
    from fvx.data import datasets
    from fvx_methods import self_forcing as sf
    from fvx_models import streaming

    config = fconfig.apply_overrides(fconfig.load_experiment(EXPERIMENT), overrides)
    world = datasets.open_dataset(config.data, random.key(0))
    prompts = len(world.prompts)
    indices = [p + prompts * i for p in range(prompts) for i in range(PER_PROMPT)]
    student = msgspec.structs.replace(config.models["student"], path=student_path)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        args = [EXPERIMENT, "--out", str(out / "run"), "--steps", str(steps), "run.progress=false",
                "validation.every=0", f"models.student.path={student_path}", f"models.teacher.path={teacher_path}",
                *overrides]
        assert run.main(args) == 0
        assert run.main(["export", str(out / "run"), "--ema", "--out", str(out / "tuned")]) == 0
        model = student.build()
        batch = model.batch(world.read(indices))
        noise = random.normal(random.key(1), (len(indices), *config.method.latent_shape))
        keys = random.split(random.key(2), len(indices))
        timesteps, sigmas = sf.student_schedule(config.method)
        draw = streaming.draw(model.causal, sigmas, sampler=config.method.student_sample_type, timesteps=timesteps)
        codec = config.vae.build()
        for name, path in (("Self-Forcing student", student_path), ("after streaming tuning", str(out / "tuned"))):
            with torch.no_grad():
                latents = draw(model.weights.load(path), noise, batch["cond"], keys)
                videos = codec.decode(model.latents.denormalize(latents))
            figures = world.sample_quality(videos, indices)
            rows.append({"name": name, **figures})
            windows = sorted({key.split("/")[0] for key in figures if key.startswith("window_")})
            print(f"  {name}")
            for figure in ("hit_rate", "nearest_mse", "prompt_match"):
                print(f"    {figure:13s} " + "  ".join(f"{w} {figures[f'{w}/{figure}']:.3f}" for w in windows)
                      + f"  mean {figures[figure]:.3f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--student", default="runs/sf_student")
    parser.add_argument("--teacher", default="runs/teacher")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("overrides", nargs="*", help="field=value overrides of the streaming run")
    args = parser.parse_args()
    if not args.skip_cost:
        print(f"cost per chunk of one stream of {FRAMES} latent frames (tiny causal Wan, batch 2, 32x32 frames):")
        print_cost(cost(4), "window 4, sink 1")
        print_cost(cost(-1), "global attention")
    if not args.skip_quality:
        for path in (args.student, args.teacher):
            if not pathlib.Path(path).is_dir():
                sys.exit(f"{path} is not a folder: run the README's Self-Forcing scenario and export its EMA to "
                         "runs/sf_student first (or pass --student, --teacher)")
        print(f"quality per window of 4 frames of 12-frame streams ({PER_PROMPT} clips per prompt; {args.steps} "
              "streaming steps):")
        quality(args.steps, args.student, args.teacher, args.overrides)


if __name__ == "__main__":
    main()
