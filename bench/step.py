"""The fine-tuning step of fvx against an eager PyTorch baseline written the usual way, in one process, for the tiny
model of every family and larger Wan, LTX-2 and MiniMax-H3 models (``cpu-4x256``, ``ltx2-mid``, ``minimax-h3-mid``),
and ``ltx2-mid-nvfp4``: LTX-2's step with NVFP4 linear QAT beside the same dense baseline.

Baseline: the family's diffusers ``nn.Module`` forward (with the arguments its pipeline passes), ``loss.backward()``,
``clip_grad_norm_(foreach=True)`` and ``torch.optim.AdamW(foreach=True)``. fvx: ``Finetune(...).build(models).step_``
(functional_call forward, ``fvx.core.grad.value_and_grad``, foreach clip + AdamW in place), eager and with
``compile=blocks`` (one inductor graph per unit group) and ``compile=model`` (the whole forward as one graph), against
the baseline and the same module under ``torch.compile`` (``compile ms``). Same architecture, initial params, batch,
noise and timesteps: both steps draw the noise and timesteps with the same fvx keys inside their timing. Timings
alternate fvx / baseline; peak memory is measured per variant in a fresh subprocess.

Models that make sound too: LTX-2 trains video only (its audio branch frozen: the baseline module's audio params do not
require grad) and draws its own noise levels (``Model.rules.sigma_sampler``, which the baseline draws with too); MiniMax-H3
is joint (latents ``{"video": [B, C, T, H, W], "audio": [B, 2, 32, A]}``, one sample per forward, the loss the sum of
the modalities' mean squared errors, as ``fvx_methods.finetune.loss_fn``). Its tokens column counts the video's.
For LTX-2 a second memory table puts fvx's frozen-audio step beside a bench-only baseline that trains both branches
(``both``: every param of the module trained, LTX-2's joint forward on audio latents of the clip's length with the
a2v / v2a attention on, and the audio's mean squared error added to the loss), each variant in a fresh subprocess.

A second table runs the same fvx step (eager and ``compile=blocks``) on the same global batch in 1 process and in 2
gloo processes (params, grads and AdamW state sharded, each rank on its half of the batch, one thread each; the
1-process run gets ``--threads``), each in fresh processes: per-rank median step time (the variants timed in turn
in the same processes, so drift hits all alike), peak resident memory of the
process over the timed steps (reset after setup and two warm-up steps, so compilation's transient peak does not
count; the allocator keeps what the warm-up steps touched, so this is the rank's steady-state footprint, torch's
own ~300 MB included), and the params + optimizer state a rank holds. A case whose batch does not split over 2 ranks
runs there on a global batch rounded up to a multiple of 2 (its B column says which). The sharded rows: fvx's units
prefetch the next unit's gather and drop their full params after the forward (``reshard_after_forward``, the default)
against FSDP2 doing the same (``fsdp2``), and with the full params kept to the backward (``fvx_blocks_keep``, FSDP2
``reshard_after_forward=False``: ``fsdp2_keep``). Two bounds beside them: ``fvx_blocks_local``, the compiled step
with full params and no communication (the compute floor of every rank busy at once), and ``collectives``, the sharded
step's traffic alone without compute. It runs Wan's ``tiny`` and ``cpu-4x256``, or the ``--cases`` named (but those
of ``DIST_REFUSED``, named in a line). ``--skip-dist`` leaves it out. ``--sp 2`` adds rows of the same step under
sequence parallelism in the same processes (``fvx_sp2``, ``fvx_blocks_sp2``: both ranks on the whole global batch,
each on half of every sample's tokens, params still sharded over both), beside the data-parallel ones.
    python bench/step.py [--repeats 10] [--threads N] [--skip-dist | --dist-only] [--sp 2] [--cases tiny,ltx2]
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parents[1]))  # the repository root: fvx, fvx_models, ...
from common import alternate, current_rss_bytes, free_port, peak_rss_bytes, reset_peak_rss  # noqa: E402

import torch  # noqa: E402

from fvx.core import flow, random  # noqa: E402
from fvx.core.optim_config import AdamWConfig  # noqa: E402
from fvx.data import sections  # noqa: E402
from fvx.distributed import processes, sharding  # noqa: E402
from fvx_methods import finetune  # noqa: E402
from fvx_models import build as fvx_build, ltx2, minimax_h3, wan  # noqa: E402
from fvx_models.family import Preset  # noqa: E402
from fvx_models.allegro import AllegroConfig  # noqa: E402
from fvx_models.chronoedit import ChronoEditConfig  # noqa: E402
from fvx_models.cogvideox import CogVideoXConfig  # noqa: E402
from fvx_models.cosmos import CosmosConfig  # noqa: E402
from fvx_models.cosmos3 import Cosmos3Config  # noqa: E402
from fvx_models.easyanimate import EasyAnimateConfig  # noqa: E402
from fvx_models.hunyuan_video import HunyuanVideoConfig  # noqa: E402
from fvx_models.hunyuan_video15 import HunyuanVideo15Config  # noqa: E402
from fvx_models.kandinsky5 import Kandinsky5Config  # noqa: E402
from fvx_models.helios import HeliosConfig  # noqa: E402
from fvx_models.hunyuan_framepack import FramepackConfig  # noqa: E402
from fvx_models.kandinsky6 import Kandinsky6Config  # noqa: E402
from fvx_models.latte import LatteConfig  # noqa: E402
from fvx_models.linear_qat import LinearQATConfig  # noqa: E402
from fvx_models.matrixgame2 import MatrixGame2Config  # noqa: E402
from fvx_models.ltx2 import LTX2Config  # noqa: E402
from fvx_models.ltx_video import LTXVideoConfig  # noqa: E402
from fvx_models.minimax_h3 import MiniMaxH3Config  # noqa: E402
from fvx_models.mochi import MochiConfig  # noqa: E402
from fvx_models.motif_video import MotifVideoConfig  # noqa: E402
from fvx_models.sana_video import SanaVideoConfig  # noqa: E402
from fvx_models.skyreels_v2 import SkyReelsV2Config  # noqa: E402
from fvx_models.wan_moe import Wan22MoEConfig  # noqa: E402
from fvx_models.wan_animate import WanAnimateConfig  # noqa: E402
from fvx_models.wan_vace import WanVACEConfig  # noqa: E402
from fvx_models.wan_vace_moe import WanVACEMoEConfig  # noqa: E402

# Wan's 4 layers x dim 256, registered in this process as a bench-only preset
wan.PRESETS["bench-cpu-4x256"] = Preset({**wan.TINY, "num_layers": 4, "num_attention_heads": 2,
                                         "attention_head_dim": 128, "ffn_dim": 1024, "text_dim": 64,
                                         "rope_max_seq_len": 64}, wan.TINY_VAE, 16)
# LTX-2 at 4 layers x dim 256 (4 heads of 64), its audio stream half the video's width as released (4 heads of 32)
ltx2.PRESETS["bench-mid-4x256"] = Preset({**ltx2.TINY, "num_attention_heads": 4, "attention_head_dim": 64,
                                          "cross_attention_dim": 256, "audio_num_attention_heads": 4,
                                          "audio_attention_head_dim": 32, "audio_cross_attention_dim": 128,
                                          "caption_channels": 64, "num_layers": 4},
                                         ltx2.TINY_LATENTS, 8, ltx2.PRESETS["tiny"].options)
# MiniMax-H3 at hidden 256, attention 4 x 64 (its world preset) with 4 layers
minimax_h3.PRESETS["bench-mid-4x256"] = Preset({**minimax_h3.WORLD, "num_layers": 4}, minimax_h3.WORLD_LATENTS, 8)

# name -> (model config, latent [C, T, H, W] (a joint model's: one per modality), batch size)
CASES = {
    "tiny": (wan.WanConfig(preset="tiny"), (16, 2, 16, 16), 4),
    "wan-ti2v": (wan.WanConfig(preset="tiny-ti2v"), (48, 2, 16, 16), 4),
    "skyreels": (SkyReelsV2Config(preset="tiny"), (16, 2, 16, 16), 4),
    "wan-a14b": (Wan22MoEConfig(preset="tiny"), (16, 2, 16, 16), 4),
    "hunyuan": (HunyuanVideoConfig(preset="tiny"), (16, 2, 16, 16), 4),
    "wan-i2v": (wan.WanConfig(preset="tiny-i2v"), (16, 2, 16, 16), 4),
    "matrixgame2": (MatrixGame2Config(preset="tiny"), (16, 2, 16, 16), 4),  # its actions per video frame: [B, 5, 4]
    "cosmos": (CosmosConfig(preset="tiny"), (16, 2, 16, 16), 4),
    "chronoedit": (ChronoEditConfig(preset="tiny"), (16, 2, 16, 16), 4),  # Wan 2.1 I2V's call, its 2-frame RoPE
    "wan-vace": (WanVACEConfig(preset="tiny"), (16, 2, 16, 16), 4),  # the context blocks: a unit group of their own
    "wan-vace-a14b": (WanVACEMoEConfig(preset="tiny"), (16, 2, 16, 16), 4),  # two VACE experts (VACE-Fun A14B)
    "wan-animate": (WanAnimateConfig(preset="tiny"), (16, 3, 16, 16), 4),  # the reference slot, pose, 5 face frames
    "cogvideox": (CogVideoXConfig(preset="tiny"), (16, 2, 16, 16), 4),  # the 5B's layout, its VP call and loss weight
    "sana-video": (SanaVideoConfig(preset="tiny"), (16, 2, 16, 16), 4),  # linear attention, gated conv feed-forward
    "mochi": (MochiConfig(preset="tiny"), (12, 2, 16, 16), 4),  # its joint attention as one masked call
    "latte": (LatteConfig(preset="tiny"), (16, 2, 16, 16), 4),  # spatial and temporal blocks, epsilon as a flow
    "allegro": (AllegroConfig(preset="tiny"), (16, 2, 16, 16), 4),  # 3-D RoPE over the whole video, epsilon
    "easyanimate": (EasyAnimateConfig(preset="tiny"), (16, 2, 16, 16), 4),  # MMDiT: text and video in one attention
    "motif-video": (MotifVideoConfig(preset="tiny"), (16, 2, 16, 16), 4),  # dual- then single-stream blocks
    "kandinsky6": (Kandinsky6Config(preset="tiny"), (16, 2, 16, 16), 4),  # video-only: the audio branch frozen
    "kandinsky6-t2va": (Kandinsky6Config(preset="tiny", train_audio=True),  # joint: video and audio at one level
                        {"video": (16, 2, 16, 16), "audio": (1, 20, 32)}, 4),
    "framepack": (FramepackConfig(preset="tiny"), (16, 2, 16, 16), 1),  # a section and its history; one sample
    "helios": (HeliosConfig(preset="tiny"), (16, 2, 16, 16), 4),  # a chunk and its memory (training corrupts it)
    "ltx-video": (LTXVideoConfig(preset="tiny"), (8, 2, 16, 16), 4),
    "hunyuan15": (HunyuanVideo15Config(preset="tiny"), (4, 2, 16, 16), 4),
    "kandinsky5": (Kandinsky5Config(preset="tiny"), (16, 2, 16, 16), 4),
    "ltx2": (LTX2Config(preset="tiny"), (8, 2, 16, 16), 4),
    "minimax-h3": (MiniMaxH3Config(preset="tiny"), {"video": (48, 2, 8, 8), "audio": (2, 32, 16)}, 1),
    "cosmos3": (Cosmos3Config(preset="tiny"), (16, 2, 16, 16), 1),  # one packed text-and-video sequence; one sample
    "cpu-4x256": (wan.WanConfig(preset="bench-cpu-4x256"), (16, 4, 32, 32), 1),
    "ltx2-mid": (LTX2Config(preset="bench-mid-4x256"), (8, 4, 16, 16), 1),
    # the same with NVFP4 linear QAT (fvx_models.linear_qat's reference) on LTX-2's curated set, against the same
    # dense baseline (its loss_diff_step0 is the quantization's)
    "ltx2-mid-nvfp4": (LTX2Config(preset="bench-mid-4x256", linear_qat=LinearQATConfig(implementation="reference")),
                       (8, 4, 16, 16), 1),
    "minimax-h3-mid": (MiniMaxH3Config(preset="bench-mid-4x256"), {"video": (48, 4, 32, 32), "audio": (2, 32, 32)},
                       1),
}
TEXT_LEN = 16
WORLD = 2  # processes of the multi-process table
DIST_CASES = ("tiny", "cpu-4x256")
DIST_REFUSED = {  # case -> why the 2-process table cannot run it
    "wan-a14b": "its FSDP2 peer deadlocks: each rank's router sends its samples to the expert of its own timesteps",
    "minimax-h3": "its diffusers module (the FSDP2 peer's) takes one sample per forward: a batch of 2 fails there",
    "framepack": "its diffusers module (the FSDP2 peer's) takes one sample per forward: a batch of 2 fails there",
    "cosmos3": "its diffusers module (the FSDP2 peer's) takes one sample per forward: a batch of 2 fails there",
}
VARIANTS = {"fvx": "none", "fvx_blocks": "blocks"}  # name -> ModelConfig.compile
# sharded only: units keep their gathered params from forward to backward, beside FSDP2 doing the same
KEEP_VARIANTS = {"fvx_blocks_keep": "blocks"}
FLOORS = ("fvx_blocks_local", "collectives")  # sharded runs only: no communication; communication alone


def model_config(case: str, compile: str = "none", reshard_after_forward: bool = True):
    config = CASES[case][0]
    return type(config)(**{**{f: getattr(config, f) for f in config.__struct_fields__}, "compile": compile,
                           "reshard_after_forward": reshard_after_forward,
                           "frozen_dtype": "fp32"})  # params a mode leaves unused, held as the baseline holds them


def make_batch(model, latent_shape, batch_size: int) -> dict:
    """A batch as methods see it: latents (a joint model's: a dict of modalities, ``latent_shape`` one per modality),
    the model's cond from its spec (normal embeddings, all-ones masks)."""
    g = torch.Generator().manual_seed(0)
    video = latent_shape["video"] if isinstance(latent_shape, dict) else latent_shape
    sizes = {"L": TEXT_LEN, "T": video[1], "H": video[2], "W": video[3], "N": 4,
             "F": model.latents.vae_stride[0] * (video[1] - 1) + 1,  # video frames: actions come one a frame
             "P": video[1] + sections.HISTORY,  # a section's frames and its history's: FramePack's positions
             "Tp": video[1] - 1, "Ff": 4 * (video[1] - 2) + 1}  # Wan-Animate's pose and face frames (a reference slot)
    shapes = {name: (batch_size, *(sizes.get(s, s) for s in shape)) for name, shape in model.cond.items()}
    cond = {name: torch.ones(shape) if "mask" in name else torch.randn(shape, generator=g)
            for name, shape in shapes.items()}
    if "frame_indices" in cond:  # positions: the section first, then its history
        cond["frame_indices"] = torch.arange(shapes["frame_indices"][1]).float().expand(shapes["frame_indices"])
    if model.cond.get("text") == ("L", 1):  # a prompt as token ids (Cosmos 3): ids in its vocabulary
        cond["text"] = torch.randint(0, 64, shapes["text"], generator=g).float()
    latents = ({name: torch.randn(batch_size, *shape, generator=g) for name, shape in latent_shape.items()}
               if isinstance(latent_shape, dict) else torch.randn(batch_size, *latent_shape, generator=g))
    return {"latents": latents, "cond": cond, "sample_index": torch.arange(batch_size)}


def video_tokens(model, batch: dict) -> int:
    """The video tokens of one sample: latent frames x height x width over the model's patch."""
    video = batch["latents"]["video"] if isinstance(batch["latents"], dict) else batch["latents"]
    return math.prod(video.shape[2:]) // math.prod(model.patch_size)


def build_fvx(case: str, compile: str = "none", mesh=None, batch_size: int | None = None,
              reshard_after_forward: bool = True):
    """The fvx model, config, program and initial state of ``case`` (sharded on ``mesh``), and its global batch
    (``batch_size`` samples, default the case's)."""
    _, latent_shape, case_batch = CASES[case]
    model = model_config(case, compile, reshard_after_forward).build(mesh=mesh)
    config = finetune.Finetune(optim=AdamWConfig(lr=1e-4, weight_decay=0.01, max_grad_norm=1.0))
    program = config.build({"student": model}, total_steps=1000,
                           **({} if mesh is None else {"ranks": processes.group_of(mesh)}))
    state = program.init(random.key(0))
    return model, config, program, state, make_batch(model, latent_shape, batch_size or case_batch)


def build(case: str, compile: str = "none", train_all: bool = False):
    """The fvx model and program, a baseline module and optimizer with the same initial params, and a batch;
    ``train_all``: the module trains every param (:func:`baseline_module`)."""
    model, config, program, state, batch = build_fvx(case, compile)
    module = baseline_module(case, program, state, train_all)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.01,
                                  foreach=True)
    return model, config, program, state, module, optimizer, batch


