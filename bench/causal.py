"""The block-causal Wan (``fvx_models.wan_causal``) against bidirectional Wan on the same params, latents and text.

Table 1, training forward + backward (``fvx.core.grad.value_and_grad`` of the mean squared velocity): bidirectional Wan
(``WanConfig``, ``t [B]``) against the block-causal model in both attention forms (``"prefix"``: one SDPA per query
block over the keys it reads; ``"mask"``: one SDPA with a boolean mask), each with per-frame timesteps ``t [B, T]``
(what DFSFT / teacher forcing train with; diffusers' per-token path, ``timestep_proj [B, L, 6, D]``) and with
per-sample ``t [B]``, which isolates what the per-token timestep path costs. Columns: median (and minimum) step
time over alternating repeats after a warm-up, what autograd saves for the backward (saved-tensor hooks, params
excluded), and the peak resident memory above the set-up process over two steps (each variant in a fresh process;
it includes the gradients, the same for all), each also as a ratio to the bidirectional peer.

Table 2, streaming inference under ``no_grad``: a rollout of K blocks with the KV cache (``model.causal.apply_cached``
block by block, as ``fvx_models.streaming`` runs its context passes) against re-running the full block-causal prefix
for every block (block b: ``model.apply`` over frames ``[0, (b+1) F)``, keep the last block). Time, peak RSS and the
largest difference of the two outputs.

Last, the size of the per-token timestep transient at Wan 2.1 14B's full resolution (81 frames of 720x1280: 21
latent frames of 90x160, patch (1, 2, 2), dim 5120, 40 blocks), and what the measured saved bytes scale to there: the
per-token path's extra per block and once per model (split by measuring a 2-layer copy as well), and the mask form's
``[L, L]`` mask.

The model is Wan's 4 layers x dim 256 (as ``bench/step.py``'s ``cpu-4x256``), registered here as a bench preset, fp32.
Table 3, Matrix-Game 2.0's streaming model with actions (``--actions-only`` runs it alone): time per block as the
stream grows on a window, and the cache it holds.
    python bench/causal.py [--frames 8] [--size 24] [--frames-per-block 2] [--blocks K] [--batch 1] [--repeats 5]
                           [--stream-attention prefix|mask] [--threads N] [--action-blocks 15] [--actions-only]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parents[1]))  # the repository root: fvx, fvx_models, ...
from common import current_rss_bytes, peak_rss_bytes, reset_peak_rss, timed  # noqa: E402

import torch  # noqa: E402

from fvx.core import grad, random  # noqa: E402
from fvx_models import wan, wan_causal  # noqa: E402
from fvx_models.family import Preset  # noqa: E402

PRESET, SHALLOW = "bench-causal-4x256", "bench-causal-2x256"  # the second only splits saved bytes by depth
_KWARGS = {**wan.TINY, "num_layers": 4, "num_attention_heads": 2, "attention_head_dim": 128, "ffn_dim": 1024,
           "text_dim": 64, "rope_max_seq_len": 64}
LAYERS, SHALLOW_LAYERS = _KWARGS["num_layers"], 2
for _presets in (wan.PRESETS, wan_causal.PRESETS):  # the causal family holds its own copy of Wan's table
    _presets[PRESET] = Preset(_KWARGS, wan.TINY_VAE, 16)
    _presets[SHALLOW] = Preset({**_KWARGS, "num_layers": SHALLOW_LAYERS}, wan.TINY_VAE, 16)
DIM = _KWARGS["num_attention_heads"] * _KWARGS["attention_head_dim"]
TEXT_LEN = 16

# name -> (attention form or None for bidirectional Wan, whether t is per frame [B, T])
TRAIN = {"bidirectional": (None, False), "prefix t[B,T]": ("prefix", True), "mask t[B,T]": ("mask", True),
         "prefix t[B]": ("prefix", False), "mask t[B]": ("mask", False)}
STREAM = ("cached", "rerun")

# Wan 2.1 14B at full resolution: 81 frames of 720x1280 -> 21 latent frames of 90x160, patch (1, 2, 2)
WAN14B_TOKENS, WAN14B_DIM, WAN14B_LAYERS = 21 * (90 // 2) * (160 // 2), 5120, 40


def build_model(attention: str | None, frames_per_block: int, preset: str = PRESET):
    """Bidirectional Wan (``attention`` None) or the block-causal one in that attention form."""
    if attention is None:
        return wan.WanConfig(preset=preset).build()
    return wan_causal.WanCausalConfig(preset=preset, num_frames_per_block=frames_per_block,
                                      block_attention=attention).build()


def first_layers(params: dict, layers: int) -> dict:
    """The params of a model of the first ``layers`` blocks (the rest, head and embedders, shared)."""
    return {n: p for n, p in params.items() if not n.startswith("blocks.") or int(n.split(".")[1]) < layers}


def make_inputs(args) -> dict:
    """Params (the causal and the bidirectional model share their names), latents, both timesteps and the text."""
    params = build_model("prefix", args.frames_per_block).weights.init(random.key(0))
    k = random.split(random.key(1), 4)
    b = args.batch
    x = random.normal(k[0], (b, _KWARGS["in_channels"], args.frames, args.size, args.size))
    t_frame = torch.floor(random.uniform(k[1], (b, args.frames)) * 1000)
    cond = {"text": random.normal(k[2], (b, TEXT_LEN, _KWARGS["text_dim"])), "text_mask": torch.ones(b, TEXT_LEN)}
    return {"params": params, "x": x, "t_frame": t_frame, "t_sample": t_frame[:, 0].contiguous(), "cond": cond}


def alternate_runs(fns: dict, repeats: int, warmup: int = 1) -> dict[str, tuple[float, float]]:
    """(median, min) seconds per call of each of ``fns``, run in turn after ``warmup`` rounds (``common.alternate``
    with the minimum kept too: on a shared machine the minimum shows the cost with the least interference)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            runs[name].append(timed(fn))
    return {name: (statistics.median(ts), min(ts)) for name, ts in runs.items()}


