"""``python -m fvx.run sample`` against diffusers' WanPipeline (seconds per video), and a streaming student's seconds
per block as the video it streams grows.

Wan: a random-weight Wan pipeline folder (a small UMT5, the tiny Wan VAE, a DiT of 4 blocks of width 384:
``bench-sample-4x384``) is fine-tuned one step (``experiments/finetune_wan.py``) and exported with ``--base``; one
video of latents ``[16, 5, 16, 16]`` (17 frames of 64x64), ``--steps`` Euler steps of ``FlowMatchEulerDiscreteScheduler
(shift=3)`` at guidance 5 with the negative prompt "", measured in one run, alternating:
  fvx e2e        ``sampling.run_sample``: plan, text encoder, encode, DiT weights, sample, decode, write the mp4
  fvx steady     the sampling loop alone: ``validation.draw`` with the sampler of ``sampling.sampler_of``, plus decode
  fvx draw       ``validation.draw`` alone (the DiT loop)
  diffusers      ``WanPipeline(...)(prompt=..., negative_prompt="", latents=..., output_type="np")`` on the export
  diffusers lat  the same call with ``output_type="latent"`` (encode and the DiT loop, no decode)
  diffusers e2e  ``DiffusionPipeline.from_pretrained`` of the export, the call, the mp4 written as fvx writes it
Both make the same video from the same noise (max |difference| printed). ``--compile`` adds fvx with
``models.student.compile=blocks`` and the pipeline with its transformer under ``torch.compile`` (inductor). The two end
to end paths run once more each in a fresh process (after importing torch, diffusers and av): their seconds there (what
the in-process runs already imported, e.g. orbax for the checkpoint, included) and peak resident memory.

Streaming: the toy block-causal Wan (``experiments/dfsft_causal_t2v.py``: blocks of 2 latent frames, 6-frame clips;
its ``world`` preset with a RoPE table of 64 frames, ``bench-world-rope64``, as ``world``'s 32 frames cannot make 10x)
trained 2 steps, then streamed at 1x, 3x and 10x the training length (6, 18, 60 latent frames of 64x64 pixels, 8x8
latents), globally and with ``models.student.local_attn_size=4`` (``sampling.Request(overrides=...)``): seconds per
block (all blocks; the first 3 and the last 3, each the sum of its ``Causal.apply_cached`` calls), the KV cache's slots
and MB (all guidance branches), and the peak resident memory a stream adds (a fresh process each).

    python bench/sample.py [--repeats 5] [--steps 10] [--compile] [--skip-wan] [--skip-stream]   # CPU, ~3 min
    python bench/sample.py --check [--steps 50] [--compile]   # a GPU: Wan 2.1 1.3B's DiT, 81x480x832, bf16
``--check``: the DiT of ``models.student.preset=wan2.1-t2v-1.3b`` (random weights, one copy: fvx samples its fp32
params in bf16 compute as ``sample`` does, the pipeline holds them in bf16) on a random 512-token prompt and negative
prompt, fvx's sampler (``sampling.sampler_of`` + ``validation.draw``) against the pipeline's transformer loop (WanPipeline
with only its transformer, ``prompt_embeds``, ``output_type="latent"``), 50 steps at guidance 5; seconds per video, peak
GPU memory; exits 1 when fvx is slower than the pipeline (or, with ``--compile``, compile=blocks above 0.8x the eager
pipeline). On a machine without CUDA it says so, exit 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, NamedTuple

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(2, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "helpers"))
import tiny_wan_pipeline  # noqa: E402  (the tests' tiny whole Wan pipeline folder)
from common import alternate, current_rss_bytes, peak_rss_bytes, quiet, reset_peak_rss, timed  # noqa: E402

import torch  # noqa: E402

from fvx import config as fconfig, run as frun  # noqa: E402
from fvx.core import tree  # noqa: E402
from fvx.training import preprocessing, sampling, validation  # noqa: E402
from fvx.training.experiment import build_models  # noqa: E402  (--check)
from fvx_models import wan, wan_causal  # noqa: E402
from fvx_models.family import Preset  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
FINETUNE = str(ROOT / "experiments" / "finetune_wan.py")
STREAM = str(ROOT / "experiments" / "dfsft_causal_t2v.py")
PROMPT = "a red cat moving left"
STREAM_PROMPT = "red bars moving left"  # the toy world's text encoder knows its own prompts only
TEXT_LEN = 64  # both pad the prompt to this many tokens (data.text_len, max_sequence_length)
GUIDANCE, SHIFT = 5.0, 3.0
VIDEO = (17, 64, 64)  # frames, height, width in pixels: latents [16, 5, 16, 16] under the tiny Wan VAE's 4x
PRESET = "bench-sample-4x384"
wan.PRESETS[PRESET] = Preset({**wan.TINY, "num_layers": 4, "num_attention_heads": 4, "attention_head_dim": 96,
                              "ffn_dim": 1536}, wan.TINY_VAE, TEXT_LEN, {"flow_shift": SHIFT})
STREAM_PRESET = "bench-world-rope64"  # the toy world's causal model, its RoPE table 64 frames long (world's: 32)
wan_causal.PRESETS[STREAM_PRESET] = dataclasses.replace(
    wan.PRESETS["world"], kwargs={**wan.PRESETS["world"].kwargs, "rope_max_seq_len": 64})
STREAM_TRAINED = 6  # latent frames the toy run trains on (its world clips; the codec keeps every frame)
STREAM_SIDE = 64  # pixels: 8x8 latents, 64 tokens a frame
STREAM_LENGTHS = (1, 3, 10)
WINDOW = 4
GOAL_EAGER, GOAL_COMPILED = 1.0, 0.8  # fvx seconds per video over the eager pipeline's


# ----------------------------------------------------------------------------------------------------- the runs


def build_pipeline(path: pathlib.Path) -> pathlib.Path:
    """A whole WanPipeline folder of random weights: UMT5 of width 32, the tiny Wan VAE, the ``PRESET`` DiT."""
    return tiny_wan_pipeline.save_t2v(path, wan.PRESETS[PRESET].kwargs)


def wan_run(work: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """(the run folder of one fine-tuning step from the pipeline folder, its export with the folder as ``--base``)."""
    folder, out, export = build_pipeline(work / "pipeline"), work / "run", work / "export"
    frames, height, width = VIDEO
    shape = [16, (frames - 1) // 4 + 1, height // 4, width // 4]
    assert frun.main([FINETUNE, "--out", str(out), "--steps", "1", "run.progress=false", "validation.every=0",
                      "data.world=null", "vae=null", f"models.student.preset={PRESET}", f"models.student.path={folder}",
                      f"data.text_len={TEXT_LEN}", "data.batch_size=1", f"validation.latent_shape={shape}",
                      "run.checkpoint.final=true"]) == 0
    assert frun.main(["export", str(out), "--out", str(export), "--base", str(folder)]) == 0
    return out, export


def stream_run(work: pathlib.Path) -> pathlib.Path:
    """The toy block-causal run (``dfsft_causal_t2v.py`` on the ``STREAM_PRESET``), 2 training steps."""
    out = work / "stream"
    assert frun.main([STREAM, "--out", str(out), "--steps", "2", "run.progress=false", "validation.every=0",
                      f"models.student.preset={STREAM_PRESET}", "run.checkpoint.final=true"]) == 0
    return out


def wan_request(run: pathlib.Path, out: pathlib.Path | None, steps: int, overrides: tuple[str, ...] = ()):
    """What ``sample RUN --prompt PROMPT --steps K --guidance 5 --shift 3 --schedule diffusers --negative-prompt ''
    --frames 17 --height 64 --width 64`` asks for."""
    frames, height, width = VIDEO
    return sampling.Request(str(run), (PROMPT,), overrides, out=None if out is None else str(out), steps=steps,
                            guidance=GUIDANCE, shift=SHIFT, schedule="diffusers", negative_prompt="", frames=frames,
                            height=height, width=width)


# ------------------------------------------------------------------------------------------------------- fvx


class Prepared(NamedTuple):
    """What ``run_sample`` holds before its loop, and the seconds each part took to make."""

    plan: sampling.Plan
    model: Any
    sampler: Any
    cond: dict[str, torch.Tensor]
    uncond: Callable[[Any], Any]
    decoder: Callable[[torch.Tensor], torch.Tensor]
    noise: torch.Tensor
    keys: torch.Tensor
    phases: dict[str, float]


def prepare(request: sampling.Request,
            hook: Callable[[dict[str, Any]], dict[str, Any]] = lambda models: models) -> Prepared:
    """``run_sample``'s steps up to its loop (one prompt, seed ``request.seed``), each timed; ``hook`` may wrap the
    plan's built models, the sampler then made again of them."""
    phases: dict[str, float] = {}

    def step(name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = fn()
        phases[name] = time.perf_counter() - start
        return out

    p = step("plan", lambda: sampling.plan(request, say=lambda line: None))  # the models and sampler built
    device = preprocessing.device()
    encoder = step("text encoder", p.encoder)
    cond, uncond = step("encode", functools.partial(encode_prompts, p, encoder, device))
    del encoder  # as run_sample: the text encoder is gone before the DiT loads
    models = hook(p.models)
    sampler = p.sampler if models is p.models else sampling.sampler_of(p.source, models, {}, p.vcfg, request.jumps)
    sampler = step("weights", lambda: sampler._replace(params=tree.to_device(p.source.weights(), device)))
    decoder = step("vae", p.decoder)
    noise, keys = tree.to_device(sampling.noise_and_keys([request.seed], p.shape), device)
    return Prepared(p, models[p.source.role], sampler, cond, uncond, decoder, noise, keys, phases)


def encode_prompts(p: sampling.Plan, encoder: Any, device: torch.device) -> tuple[dict[str, torch.Tensor], Callable]:
    """(the prompts' cond on ``device``, ``uncond(cond)``: the negative prompt's), as ``run_sample`` encodes them."""
    config = p.source.config
    cond = tree.to_device(sampling.encoded_cond(config, p.model, encoder, p.request.prompts), device)
    return cond, sampling._uncond(config, p.model, encoder, p.request.negative_prompt, p.vcfg, device)


def fvx_draw(prep: Prepared) -> torch.Tensor:
    return validation.draw(prep.sampler, prep.noise, prep.cond, prep.keys, prep.uncond,
                           prep.plan.vcfg.guidance_scale)[0]


def fvx_steady(prep: Prepared) -> torch.Tensor:
    """The video ``[1, 3, T, H, W]`` in [0, 1]: the sampling loop, then the decoder."""
    return sampling.decoded(prep.model, prep.decoder, None, fvx_draw(prep))[0]


class Folders:
    """A fresh output folder per call under ``root``, the previous one removed."""

    def __init__(self, root: pathlib.Path):
        self.root, self.count = root, 0

    def __call__(self) -> pathlib.Path:
        import shutil

        if self.count:
            shutil.rmtree(self.root / str(self.count), ignore_errors=True)
        self.count += 1
        return self.root / str(self.count)


# -------------------------------------------------------------------------------------------------- diffusers


def pipeline(export: pathlib.Path, compiled: bool = False):
    """The export as a DiffusionPipeline with ``FlowMatchEulerDiscreteScheduler(shift=3)``, its transformer under
    ``torch.compile`` when ``compiled``."""
    from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

    pipe = DiffusionPipeline.from_pretrained(export)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=SHIFT)
    pipe.set_progress_bar_config(disable=True)
    if compiled:
        pipe.transformer.compile()
    return pipe


