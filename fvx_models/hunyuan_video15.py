"""HunyuanVideo 1.5 text-to-video (diffusers ``HunyuanVideo15Transformer3DModel``): the family's spec.

Two unit groups: the dual-stream blocks (video tokens and the joint text sequence apart, joint attention) and the
Qwen token refiner's blocks (run over the Qwen tokens only). The DiT takes ``x | condition latents | mask`` on channels
(65 = 32 + 32 + 1): for text-to-video the condition latents and the mask are zeros, and the image embedding is the zero
placeholder ``[B, 729, image_embed_dim]`` the t2v pipeline passes (the DiT then zeroes and masks those 729 tokens), all
made here as ``HunyuanVideo15Pipeline`` makes them. Timesteps go in as given, 0..1000 (the pipeline passes its
scheduler's ``1000 sigma``); it predicts the flow velocity ``noise - x0`` (the pipeline steps
``FlowMatchEulerDiscreteScheduler`` on it), taken as it is.

Conditioning: the Qwen2.5-VL embedding ``text [B, L, 3584]`` (the pipeline's 1000 tokens after its 108-token template)
with ``text_mask [B, L]``, and the ByT5 glyph-text embedding ``text_2 [B, 256, 1472]`` with ``text_mask_2 [B, 256]``
(the quoted text of the prompt; a prompt that quotes none gives zeros with an all-zero mask, as the pipeline encodes
it). The DiT zeroes the padded tokens of both streams, so only the masks matter at padded positions. FastVideo has no
training layout for HunyuanVideo 1.5: its data holds one text embedding. The ByT5 stream is an extension of that
layout: a parquet tensor ``text_embedding_2`` (the valid ByT5 rows, none for a prompt quoting no text) collated like
``text_embedding`` (zero-padded to ``data.text_2_len``, 256 for the presets, with its mask) into the batch entries
``text_2`` and ``text_mask_2``.
``glyph_text=False`` runs on data without it: every prompt is taken to quote no text and the DiT gets the pipeline's
empty ByT5 stream (then ``text_2``/``text_mask_2`` are not cond tensors). Encoders: ``ENCODERS`` stores the Qwen
stream's real tokens as ``text_embedding`` and the VAE's posterior mean unscaled as ``vae_latent`` (the latent space
applies the scaling factor); its second stream, the ByT5 rows, goes to ``text_embedding_2``.

Unused params, measured (a forward and backward of the tiny model; tests/fvx_models/test_hunyuan_video15.py): the last
block's text stream goes nowhere (its text output is dropped), so its ``attn.to_add_out`` and ``ff_context`` get no
gradient and its text queries (``attn.add_q_proj``, ``attn.norm_added_q``) a zero one; in text-to-video the DiT
multiplies the image embedder's output by 0, so ``image_embedder`` gets a zero gradient. They are held frozen
(:func:`unused`). Latents are the HunyuanVideo 1.5 VAE's (32 channels, 4x16x16) scaled by its ``scaling_factor``
1.03682. The meanflow input (``use_meanflow``/``timestep_r``) is left out: no released text-to-video config sets it.
One departure from diffusers' pipeline (docs/design.md): under bf16 compute ``t`` stays fp32 (:func:`rebuild`), where
the bf16 pipeline rounds it to bf16. The family has no sequence parallelism, and its forward does not compile as one
graph (``compile=blocks`` does).
"""
from __future__ import annotations

import pathlib
from typing import Any, Mapping

import torch
from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Transformer3DModel
from torch import nn

from fvx.distributed import memory
from fvx_models import diffusers_folder as dfolder
from fvx_models import encoders as fencoders
from fvx_models.build import ModelConfig
from fvx_models.family import (Architecture, Checkpoints, Conditioning, Family, Forward, Preset, TEXT_MASK_DEFAULT,
                               Training, require, skeleton_of)
from fvx_models.model import LatentSpace

NAME = "hunyuan_video15"
SCALING_FACTOR = 1.03682  # AutoencoderKLHunyuanVideo15's scaling_factor (its default; the released VAE's)
LATENTS = LatentSpace(32, scale=SCALING_FACTOR, vae_stride=(4, 16, 16), vae="HunyuanVideo 1.5")
TINY_LATENTS = LatentSpace(4, scale=SCALING_FACTOR, vae_stride=(4, 16, 16), vae="HunyuanVideo 1.5 (tiny: 4 channels)")
IMAGE_TOKENS = 729  # HunyuanVideo15Pipeline.vision_num_semantic_tokens: the t2v image placeholder's length
GUIDANCE_SCALE = 6.0  # the released t2v pipelines' ClassifierFreeGuidance