def tokens(args) -> int:
    _, p_h, p_w = _KWARGS["patch_size"]
    return args.frames * (args.size // p_h) * (args.size // p_w)


# ------------------------------------------------------------------------------------------- training forward+backward


def train_step(name: str, args, inputs: dict, preset: str = PRESET):
    """``step()``: value and gradients of the mean squared velocity of variant ``name``; and its loss function."""
    attention, per_frame = TRAIN[name]
    model = build_model(attention, args.frames_per_block, preset)
    t = inputs["t_frame"] if per_frame else inputs["t_sample"]

    def loss(params):
        return model.apply(params, inputs["x"], t, inputs["cond"]).square().mean()

    value_and_grad = grad.value_and_grad(loss)

    def step():
        value, _ = value_and_grad(inputs["params"])
        return float(value)

    return step, loss


def saved_bytes(loss, params: dict, square: int = 0) -> tuple[int, int]:
    """Bytes autograd saves for the backward of ``loss(params)`` (distinct storages, params not counted), and those
    of them held by ``[square, square]`` tensors (the attention masks of ``square`` tokens)."""
    leaves = {n: p.detach().requires_grad_(True) for n, p in params.items()}
    skip = {p.untyped_storage().data_ptr() for p in leaves.values()}
    seen: dict[int, tuple[int, bool]] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = (storage.nbytes(), tuple(tensor.shape) == (square, square))
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss(leaves)
    return sum(n for n, _ in seen.values()), sum(n for n, mask in seen.values() if mask)


# ------------------------------------------------------------------------------------------------- streaming rollout


def rollout_cached(model, inputs: dict, blocks: int, size: int) -> torch.Tensor:
    """K blocks one ``apply_cached`` call each, the cache carried from block to block."""
    x, t, cond = inputs["x"], inputs["t_frame"], inputs["cond"]
    cache, outs = model.causal.empty_cache(x.shape[2]), []
    with torch.no_grad():
        for b in range(blocks):
            frames = slice(b * size, (b + 1) * size)
            v, cache = model.causal.apply_cached(inputs["params"], x[:, :, frames], t[:, frames], cond, cache)
            outs.append(v)
    return torch.cat(outs, dim=2)


def rollout_rerun(model, inputs: dict, blocks: int, size: int) -> torch.Tensor:
    """K blocks, block b by one block-causal forward over frames [0, (b+1) F) keeping its last block."""
    x, t, cond = inputs["x"], inputs["t_frame"], inputs["cond"]
    outs = []
    with torch.no_grad():
        for b in range(blocks):
            end = (b + 1) * size
            outs.append(model.apply(inputs["params"], x[:, :, :end], t[:, :end], cond)[:, :, end - size:])
    return torch.cat(outs, dim=2)


def stream_step(name: str, args, inputs: dict):
    model = build_model(args.stream_attention, args.frames_per_block)
    rollout = rollout_cached if name == "cached" else rollout_rerun
    return lambda: rollout(model, inputs, args.blocks, args.frames_per_block)


# ------------------------------------------------------------------------------------------------------ peak memory


def peak_in_process(kind: str, name: str, args) -> float:
    """Peak resident MB above the set-up process over two runs of one variant (run in a fresh process, on the
    inputs the parent saved to ``args.inputs``: drawing the params again would compile fvx.core.random's kernel)."""
    inputs = torch.load(args.inputs)
    fn = train_step(name, args, inputs)[0] if kind == "train" else stream_step(name, args, inputs)
    gc.collect()
    base = current_rss_bytes()
    reset_peak_rss()
    for _ in range(2):
        fn()
    return (peak_rss_bytes() - base) / 2**20


def peak_mb(kind: str, name: str, args) -> float:
    """:func:`peak_in_process` of one variant in a fresh process with the same sizes and inputs."""
    cmd = [sys.executable, __file__, "--frames", str(args.frames), "--size", str(args.size), "--frames-per-block",
           str(args.frames_per_block), "--batch", str(args.batch), "--blocks", str(args.blocks),
           "--stream-attention", args.stream_attention, "--inputs", args.inputs, "--peak", kind, name]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)["peak_mb"]


