"""LTX-2 (LTX-2.0 and LTX-2.3, diffusers ``LTX2VideoTransformer3DModel``), trained video-only: the family's spec.

An audio-video DiT: every block runs a video stream and an audio stream side by side (self-attention, text
cross-attention, FFN each) and joins them by audio-to-video and video-to-audio cross-attention. fvx trains it as
FastVideo's LTX-2 recipes do (``fastvideo/train/models/ltx2/ltx2.py``): on video only, the audio branch and the
cross-modal attention frozen. The forward is the one ``LTX2Pipeline`` runs for its modality-isolated guidance pass
(``isolate_modalities=True``: no a2v/v2a attention), so the video output does not depend on the audio stream at all;
the audio stream gets the smallest input the DiT takes (one zero audio latent frame and one zero text token), which it
processes and discards. The audio branch is declared as the ``"audio"`` modality (:data:`AUDIO_PATTERNS`): its params
are held frozen, with no optimizer state, and exported as loaded. ``train_audio=True`` is refused.

Tokens. Patch size 1: every latent voxel is a token. The family declares the channels-last layout ``"BTHWC"`` and
flattens ``[B, T, H, W, C]`` to ``[B, T H W, C]`` as ``LTX2Pipeline._pack_latents`` does; the DiT is told the latent
grid (``num_frames``, ``height``, ``width``) and the frame rate ``fps`` (``LTX2Config.fps``, default 24, FastVideo's
and the pipeline's): its RoPE places latent frame ``f`` at the middle of pixel frames ``[max(8 f - 7, 0), 8 f + 1)``
over ``fps`` seconds, so the frame rate changes the output. Timesteps go in as ``LTX2Pipeline`` passes them:
``timestep = sigma = t`` ``[B]`` on 0..1000 (its scheduler's ``1000 sigma``; LTX-2.3's prompt modulation reads
``sigma``), ``use_cross_timestep`` per version (False for 2.0, True for 2.3; it only matters for the a2v/v2a
modulation, which the isolated forward skips).

Velocity, not x0 (the issue's "x0 -> velocity" item). diffusers' ``LTX2VideoTransformer3DModel`` predicts the flow
velocity ``noise - x0``: ``LTX2Pipeline`` turns its output into x0 with ``convert_velocity_to_x0`` (``x_t - sigma v``)
for its guidance and steps ``FlowMatchEulerDiscreteScheduler`` on it. FastVideo's own LTX-2 DiT wrapper instead returns
the denoised x0 (its ``predict_noise`` converts back with ``v = (x_t - x0) / sigma`` in fp32). fvx runs diffusers'
class, so its output is taken as the velocity as it is: no conversion, and no division by a small sigma.

Conditioning: the text embedding after LTX-2's text connector (Gemma-3 features through ``LTX2TextConnectors``), as
FastVideo's LTX-2 data stores it: ``text [B, L, D]`` with ``text_mask [B, L]``, L = 1024 (the pipeline's and
FastVideo's Gemma ``max_sequence_length``). The connector replaces padding by learned registers, so its mask is all
ones. D depends on the version: LTX-2.0's connector gives 3840-wide embeddings that the DiT projects
(``caption_projection``, ``use_prompt_embeddings``) to its 4096; LTX-2.3's gives the DiT's own 4096 (per-modality
projections in the connector, none in the DiT). A batch of the other width is a one-line error. fvx's preprocessing
(:data:`ENCODERS`) stores it so: ``LTX2Pipeline.encode_prompt`` through the pipeline's connectors, all 1024 rows.

Latents: the LTX-2 video VAE's 128 channels, 8x32x32 compression, identity statistics: FastVideo's LTX-2 VAE applies
its per-channel statistics inside ``encode``, so its data's latents are already what the DiT takes (FastVideo: "no
normalisation"); fvx's preprocessing stores the same (:data:`ENCODERS`: the posterior mean through the pipeline's
``_normalize_latents``). Training noise levels are FastVideo's (LTX-2 trainer's) stretched shifted logit-normal
(:func:`sigma_sampler`). Exports are ``LTX2Pipeline`` folders (``model_index.json``, ``scheduler/``, ``transformer/``);
copy the VAEs, connectors, vocoder, text encoder and tokenizer from the base model.
"""
from __future__ import annotations