def diffusers_call(pipe, noise: torch.Tensor, steps: int, output_type: str = "np") -> Any:
    frames, height, width = VIDEO
    return pipe(prompt=PROMPT, negative_prompt="", latents=noise, num_inference_steps=steps, guidance_scale=GUIDANCE,
                height=height, width=width, num_frames=frames, max_sequence_length=TEXT_LEN,
                output_type=output_type).frames


def diffusers_end_to_end(export: pathlib.Path, noise: torch.Tensor, steps: int, out: pathlib.Path, fps: float) -> None:
    """Load the export, make the video, write it as ``sample`` writes its mp4s."""
    from fvx.data import media

    frames = diffusers_call(pipeline(export), noise, steps)[0]  # [T, H, W, 3] in [0, 1]
    out.mkdir(parents=True, exist_ok=True)
    media.write_mp4(out / "video.mp4", (frames.clip(0, 1) * 255).round().astype("uint8"), fps)


# ------------------------------------------------------------------------------------------------- measuring


def measure_wan(work: pathlib.Path, steps: int, repeats: int, compiled: bool) -> dict[str, Any]:
    """Seconds per video of every case (medians of ``repeats`` alternating calls after one warm-up call each), the
    fvx parts, the two paths' difference, the peak resident memory of each end to end (a fresh process each)."""
    run, export = wan_run(work)
    folders = Folders(work / "samples")
    prep = prepare(wan_request(run, None, steps))
    pipe = pipeline(export)
    fps = prep.plan.source.config.validation.fps
    with torch.no_grad():
        ours = fvx_steady(prep)
        theirs = torch.from_numpy(diffusers_call(pipe, prep.noise, steps)).permute(0, 4, 1, 2, 3)
    diff = float((ours - theirs).abs().max())
    cases: dict[str, Callable[[], object]] = {
        "fvx e2e": lambda: sampling.run_sample(wan_request(run, folders(), steps), progress=False,
                                               say=lambda line: None),
        "fvx steady": lambda: fvx_steady(prep),
        "fvx draw": lambda: fvx_draw(prep),
        "diffusers e2e": lambda: diffusers_end_to_end(export, prep.noise, steps, folders(), fps),
        "diffusers": lambda: diffusers_call(pipe, prep.noise, steps),
        "diffusers lat": lambda: diffusers_call(pipe, prep.noise, steps, "latent"),
    }
    first: dict[str, float] = {}
    if compiled:
        blocks = prepare(wan_request(run, None, steps, ("models.student.compile=blocks",)))
        pipe_compiled = pipeline(export, compiled=True)
        cases["fvx blocks"] = lambda: fvx_steady(blocks)
        cases["diffusers compiled"] = lambda: diffusers_call(pipe_compiled, prep.noise, steps)
        first = {"fvx blocks": timed(cases["fvx blocks"]), "diffusers compiled": timed(cases["diffusers compiled"])}
    for fn in cases.values():  # the warm-up
        fn()
    parts = dict(prep.phases)
    with torch.no_grad():
        parts["draw"] = timed(lambda: parts.update(latents=fvx_draw(prep)))
        latents = parts.pop("latents")
        video: list[torch.Tensor] = []
        parts["decode"] = timed(lambda: video.append(sampling.decoded(prep.model, prep.decoder, None, latents)[0]))
        out = folders()
        out.mkdir(parents=True)
        parts["write mp4"] = timed(lambda: sampling.write_video(out, "video", video[0][0], fps, gif=False, scale=1))
    times = alternate(cases, repeats=repeats, warmup=0)
    peaks = {name: peak_child(work, name, steps) for name in ("fvx e2e", "diffusers e2e")}
    return {"times": times, "first": first, "peaks": peaks, "parts": parts, "diff": diff, "steps": steps,
            "shape": list(prep.plan.shape)}


