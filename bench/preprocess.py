"""``python -m fvx.run preprocess`` against a plain loop doing the same work in one process: clips/s, peak memory.

A random-weight Wan pipeline folder (a small UMT5 text encoder, the Wan 2.1 VAE's layout at base width 32, an offline
tokenizer) and N smooth mp4 clips (33 frames of 72x96 at 16 fps, cut to 64x64) with caption files are written to a
temp folder. Measured on the same clips in one run, alternating:
  fvx      the real path: ``fvx.training.preprocessing`` on ``experiments/finetune_wan.py`` with
           ``models.student.path`` the folder and ``data.world=null`` (steady state: ``preprocess.run`` with the
           encoders already opened; end to end: ``run_preprocess``, the folder's loading included)
  plain    PyAV decodes the clip, ``fvx.data.media.resize_crop`` (the same pixels), ``pipe.vae.encode(x)
           .latent_dist.mode()``, ``pipe.encode_prompt([caption], max_sequence_length=512)`` per clip, the real tokens
           kept, one pyarrow parquet written at the end
Both write the same latents and embeddings (checked). Peak resident memory (``VmHWM``) of the end-to-end command is
measured in a fresh process per case, for N and 4N clips, at the default ``samples_per_file`` and with parts of N.

    python bench/preprocess.py [--clips 6] [--repeats 3]      # CPU, about 2-3 minutes on 2 cores
    python bench/preprocess.py --check [--clips 4] [--text-layers 24]   # a GPU: Wan 2.1 1.3B's encoders, 81x480x832
``--check``: the Wan 2.1 VAE (``fvx_models.wan_vae.PRESETS["wan2.1"]``) and a UMT5 of UMT5-XXL's widths (4096, 64
heads, d_ff 10240; ``--text-layers`` of its 24) in bf16, random weights, clips of 81 frames at 480x832; prints clips/s
and peak GPU memory, and exits 1 if fvx is below 0.9x the plain loop. On a machine without CUDA it says so, exit 0.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parents[1]))
from common import alternate, current_rss_bytes, peak_rss_bytes, quiet, timed  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fvx import config as fconfig  # noqa: E402
from fvx.data import media, preprocess  # noqa: E402
from fvx.training import preprocessing  # noqa: E402
from fvx_models.wan_vae import PRESETS as VAE_PRESETS  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENT = ROOT / "experiments" / "finetune_wan.py"
TEXT_LEN = 512  # what fvx's Wan record (and FastVideo) encode prompts at
WORDS = ["<pad>", "</s>", "<unk>"] + [f"▁{w}" for w in (
    "a the red blue green white black small large cat dog bird car tree river road city street moving walking "
    "running slowly quickly left right up down under over near far camera pans zooms in out sunset night").split()]
GOAL = 0.9  # fvx clips/s over the plain loop's


@dataclasses.dataclass(frozen=True)
class Setup:
    """Encoder sizes and clip geometry: UMT5Config and AutoencoderKLWan kwargs, frames, the cut ``height x width``,
    the size the clips are written at, their fps, the encoders' dtype and device."""

    text: dict[str, int]
    vae: dict[str, Any]
    frames: int
    height: int
    width: int
    source: tuple[int, int]
    fps: int
    dtype: str
    device: str