import math
import pathlib
from typing import Any, Mapping

import msgspec
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, LTX2VideoTransformer3DModel
from typing_extensions import Annotated

from fvx.core import random
from fvx.distributed import memory
from fvx_models import diffusers_folder as dfolder, encoders as fencoders, wan
from fvx_models.build import ModelConfig
from fvx_models.family import (Architecture, Checkpoints, Conditioning, Family, Forward, Joint, Modality, Preset,
                               TEXT_MASK_DEFAULT, Training, require, skeleton_of)
from fvx_models.model import LatentSpace

NAME = "ltx2"
CHANNELS = 128  # AutoencoderKLLTX2Video's latent_channels (2.0 and 2.3)
VAE_STRIDE = (8, 32, 32)  # its (temporal, spatial, spatial) compression
TEXT_LEN = 1024  # LTX2Pipeline's max_sequence_length; FastVideo's Gemma text_len (configs/models/encoders/gemma.py)
FPS = 24.0  # LTX2Pipeline's frame_rate; FastVideo's _DEFAULT_ROPE_FPS

VIDEO = LatentSpace(CHANNELS, (0.0,) * CHANNELS, (1.0,) * CHANNELS, vae_stride=VAE_STRIDE, vae="LTX-2")
"""Latents as FastVideo's LTX-2 VAE encodes them (already normalised): identity statistics."""
# The audio VAE (AutoencoderKLLTX2Audio): 8 latent channels over (audio frames, mel bins / 4 = 16); the DiT packs the
# 8 x 16 into its 128 audio_in_channels. Compression (4 in time, 4 in mel; the third entry unused). Only a
# description here: fvx never trains the audio, so no audio latents reach the model.
AUDIO = LatentSpace(8, vae_stride=(4, 4, 1), vae="LTX-2 audio")

# diffusers' scripts/convert_ltx2_to_diffusers.py, get_ltx2_transformer_config("2.0") (model_id Lightricks/LTX-2), and
# the class defaults for the arguments it leaves out (ff_bias, audio_ff_bias, use_prompt_adaln_single,
# use_keyframes_abs_pos_embedding: set only for LTX-2.5). FastVideo's LTX2VideoArchConfig agrees (32 x 128 heads, 48
# layers, caption 3840, audio 32 x 64, split RoPE, max positions (20, 2048, 2048), timestep multiplier 1000).
LTX_2 = dict(
    in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32, attention_head_dim=128,
    cross_attention_dim=4096, vae_scale_factors=(8, 32, 32), pos_embed_max_pos=20, base_height=2048, base_width=2048,
    gated_attn=False, cross_attn_mod=False, audio_in_channels=128, audio_out_channels=128, audio_patch_size=1,
    audio_patch_size_t=1, audio_num_attention_heads=32, audio_attention_head_dim=64, audio_cross_attention_dim=2048,
    audio_scale_factor=4, audio_pos_embed_max_pos=20, audio_sampling_rate=16000, audio_hop_length=160,
    audio_gated_attn=False, audio_cross_attn_mod=False, num_layers=48, activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=3840,
    attention_bias=True, attention_out_bias=True, rope_theta=10000.0, rope_double_precision=True, causal_offset=1,
    timestep_scale_multiplier=1000, cross_attn_timestep_scale_multiplier=1000, rope_type="split",
    use_prompt_embeddings=True, perturbed_attn=False, ff_bias=True, audio_ff_bias=True, use_prompt_adaln_single=True,
    use_keyframes_abs_pos_embedding=False,
)
# The same script's get_ltx2_transformer_config("2.3") (Lightricks/LTX-2.3): gated attention and prompt
# (cross-attention) modulation in both streams, no caption projection in the DiT, the STG-capable attention processor.
LTX_2_3 = {**LTX_2, "gated_attn": True, "cross_attn_mod": True, "audio_gated_attn": True, "audio_cross_attn_mod": True,
           "use_prompt_embeddings": False, "perturbed_attn": True}