class StreamCase(NamedTuple):
    label: str
    frames: int
    window: int | None
    prep: Prepared
    slots: int
    cache_mb: float
    runs: list[dict[int, float]]  # per run: the seconds of each block (keyed by its first frame)


def timed_blocks(runs: list[dict[int, float]]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A ``prepare`` hook: the student's ``Causal.apply_cached`` adds its seconds to ``runs[-1][block's first
    frame]`` (a call on a cache whose next frame is ``f`` is a pass of the block starting at ``f``)."""
    def hook(models: dict[str, Any]) -> dict[str, Any]:
        model = models["student"]
        inner = model.causal.apply_cached

        def apply_cached(params, x_t, t, cond, cache):
            start = time.perf_counter()
            out = inner(params, x_t, t, cond, cache)
            runs[-1][cache.next_frame] = runs[-1].get(cache.next_frame, 0.0) + time.perf_counter() - start
            return out

        causal = dataclasses.replace(model.causal, apply_cached=apply_cached)
        return {**models, "student": dataclasses.replace(model, causal=causal)}

    return hook


def stream_case(run: pathlib.Path, multiple: int, window: int | None, steps: int) -> StreamCase:
    frames = STREAM_TRAINED * multiple
    overrides = () if window is None else (f"models.student.local_attn_size={window}",)
    request = sampling.Request(str(run), (STREAM_PROMPT,), overrides, steps=steps, frames=frames, height=STREAM_SIDE,
                               width=STREAM_SIDE)
    runs: list[dict[int, float]] = []
    prep = prepare(request, timed_blocks(runs))
    causal, (channels, _, height, width) = prep.model.causal, prep.plan.shape
    branches = 2 if prep.sampler.guided and prep.plan.vcfg.guidance_scale != 1.0 else 1
    cache_mb = causal.cache_bytes(frames, (1, channels, causal.frames_per_block, height, width)) / 2**20
    label = f"{multiple}x, " + ("global" if window is None else f"window {window}")
    return StreamCase(label, frames, window, prep, len(causal.empty_cache(frames).slots), cache_mb * branches, runs)


def measure_stream(work: pathlib.Path, steps: int, repeats: int) -> list[dict[str, Any]]:
    """Per case: seconds per block (all, the first 3, the last 3), slots, cache MB, the peak resident memory of one
    stream (a fresh process each)."""
    run = stream_run(work)
    cases = [stream_case(run, m, w, steps) for w in (None, WINDOW) for m in STREAM_LENGTHS]

    def streamed(case: StreamCase) -> Callable[[], object]:
        def go() -> None:
            case.runs.append({})
            fvx_draw(case.prep)
        return go

    times = alternate({case.label: streamed(case) for case in cases}, repeats=repeats, warmup=1)
    peaks = {case.label: peak_child(work, "stream", steps, case.frames // STREAM_TRAINED, case.window)
             for case in cases}
    rows = []
    for case in cases:
        timed_runs = case.runs[1:]  # after the warm-up
        blocks = sorted(timed_runs[0])
        per_block = [statistics.median(r[b] for r in timed_runs) for b in blocks]
        rows.append({"label": case.label, "frames": case.frames, "blocks": len(blocks),
                     "per_block": times[case.label] / len(blocks), "first": statistics.mean(per_block[:3]),
                     "last": statistics.mean(per_block[-3:]), "slots": case.slots, "cache_mb": case.cache_mb,
                     "peak": peaks[case.label]})
    return rows


def peak_child(work: pathlib.Path, case: str, steps: int, multiple: int = 1, window: int | None = None
               ) -> dict[str, float]:
    """Resident MB of a fresh process running ``case`` once on the runs in ``work``: after its imports (a stream:
    after ``prepare``) and at its peak; the seconds from there to the end (lazy imports included)."""
    command = [sys.executable, __file__, "--peak", case, "--work", str(work), "--steps", str(steps),
               "--stream-steps", str(steps), "--multiple", str(multiple)] + (
                   [] if window is None else ["--window", str(window)])
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"--peak {case} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def peak_in_this_process(case: str, work: pathlib.Path, steps: int, multiple: int, window: int | None) -> None:
    import av  # noqa: F401  (both paths' imports before the baseline)
    import diffusers  # noqa: F401

    if case == "stream":
        case_ = stream_case(work / "stream", multiple, window, steps)
        case_.runs.append({})
        base, start = current_rss_bytes(), time.perf_counter()
        reset_peak_rss()
        fvx_draw(case_.prep)
    else:
        base, start = current_rss_bytes(), time.perf_counter()
        out = pathlib.Path(tempfile.mkdtemp(dir=work))
        if case == "fvx e2e":
            sampling.run_sample(wan_request(work / "run", out, steps), progress=False, say=lambda line: None)
        else:
            noise, _ = sampling.noise_and_keys([0], (16, (VIDEO[0] - 1) // 4 + 1, VIDEO[1] // 4, VIDEO[2] // 4))
            diffusers_end_to_end(work / "export", noise, steps, out, 16.0)
    print(json.dumps({"peak_mb": peak_rss_bytes() / 2**20, "base_mb": base / 2**20,
                      "seconds": time.perf_counter() - start}))


# ---------------------------------------------------------------------------------------------------- report


def report_wan(result: dict[str, Any]) -> None:
    times, base = result["times"], result["times"]["diffusers"]
    print(f"Wan: DiT {PRESET} ({wan.PRESETS[PRESET].kwargs['num_layers']} blocks, width 384), latents "
          f"{result['shape']} ({VIDEO[0]}x{VIDEO[1]}x{VIDEO[2]}), {result['steps']} steps, guidance {GUIDANCE}, fp32 "
          f"on cpu, {torch.get_num_threads()} threads; max |fvx - diffusers| of the decoded video {result['diff']:.1e}")
    print(f"{'':20} {'s/video':>8} {'x diffusers':>12}")
    for name, seconds in times.items():
        print(f"{name:20} {seconds:8.3f} {seconds / base:12.3f}")
    print("ratios fvx/diffusers: steady (draw + decode) vs the pipeline call "
          f"{times['fvx steady'] / base:.3f}; the DiT loop (draw vs output_type=latent) "
          f"{times['fvx draw'] / times['diffusers lat']:.3f}; end to end "
          f"{times['fvx e2e'] / times['diffusers e2e']:.3f} (goal <= {GOAL_EAGER})")
    if result["first"]:
        print(f"compile=blocks vs the eager pipeline {times['fvx blocks'] / base:.3f}, vs torch.compile(transformer) "
              f"{times['fvx blocks'] / times['diffusers compiled']:.3f}; first call (compiling): "
              + ", ".join(f"{k} {v:.1f} s" for k, v in result["first"].items()))
    print("fvx parts, ms: " + ", ".join(f"{k} {1000 * v:.0f}" for k, v in result["parts"].items()))
    print("end to end in a fresh process each (after importing torch, diffusers, av): resident MB after imports -> "
          "peak (above), seconds: " + ", ".join(
              f"{k} {m['base_mb']:.0f} -> {m['peak_mb']:.0f} ({m['peak_mb'] - m['base_mb']:.0f}), {m['seconds']:.2f} s"
              for k, m in result["peaks"].items()))


def report_stream(rows: list[dict[str, Any]], steps: int) -> None:
    print(f"Streaming: {STREAM_PRESET} (blocks of 2 latent frames, trained on {STREAM_TRAINED}), {STREAM_SIDE}x"
          f"{STREAM_SIDE} pixels (8x8 latents), {steps} steps a block; s/block = the whole stream's median / blocks; "
          "first/last 3 = the mean of those blocks' median seconds in apply_cached; peak: resident MB a stream adds "
          "to its prepared process (weights loaded, a fresh process each)")
    print(f"{'':18} {'frames':>6} {'blocks':>6} {'s/block':>8} {'first 3':>8} {'last 3':>8} {'slots':>6} "
          f"{'cache MB':>8} {'peak MB':>8}")
    for r in rows:
        added = r["peak"]["peak_mb"] - r["peak"]["base_mb"]
        print(f"{r['label']:18} {r['frames']:6d} {r['blocks']:6d} {r['per_block']:8.4f} {r['first']:8.4f} "
              f"{r['last']:8.4f} {r['slots']:6d} {r['cache_mb']:8.3f} {added:8.1f}")


# ----------------------------------------------------------------------------------------------------- --check


class CheckSetup(NamedTuple):
    preset: str
    shape: tuple[int, int, int, int]
    text_len: int
    device: str
    dtype: str  # fvx's compute dtype, the pipeline transformer's dtype


CHECKS = {"gpu": CheckSetup("wan2.1-t2v-1.3b", (16, 21, 60, 104), 512, "cuda", "bf16"),  # 81x480x832, 2.1 VAE
          # --check's path at CPU sizes in fp32 (a hidden flag): the two must agree to float rounding
          "gpu-on-cpu": CheckSetup(PRESET, (16, 2, 8, 8), 16, "cpu", "fp32")}


def check(setup: CheckSetup, steps: int, compiled: bool) -> None:
    """fvx's sampler against the pipeline's transformer loop on one random-weight DiT (module docstring)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    device, cuda = torch.device(setup.device), setup.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    kwargs = wan.PRESETS[setup.preset].kwargs
    torch.manual_seed(0)
    with device:
        module = WanTransformer3DModel(**kwargs)
        text = torch.randn(2, setup.text_len, kwargs["text_dim"])  # the prompt's and the negative prompt's
    params = {name: p.detach().clone() for name, p in module.named_parameters()}  # fp32, as sample loads them
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[setup.dtype]
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=module.to(dtype),
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT))
    pipe.set_progress_bar_config(disable=True)
    noise, keys = tree.to_device(sampling.noise_and_keys([0], setup.shape), device)
    mask = torch.ones(1, setup.text_len, device=device)
    cond, negative = {"text": text[:1], "text_mask": mask}, {"text": text[1:], "text_mask": mask}

    def fvx_samplers(compile_mode: str = "none") -> tuple[Callable[[], torch.Tensor], ...]:
        """fvx's sampling of 2 steps (the warm-up) and of ``steps``, one built model for both."""
        config = fconfig.apply_overrides(fconfig.load_experiment(FINETUNE), [
            f"models.student.preset={setup.preset}", f"models.student.compute_dtype={setup.dtype}", "data.world=null",
            "vae=null", f"data.text_len={setup.text_len}", f"models.student.compile={compile_mode}"])
        source = sampling.Source(config, "student", 0, False, "random weights", lambda: params)
        models = build_models(config)
        model = models["student"]
        uncond = lambda c: model.uncond(c, "negative_prompt", negative)  # noqa: E731

        def draw(n: int) -> Callable[[], torch.Tensor]:
            vcfg = sampling.validation_config(config, sampling.Request("", (), steps=n, guidance=GUIDANCE,
                                                                       shift=SHIFT, schedule="diffusers"), setup.shape)
            sampler = sampling.sampler_of(source, models, params, vcfg, None)
            return lambda: validation.draw(sampler, noise, cond, keys, uncond, GUIDANCE)[0]

        return draw(2), draw(steps)

    def pipe_loop(n: int) -> Callable[[], torch.Tensor]:
        return lambda: pipe(prompt_embeds=text[:1], negative_prompt_embeds=text[1:], latents=noise,
                            num_inference_steps=n, guidance_scale=GUIDANCE, height=setup.shape[2] * 8,
                            width=setup.shape[3] * 8, num_frames=(setup.shape[1] - 1) * 4 + 1,
                            output_type="latent").frames

    def measure(cases: dict[str, tuple[Callable[[], Any], Callable[[], Any]]]) -> dict[str, dict[str, float]]:
        """Per case (a 2-step warm-up call, the timed call): seconds, the warm-up's, the latents (printed with the
        peak GPU memory above the memory before)."""
        out = {}
        for name, (warm, full) in cases.items():
            first = timed(warm, sync)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            held: list[torch.Tensor] = []
            seconds = timed(lambda: held.append(full()), sync)
            peak = f", peak {(torch.cuda.max_memory_allocated() - base) / 2**30:.2f} GiB" if cuda else ""
            out[name] = {"s": seconds, "first": first, "latents": held[0].float()}
            print(f"  {name:20} {seconds:8.2f} s ({seconds / steps:.3f} s/step; warm-up {first:.1f} s){peak}",
                  flush=True)
        return out

    print(f"--check: {setup.preset} DiT, latents {list(setup.shape)}, {steps} steps, guidance {GUIDANCE}, "
          f"{setup.dtype} on {setup.device}" + (f" ({torch.cuda.get_device_name()})" if cuda else ""), flush=True)
    with torch.no_grad():
        result = measure({"fvx": fvx_samplers(), "diffusers": (pipe_loop(2), pipe_loop(steps))})
        if compiled:
            pipe.transformer.compile()
            result |= measure({"fvx blocks": fvx_samplers("blocks"),
                               "diffusers compiled": (pipe_loop(2), pipe_loop(steps))})
    ours, theirs = result["fvx"]["latents"], result["diffusers"]["latents"]
    relative = float((ours - theirs).norm() / theirs.norm())
    ratio = result["fvx"]["s"] / result["diffusers"]["s"]
    print(f"fvx / diffusers seconds per video {ratio:.3f} (goal <= {GOAL_EAGER}); |fvx - diffusers| / |diffusers| of "
          f"the latents {relative:.2e}" + (" (diffusers keeps its latents in bf16 between steps)"
                                           if setup.dtype == "bf16" else ""))
    failed = [f"fvx eager is {ratio:.3f}x the pipeline"] if ratio > GOAL_EAGER else []
    if compiled:
        blocks = result["fvx blocks"]["s"]
        print(f"compile=blocks / eager pipeline {blocks / result['diffusers']['s']:.3f} (goal <= {GOAL_COMPILED}), / "
              f"torch.compile(transformer) {blocks / result['diffusers compiled']['s']:.3f}")
        if blocks / result["diffusers"]["s"] > GOAL_COMPILED:
            failed.append(f"compile=blocks is {blocks / result['diffusers']['s']:.3f}x the eager pipeline")
    if failed and cuda:
        sys.exit("check FAILED: " + "; ".join(failed))