_T2V = dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128, num_layers=54,
            num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm", text_embed_dim=3584,
            text_embed_2_dim=1472, image_embed_dim=1152, rope_theta=256.0, rope_axes_dim=(16, 56, 56),
            target_size=640, task_type="t2v", use_meanflow=False)
TINY = {**_T2V, "in_channels": 9, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 32,
        "num_layers": 2, "num_refiner_layers": 1, "mlp_ratio": 2.0, "text_embed_dim": 32, "text_embed_2_dim": 24,
        "image_embed_dim": 16, "rope_axes_dim": (8, 12, 12)}

# What one unit of each group saves per token (saved-tensor hooks, bf16, eager; the tiny model at 1024 and 4096 video
# tokens, the slope per video token: the joint text sequence each block also carries (Qwen, ByT5 and the 729 image
# placeholder tokens) is left out of the linear terms, as the dry run counts video tokens). Each dual-stream block also
# saves the [B, 1, S, S] attention mask diffusers' processor builds over its S = video + text + glyph + image tokens,
# one compute-dtype element per pair (5.3 GB a sample at 480p x 121 frames): the pair term, its joint tokens set per
# preset (:func:`_options`). The refiner's FFN is 4x its width whatever the model's mlp_ratio: counted at width dim.
ACTIVATIONS = {
    "transformer_blocks": memory.BlockActivations(fp32_dim=2.1, compute_dim=16.1, compute_ffn=2.0, pairs=1.0),
    "token_refiner": memory.BlockActivations(fp32_dim=0.0, compute_dim=17.7, compute_ffn=0.0),
}


def _options(flow_shift: float, text_len: int, glyph_len: int) -> dict:
    """A preset's options: its scheduler's flow shift, the ByT5 stream's length, and the dual-stream blocks' joint
    tokens beside the video's (Qwen, ByT5, the image placeholder) for the mask's pair term."""
    blocks = ACTIVATIONS["transformer_blocks"]._replace(joint_tokens=text_len + glyph_len + IMAGE_TOKENS)
    return {"flow_shift": flow_shift, "glyph_len": glyph_len, "activations": {"transformer_blocks": blocks}}


PRESETS: dict[str, Preset] = {
    "tiny": Preset(TINY, TINY_LATENTS, 8, _options(5.0, 8, 4)),
    # diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py: TRANSFORMER_CONFIGS and SCHEDULER_CONFIGS
    "hunyuanvideo1.5-480p-t2v": Preset(_T2V, LATENTS, 1000, _options(5.0, 1000, 256)),
    "hunyuanvideo1.5-720p-t2v": Preset({**_T2V, "target_size": 960}, LATENTS, 1000, _options(9.0, 1000, 256)),
}
"""``HunyuanVideo15Transformer3DModel`` constructor arguments per preset (every argument; the 720p model differs only
in the pixel ``target_size`` its pipeline defaults to), latent space, the Qwen text length, the pipeline scheduler's
flow shift, the ByT5 stream's length (the pipeline pads it to 256) and the blocks' activation figures."""

REFINER_MLP_RATIO = 4.0  # the token refiner's own (diffusers does not pass the model's mlp_ratio to it)



def cond_spec(config: HunyuanVideo15Config) -> dict[str, tuple]:
    k = config.spec.kwargs
    spec = {"text": ("L", k["text_embed_dim"]), "text_mask": ("L",)}
    if config.glyph_text:
        glyph_len = config.spec.options["glyph_len"]
        spec.update(text_2=(glyph_len, k["text_embed_2_dim"]), text_mask_2=(glyph_len,))
    return spec


