"""HunyuanVideo FramePack (diffusers ``HunyuanVideoFramepackTransformer3DModel``): next-section prediction, the
family's spec.

FramePack is HunyuanVideo's DiT (the same three unit groups and packed text, ``fvx_models.hunyuan_video``) made an
image-to-video model that makes a video a section at a time: it denoises a window of latent frames while it reads,
unnoised, the clip's first frame, one history frame at full resolution and 2 + 16 more packed 2x and 4x coarser
(``clean_x_embedder``'s three patch embeddings), each at its RoPE time position, and SigLIP's features of the start
image (``image_projection``, ``image_embeds [B, 729, 1152]``) ahead of the text tokens. The data is FramePack's
sections (``data.kind=framepack``, ``fvx.data.sections``: musubi-tuner's ``fpack_cache_latents.py`` cut), so the
velocity loss covers the window alone, as musubi-tuner's ``fpack_train_network.py`` trains it (flow target
``noise - latents``, the guidance scale embedded as ``g * 1000``).

diffusers' DiT takes one set of frame positions per call, and sections differ in theirs (FramePack's gap before the
section), so a forward takes one sample (``Training.one_sample``; musubi-tuner's default batch is one too): a batch
runs sample by sample. For one sample the DiT cuts the text to its mask's length
(``int(mask.sum())``), so the whole forward does not compile as one graph; its blocks do. lllyasviel's checkpoint and
musubi-tuner's FramePack DiT use diffusers' module names, so a LoRA exports as PEFT and as musubi-tuner's keys (with
their alpha) under the same names.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Mapping

import msgspec
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoFramepackTransformer3DModel
from typing_extensions import Annotated

from fvx_models import cond as fcond, diffusers_folder as dfolder, history, hunyuan_video, wan
from fvx_models.build import ModelConfig
from fvx_models.family import Conditioning, Preset, packed_pooled_cond, require, skeleton_of

_FRAMEPACK = {**hunyuan_video.PRESETS["hunyuanvideo-t2v"].kwargs, "has_image_proj": True, "image_proj_dim": 1152,
              "has_clean_x_embedder": True}
_TINY = {**hunyuan_video.PRESETS["tiny"].kwargs, "has_image_proj": True, "image_proj_dim": 16,
         "has_clean_x_embedder": True}

PRESETS: dict[str, Preset] = {
    "tiny": Preset(_TINY, hunyuan_video.LATENTS, 9),
    # the toy world's (48-channel space-to-depth 4 latents; its 4 text rows read as a pooled row and 3 tokens; the
    # start frame's latent tokens as the image features)
    "world": Preset({**_TINY, "in_channels": 48, "out_channels": 48, "num_attention_heads": 4, "attention_head_dim": 64,
                     "num_layers": 1, "num_single_layers": 2, "image_proj_dim": 48, "rope_axes_dim": (16, 24, 24)},
                    wan.WORLD_CODEC_4, 4),
    # lllyasviel/FramePackI2V_HY (FramePack and FramePack-F1 share it): HunyuanVideo's with both FramePack modules
    "framepack-i2v": Preset(_FRAMEPACK, hunyuan_video.LATENTS, 257),
}
"""``HunyuanVideoFramepackTransformer3DModel`` constructor arguments per preset (every argument), latent space (the
HunyuanVideo VAE's) and the packed text length."""

IMAGE = frozenset({"image_embeds", *history.NAMES})
DUAL_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                "ff_context.net.2")
SINGLE_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out")


def musubi_lora_targets(config: ModelConfig) -> tuple[str, ...]:
    """musubi-tuner's FramePack LoRA targets (``networks/lora_framepack.py``): every linear layer of the dual- and
    single-stream blocks but their norms' (``.*(norm).*`` excluded), none of the token refiner's, as fvx's
    ``lora.target_modules`` names (each module's whole name: a block's index keeps the refiner's apart)."""
    k = config.spec.kwargs
    return (tuple(f"transformer_blocks.{i}.{name}" for i in range(k["num_layers"]) for name in DUAL_LINEARS)
            + tuple(f"single_transformer_blocks.{i}.{name}" for i in range(k["num_single_layers"])
                    for name in SINGLE_LINEARS))
ONE_SAMPLE = ("diffusers' FramePack DiT takes one set of frame positions per call, and sections differ in theirs; "
              "musubi-tuner trains it one sample per step too")


def cond_spec(config: ModelConfig) -> fcond.Spec:
    k = config.spec.kwargs
    return {"text": ("L", k["text_embed_dim"]), "text_mask": ("L",), "pooled": (k["pooled_projection_dim"],),
            "image_embeds": ("N", k["image_proj_dim"]), **history.cond_spec(config)}