# Tiny random models of both versions' structure: video 2 heads of 16, audio 2 heads of 8, caption width 24 (apart
# from every other width, so a mixed-up width fails loudly), 8 video and 8 audio channels.
_TINY = dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
             audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=8,
             audio_cross_attention_dim=16, num_layers=2, caption_channels=24)
TINY = {**LTX_2, **_TINY}
TINY_2_3 = {**LTX_2_3, **_TINY}
TINY_LATENTS = LatentSpace(8, (0.0,) * 8, (1.0,) * 8, vae_stride=VAE_STRIDE, vae="tiny LTX-2")
# The toy world's (fvx.data.toy_world, space-to-depth factor 8: 192 channels, text width 32): the CPU default, 3 layers
# of width 256 (as Wan's world preset)
WORLD = {**TINY, "in_channels": 192, "out_channels": 192, "caption_channels": 32, "num_attention_heads": 4,
         "attention_head_dim": 64, "cross_attention_dim": 256, "num_layers": 3, "vae_scale_factors": (1, 8, 8),
         "base_height": 16, "base_width": 16}  # RoPE's positions in the toy world's pixels, over its 16 x 16 frame
WORLD_LATENTS = LatentSpace(192, vae_stride=(1, 8, 8), vae="toy world space-to-depth (factor 8)")
TINY_AUDIO = LatentSpace(2, vae_stride=(4, 4, 1), vae="tiny LTX-2 audio")

# What one block saves per video token (saved-tensor hooks, bf16, eager, at dims 32, 64 and 128 over 2 x 1024 tokens;
# tests/fvx_models/test_ltx2.py measures it again on the tiny models). As LTX-Video's, the FFN is always 4x the width,
# so compute_ffn is the tanh-GELU's input and output counted from the graph and compute_dim the measured rest (22.0 - 4
# x 2); fp32_dim the measured fp32 vectors (the split RoPE's upcast q and k, the norms': 11.8 at dim 32, 11.6 at 128).
# LTX-2.3's gates and prompt modulation add 4.3 compute vectors (26.3 measured), and its blocks modulate the text too
# (per text token, which a per-video-token figure leaves out: L x dim per block, small beside the video's).
BLOCK_ACTIVATIONS = memory.BlockActivations(fp32_dim=11.6, compute_dim=14.0, compute_ffn=2.0)
BLOCK_ACTIVATIONS_2_3 = memory.BlockActivations(fp32_dim=11.6, compute_dim=18.3, compute_ffn=2.0)

# diffusers' convert_ltx2_to_diffusers.py writes this scheduler into a (non-distilled) LTX-2.0 or LTX-2.3 pipeline:
# mu from the token count between 1024 and 4096 tokens, stretched to end at 0.1
SCHEDULER = dict(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
                 max_image_seq_len=4096, shift_terminal=0.1)
_V2_0 = {"use_cross_timestep": False, "vocoder": "LTX2Vocoder", "audio_latents": AUDIO}
_V2_3 = {"use_cross_timestep": True, "vocoder": "LTX2VocoderWithBWE", "audio_latents": AUDIO,
         "activations": {"transformer_blocks": BLOCK_ACTIVATIONS_2_3}}

PRESETS: dict[str, Preset] = {
    "tiny": Preset(TINY, TINY_LATENTS, 8, {**_V2_0, "audio_latents": TINY_AUDIO}),
    "tiny-2.3": Preset(TINY_2_3, TINY_LATENTS, 8, {**_V2_3, "audio_latents": TINY_AUDIO}),
    "world": Preset(WORLD, WORLD_LATENTS, 4, {**_V2_0, "audio_latents": TINY_AUDIO}),
    "ltx-2": Preset(LTX_2, VIDEO, TEXT_LEN, _V2_0),
    "ltx-2.3": Preset(LTX_2_3, VIDEO, TEXT_LEN, _V2_3),
}
"""``LTX2VideoTransformer3DModel`` constructor arguments per preset (every one), the video latent space, the text
length, and per version: ``use_cross_timestep`` as ``LTX2Pipeline`` sets it, the pipeline's vocoder class and the audio
latent space (:data:`AUDIO`), and LTX-2.3's block activations."""