def held(program) -> dict:
    """What the program holds frozen (params a family leaves unused in its mode; none for most)."""
    return program.frozen(random.key(0))


def baseline_module(case: str, program, state, train_all: bool = False) -> torch.nn.Module:
    """The family's diffusers module (the skeleton, its params assigned real copies): what a user trains, the params
    fvx trains with gradients, those it holds frozen (LTX-2's audio branch) without; ``train_all``: every param with
    gradients (the bench-only LTX-2 variant that trains both branches)."""
    config = model_config(case)
    module = config.family.architecture.skeleton(config)
    trained = state.roles["student"].params
    params = {**held(program).get("student", {}), **trained}
    module.load_state_dict({n: p.detach().clone() for n, p in params.items()}, assign=True)
    for name, param in module.named_parameters():
        param.requires_grad_(train_all or name in trained)
    return module.train()


def fp32(latents):
    """Latents (a joint model's dict of them) in fp32, as fvx's loss takes them."""
    return {name: x.float() for name, x in latents.items()} if isinstance(latents, dict) else latents.float()


def baseline_draws(config, model, batch, state, step: int):
    """The noise, sigma and t that fvx's step ``step`` draws, for the baseline to use: per-sample noise (a dict for a
    joint model), the levels from the model's own sampler when it has one, else from the method's density; and the
    cond, corrupted as the family's trainer corrupts it (Helios's memory) from the same draws."""
    key = random.fold_in(state.key, step)
    x0 = model.normalize(fp32(batch["latents"]))
    joint = isinstance(x0, dict)
    shapes = {name: tuple(x.shape[1:]) for name, x in x0.items()} if joint else tuple(x0.shape[1:])
    device = x0["video"].device if joint else x0.device
    noise, t_keys = flow.per_sample_noise(key, batch["sample_index"], shapes, device)
    sigma, t = finetune.draw_sigmas(t_keys, x0, model=model, config=config)
    cond = batch["cond"]
    if model.rules.corrupt_cond is not None:
        cond = model.rules.corrupt_cond(torch.vmap(lambda k: random.fold_in(k, finetune.CORRUPT_STREAM))(t_keys), cond)
    return noise, sigma, t, cond