UMT5_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, relative_attention_num_buckets=32)
SETUPS = {
    "cpu": Setup(text=dict(d_model=64, d_kv=16, d_ff=256, num_layers=2, num_heads=4, relative_attention_num_buckets=32),
                 vae={**VAE_PRESETS["wan2.1"], "base_dim": 32, "num_res_blocks": 1}, frames=33, height=64, width=64,
                 source=(72, 96), fps=16, dtype="fp32", device="cpu"),
    "gpu": Setup(text=UMT5_XXL, vae=VAE_PRESETS["wan2.1"], frames=81, height=480, width=832, source=(480, 832), fps=16,
                 dtype="bf16", device="cuda"),
}
# --check's code path on a CPU (a hidden flag, to validate the script): bf16, the CPU sizes
SETUPS["gpu-on-cpu"] = dataclasses.replace(SETUPS["cpu"], dtype="bf16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# --------------------------------------------------------------------------------------------------- the inputs


def tokenizer():
    import transformers

    return transformers.T5Tokenizer(vocab=[(w, -float(i)) for i, w in enumerate(WORDS)], extra_ids=0)


def random_text_encoder(config, setup: Setup):
    """A UMT5 encoder of ``config`` with random weights, on the CPU in the setup's dtype; a large one is filled on the
    setup's device (a 4.6 G-param CPU init takes minutes)."""
    import transformers

    if setup.device == "cpu":
        return transformers.UMT5EncoderModel(config).to(DTYPES[setup.dtype])
    with torch.device("meta"):
        model = transformers.UMT5EncoderModel(config)
    model = model.to_empty(device=setup.device).to(DTYPES[setup.dtype])
    generator = torch.Generator(setup.device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=generator) if p.dim() > 1 else p.fill_(1.0)  # norms: ones
    return model.cpu()


def build_folder(path: pathlib.Path, setup: Setup) -> pathlib.Path:
    """A WanPipeline folder (tokenizer, text_encoder, vae, scheduler; no transformer) of random weights."""
    import transformers
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline

    torch.manual_seed(0)
    text = random_text_encoder(transformers.UMT5Config(vocab_size=len(WORDS), **setup.text), setup)
    vae = AutoencoderKLWan(**setup.vae).to(DTYPES[setup.dtype])
    WanPipeline(tokenizer=tokenizer(), text_encoder=text, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(),
                transformer=None).save_pretrained(path)
    return path


def smooth_frames(rng: np.random.Generator, count: int, height: int, width: int) -> np.ndarray:
    """uint8 ``[count, height, width, 3]``: drifting colour waves with a little noise (compresses like footage)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    freq, phase, speed = rng.uniform(0.02, 0.15, (3, 2)), rng.uniform(0, 6.3, 3), rng.uniform(-0.3, 0.3, 3)
    t = np.arange(count, dtype=np.float32)[:, None, None]
    waves = [np.sin(freq[c, 0] * x + freq[c, 1] * y + phase[c] + speed[c] * t) for c in range(3)]
    pixels = 127.5 + 100 * np.stack(waves, -1) + rng.normal(0, 4, (count, height, width, 3))
    return pixels.clip(0, 255).astype(np.uint8)


def write_clips(folder: pathlib.Path, count: int, setup: Setup) -> None:
    """``count`` mp4 clips (H.264) of the setup's frames, source size and fps, each beside a caption ``.txt``."""
    import av

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    height, width = setup.source
    for n in range(count):
        with av.open(str(folder / f"clip_{n:04d}.mp4"), "w") as out:
            stream = out.add_stream("libx264", rate=setup.fps, options={"preset": "veryfast", "crf": "20"})
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for frame in smooth_frames(rng, setup.frames, height, width):
                out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            out.mux(stream.encode())
        words = rng.choice(WORDS[3:], size=int(rng.integers(6, 20)))
        (folder / f"clip_{n:04d}.txt").write_text(" ".join(w[1:] for w in words))


def subset(videos: pathlib.Path, count: int) -> pathlib.Path:
    """A folder of hard links to the first ``count`` clips (and captions) of ``videos``."""
    folder = videos.parent / f"videos_{count}"
    if not folder.is_dir():
        folder.mkdir()
        for clip in sorted(videos.glob("*.mp4"))[:count]:
            for path in (clip, clip.with_suffix(".txt")):
                os.link(path, folder / path.name)
    return folder


# ---------------------------------------------------------------------------------------------------- the paths


def fvx_config(folder: pathlib.Path, setup: Setup, samples_per_file: int | None = None):
    """The experiment the command would run: finetune_wan.py pointed at the folder, the clips' geometry."""
    items = [f"models.student.path={folder}", "models.student.preset=tiny", "data.world=null",
             f"models.student.compute_dtype={setup.dtype}", f"data.preprocess.num_frames={setup.frames}",
             f"data.preprocess.train_fps={setup.fps}", f"data.preprocess.max_height={setup.height}",
             f"data.preprocess.max_width={setup.width}"]
    items += [f"data.preprocess.samples_per_file={samples_per_file}"] if samples_per_file else []
    return fconfig.apply_overrides(fconfig.load_experiment(str(EXPERIMENT)), items)


def fvx_end_to_end(config, videos: pathlib.Path, out: pathlib.Path) -> dict:
    """``python -m fvx.run preprocess``'s work: ``run_preprocess`` (it opens the folder itself)."""
    with contextlib.redirect_stdout(io.StringIO()):
        done = preprocessing.run_preprocess(config, str(videos), str(out), progress=False)
    assert done["complete"] and not done["skipped"], done
    return done


def fvx_steady(job: preprocess.Job, opened, videos: pathlib.Path, out: pathlib.Path) -> dict:
    """``run_preprocess`` with the encoders already opened: find the inputs, start the folder, encode every part."""
    inputs = preprocess.find_inputs(videos)
    preprocess.check_folder(out, job.identity)
    done = preprocess.run(job, lambda: opened, inputs, out, log=lambda line: None)
    assert done["complete"] and not done["skipped"], done
    return done


def plain_pipeline(folder: pathlib.Path, setup: Setup):
    from diffusers import WanPipeline

    return WanPipeline.from_pretrained(folder, transformer=None, dtype=DTYPES[setup.dtype]).to(setup.device)


def decode(path: pathlib.Path, frames: int) -> np.ndarray:
    """The first ``frames`` frames of ``path`` as uint8 ``[T, H, W, 3]`` (PyAV)."""
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for _, f in zip(range(frames), container.decode(video=0))])


