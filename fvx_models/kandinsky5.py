"""Kandinsky 5.0 text-to-video (diffusers ``Kandinsky5Transformer3DModel``): the family's spec.

Two unit groups: the text encoder blocks (self-attention over the Qwen tokens only) and the visual decoder blocks
(self-attention over the video tokens, cross-attention to the encoded text). The DiT takes channels-last latents
``[B, T, H, W, C]`` (layout ``"BTHWC"``) and predicts the flow velocity (its pipeline steps
``FlowMatchEulerDiscreteScheduler`` on the output as it is). Latents are the HunyuanVideo VAE's scaled by its
``scaling_factor`` 0.476986, as FastVideo's plugin and diffusers' ``Kandinsky5T2VPipeline`` use them (the same
latent space as ``fvx_models.hunyuan_video``); FastVideo trains it with flow shift 5.

Conditioning: the Qwen2.5-VL text embedding ``text [B, L, 3584]`` with its mask ``text_mask [B, L]`` (valid tokens
first) and CLIP's pooled embedding ``pooled [B, 768]``. FastVideo's Kandinsky 5 data packs the pooled vector as row 0
of ``text_embedding``, zero-padded to the Qwen width (``../shared/spec/fastvideo_train.md`` §3.3): row 0 is ``pooled``
(its first ``in_text_dim2`` values), rows 1: are ``text``. ``ENCODERS`` makes those rows with diffusers'
``Kandinsky5T2VPipeline.encode_prompt`` and stores the VAE's posterior mean unscaled.

The DiT has no text attention mask. As FastVideo's plugin (and the pipeline's tokenizer, which pads to the longest
prompt) does, the text is cut to the batch's longest valid length (the count of valid tokens, at least 1) and
attended in full, its positions ``text_rope_pos = arange(L)``: a shorter prompt in a batch attends to the padding
after it (zeros in FastVideo's data). The visual RoPE positions are ``arange`` of the patched grid and the RoPE
scale is the pipeline's rule of the pixel size (latents x 8): ``(1, 2, 2)`` when height and width are both within
480..854 px, else ``(1, 3.16, 3.16)``; sparse (NABLA) attention is never engaged (``sparse_params=None``). A
``visual_cond`` model (every released one: one checkpoint for text- and image-to-video) takes
``[x | zeros | a zero mask channel]`` on the channels for text-to-video.

FastVideo trains 480p only (``480 <= H, W <= 854`` pixels) and so do the real presets here (``latent_rule``: latent
height and width within 60..106, x8 being the VAE's spatial stride; ``Kandinsky5Config.only_480p=False`` lifts it,
the RoPE scale then following the pipeline's rule); the tiny preset has no trained resolution and no such rule.
Random init draws every Linear by PyTorch's default, where diffusers zero-inits the modulation layers (an init rule
is keyed by a param's local name, ``weight``, so it cannot single them out); a run starts from released weights.
"""
from __future__ import annotations

import pathlib
from typing import Any, Mapping

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5Transformer3DModel
from diffusers.models.transformers.transformer_kandinsky import Kandinsky5RoPE1D, Kandinsky5RoPE3D, get_freqs
from torch import nn

from fvx.distributed import memory
from fvx_models import cond as fcond, diffusers_folder as dfolder, hunyuan_video
from fvx_models import encoders as fencoders
from fvx_models.build import ModelConfig
from fvx_models.family import (Architecture, Checkpoints, Family, Forward, Preset, Training, pack_pooled,
                               packed_pooled_conditioning, skeleton_of)

LATENTS = hunyuan_video.LATENTS  # Kandinsky 5 decodes with HunyuanVideo's VAE: 16 channels x 0.476986, (4, 8, 8)
FLOW_SHIFT = 5.0  # FastVideo's Kandinsky5Model default and its recipes' pipeline.flow_shift
PIXELS_480P = (480, 854)  # FastVideo's 480p band (and the pipeline's), in pixels
SCALE_480P, SCALE_HD = (1.0, 2.0, 2.0), (1.0, 3.16, 3.16)  # visual RoPE scale by resolution (the pipeline's rule)
TEXT_ROPE_POSITIONS = 1024  # Kandinsky5RoPE1D's table
VISUAL_ROPE_POSITIONS = 128  # Kandinsky5RoPE3D's table, per axis (patched frames, rows, columns)