def mse(v, noise, x0, weight=None) -> torch.Tensor:
    """The flow-matching loss: mean squared error of ``v`` against ``noise - x0``, summed over a joint model's
    modalities; with the model's per-sample ``weight [B]`` (CogVideoX's), their weighted mean."""
    if isinstance(v, dict):
        return sum(mse(v[name], noise[name], x0[name]) for name in v)
    error = (v.float() - (noise - x0)) ** 2
    return torch.mean(error) if weight is None else torch.mean(weight * error.flatten(1).mean(1))


def update(module, optimizer, loss: torch.Tensor) -> torch.Tensor:
    """``loss.backward()``, clip the global norm to 1, AdamW: the end of the baseline's step."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0, foreach=True)
    optimizer.step()
    return loss.detach()


def baseline_step(case: str, model, module, optimizer, batch, draws) -> torch.Tensor:
    """``module.forward`` with the family's arguments, ``loss.backward()``, clip, AdamW: the eager PyTorch loop."""
    noise, sigma, t, cond = draws
    config = model_config(case)
    x0 = model.normalize(fp32(batch["latents"]))
    x_t = flow.add_noise(x0, noise, sigma)
    optimizer.zero_grad(set_to_none=True)
    kwargs, x = fvx_build.native_inputs(config, x_t, t, cond)
    v = fvx_build.velocity(config, module(**kwargs), x, t, cond)
    weight = None if model.rules.loss_weight is None else model.rules.loss_weight(sigma)
    return update(module, optimizer, mse(v, noise, x0, weight))