# -------------------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per case (medians)")
    parser.add_argument("--steps", type=int, default=None, help="sampling steps (default: 10 on a CPU, 50 --check)")
    parser.add_argument("--stream-steps", type=int, default=4, help="sampling steps per streamed block")
    parser.add_argument("--compile", action="store_true", help="add compile=blocks and torch.compile(transformer)")
    parser.add_argument("--skip-wan", action="store_true", help="only the streaming measurement")
    parser.add_argument("--skip-stream", action="store_true", help="only the Wan measurement")
    parser.add_argument("--check", action="store_true", help="a GPU: Wan 2.1 1.3B's DiT at 81x480x832, bf16")
    parser.add_argument("--check-on-cpu", action="store_true", help=argparse.SUPPRESS)  # --check's path, CPU sizes
    parser.add_argument("--peak", choices=("fvx e2e", "diffusers e2e", "stream"), help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)  # --peak: the parent's runs
    parser.add_argument("--multiple", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--window", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    quiet()
    if args.peak:
        peak_in_this_process(args.peak, pathlib.Path(args.work), args.steps, args.multiple, args.window)
        return
    if args.check and not torch.cuda.is_available():
        print("bench/sample.py --check needs a CUDA GPU (Wan 2.1 1.3B's DiT at 81x480x832, 50 steps); run it without "
              "--check on a CPU")
        return
    if args.check or args.check_on_cpu:
        check(CHECKS["gpu" if args.check else "gpu-on-cpu"], args.steps or (50 if args.check else 3), args.compile)
        return
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="fvx_bench_sample_") as temp:
        work = pathlib.Path(temp)
        if not args.skip_wan:
            report_wan(measure_wan(work, args.steps or 10, args.repeats, args.compile))
        if not args.skip_stream:
            report_stream(measure_stream(work, args.stream_steps, args.repeats), args.stream_steps)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