AUDIO_PATTERNS = ("audio", "a2v", "v2a", "av_ca", "av_cross_attn")
"""Name fragments of the audio branch and the cross-modal machinery: FastVideo's (``audio``, ``a2v``, ``v2a``,
``av_ca``) and ``av_cross_attn``, diffusers' spelling of FastVideo's ``av_ca`` (``av_cross_attn_video_scale_shift`` is
FastVideo's ``av_ca_video_scale_shift_adaln_single``: the a2v/v2a modulation of the video stream, which no other
fragment catches)."""


# LTX-2 trainer's timestep sampler (FastVideo's _sample_ltx2_sigmas): mu linear in the token count through
# (1024, 0.95) and (4096, 2.05), unclamped; samples stretched between the normal's 0.5% and 99.9% quantiles
SHIFT_TOKENS = (1024.0, 4096.0)
SHIFT_MU = (0.95, 2.05)
Z_LO, Z_HI = -2.5758, 3.0902
SIGMA_EPS = 1e-3


# ----------------------------------------------------------------------------------------------------- noise levels


def shift_mu(tokens: float) -> float:
    """The logit-normal's centre for ``tokens`` video tokens: linear through (1024, 0.95) and (4096, 2.05)."""
    slope = (SHIFT_MU[1] - SHIFT_MU[0]) / (SHIFT_TOKENS[1] - SHIFT_TOKENS[0])
    return slope * tokens + SHIFT_MU[0] - slope * SHIFT_TOKENS[0]


def stretched_sigma(normal: torch.Tensor, tokens: float) -> torch.Tensor:
    """The LTX-2 trainer's noise level from standard normals ``normal [B]`` at ``tokens`` tokens: ``s = sigmoid(normal +
    mu)`` stretched so that ``sigmoid(mu + Z_LO)`` maps to 0 and ``sigmoid(mu + Z_HI)`` to 1, values below ``eps``
    reflected to ``2 eps - raw``, clamped to [0, 1]. fp32 ``[B]``."""
    mu = shift_mu(tokens)
    s = torch.sigmoid(normal.float() + mu)
    lo, hi = torch.sigmoid(torch.tensor(mu + Z_LO)), torch.sigmoid(torch.tensor(mu + Z_HI))
    raw = (s - lo.to(s.device)) / (hi - lo).to(s.device)
    return torch.where(raw >= SIGMA_EPS, raw, 2 * SIGMA_EPS - raw).clamp(0.0, 1.0)