# ------------------------------------------------------------------------ LTX-2 training both branches (bench only)


def ltx2_audio_shape(case: str) -> tuple[int, int, int]:
    """The audio latents ``[C, A, M]`` of the clip an LTX-2 case's video latents come from: ``A`` from its duration
    (``(T - 1) s + 1`` frames at the config's fps; sampling rate / hop / audio scale latents a second, as
    ``LTX2Pipeline`` counts them), ``C`` the audio latent channels, ``M`` the mel bins the DiT packs beside them."""
    config, (_, frames, _, _), _ = CASES[case]
    k = config.spec.kwargs
    seconds = ((frames - 1) * k["vae_scale_factors"][0] + 1) / config.fps
    count = round(seconds * k["audio_sampling_rate"] / k["audio_hop_length"] / k["audio_scale_factor"])
    channels = config.spec.options["audio_latents"].channels
    return channels, count, k["audio_in_channels"] // channels


def both_branches_batch(case: str, batch: dict) -> dict:
    """``batch`` with audio latents ``[B, C, A, M]`` (:func:`ltx2_audio_shape`) and the audio stream's text ``[B, L,
    width]`` (LTX-2.0: the caption embedding the video stream takes too; LTX-2.3: a normal one of its own width)."""
    config, g = CASES[case][0], torch.Generator().manual_seed(1)
    size = len(batch["sample_index"])
    text = batch["cond"]["text"]
    if text.shape[-1] != ltx2.audio_text_width(config):
        text = torch.randn(*text.shape[:2], ltx2.audio_text_width(config), generator=g)
    return {**batch, "audio_latents": torch.randn(size, *ltx2_audio_shape(case), generator=g), "audio_text": text}