# ------------------------------------------------------------------------------------------------------------ tables


def print_training(args, inputs: dict) -> float:
    """Table 1; returns the bytes per query-key pair per layer that the mask form saves over the prefix form."""
    steps = {name: train_step(name, args, inputs) for name in TRAIN}
    runs = alternate_runs({name: step for name, (step, _) in steps.items()}, args.repeats)
    times, best = {name: run[0] for name, run in runs.items()}, {name: run[1] for name, run in runs.items()}
    measured = {name: saved_bytes(loss, inputs["params"], tokens(args)) for name, (_, loss) in steps.items()}
    saved = {name: total / 2**20 for name, (total, _) in measured.items()}
    peaks = {name: peak_mb("train", name, args) for name in TRAIN}
    print(f"\nforward + backward, B {args.batch}, {args.frames} latent frames x {args.size}x{args.size} = "
          f"{tokens(args)} tokens, blocks of {args.frames_per_block} frames; median of {args.repeats} alternating "
          "steps")
    print(f"{'variant':14} {'step ms':>8} {'time/bi':>8} {'min ms':>7} {'min/bi':>7} {'saved MB':>9} {'saved/bi':>9} "
          f"{'peak MB':>8} {'peak/bi':>8}")
    ref = "bidirectional"
    for name in TRAIN:
        print(f"{name:14} {times[name] * 1e3:8.1f} {times[name] / times[ref]:8.2f} {best[name] * 1e3:7.1f} "
              f"{best[name] / best[ref]:7.2f} {saved[name]:9.1f} {saved[name] / saved[ref]:9.2f} {peaks[name]:8.1f} "
              f"{peaks[name] / peaks[ref]:8.2f}")
    for form in ("prefix", "mask"):
        frame, sample = f"{form} t[B,T]", f"{form} t[B]"
        print(f"per-token timestep path ({form}): time x{times[frame] / times[sample]:.2f} (min "
              f"x{best[frame] / best[sample]:.2f}), saved "
              f"{saved[frame] - saved[sample]:+.1f} MB (x{saved[frame] / saved[sample]:.2f}) over t [B]")
    masks = measured["mask t[B]"][1]
    pair = masks / (LAYERS * tokens(args) ** 2)
    print(f"mask form over prefix form (t [B]): time x{times['mask t[B]'] / times['prefix t[B]']:.2f} (min "
          f"x{best['mask t[B]'] / best['prefix t[B]']:.2f}), saved "
          f"{saved['mask t[B]'] - saved['prefix t[B]']:+.1f} MB, of which {masks / 2**20:.1f} MB are [L, L] masks: "
          f"{pair:.2f} bytes per query-key pair per layer (SDPA saves the float mask it makes of the boolean one)")
    return pair