# Dense attention: the released 5 s Lite checkpoints (sft, pretrain, nocfg, distilled16steps share the architecture;
# the 10 s ones use NABLA). The attention_* fields only steer the pipeline's sparse attention, which fvx never runs.
# Sources (no hub access here): the Lite sizes and causal/local/glob/window from Kandinsky-5's
# configs/config_5s_sft.yaml, attention_type "regular" from FastVideo's golden-gate test of its config.json;
# its NABLA fields are assumed absent (None). The Pro's are a copy of its Diffusers transformer/config.json (plus
# attention_chunk, which diffusers 0.42.1 no longer takes). A folder whose config.json differs is refused, each field
# named.
_DENSE = dict(attention_type="regular", attention_causal=False, attention_local=False, attention_glob=False,
              attention_window=3, attention_P=None, attention_wT=None, attention_wW=None, attention_wH=None,
              attention_add_sta=None, attention_method=None)
_LITE = dict(in_visual_dim=16, in_text_dim=3584, in_text_dim2=768, time_dim=512, out_visual_dim=16,
             patch_size=(1, 2, 2), model_dim=1792, ff_dim=7168, num_text_blocks=2, num_visual_blocks=32,
             axes_dims=(16, 24, 24), visual_cond=True, **_DENSE)
_PRO = dict(_LITE, time_dim=1024, model_dim=4096, ff_dim=16384, num_text_blocks=4, num_visual_blocks=60,
            axes_dims=(32, 48, 48), attention_type="nabla", attention_method="topcdf", attention_P=0.8,
            attention_add_sta=True, attention_wT=11, attention_wW=3, attention_wH=3)
TINY = dict(_LITE, in_text_dim=32, in_text_dim2=16, time_dim=32, model_dim=64, ff_dim=128, num_text_blocks=1,
            num_visual_blocks=2, axes_dims=(8, 12, 12))

PRESETS: dict[str, Preset] = {
    "tiny": Preset(TINY, LATENTS, 9),
    "kandinsky5-t2v-lite": Preset(_LITE, LATENTS, 513, {"pixels": PIXELS_480P}),
    "kandinsky5-t2v-pro": Preset(_PRO, LATENTS, 513, {"pixels": PIXELS_480P}),
}
"""``Kandinsky5Transformer3DModel`` constructor arguments per preset (every argument: Lite is
``kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers``, 2B; Pro ``Kandinsky-5.0-T2V-Pro-sft-5s-Diffusers``, 19B,
whose config names NABLA attention, which FastVideo's plugin and fvx replace by dense attention), the latent space,
the packed text length (FastVideo's Qwen ``text_len`` 512 plus the pooled row) and the trained pixel band."""

# What one unit of each group saves per token it runs over (saved-tensor hooks, bf16, eager): bench/activations.py's
# saved_per_group on the tiny preset at two FFN widths (model_dim 64 and 256; its --family loop widens mlp_ratio or
# ffn_dim, not Kandinsky's ff_dim). Much is fp32: the blocks norm, modulate and gate in fp32 and rotate q, k in fp32.
# tests/fvx_models/test_kandinsky5.py measures it again.
ACTIVATIONS = {
    "visual_transformer_blocks": memory.BlockActivations(fp32_dim=17.5, compute_dim=9.3, compute_ffn=2.0),
    "text_transformer_blocks": memory.BlockActivations(fp32_dim=12.5, compute_dim=6.0, compute_ffn=2.0),
}