@torch.no_grad()
def plain_loop(pipe, setup: Setup, videos: pathlib.Path, out: pathlib.Path | None,
               phases: dict[str, float] | None = None) -> list[dict]:
    """Per clip: decode, resize and crop, VAE posterior mean, ``encode_prompt``; one parquet at the end (when ``out``).
    ``phases`` collects seconds per step."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    phases = {} if phases is None else phases
    sync = torch.cuda.synchronize if setup.device == "cuda" else (lambda: None)
    rows = []
    for clip_path in sorted(videos.glob("*.mp4")):
        caption = clip_path.with_suffix(".txt").read_text().strip()
        start = time.perf_counter()
        frames = decode(clip_path, setup.frames)
        mid = time.perf_counter()
        clip = media.resize_crop(frames, setup.height, setup.width)
        encoded = time.perf_counter()
        x = clip[None].to(setup.device, pipe.vae.dtype)
        latents = pipe.vae.encode(x).latent_dist.mode()[0].float().cpu()
        sync()
        vae_done = time.perf_counter()
        embeds, _ = pipe.encode_prompt([caption], do_classifier_free_guidance=False, max_sequence_length=TEXT_LEN,
                                       device=torch.device(setup.device))
        text = embeds[0].float().cpu()
        text = text[: int((text.abs().sum(-1) > 0).sum())]  # encode_prompt zero-pads past the real tokens
        end = time.perf_counter()
        for name, seconds in (("decode", mid - start), ("resize", encoded - mid), ("vae", vae_done - encoded),
                              ("text", end - vae_done)):
            phases[name] = phases.get(name, 0.0) + seconds
        rows.append({"id": clip_path.name, "caption": caption, "latents": latents.numpy().tobytes(),
                     "latents_shape": list(latents.shape), "text": text.numpy().tobytes(),
                     "text_shape": list(text.shape)})
    if out is not None:
        start = time.perf_counter()
        pq.write_table(pa.Table.from_pylist(rows), out)
        phases["write"] = phases.get("write", 0.0) + time.perf_counter() - start
    return rows


def agreement(fvx_out: pathlib.Path, rows: list[dict]) -> tuple[float, float]:
    """Largest |difference| of the latents and of the text embeddings fvx wrote against the plain loop's."""
    import pyarrow.parquet as pq

    table = pq.read_table(fvx_out / preprocess.PARTS).to_pylist()
    ours = {r["id"]: r for r in table}
    assert sorted(ours) == [r["id"] for r in rows], (sorted(ours), [r["id"] for r in rows])
    worst = [0.0, 0.0]
    for plain in rows:
        mine = ours[plain["id"]]
        for k, (theirs, name) in enumerate((("latents", "vae_latent"), ("text", "text_embedding"))):
            a = np.frombuffer(mine[f"{name}_bytes"], np.float32).reshape(mine[f"{name}_shape"])
            b = np.frombuffer(plain[theirs], np.float32).reshape(plain[f"{theirs}_shape"])
            assert a.shape == b.shape, (plain["id"], theirs, a.shape, b.shape)
            worst[k] = max(worst[k], float(np.abs(a - b).max()))
    return worst[0], worst[1]