def both_branches_step(case: str, model, module, optimizer, batch, draws, step: int) -> torch.Tensor:
    """The baseline step of LTX-2 training both branches: audio latents noised at the video's level (audio noise
    from fvx key ``fold_in(key(1), step)``), ``LTX2Pipeline``'s joint forward (a2v / v2a attention on), and the
    sum of the video's and the audio's mean squared errors (the audio's over its packed ``[B, A, C M]`` tokens)."""
    noise, sigma, t, _ = draws
    config = model_config(case)
    x0, a0 = model.normalize(fp32(batch["latents"])), batch["audio_latents"]
    audio_noise = random.normal(random.fold_in(random.key(1), step), tuple(a0.shape))
    x_t, a_t = flow.add_noise(x0, noise, sigma), flow.add_noise(a0, audio_noise, sigma)
    pack = lambda a: a.transpose(1, 2).flatten(2, 3)  # noqa: E731  [B, C, A, M] -> [B, A, C M], as LTX2Pipeline
    optimizer.zero_grad(set_to_none=True)
    kwargs, x = fvx_build.native_inputs(config, x_t, t, batch["cond"])
    kwargs.update(audio_hidden_states=pack(a_t), audio_encoder_hidden_states=batch["audio_text"],
                  audio_encoder_attention_mask=batch["cond"]["text_mask"], audio_num_frames=a0.shape[2],
                  isolate_modalities=False)
    out = module(**kwargs)
    v = fvx_build.velocity(config, out, x, t, batch["cond"])
    return update(module, optimizer, mse(v, noise, x0) + mse(out[1], pack(audio_noise), pack(a0)))