def cond_from_batch(config: ModelConfig, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The packed text, the start image's features and the section's history from a batch of kind ``framepack``; a
    ValueError names the parquet column that is missing or of the wrong shape."""
    name = config.family.name
    require(batch, ("image_embeds",), name, "the start image's SigLIP features: data.kind='framepack'")
    width = config.spec.kwargs["image_proj_dim"]
    if batch["image_embeds"].dim() != 3 or batch["image_embeds"].shape[2] != width:
        raise ValueError(f"{name}: clip_feature {list(batch['image_embeds'].shape[1:])} must be [N, {width}] (the "
                         "start image's SigLIP features)")
    return {**packed_pooled_cond(batch, config.spec.kwargs["pooled_projection_dim"], name,
                                 "the packed [pooled CLIP | LLaMA] text embedding"),
            "image_embeds": batch["image_embeds"], **history.cond_from_batch(config, batch)}


def inputs(config: FramepackConfig, x_t: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """The DiT's arguments as ``HunyuanVideoFramepackPipeline`` passes them: the history split into the clean (first
    frame and 1x), 2x and 4x latents, each with its frame positions (one sample's, 1-D: ``Training.one_sample``)."""
    parts = history.split(cond, x_t.shape[2], x_t.dtype)
    (clean, coarse2, coarse4), positions = parts["latents"], [p[0] for p in parts["positions"]]
    return {**hunyuan_video.inputs(config, x_t, t, cond, sharded), "image_embeds": cond["image_embeds"],
            "indices_latents": positions[0], "latents_clean": clean, "indices_latents_clean": positions[1],
            "latents_history_2x": coarse2, "indices_latents_history_2x": positions[2], "latents_history_4x": coarse4,
            "indices_latents_history_4x": positions[3]}


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``HunyuanVideoFramepackPipeline`` files beside ``transformer/``: ``model_index.json`` and
    ``scheduler/`` (HunyuanVideo's, flow shift 7); copy the VAE and both text encoders from HunyuanVideo and the
    SigLIP image encoder and its processor from ``lllyasviel/flux_redux_bfl``."""
    FlowMatchEulerDiscreteScheduler(shift=hunyuan_video.FLOW_SHIFT).save_config(folder / "scheduler")
    dfolder.write_model_index(
        folder, "HunyuanVideoFramepackPipeline",
        {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
         "transformer": ("diffusers", "HunyuanVideoFramepackTransformer3DModel"),
         "vae": ("diffusers", "AutoencoderKLHunyuanVideo"), "text_encoder": ("transformers", "LlamaModel"),
         "tokenizer": ("transformers", "LlamaTokenizerFast"), "text_encoder_2": ("transformers", "CLIPTextModel"),
         "tokenizer_2": ("transformers", "CLIPTokenizer"), "image_encoder": ("transformers", "SiglipVisionModel"),
         "feature_extractor": ("transformers", "SiglipImageProcessor")})


def encode_image(pipe: Any, frames: torch.Tensor) -> torch.Tensor:
    """SigLIP's last hidden state of the start frames ``[B, 3, H, W]`` in [0, 1], as the pipeline's ``encode_image``
    makes it (its processor resizes to 384 x 384): ``[B, 729, 1152]``."""
    return pipe.encode_image(frames * 2 - 1, device=frames.device, dtype=torch.float32)


ENCODERS = dataclasses.replace(hunyuan_video.ENCODERS, pipeline="HunyuanVideoFramepackPipeline",
                               image=("image_encoder", "feature_extractor"), encode_image=encode_image)
"""HunyuanVideo's text and video encoders, and the start image's SigLIP features (``clip_feature``)."""


HUNYUAN_FRAMEPACK = hunyuan_video.HUNYUAN_VIDEO.variant(
    name="hunyuan_framepack",
    presets=PRESETS,
    encoders=ENCODERS,
    architecture={"skeleton": lambda config: skeleton_of(HunyuanVideoFramepackTransformer3DModel, config.spec.kwargs),
                  "whole_graph_refusal": "for one sample its forward cuts the text to int(mask.sum()) tokens"},
    forward={"inputs": inputs},
    conditioning=Conditioning(spec=cond_spec, from_batch=cond_from_batch, image=IMAGE,
                              data_keys=("text", "text_mask", "image_embeds", *history.NAMES),
                              zero=hunyuan_video.zero_cond, defaults=hunyuan_video.HUNYUAN_VIDEO.conditioning.defaults),
    checkpoints={"pipeline_files": pipeline_files, "original_name": lambda name: name,
                 "original_formats": ("musubi",), "musubi_script": "fpack_generate_video.py"},
    training={"one_sample": ONE_SAMPLE},
)


class FramepackConfig(ModelConfig, tag="hunyuan_framepack"):
    """A FramePack DiT (presets: tiny, world, framepack-i2v). ``embedded_guidance``: the guidance scale the
    guidance-distilled DiT is told, as ``g * 1000``, in training and validation alike: musubi-tuner's training
    default 1.0 (its ``--guidance_scale``); its sampler tells it 10 and diffusers' pipeline 6."""

    family = HUNYUAN_FRAMEPACK

    embedded_guidance: Annotated[float, msgspec.Meta(gt=0)] = 1.0