# ---------------------------------------------------------------------------------------------------- measuring


class Outs:
    """Fresh output paths under one folder, the previous one removed (a run must not find its folder complete)."""

    def __init__(self, root: pathlib.Path):
        self.root, self.count = root, 0

    def __call__(self, name: str, suffix: str = "") -> pathlib.Path:
        self.count += 1
        for old in self.root.glob(f"{name}_*"):
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        return self.root / f"{name}_{self.count}{suffix}"


def throughput(work: pathlib.Path, setup: Setup, videos: pathlib.Path, repeats: int) -> dict[str, Any]:
    """Steady-state seconds per run of fvx and of the plain loop (median of ``repeats`` alternating, after one run
    each whose outputs are compared), the plain loop's phases per run, load times, GPU peaks and fvx's swap."""
    folder, outs, cuda = work / "wan", Outs(work / "out"), setup.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    job, factory = preprocessing.job_of(fvx_config(folder, setup))
    holder: dict[str, Any] = {}
    load = {"fvx": timed(lambda: holder.update(opened=factory()), sync),  # on the CPU: moved on first use
            "plain": timed(lambda: holder.update(pipe=plain_pipeline(folder, setup)), sync)}
    opened, pipe = holder.pop("opened"), holder.pop("pipe")

    def fvx() -> None:
        fvx_steady(job, opened, videos, outs("fvx"))

    first = outs("fvx")
    fvx_steady(job, opened, videos, first)
    diff = agreement(first, plain_loop(pipe, setup, videos, None))
    gpu_peak, swap = {}, 0.0
    if cuda:  # each from its weights on the CPU; fvx brings one encoder at a time, plain moves the pipe over
        opened._use(())
        pipe.to("cpu")
        gpu_peak["fvx"] = cuda_peak(fvx)
        gpu_peak["plain"] = cuda_peak(lambda: plain_loop(pipe.to(setup.device), setup, videos,
                                                         outs("plain", ".parquet")))
        swap = timed(lambda: (opened._use(opened.encoders.text), opened._use(opened.encoders.video)), sync)
    phases: dict[str, float] = {}
    probe = timed(lambda: [media.probe_video(p) for p in sorted(videos.glob("*.mp4"))])
    times = alternate({"fvx": fvx, "plain": lambda: plain_loop(pipe, setup, videos, outs("plain", ".parquet"), phases)},
                      repeats=repeats, warmup=0, sync=sync)
    return {"times": times, "load": load, "diff": diff, "gpu_peak": gpu_peak, "swap": swap,
            "phases": {k: v / repeats for k, v in phases.items()}, "probe": probe}