def print_streaming(args, inputs: dict) -> None:
    model = build_model(args.stream_attention, args.frames_per_block)
    cached = rollout_cached(model, inputs, args.blocks, args.frames_per_block)
    rerun = rollout_rerun(model, inputs, args.blocks, args.frames_per_block)
    runs = alternate_runs({name: stream_step(name, args, inputs) for name in STREAM}, args.repeats)
    peaks = {name: peak_mb("stream", name, args) for name in STREAM}
    print(f"\nstreaming rollout of {args.blocks} blocks of {args.frames_per_block} frames ({args.stream_attention}), "
          f"no_grad, one forward per block; median of {args.repeats} alternating rollouts")
    print(f"{'variant':14} {'rollout ms':>10} {'time/rerun':>10} {'min ms':>7} {'min/rerun':>9} {'peak MB':>8} "
          f"{'peak/rerun':>10}")
    (time_r, best_r) = runs["rerun"]
    for name in STREAM:
        time, best = runs[name]
        print(f"{name:14} {time * 1e3:10.1f} {time / time_r:10.2f} {best * 1e3:7.1f} {best / best_r:9.2f} "
              f"{peaks[name]:8.1f} {peaks[name] / peaks['rerun']:10.2f}")
    print(f"max |cached - rerun| = {(cached - rerun).abs().max().item():.2e}")


def timestep_path_bytes(args, inputs: dict) -> tuple[float, float]:
    """Bytes per token that per-frame ``t [B, T]`` saves for the backward over ``t [B]`` (prefix form): in each
    block, and once per model (time embedder, output head), split by measuring the 4- and the 2-layer model."""
    extra = {}
    for preset, layers in ((PRESET, LAYERS), (SHALLOW, SHALLOW_LAYERS)):
        params = first_layers(inputs["params"], layers)
        frame, sample = (saved_bytes(train_step(name, args, inputs, preset)[1], params)[0]
                         for name in ("prefix t[B,T]", "prefix t[B]"))
        extra[layers] = frame - sample
    per_block = (extra[LAYERS] - extra[SHALLOW_LAYERS]) / (LAYERS - SHALLOW_LAYERS)
    count = tokens(args) * args.batch
    return per_block / count, (extra[LAYERS] - LAYERS * per_block) / count


def print_transient(per_block: float, once: float, mask_pair_bytes: float) -> None:
    """The per-token timestep transient at Wan 14B full resolution, the measured extra saved bytes scaled there, and
    the mask form's ``[L, L]`` mask there."""
    gib, n, d = 2**30, WAN14B_TOKENS, WAN14B_DIM
    modulation = n * 6 * d
    print(f"\nper-token timestep transient, Wan 2.1 14B at 81x720x1280 (21x90x160 latents -> {n} tokens), dim {d}, "
          "B 1:")
    print(f"  timestep_proj [1, {n}, 6, {d}]: {modulation * 2 / gib:.2f} GiB bf16, {modulation * 4 / gib:.2f} GiB fp32 "
          f"(t [B]: [1, 6, {d}], {6 * d * 4 / 2**10:.0f} KiB; the hidden state [1, L, D] is {n * d * 2 / gib:.2f} GiB "
          "bf16); every block's input")
    print(f"  inside each block: scale_shift_table + timestep_proj.float(), [1, L, 6, D] fp32 = "
          f"{modulation * 4 / gib:.2f} GiB, whatever the compute dtype")
    vectors = per_block / (4 * DIM)
    print(f"  measured here (t [B, T] over t [B], saved for the backward): {vectors:.1f} fp32 vectors of width dim "
          f"per token per block, {once / (4 * DIM):.1f} once per model; at 14B: {vectors * n * d * 4 / gib:.2f} GiB "
          f"per block, {WAN14B_LAYERS * vectors * n * d * 4 / gib:.0f} GiB over {WAN14B_LAYERS} blocks without remat "
          "(under remat only the block being recomputed holds its share)")
    print(f"  the mask form's [L, L] mask there: {n * n / gib:.1f} GiB bool per forward, and the float copy SDPA "
          f"saves in each layer ({mask_pair_bytes:.2f} bytes per pair here, fp32): "
          f"{mask_pair_bytes * n * n / gib:.1f} GiB ({2 * n * n / gib:.1f} GiB in bf16, "
          f"{WAN14B_LAYERS * 2 * n * n / gib:.0f} GiB over {WAN14B_LAYERS} blocks without remat)")