def sigma_sampler(config: LTX2Config, keys: torch.Tensor, x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Training noise levels of latents ``x0 [B, C, T, H, W]`` from per-sample keys ``keys [B, 2]``: each key split in
    three (a normal, a coin, a uniform); the stretched shifted logit-normal at the latents' token count, replaced by
    U(eps, 1) where the coin falls below ``timestep_uniform_prob``. Returns ``(sigma [B], t = 1000 sigma [B])`` fp32;
    a sample's draw depends on its own key only."""
    device = x0.device
    parts = torch.vmap(lambda k: random.split(k, 3))(keys.to(device))  # [B, 3, 2]
    k = config.spec.kwargs
    tokens = math.prod(x0.shape[2:]) / (k["patch_size_t"] * k["patch_size"] ** 2)
    sigma = stretched_sigma(random.normal_each(parts[:, 0]), tokens)
    coin = torch.vmap(lambda key: random.uniform(key, ()))(parts[:, 1])
    uniform = torch.vmap(lambda key: random.uniform(key, (), minval=SIGMA_EPS, maxval=1.0))(parts[:, 2])
    sigma = torch.where(coin < config.timestep_uniform_prob, uniform, sigma)
    return sigma, sigma * 1000.0


# ---------------------------------------------------------------------------------------------------------- the DiT


def text_width(config: ModelConfig) -> int:
    """The width of the text embedding the DiT takes: the caption width when it projects captions (LTX-2.0), else its
    cross-attention width (LTX-2.3: the connector's output is already the DiT's)."""
    k = config.spec.kwargs
    return k["caption_channels"] if k["use_prompt_embeddings"] else k["cross_attention_dim"]


def audio_text_width(config: ModelConfig) -> int:
    """The width of the audio stream's text input: the caption width when projected, else the audio cross width."""
    k = config.spec.kwargs
    return k["caption_channels"] if k["use_prompt_embeddings"] else k["audio_cross_attention_dim"]


def cond_spec(config: ModelConfig) -> dict[str, tuple]:
    return {"text": ("L", text_width(config)), "text_mask": ("L",)}


def cond_from_batch(config: ModelConfig, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The connector's text embedding and its mask; a ValueError when its width is the other LTX-2 version's."""
    require(batch, ("text", "text_mask"), NAME, "the LTX-2 text connector's embedding and its mask")
    text, width = batch["text"], text_width(config)
    if isinstance(text, torch.Tensor) and text.dim() == 3 and text.shape[-1] != width:
        raise ValueError(f"{NAME}: the batch's text embedding is {text.shape[-1]} wide, but preset {config.preset!r} "
                         f"takes {width}: LTX-2.0 data stores the connector's 3840-wide embeddings, LTX-2.3 data its "
                         "4096-wide video embeddings; preprocess the data with the text stack of the model trained")
    return {"text": text, "text_mask": batch["text_mask"]}


def inputs(config: LTX2Config, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """``x [B, T, H, W, C]`` as the token sequence ``[B, T H W, C]``, with what ``LTX2Pipeline`` passes beside it for
    a modality-isolated forward: one zero audio frame ``[B, 1, audio_in_channels]`` and one zero audio text token."""
    batch, frames, height, width, channels = x.shape
    k = config.spec.kwargs
    return {"hidden_states": x.reshape(batch, frames * height * width, channels),
            "audio_hidden_states": x.new_zeros(batch, 1, k["audio_in_channels"]),
            "encoder_hidden_states": cond["text"],
            "audio_encoder_hidden_states": x.new_zeros(batch, 1, audio_text_width(config)),
            "timestep": t, "sigma": t, "encoder_attention_mask": cond["text_mask"],
            "num_frames": frames, "height": height, "width": width, "fps": config.fps, "audio_num_frames": 1,
            "isolate_modalities": True, "use_cross_timestep": config.spec.options["use_cross_timestep"],
            "return_dict": False}


def output(config: ModelConfig, out: Any, x: torch.Tensor, t: torch.Tensor,
           cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The video token sequence ``[B, T H W, C]`` back as ``x``'s ``[B, T, H, W, C]`` (a velocity as it is)."""
    return out[0].reshape(x.shape)


def widths(config: ModelConfig) -> tuple[int, dict[str, tuple[int, int]]]:
    k = config.spec.kwargs
    dim = k["num_attention_heads"] * k["attention_head_dim"]
    return dim, {"transformer_blocks": (dim, 4 * dim)}  # diffusers' FeedForward default: 4x the width


def owns_audio(name: str) -> bool:
    """Whether param ``name`` belongs to the audio branch or the audio<->video cross-attention."""
    return any(fragment in name for fragment in AUDIO_PATTERNS)


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``LTX2Pipeline`` files beside the exported ``transformer/``: ``model_index.json`` (the version's
    vocoder) and ``scheduler/`` (as diffusers' conversion script writes it). The VAEs, connectors, vocoder, text encoder
    and tokenizer are the base model's: copy them from it."""
    FlowMatchEulerDiscreteScheduler(**SCHEDULER).save_config(folder / "scheduler")
    dfolder.write_model_index(
        folder, "LTX2Pipeline",
        {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
         "transformer": ("diffusers", "LTX2VideoTransformer3DModel"), "vae": ("diffusers", "AutoencoderKLLTX2Video"),
         "audio_vae": ("diffusers", "AutoencoderKLLTX2Audio"), "connectors": ("diffusers", "LTX2TextConnectors"),
         "vocoder": ("diffusers", config.spec.options["vocoder"]),
         "text_encoder": ("transformers", "Gemma3ForConditionalGeneration"),
         "tokenizer": ("transformers", "GemmaTokenizerFast"),
         "processor": (None, None), "prompt_enhancer": (None, None), "duration_head": (None, None)})


# FastVideo's LTX-2 NVFP4 deployment set (fastvideo/layers/quantization/nvfp4_config.py,
# _LTX2_NVFP4_BLOCK_LINEAR_SUFFIXES) in diffusers' names: its ``ffn.fc_in``/``fc_out`` are ``ff.net.0.proj``/``ff.net.2``,
# its ``to_out`` is ``to_out.0``; 12 linears a block, 576 on the 48 blocks. Its ``adaln_single.linear`` is listed but is
# a torch.nn.Linear there, which the QAT config never quantizes (it takes only its LinearBase layers), so it is left out.
NVFP4_LINEARS = tuple(f"transformer_blocks.*.{suffix}" for suffix in (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_out.0",
    "audio_to_video_attn.to_q", "audio_to_video_attn.to_out.0", "video_to_audio_attn.to_k",
    "video_to_audio_attn.to_v", "ff.net.0.proj", "ff.net.2"))


def _unscaled_normal(key: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """diffusers' init of the prompt and a2v/v2a modulation tables: N(0, 1)."""
    return random.normal(key, shape)


# ------------------------------------------------------------------------------------------------------- encoders

N_FFT = 1024  # LTX-2's audio STFT size (FastVideo's AudioEncoder n_fft, stft filter_length): not in diffusers' config
LOG_FLOOR = 1e-5  # the mel magnitudes' floor before the log (FastVideo's AudioProcessor)
RESAMPLE_ZEROS, RESAMPLE_ROLLOFF = 6, 0.99  # the windowed-sinc resampler's half-width (zero crossings) and cutoff


def encode_text(pipe: Any, prompts: list[str]) -> list[torch.Tensor]:
    """Gemma-3's stacked hidden states at 1024 left-padded tokens (``LTX2Pipeline.encode_prompt``, no CFG) through the
    text connectors as ``LTX2Pipeline.__call__`` runs them: each prompt's video-stream embedding ``[L_i, D]`` (D 3840
    for LTX-2.0, 4096 for 2.3) cut by the connector's mask, which is all ones when it has learnable registers (the
    released ones: every 1024 rows kept, padding replaced by registers)."""
    embeds, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=TEXT_LEN,
                                            device=pipe.text_encoder.device)
    video, _, video_mask = pipe.connectors(embeds, mask, padding_side=getattr(pipe.tokenizer, "padding_side", "left"))
    return fencoders.real_tokens(video, video_mask)


def resample(waveform: torch.Tensor, rate: int, target: int) -> torch.Tensor:
    """``waveform [..., S]`` at ``rate`` Hz resampled to ``target`` Hz, ``[..., ceil(S target / rate)]``: a
    Hann-windowed sinc with 6 zero crossings and cutoff 0.99 of the lower Nyquist (torchaudio's ``resample``
    defaults, which FastVideo's LTX-2 audio preprocessing calls), in the waveform's dtype."""
    if rate == target:
        return waveform
    g = math.gcd(rate, target)
    up, down = target // g, rate // g  # output phases per block, input samples per block
    cutoff = min(up, down) * RESAMPLE_ROLLOFF
    half = math.ceil(RESAMPLE_ZEROS * down / cutoff)  # kernel half-width in input samples
    taps = torch.arange(-half, half + down, dtype=waveform.dtype, device=waveform.device) / down
    phases = -torch.arange(up, dtype=waveform.dtype, device=waveform.device)[:, None] / up
    x = ((phases + taps) * cutoff).clamp(-RESAMPLE_ZEROS, RESAMPLE_ZEROS)  # [up, taps], in units of the cutoff
    window = torch.cos(x * math.pi / RESAMPLE_ZEROS / 2) ** 2
    x = x * math.pi
    sinc = torch.where(x == 0, torch.ones_like(x), torch.sin(x) / x)
    kernel = (sinc * (window * (cutoff / down)))[:, None]  # [up, 1, taps]
    flat = waveform.reshape(-1, 1, waveform.shape[-1])
    out = torch.nn.functional.conv1d(torch.nn.functional.pad(flat, (half, half + down)), kernel, stride=down)
    length = math.ceil(up * waveform.shape[-1] / down)
    return out.transpose(1, 2).reshape(flat.shape[0], -1)[:, :length].reshape(*waveform.shape[:-1], length)


def mel_filters(rate: int, n_fft: int, bins: int, *, device: torch.device | None = None) -> torch.Tensor:
    """Triangular mel filters ``[n_fft // 2 + 1, bins]`` over 0..rate/2 on the Slaney mel scale (linear below 1 kHz,
    logarithmic above), each scaled to unit area (Slaney norm): torchaudio's ``melscale_fbanks(mel_scale="slaney",
    norm="slaney")``, fp32."""
    step, knee = 200.0 / 3, 1000.0  # Hz per mel below the knee
    log_step = math.log(6.4) / 27.0
    top = rate / 2
    top_mel = top / step if top < knee else knee / step + math.log(top / knee) / log_step
    mels = torch.linspace(0.0, top_mel, bins + 2, device=device)
    edges = torch.where(mels >= knee / step, knee * torch.exp(log_step * (mels - knee / step)), step * mels)
    freqs = torch.linspace(0, rate // 2, n_fft // 2 + 1, device=device)
    gaps = edges[1:] - edges[:-1]
    offsets = edges[None] - freqs[:, None]  # [freqs, bins + 2]
    rising, falling = -offsets[:, :-2] / gaps[:-1], offsets[:, 2:] / gaps[1:]
    filters = torch.minimum(rising, falling).clamp(min=0.0)
    return filters * (2.0 / (edges[2:] - edges[:-2]))


def log_mel(waveform: torch.Tensor, rate: int, hop: int, bins: int, n_fft: int = N_FFT) -> torch.Tensor:
    """The log-magnitude mel spectrogram ``[B, ch, frames, bins]`` of ``waveform [B, ch, S]`` at ``rate`` Hz as
    FastVideo's LTX-2 ``AudioProcessor`` makes it: a centred (reflect-padded) Hann STFT of ``n_fft``, hop ``hop``, its
    magnitude through :func:`mel_filters`, ``log(max(., 1e-5))``; ``frames = S // hop + 1``."""
    flat = waveform.reshape(-1, waveform.shape[-1])
    window = torch.hann_window(n_fft, dtype=flat.dtype, device=flat.device)
    spectrum = torch.stft(flat, n_fft, hop_length=hop, win_length=n_fft, window=window, center=True,
                          pad_mode="reflect", normalized=False, onesided=True, return_complex=True).abs()
    mel = spectrum.transpose(1, 2) @ mel_filters(rate, n_fft, bins, device=flat.device).to(flat.dtype)
    return torch.log(mel.clamp(min=LOG_FLOOR)).reshape(*waveform.shape[:-1], *mel.shape[1:])


def encode_audio(pipe: Any, waveform: torch.Tensor, rate: int) -> torch.Tensor:
    """Audio latents ``[B, C, F, M]`` (8 channels, F latent frames, M = mel_bins / 4) of stereo ``waveform [B, 2, S]``
    at ``rate`` Hz: resampled to the audio VAE's rate (fp32), :func:`log_mel`, the audio VAE's posterior mean,
    normalised by its per-channel statistics as ``LTX2Pipeline`` normalises given audio latents (packed ``[B, F, C
    M]``, ``_normalize_audio_latents``), unpacked: what FastVideo's LTX-2 audio encoder gives."""
    vae = pipe.audio_vae
    config = vae.config
    wave = resample(waveform.float(), int(rate), int(config.sample_rate))
    mel = log_mel(wave, config.sample_rate, config.mel_hop_length, config.mel_bins)
    means = fencoders.latent_mean(vae, mel.to(vae.dtype))
    frames, bins = means.shape[2], means.shape[3]
    packed = pipe._normalize_audio_latents(pipe._pack_audio_latents(means), vae.latents_mean, vae.latents_std)
    return pipe._unpack_audio_latents(packed, frames, num_mel_bins=bins)


ENCODERS = fencoders.Encoders(
    pipeline="LTX2Pipeline", text=("tokenizer", "text_encoder", "connectors"), encode_text=encode_text,
    encode_video=fencoders.pipeline_normalized_latents, frame_step=VAE_STRIDE[0], pixel_multiple=VAE_STRIDE[1],
    audio=("audio_vae",), encode_audio=encode_audio)
"""LTX-2's encoders: the post-connector text embedding fvx trains on, and video and audio latents normalised by the
VAEs' statistics (identity latent spaces), as FastVideo's LTX-2 VAEs normalise inside ``encode``."""


LTX2 = Family(
    name=NAME,
    presets=PRESETS,
    encoders=ENCODERS,
    architecture=Architecture(
        skeleton=lambda config: skeleton_of(LTX2VideoTransformer3DModel, config.spec.kwargs),  # RoPE holds no buffer
        unit_groups={"transformer_blocks": ("transformer_blocks",)},
        activations={"transformer_blocks": BLOCK_ACTIVATIONS},
        widths=widths,
        # N(0, 1) / sqrt(width): the root's [2, dim] tables and the blocks' [6 or 9, dim]; N(0, 1): the prompt and
        # a2v/v2a tables
        init_rules={"scale_shift_table": wan.scale_shift_init, "audio_scale_shift_table": wan.scale_shift_init,
                    "prompt_scale_shift_table": _unscaled_normal, "audio_prompt_scale_shift_table": _unscaled_normal,
                    "video_a2v_cross_attn_scale_shift_table": _unscaled_normal,
                    "audio_a2v_cross_attn_scale_shift_table": _unscaled_normal,
                    "keyframes_abs_pos_embedding": lambda key, shape: torch.zeros(shape)},
        self_attention=("transformer_blocks.*.attn1",),
        # FastVideo's LTX-2 blocks offer ATTN_QAT_TRAIN to the video attention only (audio: flash or SDPA) and run a
        # masked call through SDPA (LTXSelfAttention.attn_masked): training always masks the text cross-attention,
        # and the a2v/v2a attention does not run with the modalities isolated, so its video self-attention is what
        # quantizes.
        qat_attention=("transformer_blocks.*.attn1",),
        linear_qat=NVFP4_LINEARS,
        vsa_refusal="FastVideo's LTX-2 trainer builds no sparse-attention metadata and refuses the VSA backend (its "
                    "LTX-2 VSA path serves LTX-2.0 VSA-QAT checkpoints at inference only, and the released checkpoints "
                    "are dense, with no trained VSA gate)",
    ),
    forward=Forward(
        inputs=inputs,
        layout="BTHWC",
        output=output,
    ),
    conditioning=Conditioning(
        spec=cond_spec,
        from_batch=cond_from_batch,
        cfg_dropout_refusal="CFG dropout zeroes the post-connector text embeddings, but LTX-2's unconditional input is "
                            "an empty prompt encoded through Gemma and the connector (FastVideo trains LTX-2 with "
                            "training_cfg_rate 0)",
        defaults=TEXT_MASK_DEFAULT,
    ),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
    training=Training(sigma_sampler=sigma_sampler),
    joint=Joint(
        modalities={"audio": Modality(latents=lambda config: config.spec.options["audio_latents"], owns=owns_audio)},
        trained=lambda config: ("video",),
    ),
)


class LTX2Config(ModelConfig, tag="ltx2"):
    """An LTX-2 DiT (presets: tiny, tiny-2.3, ltx-2, ltx-2.3), trained video-only. ``fps``: the frame rate of the
    training videos, which sets the temporal RoPE positions (FastVideo reads it from the data's ``info_list``, default
    24). ``train_audio`` must stay False (module docstring). ``timestep_uniform_prob``: the share of training noise
    levels drawn from U(0.001, 1) instead of the shifted logit-normal (FastVideo's, default 0.1)."""

    family = LTX2

    fps: Annotated[float, msgspec.Meta(gt=0)] = FPS
    train_audio: bool = False
    timestep_uniform_prob: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.fps) and self.fps > 0):
            raise ValueError(f"{NAME} fps must be a positive finite frame rate (frames per second), got {self.fps}")
        if self.train_audio:
            raise ValueError(f"{NAME} train_audio=True is not supported: LTX-2 trains video-only here, as in "
                             "FastVideo (training the audio needs audio latents in the batch, an audio forward and "
                             "an audio loss, which the LTX-2 recipes do not have); leave train_audio=False")
        if not 0.0 <= self.timestep_uniform_prob <= 1.0:
            raise ValueError(f"{NAME} timestep_uniform_prob must lie in [0, 1], got {self.timestep_uniform_prob}")