def run_case(case: str, repeats: int) -> dict:
    # dynamo caches per code object: diffusers wraps every family's forward in one decorator (peft_utils' wrapper), so
    # without a reset the ninth family's torch.compile(module) hits recompile_limit and its peer silently runs eager
    torch._dynamo.reset()
    model, config, program, state, module, optimizer, batch = build(case)
    compiled = build(case, compile="blocks")[2]
    whole = None if model_config(case).family.architecture.whole_graph_refusal else build(case, compile="model")[2]
    peer = torch.compile(baseline_module(case, program, state))
    peer_optimizer = torch.optim.AdamW([p for p in peer.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.01,
                                       foreach=True)
    holder = {"fvx": state, "fvx_blocks": compiled.init(random.key(0))}
    first_fvx = program.step_(holder["fvx"], held(program), batch)
    holder["fvx"] = first_fvx[0]
    first_base = baseline_step(case, model, module, optimizer, batch, baseline_draws(config, model, batch, state, 0))
    agree = abs(first_fvx[1]["loss"].item() - first_base.item())

    def fvx_step(name, prog):
        frozen = held(prog)

        def step():
            holder[name], metrics = prog.step_(holder[name], frozen, batch)
            metrics["loss"].item()
        return step

    def base_step(net, opt):
        def step():
            draws = baseline_draws(config, model, batch, holder["fvx"], int(holder["fvx"].step))
            baseline_step(case, model, net, opt, batch, draws)
        return step

    steps = {"fvx": fvx_step("fvx", program), "fvx_blocks": fvx_step("fvx_blocks", compiled),
             "baseline": base_step(module, optimizer), "compiled": base_step(peer, peer_optimizer)}
    if whole is not None:  # (a family whose forward is not one graph refuses compile=model)
        holder["fvx_model"] = whole.init(random.key(0))
        steps["fvx_model"] = fvx_step("fvx_model", whole)
    times = {"fvx_model": float("nan"), **alternate(steps, repeats=repeats, warmup=2)}
    return {"case": case, "tokens": video_tokens(model, batch), "batch": len(batch["sample_index"]),
            "loss_diff_step0": agree, **times}


MEMORY_VARIANTS = ("fvx", "baseline", "both")  # both: LTX-2's bench-only baseline training both branches


def peak_memory(case: str, variant: str, steps: int) -> float:
    """Peak resident MB above the process's memory after setup, over ``steps`` steps of one variant (``both``: the
    baseline module training every param on LTX-2's joint step, :func:`both_branches_step`)."""
    if variant not in MEMORY_VARIANTS:
        raise ValueError(f"variant={variant!r}: allowed {', '.join(MEMORY_VARIANTS)}")
    model, config, program, state, module, optimizer, batch = build(case, train_all=variant == "both")
    if variant == "fvx":
        del module, optimizer
    if variant == "both":
        batch = both_branches_batch(case, batch)
    base = current_rss_bytes()
    frozen = held(program)
    for step in range(steps):
        if variant == "fvx":
            state, _ = program.step_(state, frozen, batch)
        elif variant == "baseline":
            baseline_step(case, model, module, optimizer, batch, baseline_draws(config, model, batch, state, step))
        else:
            both_branches_step(case, model, module, optimizer, batch,
                               baseline_draws(config, model, batch, state, step), step)
    return (peak_rss_bytes() - base) / 2**20


def measure_memory(case: str, variant: str, threads: int | None) -> float:
    """:func:`peak_memory` of one variant in a fresh subprocess."""
    cmd = [sys.executable, __file__, "--memory", case, variant]
    if threads:
        cmd += ["--threads", str(threads)]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def print_both_branches(rows: dict[str, dict[str, float]]) -> None:
    """The LTX-2 memory table: fvx's frozen-audio step and the baseline's beside the baseline training both
    branches (``rows``: case -> variant -> peak MB)."""
    print("\nLTX-2 peak memory (MB above setup, 3 steps, each variant in a fresh process): the audio branch frozen "
          "(fvx, base) vs the baseline training both branches (both: every param, joint forward and loss)")
    print(f"{'case':14} {'audio A':>7} {'fvx MB':>8} {'base MB':>8} {'both MB':>8} {'fvx/both':>8} {'base/both':>9}")
    for case, mem in rows.items():
        print(f"{case:14} {ltx2_audio_shape(case)[1]:7d} {mem['fvx']:8.1f} {mem['baseline']:8.1f} "
              f"{mem['both']:8.1f} {mem['fvx'] / mem['both']:8.2f} {mem['baseline'] / mem['both']:9.2f}")


# ------------------------------------------------------------------------------------------------ processes


def rank_slice(batch: dict, rank: int, world: int) -> dict:
    """Rank ``rank``'s contiguous rows of the global batch (as fvx.data.batching.batch_at splits it)."""
    local = len(batch["sample_index"]) // world
    rows = slice(rank * local, (rank + 1) * local)
    return {name: {k: v[rows] for k, v in value.items()} if isinstance(value, dict) else value[rows]
            for name, value in batch.items()}


def peak_steps(step, repeats: int) -> dict:
    """Step-0 loss of ``step()`` (which returns its loss) and peak resident MB over ``repeats`` steps after 2 warm-up
    steps (the peak reset after the warm-up)."""
    loss0 = step()
    step()
    gc.collect()
    reset_peak_rss()
    for _ in range(repeats):
        step()
    return {"loss0": loss0, "peak_mb": peak_rss_bytes() / 2**20}


def fvx_stepper(program, state, batch: dict):
    """``(step, state_mb)``: one step of ``program`` from ``state`` on ``batch`` (returns its loss), and MB of params
    + AdamW state held (beside what the program holds frozen, :func:`held`)."""
    holder, frozen = {"state": state}, held(program)

    def step():
        holder["state"], metrics = program.step_(holder["state"], frozen, batch)
        return metrics["loss"].item()

    return step, lambda: sharding.local_bytes(holder["state"].roles) / 2**20


def fsdp2_stepper(case: str, batch_size: int, d, reshard_after_forward: bool = True):
    """The peer of the sharded fvx step, as :func:`fvx_stepper`: the diffusers module with FSDP2 ``fully_shard`` on
    every unit and the root (one 1-D mesh of all ranks; ``reshard_after_forward`` as given), ``loss.backward()``,
    ``clip_grad_norm_``, AdamW foreach; the same initial params and draws as fvx's step on this rank's slice."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fvx_models import build as fbuild

    model, config, program, state, batch = build_fvx(case, "none", None, batch_size)
    module = baseline_module(case, program, state)
    mesh = init_device_mesh("cpu", (d.world,))
    for units in fbuild.unit_groups(model_config(case).family, module).values():
        for prefix in units:
            fully_shard(module.get_submodule(prefix[:-1]), mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.01,
                                  foreach=True)
    local = rank_slice(batch, d.rank, d.world)
    holder = {"step": 0}

    def step():
        draws = baseline_draws(config, model, local, state, holder["step"])
        loss = baseline_step(case, model, module, optimizer, local, draws)
        holder["step"] += 1
        return float(loss)

    return step, lambda: sum(p.to_local().numel() * 12 for p in module.parameters()) / 2**20


def process_steppers(case: str, batch_size: int, sp: int, d) -> dict:
    """name -> a zero-argument builder of that variant's :func:`fvx_stepper` (or FSDP2's) in this process."""
    meshes = {"": processes.make_mesh() if d.world > 1 else None}
    if sp > 1 and d.world > 1:
        meshes[f"_sp{sp}"] = processes.make_mesh(sp=sp)
    builders = {}
    for suffix, mesh in meshes.items():
        rank, world = processes.data_rank(mesh, d.rank, d.world)
        variants = {**VARIANTS, **(KEEP_VARIANTS if d.world > 1 and not suffix else {})}
        for name, compile in variants.items():
            def make(compile=compile, mesh=mesh, rank=rank, world=world, keep=name in KEEP_VARIANTS):
                _, _, program, state, batch = build_fvx(case, compile, mesh, batch_size, reshard_after_forward=not keep)
                return fvx_stepper(program, state, rank_slice(batch, rank, world))
            builders[name + suffix] = make
    if d.world > 1:
        builders["fsdp2"] = lambda: fsdp2_stepper(case, batch_size, d)
        builders["fsdp2_keep"] = lambda: fsdp2_stepper(case, batch_size, d, reshard_after_forward=False)
        builders.update(floor_steppers(case, batch_size, d))
    return builders


def floor_steppers(case: str, batch_size: int, d) -> dict:
    """The two bounds of a sharded step: ``fvx_blocks_local``, the same compiled step on this rank's slice with the
    full params and no communication (the compute floor with every rank busy), and ``collectives``, the sharded
    step's traffic alone (its 2 all-gathers and 1 reduce-scatter of every param: forward, backward regather,
    gradients), as one flat buffer each, no compute."""
    def local():
        _, _, program, state, batch = build_fvx(case, "blocks", None, batch_size)
        return fvx_stepper(program, state, rank_slice(batch, d.rank, d.world))

    def collectives():
        state = build_fvx(case, "none", processes.make_mesh(), batch_size)[3]
        shard = torch.ones(sharding.local_bytes(state.roles["student"].params) // 4)
        full, grads = torch.empty(shard.numel() * d.world), torch.ones(shard.numel() * d.world)

        def step():
            for _ in range(2):
                torch.distributed.all_gather_into_tensor(full, shard)
            torch.distributed.reduce_scatter_tensor(shard, grads)
            return 0.0
        return step, lambda: 0.0  # holds no training state

    return dict(zip(FLOORS, (local, collectives)))


def measure_process(case: str, repeats: int, batch_size: int, sp: int = 1) -> dict:
    """Each variant in this process, on its part of the global batch of ``batch_size``: built alone for its step-0
    loss, peak memory (:func:`peak_steps`) and state, then all built together and timed in turn (a, b, c, a, ...) so
    drift on a shared machine hits all alike. Under torchrun's environment (WORLD_SIZE, ...) the params are sharded
    over all processes; with ``sp`` > 1 also under sequence parallelism over groups of ``sp`` ranks (variants
    ``<name>_sp<sp>``)."""
    d = processes.init_distributed()
    builders = process_steppers(case, batch_size, sp, d)
    out = {}
    for name, make in builders.items():
        step, state_mb = make()
        out[name] = {**peak_steps(step, repeats), "state_mb": state_mb()}
        del step, state_mb
        gc.collect()
    steps = {name: make()[0] for name, make in builders.items()}
    for name, seconds in alternate(steps, repeats=repeats, warmup=2).items():
        out[name]["step_s"] = seconds
    if d.world > 1:
        torch.distributed.destroy_process_group()
    return out


def run_processes(case: str, repeats: int, batch_size: int, world: int, threads: int | None, sp: int = 1
                  ) -> list[dict]:
    """:func:`measure_process` in ``world`` fresh processes (gloo when more than one), each rank's result."""
    cmd = [sys.executable, __file__, "--process", case, "--repeats", str(repeats), "--batch", str(batch_size),
           "--sp", str(sp)]
    if threads:
        cmd += ["--threads", str(threads)]
    env = {key: value for key, value in os.environ.items() if key not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    port = free_port()
    procs = []
    for rank in range(world):
        rank_env = env if world == 1 else {**env, "WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank),
                                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                           "OMP_NUM_THREADS": str(threads or 1)}
        procs.append(subprocess.Popen(cmd, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for rank, proc in enumerate(procs):
        stdout, stderr = proc.communicate(timeout=600)
        if proc.returncode:
            raise RuntimeError(f"bench process {rank} of {world} failed:\n{stderr[-3000:]}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


def print_processes(repeats: int, threads: int | None, sp: int = 1, cases: tuple[str, ...] = DIST_CASES) -> None:
    """The 1-process vs WORLD-process table of every case, on its global batch rounded up to a multiple of WORLD."""
    print(f"\nfvx step on the same global batch: 1 process ({threads or torch.get_num_threads()} threads) vs "
          f"{WORLD} gloo processes (1 thread each, sharded); median of {repeats} steps; MB: peak RSS over the steps "
          "(after 2 warm-up steps), and params + AdamW state held")
    ranks = range(WORLD)
    print(f"{'case':10} {'variant':14} {'B':>2} {'1p ms':>7} " + " ".join(f"{f'r{r} ms':>7}" for r in ranks)
          + f" {'1p MB':>7} " + " ".join(f"{f'r{r} MB':>7}" for r in ranks)
          + f" {'1p state':>8} " + " ".join(f"{f'r{r} state':>8}" for r in ranks) + f" {'|dloss| 0':>9}")
    for case, (_, _, case_batch) in CASES.items():
        if case not in cases:
            continue
        batch_size = -(-case_batch // WORLD) * WORLD
        (single,) = run_processes(case, repeats, batch_size, 1, threads)
        multi = run_processes(case, repeats, batch_size, WORLD, 1, sp)
        with_sp = (*VARIANTS, *(f"{name}_sp{sp}" for name in VARIANTS)) if sp > 1 else tuple(VARIANTS)
        for name in (*with_sp, "fsdp2", *KEEP_VARIANTS, "fsdp2_keep", *FLOORS):
            if name.startswith("fsdp2") or name == "collectives":  # runs sharded only: 1-process column repeats fvx's
                one = single["fvx"]
            else:  # an SP, keep or local variant's 1-process column repeats its variant's (one process has none)
                one = single[name.split("_sp")[0].removesuffix("_keep").removesuffix("_local")]
            peer = "fsdp2_keep" if name in KEEP_VARIANTS else "fsdp2"
            per_rank = [m[name] for m in multi]
            print(f"{case:10} {name:14} {batch_size:2d} {one['step_s'] * 1e3:7.1f} "
                  + " ".join(f"{r['step_s'] * 1e3:7.1f}" for r in per_rank)
                  + f" {one['peak_mb']:7.1f} " + " ".join(f"{r['peak_mb']:7.1f}" for r in per_rank)
                  + f" {one['state_mb']:8.2f} " + " ".join(f"{r['state_mb']:8.2f}" for r in per_rank)
                  + (f" {'-':>9}" if name in FLOORS else f" {abs(per_rank[0]['loss0'] - one['loss0']):9.2e}")
                  + ("" if name.startswith("fsdp2") or name == "collectives" else
                     f"   vs {peer} {per_rank[0]['step_s'] / multi[0][peer]['step_s']:.2f}x"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-dist", action="store_true", help="leave out the 1- vs 2-process table")
    parser.add_argument("--sp", type=int, default=1, help="also time the 2-process step under sequence parallelism")
    parser.add_argument("--cases", default=None, help="comma-separated cases to run (default: all)")
    parser.add_argument("--dist-only", action="store_true", help="only the 1- vs 2-process table")
    parser.add_argument("--memory", nargs=2, metavar=("CASE", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--process", metavar="CASE", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory:
        print(json.dumps(peak_memory(*args.memory, steps=3)))
        return
    if args.process:
        print(json.dumps(measure_process(args.process, args.repeats, args.batch, args.sp)))
        return
    cases = tuple(CASES) if args.cases is None else tuple(args.cases.split(","))
    unknown = [case for case in cases if case not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; valid: {', '.join(CASES)}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats} alternating steps")
    if not args.dist_only:
        print(f"{'case':14} {'tokens':>6} {'B':>2} {'base ms':>8} {'fvx ms':>8} {'ratio':>6} {'blocks ms':>9} "
              f"{'ratio':>6} {'model ms':>8} {'ratio':>6} {'compile ms':>10} {'blocks/compile':>14} "
              f"{'model/compile':>13} {'base MB':>8} {'fvx MB':>8} {'ratio':>6} "
              f"{'|dloss| step 0':>14}")
    both = {}
    for case in () if args.dist_only else cases:
        row = run_case(case, args.repeats)
        mem = {variant: measure_memory(case, variant, args.threads) for variant in ("fvx", "baseline")}
        if isinstance(CASES[case][0], LTX2Config):
            both[case] = {**mem, "both": measure_memory(case, "both", args.threads)}
        base = row["baseline"]
        print(f"{case:14} {row['tokens']:6d} {row['batch']:2d} {base * 1e3:8.1f} {row['fvx'] * 1e3:8.1f} "
              f"{row['fvx'] / base:6.2f} {row['fvx_blocks'] * 1e3:9.1f} {row['fvx_blocks'] / base:6.2f} "
              f"{row['fvx_model'] * 1e3:8.1f} {row['fvx_model'] / base:6.2f} "
              f"{row['compiled'] * 1e3:10.1f} {row['fvx_blocks'] / row['compiled']:14.2f} "
              f"{row['fvx_model'] / row['compiled']:13.2f} {mem['baseline']:8.1f} {mem['fvx']:8.1f} "
              f"{mem['fvx'] / mem['baseline']:6.2f} "
              f"{row['loss_diff_step0']:14.2e}")
    if both:
        print_both_branches(both)
    if not args.skip_dist:
        # named cases run there too (but those it refuses, said once); by default the table is Wan's two
        for case in (case for case in cases if args.cases and case in DIST_REFUSED):
            print(f"\n{case} is left out of the 2-process table: {DIST_REFUSED[case]}")
        dist = tuple(case for case in cases if case not in DIST_REFUSED) if args.cases else DIST_CASES
        print_processes(args.repeats, args.threads, args.sp, dist)


if __name__ == "__main__":
    main()