def print_action_stream(args) -> None:
    """Table 3: Matrix-Game 2.0's block-causal model (``fvx_models.matrixgame2_causal``, tiny preset, its action
    module on block 1) streaming ``--action-blocks`` blocks of ``--frames-per-block`` latent frames with actions on a
    window of 4 frames and 1 sink frame: the time of each block, by thirds of the stream, and the cache it holds."""
    from fvx_models.matrixgame2_causal import MatrixGame2CausalConfig

    fpb, blocks = args.frames_per_block, args.action_blocks
    frames, size = fpb * blocks, args.size
    model = MatrixGame2CausalConfig(preset="tiny", num_frames_per_block=fpb, local_attn_size=max(4, fpb + 1),
                                    sink_size=1).build()
    params = model.weights.init(random.key(0))
    video_frames = 4 * (frames - 1) + 1
    cond = {"first_frame_latents": random.normal(random.key(1), (1, 16, frames, size, size)),
            "image_embeds": random.normal(random.key(2), (1, 5, 16)),
            "keyboard": torch.nn.functional.one_hot(torch.arange(video_frames) % 4, 4).float()[None],
            "mouse": random.normal(random.key(3), (1, video_frames, 2)) * 0.1}
    cache, times = model.causal.empty_cache(frames), []
    with torch.no_grad():
        for b in range(blocks):
            x = random.normal(random.fold_in(random.key(4), b), (1, 16, fpb, size, size))
            start = time.perf_counter()
            _, cache = model.causal.apply_cached(params, x, torch.tensor([500.0]), cond, cache)
            times.append(time.perf_counter() - start)
    thirds = [times[i * blocks // 3:(i + 1) * blocks // 3] for i in range(3)]
    held = sum(k.numel() * k.element_size() for k in cache.keys + cache.values) / 2**20
    print(f"\nMatrix-Game 2.0 streaming with actions: {blocks} blocks of {fpb} frames ({size}x{size} latents), "
          f"window {model.causal.window}, sink {model.causal.sink}")
    print("blocks          ms per block (median)")
    for i, part in enumerate(thirds):
        print(f"{i * blocks // 3:>4}-{(i + 1) * blocks // 3 - 1:<4}       {1e3 * statistics.median(part):8.2f}")
    print(f"cache: {len(cache.slots)} frame slots, {len(cache.keys)} layers (video and action), {held:.2f} MB, the "
          "same after every block")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=8, help="latent frames T (whole blocks)")
    parser.add_argument("--size", type=int, default=24, help="latent height = width (patch 2)")
    parser.add_argument("--frames-per-block", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=None, help="blocks K of the streaming rollout (default all)")
    parser.add_argument("--stream-attention", choices=("prefix", "mask"), default="prefix")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--action-blocks", type=int, default=15,
                        help="blocks of the Matrix-Game stream (table 3; the tiny preset's RoPE holds 32 frames)")
    parser.add_argument("--actions-only", action="store_true", help="only table 3, the stream with actions")
    parser.add_argument("--peak", nargs=2, metavar=("KIND", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--inputs", help=argparse.SUPPRESS)  # the parent's saved inputs, for --peak
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.frames % args.frames_per_block:
        parser.error(f"--frames {args.frames} must be whole blocks of --frames-per-block {args.frames_per_block}")
    args.blocks = args.blocks or args.frames // args.frames_per_block
    if args.blocks * args.frames_per_block > args.frames:
        parser.error(f"--blocks {args.blocks} x {args.frames_per_block} frames exceed --frames {args.frames}")
    if args.peak:
        print(json.dumps({"peak_mb": peak_in_process(*args.peak, args)}))
        return
    if args.actions_only:
        print_action_stream(args)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, Wan {_KWARGS['num_layers']} layers x dim "
          f"{DIM}, fp32")
    inputs = make_inputs(args)
    with tempfile.TemporaryDirectory() as folder:
        args.inputs = str(pathlib.Path(folder) / "inputs.pt")
        torch.save(inputs, args.inputs)
        mask_pair_bytes = print_training(args, inputs)
        print_streaming(args, inputs)
    print_transient(*timestep_path_bytes(args, inputs), mask_pair_bytes)
    print_action_stream(args)


if __name__ == "__main__":
    main()