def rebuild(module: nn.Module) -> None:
    """Recompute on the CPU what the meta skeleton holds as tensors that are not params: the RoPE tables (buffers)
    and the time embedding's frequencies (a plain attribute)."""
    config = module.config
    head_dim = sum(config.axes_dims)
    module.text_rope_embeddings = Kandinsky5RoPE1D(head_dim)
    module.visual_rope_embeddings = Kandinsky5RoPE3D(tuple(config.axes_dims))
    embeddings = module.time_embeddings
    embeddings.freqs = get_freqs(embeddings.model_dim // 2, embeddings.max_period)


def skeleton(config: ModelConfig) -> nn.Module:
    module = skeleton_of(Kandinsky5Transformer3DModel, config.spec.kwargs, rebuild)
    meta = [f"{name}.{attr}" for name, part in module.named_modules() for attr, value in vars(part).items()
            if isinstance(value, torch.Tensor) and value.is_meta]
    if meta:
        raise RuntimeError(f"Kandinsky5Transformer3DModel skeleton: tensors left on meta (diffusers changed?): {meta}")
    return module


def valid_length(mask: torch.Tensor) -> int:
    """The batch's longest valid text (valid tokens first), at least 1; counted in fp32 as FastVideo does."""
    return max(1, int(mask.float().sum(dim=1).max().item()))


def rope_scale(config: ModelConfig, height: int, width: int) -> tuple[float, float, float]:
    """The visual RoPE scale diffusers' pipeline picks for latents of ``height x width``: (1, 2, 2) at 480p."""
    stride = config.spec.latents.vae_stride[1]
    low, high = PIXELS_480P
    return SCALE_480P if all(low <= size * stride <= high for size in (height, width)) else SCALE_HD


def inputs(config: ModelConfig, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """The DiT's arguments for channels-last ``x [B, T, H, W, C]`` (module docstring)."""
    k = config.spec.kwargs
    length = valid_length(cond["text_mask"])
    if length > TEXT_ROPE_POSITIONS:
        raise ValueError(f"kandinsky5: the text has {length} valid tokens; the DiT's text RoPE holds "
                         f"{TEXT_ROPE_POSITIONS} positions")
    hidden = x
    if k["visual_cond"]:  # text-to-video: no conditioning frames, a zero mask
        hidden = torch.cat([x, torch.zeros_like(x), torch.zeros_like(x[..., :1])], dim=-1)
    frames, height, width = x.shape[1:4]
    p_t, p_h, p_w = k["patch_size"]
    grid = (frames // p_t, height // p_h, width // p_w)
    return {"hidden_states": hidden, "encoder_hidden_states": cond["text"][:, :length], "timestep": t,
            "pooled_projections": cond["pooled"],
            "visual_rope_pos": [torch.arange(size, device=x.device) for size in grid],
            "text_rope_pos": torch.arange(length, device=x.device),
            "scale_factor": rope_scale(config, height, width), "sparse_params": None, "return_dict": False}


def output(config: ModelConfig, out: Any, x: torch.Tensor, t: torch.Tensor,
           cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The DiT returns the velocity channels-last ``[B, T, H, W, C]`` as a tensor (not a tuple)."""
    return out if isinstance(out, torch.Tensor) else out[0]


def latent_rule(config: Kandinsky5Config, shape: tuple[int, ...]) -> str | None:
    """Latents beyond the RoPE tables, or (real presets, ``only_480p``) outside FastVideo's 480p band."""
    p_t, p_h, p_w = config.spec.kwargs["patch_size"]
    frames, height, width = shape[2] // p_t, shape[3] // p_h, shape[4] // p_w
    if max(frames, height, width) > VISUAL_ROPE_POSITIONS:
        return (f"the DiT's visual RoPE holds {VISUAL_ROPE_POSITIONS} positions per axis; these latents make a grid of "
                f"{frames} x {height} x {width} patches")
    pixels = config.spec.options.get("pixels")
    if pixels is None or not config.only_480p:
        return None
    stride = config.spec.latents.vae_stride[1]
    low, high = pixels
    if not all(low <= size * stride <= high for size in shape[3:]):
        return (f"Kandinsky 5 trains at 480p only, as FastVideo: height and width {shape[3] * stride} x "
                f"{shape[4] * stride} px (latents x {stride}) must each be within {low}..{high} px (latent "
                f"{-(-low // stride)}..{high // stride}); models.<role>.only_480p=false trains other sizes with "
                "the pipeline's RoPE scale (1, 3.16, 3.16)")
    return None


def widths(config: ModelConfig) -> tuple[int, dict[str, tuple[int, int]]]:
    k = config.spec.kwargs
    dim, ffn = k["model_dim"], k["ff_dim"]
    return dim, {"visual_transformer_blocks": (dim, ffn), "text_transformer_blocks": (dim, ffn)}


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``Kandinsky5T2VPipeline`` files beside ``transformer/``: ``model_index.json`` and ``scheduler/``
    (flow shift 5); copy the VAE (HunyuanVideo's), both text encoders and their tokenizers from the base model."""
    FlowMatchEulerDiscreteScheduler(shift=FLOW_SHIFT).save_config(folder / "scheduler")
    dfolder.write_model_index(
        folder, "Kandinsky5T2VPipeline",
        {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
         "transformer": ("diffusers", "Kandinsky5Transformer3DModel"),
         "vae": ("diffusers", "AutoencoderKLHunyuanVideo"),
         "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
         "tokenizer": ("transformers", "Qwen2VLProcessor"), "text_encoder_2": ("transformers", "CLIPTextModel"),
         "tokenizer_2": ("transformers", "CLIPTokenizer")})


TEXT_LEN = 512  # Kandinsky5T2VPipeline's max_sequence_length: the Qwen tokens after its template


def encode_text(pipe: Any, prompts: list[str]) -> list[torch.Tensor]:
    """``Kandinsky5T2VPipeline.encode_prompt`` as its ``__call__`` calls it (the Qwen2.5-VL's last hidden state of the
    cleaned prompt in its template, the template's tokens cropped, 512 tokens; CLIP's pooled output): each prompt's
    real tokens (its ``cu_seqlens`` length, on the side its tokenizer does not pad) after its pooled row,
    ``[1 + L_i, 3584]``."""
    embeds, pooled, cu_seqlens = pipe.encode_prompt(prompts, max_sequence_length=TEXT_LEN,
                                                    device=pipe.text_encoder.device)
    left = getattr(pipe.tokenizer, "tokenizer", pipe.tokenizer).padding_side == "left"
    tokens = [e[len(e) - n:] if left else e[:n] for e, n in zip(embeds, cu_seqlens.diff().tolist())]
    return pack_pooled(pooled, tokens)


ENCODERS = fencoders.Encoders(
    pipeline="Kandinsky5T2VPipeline", text=("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2"),
    encode_text=encode_text, encode_video=lambda pipe, video: fencoders.latent_mean(pipe.vae, video),
    frame_step=4, pixel_multiple=16, audio_refusal="Kandinsky 5 makes no sound",
    own_loaders=(("tokenizer", fencoders.processor_tokenizer),))
"""Kandinsky 5's encoders: the packed text rows above and the HunyuanVideo VAE's posterior mean, unscaled (``LATENTS``
applies the scaling factor in training); 4x temporal compression, 8x spatial times the DiT's 2x2 patch."""


KANDINSKY5 = Family(
    name="kandinsky5",
    presets=PRESETS,
    encoders=ENCODERS,
    architecture=Architecture(
        skeleton=skeleton,
        unit_groups={"visual_transformer_blocks": ("visual_transformer_blocks",),
                     "text_transformer_blocks": ("text_transformer_blocks",)},
        activations=ACTIVATIONS,
        text_groups=frozenset({"text_transformer_blocks"}),
        widths=widths,
        self_attention=("visual_transformer_blocks.*.self_attention",),
    ),
    forward=Forward(
        inputs=inputs,
        layout="BTHWC",
        output=output,
    ),
    conditioning=packed_pooled_conditioning("in_text_dim", "in_text_dim2",
                                            "the packed [pooled CLIP | Qwen] text embedding",
                                            zero=fcond.zeros_keeping_masks),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
    training=Training(latent_rule=latent_rule),
)


class Kandinsky5Config(ModelConfig, tag="kandinsky5"):
    """A Kandinsky 5.0 DiT (presets: tiny, kandinsky5-t2v-lite, kandinsky5-t2v-pro). ``only_480p``: refuse latents
    outside FastVideo's 480p band (real presets; 480..854 px a side), as FastVideo's plugin does; False trains any
    size, the visual RoPE scale following diffusers' pipeline (1, 3.16, 3.16 beyond 480p)."""

    family = KANDINSKY5

    only_480p: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.only_480p, bool):
            raise ValueError(f"kandinsky5 only_480p must be true or false, got {self.only_480p!r}")