def cond_from_batch(config: HunyuanVideo15Config, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The Qwen embedding and mask (FastVideo's ``text_embedding``), and with ``glyph_text`` the ByT5 embedding and mask
    (the batch entries ``text_2``, ``text_mask_2``: module docstring)."""
    require(batch, ("text", "text_mask"), NAME, "the Qwen2.5-VL text embedding and its mask")
    cond = {"text": batch["text"], "text_mask": batch["text_mask"]}
    if not config.glyph_text:
        if "text_2" in batch or "text_mask_2" in batch:
            raise ValueError(f"{NAME}: the batch holds a ByT5 glyph embedding (text_2) but glyph_text is false; set "
                             "glyph_text=true to condition on it")
        return cond
    require(batch, ("text_2", "text_mask_2"), NAME, "the ByT5 glyph-text embedding and its mask; for data whose "
            "prompts quote no text set glyph_text=false")
    return {**cond, "text_2": batch["text_2"], "text_mask_2": batch["text_mask_2"]}


def zero_cond(cond: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Zero embeddings with one valid Qwen token (the token refiner pools over the mask, so an all-zero mask would
    divide 0 by 0; an empty prompt still has its template's tokens); the ByT5 stream empty, as the pipeline encodes a
    prompt that quotes no text."""
    mask = torch.zeros_like(cond["text_mask"])
    mask[:, 0] = 1
    return {**{name: torch.zeros_like(t) for name, t in cond.items()}, "text_mask": mask}


def inputs(config: HunyuanVideo15Config, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """The t2v pipeline's call: ``x | zero condition latents | zero mask``, the zero image placeholder, both text
    streams (the empty ByT5 one without ``glyph_text``); ``t`` in fp32 (:func:`rebuild`)."""
    k = config.spec.kwargs
    batch, channels, frames, height, width = x.shape
    hidden = torch.cat([x, x.new_zeros(batch, channels + 1, frames, height, width)], dim=1)
    if config.glyph_text:
        text_2, mask_2 = cond["text_2"], cond["text_mask_2"]
    else:
        glyph_len = config.spec.options["glyph_len"]
        text_2 = x.new_zeros(batch, glyph_len, k["text_embed_2_dim"])
        mask_2 = x.new_zeros(batch, glyph_len)
    return {"hidden_states": hidden, "timestep": t, "encoder_hidden_states": cond["text"],
            "encoder_attention_mask": cond["text_mask"], "encoder_hidden_states_2": text_2,
            "encoder_attention_mask_2": mask_2, "image_embeds": x.new_zeros(batch, IMAGE_TOKENS, k["image_embed_dim"]),
            "return_dict": False}


def _timestep_features_in_weight_dtype(embedder: nn.Module, args: tuple) -> tuple:
    sample, *rest = args
    return (sample.to(embedder.linear_1.weight.dtype), *rest)


def rebuild(module: nn.Module) -> None:
    """The time embedding casts its sinusoidal features (computed from fp32 ``t``) to its weights' dtype, as autocast
    does in the release's bf16 training. diffusers casts them to the timestep's dtype, so its bf16 pipeline must round
    ``t`` to bf16 (999 -> 1000); fvx keeps ``t`` fp32. A no-op in fp32."""
    module.time_embed.timestep_embedder.register_forward_pre_hook(_timestep_features_in_weight_dtype)


def unused(config: HunyuanVideo15Config) -> frozenset[str]:
    """The last block's text-stream outputs and text queries (their result is dropped) and, in text-to-video, the
    image embedder (its output is multiplied by 0): module docstring."""
    last = f"transformer_blocks.{config.spec.kwargs['num_layers'] - 1}."
    text_stream = ("attn.to_add_out.weight", "attn.to_add_out.bias", "ff_context.net.0.proj.weight",
                   "ff_context.net.0.proj.bias", "ff_context.net.2.weight", "ff_context.net.2.bias",
                   "attn.add_q_proj.weight", "attn.add_q_proj.bias", "attn.norm_added_q.weight")
    image = tuple(f"image_embedder.{module}.{kind}" for module in ("norm_in", "linear_1", "linear_2", "norm_out")
                  for kind in ("weight", "bias"))
    return frozenset((*(last + name for name in text_stream), *image))


def widths(config: ModelConfig) -> tuple[int, dict[str, tuple[int, int]]]:
    k = config.spec.kwargs
    dim = k["num_attention_heads"] * k["attention_head_dim"]
    return dim, {"transformer_blocks": (dim, int(dim * k["mlp_ratio"])),
                 "token_refiner": (dim, int(dim * REFINER_MLP_RATIO))}


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``HunyuanVideo15Pipeline`` files beside ``transformer/``: ``model_index.json``, ``scheduler/`` (the
    preset's flow shift: 5 at 480p, 9 at 720p) and ``guider/`` (classifier-free guidance 6, the released t2v
    pipelines'); copy the VAE, both text encoders and tokenizers from the base model."""
    FlowMatchEulerDiscreteScheduler(shift=config.spec.options["flow_shift"]).save_config(folder / "scheduler")
    ClassifierFreeGuidance(guidance_scale=GUIDANCE_SCALE).save_config(folder / "guider")
    dfolder.write_model_index(
        folder, "HunyuanVideo15Pipeline",
        {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
         "transformer": ("diffusers", "HunyuanVideo15Transformer3DModel"),
         "vae": ("diffusers", "AutoencoderKLHunyuanVideo15"), "guider": ("diffusers", "ClassifierFreeGuidance"),
         "text_encoder": ("transformers", "Qwen2_5_VLTextModel"), "tokenizer": ("transformers", "Qwen2Tokenizer"),
         "text_encoder_2": ("transformers", "T5EncoderModel"), "tokenizer_2": ("transformers", "ByT5Tokenizer")})


def _placeholder_stream(prompts: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-token stand-in ``[B, 1, 1]`` and mask ``[B, 1]`` for the stream ``encode_prompt`` is not asked to make
    (given, it skips that encoder)."""
    return torch.zeros(len(prompts), 1, 1, device=device), torch.zeros(len(prompts), 1, device=device)


def encode_text(pipe: Any, prompts: list[str]) -> list[torch.Tensor]:
    """The Qwen2.5-VL stream of ``HunyuanVideo15Pipeline.encode_prompt`` (its chat template, ``hidden_states[-3]``,
    the 108 template tokens cropped, 1000 tokens), each prompt's real tokens ``[L_i, 3584]``: ``text``/``text_mask``."""
    device = pipe.text_encoder.device
    placeholder, placeholder_mask = _placeholder_stream(prompts, device)
    embeds, mask, _, _ = pipe.encode_prompt(prompts, device=device, batch_size=len(prompts),
                                            prompt_embeds_2=placeholder, prompt_embeds_mask_2=placeholder_mask)
    return fencoders.real_tokens(embeds, mask)


def encode_glyph_text(pipe: Any, prompts: list[str]) -> list[torch.Tensor]:
    """The ByT5 glyph stream of ``HunyuanVideo15Pipeline.encode_prompt`` (the prompt's quoted text, 256 tokens), each
    prompt's real tokens ``[n_i, 1472]`` (``n_i = 0`` for a prompt quoting none): ``text_2``/``text_mask_2``."""
    device = pipe.text_encoder_2.device
    placeholder, placeholder_mask = _placeholder_stream(prompts, device)
    _, _, embeds, mask = pipe.encode_prompt(prompts, device=device, dtype=pipe.text_encoder_2.dtype,
                                            batch_size=len(prompts), prompt_embeds=placeholder,
                                            prompt_embeds_mask=placeholder_mask)
    return fencoders.real_tokens(embeds, mask)


# diffusers' HunyuanVideo15Pipeline cannot be built without its VAE (its __init__ reads vae.config when the attribute
# exists, even as None), so each text record loads it too.
ENCODERS = fencoders.Encoders(
    pipeline="HunyuanVideo15Pipeline", text=("tokenizer", "text_encoder", "vae"), encode_text=encode_text,
    text_2=("tokenizer_2", "text_encoder_2"), encode_text_2=encode_glyph_text,
    encode_video=lambda pipe, video: fencoders.latent_mean(pipe.vae, video), frame_step=4, pixel_multiple=16,
    audio_refusal="HunyuanVideo 1.5 makes no sound")
"""HunyuanVideo 1.5's encoders: the Qwen stream as ``text_embedding``, the ByT5 glyph stream as fvx's
``text_embedding_2`` (read back as ``text_2``/``text_mask_2`` with ``data.text_2_len``, e.g. the presets' 256)."""


HUNYUAN_VIDEO15 = Family(
    name=NAME,
    presets=PRESETS,
    encoders=ENCODERS,
    architecture=Architecture(
        skeleton=lambda config: skeleton_of(HunyuanVideo15Transformer3DModel, config.spec.kwargs, rebuild),
        unit_groups={"transformer_blocks": ("transformer_blocks",),
                     "token_refiner": ("context_embedder.token_refiner.refiner_blocks",)},
        activations=ACTIVATIONS,
        text_groups=frozenset({"token_refiner"}),
        widths=widths,
        whole_graph_refusal="its forward reorders each sample's text tokens by their masks (boolean indexing, shapes "
                            "that depend on the data) and branches on whether the image embedding is all zeros",
        self_attention=("transformer_blocks.*.attn",),
        vsa_refusal="its self-attention runs over the video and text tokens together (one joint sequence)",
    ),
    forward=Forward(inputs=inputs),
    conditioning=Conditioning(
        spec=cond_spec,
        from_batch=cond_from_batch,
        data_keys=("text", "text_mask", "text_2", "text_mask_2"),
        zero=zero_cond,
        defaults=TEXT_MASK_DEFAULT,
    ),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
    training=Training(held_frozen=unused),
)


class HunyuanVideo15Config(ModelConfig, tag="hunyuan_video15"):
    """A HunyuanVideo 1.5 text-to-video DiT (presets: tiny, hunyuanvideo1.5-480p-t2v, hunyuanvideo1.5-720p-t2v).
    ``glyph_text``: the ByT5 glyph-text stream is a cond pair ``text_2``/``text_mask_2`` read from the data (True), or
    every prompt is taken to quote no text and the DiT gets the pipeline's empty stream (False: data and cond files
    then hold only ``text``/``text_mask``)."""

    family = HUNYUAN_VIDEO15

    glyph_text: bool = True