def end_to_end(work: pathlib.Path, setup: Setup, videos: pathlib.Path) -> dict[str, float]:
    """Median seconds of two alternating runs with the folder loaded in each: ``run_preprocess``; the plain
    pipeline's load and loop."""
    outs, config = Outs(work / "out"), fvx_config(work / "wan", setup)
    return alternate({"fvx": lambda: fvx_end_to_end(config, videos, outs("fvx")),
                      "plain": lambda: plain_loop(plain_pipeline(work / "wan", setup), setup, videos,
                                                  outs("plain", ".parquet"))}, repeats=2, warmup=0)


def cuda_peak(fn: Callable[[], object]) -> float:
    """GiB of GPU memory ``fn`` allocates at its peak above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def peak_child(case: str, work: pathlib.Path, setup_name: str, clips: int, parts: int | None) -> dict[str, float]:
    """Resident MB of a fresh process running ``case`` end to end on ``clips`` clips: peak, and after imports."""
    command = [sys.executable, __file__, "--peak", case, "--work", str(work), "--setup", setup_name,
               "--clips", str(clips)] + (["--parts", str(parts)] if parts else [])
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def peak_in_this_process(case: str, work: pathlib.Path, setup: Setup, clips: int, parts: int | None) -> None:
    import av  # noqa: F401  (both paths' imports before the baseline)
    import diffusers  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    base = current_rss_bytes()
    videos = subset(work / "videos", clips)
    out = pathlib.Path(tempfile.mkdtemp(dir=work / "out"))
    if case == "fvx":
        fvx_end_to_end(fvx_config(work / "wan", setup, parts), videos, out / "ds")
    else:
        plain_loop(plain_pipeline(work / "wan", setup), setup, videos, out / "plain.parquet")
    print(json.dumps({"peak_mb": peak_rss_bytes() / 2**20, "base_mb": base / 2**20}))


# ------------------------------------------------------------------------------------------------------- report


def report(setup: Setup, clips: int, result: dict[str, Any]) -> float:
    """Print the throughput table; returns fvx / plain in clips/s (steady state)."""
    times, load = result["times"], result["load"]
    rate = {k: clips / v for k, v in times.items()}
    ratio = rate["fvx"] / rate["plain"]
    lat, txt = result["diff"]
    print(f"{clips} clips of {setup.frames}x{setup.height}x{setup.width} (written at {setup.source[0]}x"
          f"{setup.source[1]}, {setup.fps} fps), {setup.dtype} on {setup.device}, {torch.get_num_threads()} threads; "
          f"max |fvx - plain|: latents {lat:.1e}, text {txt:.1e}")
    print(f"{'':8} {'s/run':>8} {'clips/s':>8} {'x plain':>8} {'load s':>7} {'GPU GiB':>8}")
    for name in ("fvx", "plain"):
        peak = f"{result['gpu_peak'][name]:8.2f}" if result["gpu_peak"] else f"{'-':>8}"
        print(f"{name:8} {times[name]:8.2f} {rate[name]:8.3f} {rate[name] / rate['plain']:8.3f} "
              f"{load[name]:7.2f} {peak}")
    per_clip = {k: 1000 * v / clips for k, v in result["phases"].items()}
    print("plain loop, ms per clip: " + ", ".join(f"{k} {v:.1f}" for k, v in per_clip.items()) +
          f"; fvx's extra header probe (media.probe_video) {1000 * result['probe'] / clips:.1f} ms per clip")
    if result["swap"]:
        print(f"fvx moves the text encoder to the GPU and the VAE off it, then back, once per part (samples_per_file "
              f"clips; every run here): {result['swap']:.2f} s")
    if "end_to_end" in result:
        e2e = result["end_to_end"]
        print(f"end to end (folder loaded in the run): fvx {e2e['fvx']:.2f} s, plain {e2e['plain']:.2f} s, "
              f"fvx/plain clips/s {e2e['plain'] / e2e['fvx']:.3f}")
    return ratio


def memory(work: pathlib.Path, setup_name: str, clips: int) -> None:
    """Peak resident memory of fvx (default parts; parts of ``clips``) and of the plain loop at ``clips`` and 4x."""
    def peak(case: str, count: int, parts: int | None = None) -> dict[str, float]:
        return peak_child(case, work, setup_name, count, parts)

    fvx_small = peak("fvx", clips)  # parts of ``clips`` at ``clips`` clips: the same single part
    rows = (("fvx, samples_per_file 64", fvx_small, peak("fvx", 4 * clips)),
            (f"fvx, samples_per_file {clips}", fvx_small, peak("fvx", 4 * clips, clips)),
            ("plain loop", peak("plain", clips), peak("plain", 4 * clips)))
    print("peak resident MB, a fresh process each, end to end: after imports -> peak (peak above imports)")
    print(f"{'':26} {f'{clips} clips':>22} {f'{4 * clips} clips':>22} {'x peak':>7} {'x above':>8}")
    for label, small, large in rows:
        up = [m["peak_mb"] - m["base_mb"] for m in (small, large)]
        cells = [f"{m['base_mb']:5.0f} -> {m['peak_mb']:5.0f} ({u:5.0f})" for m, u in zip((small, large), up)]
        print(f"{label:26} {cells[0]:>22} {cells[1]:>22} {large['peak_mb'] / small['peak_mb']:7.3f} "
              f"{up[1] / up[0]:8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=None, help="clips per run (default: 6 on a CPU, 4 under --check)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per path (default: 3; 2 under --check)")
    parser.add_argument("--check", action="store_true", help="a GPU: Wan 2.1 1.3B's encoders at 81x480x832")
    parser.add_argument("--text-layers", type=int, default=24, help="--check: UMT5-XXL layers kept (of 24)")
    parser.add_argument("--check-on-cpu", action="store_true", help=argparse.SUPPRESS)  # --check's path, CPU sizes
    parser.add_argument("--peak", choices=("fvx", "plain"), help=argparse.SUPPRESS)  # one case in this process
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--setup", default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--parts", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    quiet()
    if args.peak:
        peak_in_this_process(args.peak, pathlib.Path(args.work), SETUPS[args.setup], args.clips, args.parts)
        return
    check = args.check or args.check_on_cpu
    if args.check and not torch.cuda.is_available():
        print("bench/preprocess.py --check needs a CUDA GPU (Wan 2.1 1.3B's encoders at 81x480x832); run it without "
              "--check on a CPU")
        return
    setup_name = "gpu" if args.check else "gpu-on-cpu" if args.check_on_cpu else "cpu"
    setup = SETUPS[setup_name]
    if args.check:
        setup = dataclasses.replace(setup, text={**setup.text, "num_layers": args.text_layers})
    clips = args.clips or (4 if check else 6)
    repeats = args.repeats or (2 if check else 3)
    with tempfile.TemporaryDirectory(prefix="fvx_bench_preprocess_") as temp:
        work = pathlib.Path(temp)
        start = time.perf_counter()
        build_folder(work / "wan", setup)
        write_clips(work / "videos", clips if check else 4 * clips, setup)
        (work / "out").mkdir()
        print(f"load average {os.getloadavg()[0]:.2f}; set-up {time.perf_counter() - start:.1f} s: text encoder "
              f"{setup.text}, VAE base_dim {setup.vae['base_dim']} dim_mult {setup.vae['dim_mult']} "
              f"num_res_blocks {setup.vae['num_res_blocks']}")
        videos = subset(work / "videos", clips)
        result = throughput(work, setup, videos, repeats)
        if not args.check:  # loading a 9 GB text encoder twice more is not worth the device time
            result["end_to_end"] = end_to_end(work, setup, videos)
        ratio = report(setup, clips, result)
        if not check:
            memory(work, setup_name, clips)
    print(f"fvx / plain clips/s {ratio:.3f} (goal >= {GOAL}); load average {os.getloadavg()[0]:.2f}")
    if check and ratio < GOAL:
        sys.exit(f"check FAILED: fvx's preprocess runs at {ratio:.3f}x the plain loop's clips/s, below {GOAL}")


if __name__ == "__main__":
    main()
