"""Cosmos Predict 2.5 text-to-world (diffusers ``CosmosTransformer3DModel`` set up as Cosmos 2.5): the family's spec.

The DiT denoises the Wan 2.1 VAE's latents (per-channel mean/std, as ``Cosmos2_5_PredictBasePipeline`` and FastVideo's
``normalize_dit_input("cosmos")`` normalise them) and predicts the flow velocity ``noise - x0``: its pipeline steps
``UniPCMultistepScheduler`` in ``flow_prediction`` mode on flow sigmas, whose ``x0 = x - sigma * out`` is that velocity
for ``x = (1 - sigma) x0 + sigma noise``, so the output is taken as it is. Its timestep is the raw sigma ``t / 1000``,
passed as the pipeline passes it for text-to-world: one per latent frame, ``[B, 1, T, 1, 1]`` (every frame the
sample's; the DiT then modulates every token). Its input carries one more channel, the condition mask (zeros: no
conditioning frames), and with ``concat_padding_mask`` (the released checkpoints) the padding mask (zeros), which
diffusers resizes with torchvision: without torchvision such a preset builds and dry-runs, and is refused in one line
before its first step.

Conditioning: the Cosmos-Reason1 (Qwen2.5-VL) embedding ``text [B, L, 100352]`` (every hidden layer normalised and
concatenated, FastVideo's ``text_embedding``) that the DiT projects to 1024 wide (``crossattn_proj``), and
``text_mask [B, L]``, carried but not applied: neither diffusers' pipeline nor FastVideo gives the DiT a text mask or
zeroes padded rows. The unconditional is FastVideo's: zero embeddings with a mask of ones. FastVideo refuses CFG
dropout for this model, and so does fvx (``cfg_dropout_refusal``). FastVideo passes ``fps=16`` to its own DiT, which
ignores it (its Cosmos 2.5 pipeline config sets ``rope_enable_fps_modulation=False``); diffusers' module would scale
the temporal RoPE by 24 / fps, so fvx passes no fps, as diffusers' pipeline does.

Encoders (``ENCODERS``): the stored text is the pipeline's whole 512-token Reason1 embedding (padding rows included, as
the DiT reads them; :func:`encode_text`), the stored latents the Wan VAE's posterior mean, unnormalised (the latent
space normalises them). The pipeline's guardrail is not loaded (:class:`fvx_models.encoders.NoSafetyChecker`).
"""
from __future__ import annotations

import pathlib
from typing import Any, Mapping

import torch
from diffusers import CosmosTransformer3DModel, UniPCMultistepScheduler
from diffusers.models.transformers import transformer_cosmos

from fvx.distributed import memory
from fvx_models import diffusers_folder as dfolder, wan
from fvx_models import encoders as fencoders
from fvx_models.build import ModelConfig
from fvx_models.family import (Architecture, Checkpoints, Conditioning, Family, Forward, Preset, TEXT_MASK_DEFAULT,
                               Training, require, skeleton_of)

FLOW_SHIFT = 1.0  # FastVideo's CosmosModel default and pipeline.flow_shift; the scheduler's flow_shift
REASON1_WIDTH = 100352  # Cosmos-Reason1's 28 hidden layers x 3584, concatenated

_COSMOS25 = dict(
    in_channels=16 + 1, out_channels=16, num_attention_heads=16, attention_head_dim=128, num_layers=28, mlp_ratio=4.0,
    text_embed_dim=1024, adaln_lora_dim=256, max_size=(128, 240, 240), patch_size=(1, 2, 2), rope_scale=(1.0, 3.0, 3.0),
    concat_padding_mask=True, extra_pos_embed_type=None, use_crossattn_projection=True,
    crossattn_proj_in_channels=REASON1_WIDTH, encoder_hidden_states_channels=1024, controlnet_block_every_n=None,
    img_context_dim_in=None, img_context_num_tokens=256, img_context_dim_out=2048,
)
# The tiny model: Cosmos 2.5's structure at width 64 (adaln_lora_dim dim / 8 and cross-attention dim / 2 as the 2B's),
# text 48 wide in place of 100352, and no padding-mask channel (no torchvision needed); tiny-padded has it.
TINY = {**_COSMOS25, "num_attention_heads": 2, "attention_head_dim": 32, "num_layers": 2, "mlp_ratio": 2.0,
        "text_embed_dim": 32, "adaln_lora_dim": 8, "crossattn_proj_in_channels": 48,
        "encoder_hidden_states_channels": 32, "concat_padding_mask": False}

PRESETS: dict[str, Preset] = {
    "tiny": Preset(TINY, wan.TINY_VAE, 8),
    "tiny-padded": Preset({**TINY, "concat_padding_mask": True}, wan.TINY_VAE, 8),
    "cosmos-predict2.5-2b": Preset(_COSMOS25, wan.WAN21_VAE, 512),
    "cosmos-predict2.5-14b": Preset({**_COSMOS25, "num_attention_heads": 40, "num_layers": 36}, wan.WAN21_VAE, 512),
}
"""``CosmosTransformer3DModel`` constructor arguments per preset (every argument, as diffusers'
``convert_cosmos_to_diffusers`` writes Cosmos-2.5-Predict-Base-2B/14B), the latent space and the text length
(Reason1 pads to 512 tokens)."""

# What one block saves per token (saved-tensor hooks, bf16, eager: `PYTHONPATH=tests/helpers python
# bench/activations.py --family cosmos`; tests/fvx_models/test_cosmos.py measures it again). The per-frame timestep
# gives every token its own modulation (three AdaLN-LoRA projections, the time embedding added), as Wan 2.2 TI2V's
# per-token one: 15 of the 38.6 (one timestep per sample would save 27.3 in all, FFN included, against 42.6).
BLOCK_ACTIVATIONS = memory.BlockActivations(fp32_dim=3.2, compute_dim=38.6, compute_ffn=2.0)

TORCHVISION_REFUSAL = ("concat_padding_mask=True: diffusers' CosmosTransformer3DModel resizes the padding mask with "
                       f"torchvision, which is not installed (pip install the torchvision built for torch "
                       f"{torch.__version__.split('+')[0]})")
CFG_DROPOUT_REFUSAL = ("FastVideo's CosmosModel raises NotImplementedError for training_cfg_rate > 0: Reason1's "
                       "negative embeddings are not implemented, and zero embeddings would be a wrong unconditional")


def has_torchvision() -> bool:
    """Whether diffusers' Cosmos module could import torchvision's transforms (its padding-mask resize)."""
    return getattr(transformer_cosmos, "transforms", None) is not None


def text_width(config: ModelConfig) -> int:
    """The width of the text embedding the DiT takes: Reason1's, projected by the DiT, or its cross-attention's."""
    k = config.spec.kwargs
    return k["crossattn_proj_in_channels"] if k["use_crossattn_projection"] else k["text_embed_dim"]


def cond_spec(config: ModelConfig) -> dict[str, tuple]:
    return {"text": ("L", text_width(config)), "text_mask": ("L",)}


def cond_from_batch(config: ModelConfig, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """FastVideo's ``text_embedding`` (the Reason1 embedding) and ``text_attention_mask``, as they are."""
    require(batch, ("text", "text_mask"), "cosmos", "the Reason1 text embedding and its mask")
    return {"text": batch["text"], "text_mask": batch["text_mask"]}


def zero_cond(cond: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FastVideo's Cosmos unconditional: zero embeddings, a mask of ones."""
    return {"text": torch.zeros_like(cond["text"]), "text_mask": torch.ones_like(cond["text_mask"])}


def rope_positions(config: ModelConfig) -> tuple[int, int, int]:
    """The most latent patches along (time, height, width) the position embeddings hold: the RoPE table's length
    ``max(max_size / patch)`` on every axis, and each axis' ``max_size / patch`` with the learnable embedding."""
    k = config.spec.kwargs
    sizes = [size // patch for size, patch in zip(k["max_size"], k["patch_size"])]
    return tuple(sizes) if k["extra_pos_embed_type"] == "learnable" else (max(sizes),) * 3


def latent_rule(config: ModelConfig, shape: tuple[int, ...]) -> str | None:
    if config.spec.kwargs["concat_padding_mask"] and not has_torchvision():
        return TORCHVISION_REFUSAL
    limits, patch = rope_positions(config), config.spec.kwargs["patch_size"]
    patches = [size // p for size, p in zip(shape[2:], patch)]
    if any(n > limit for n, limit in zip(patches, limits)):
        return (f"its position embeddings hold at most {limits} patches of {tuple(patch)} along (T, H, W) "
                f"(max_size {tuple(config.spec.kwargs['max_size'])}), these latents make {tuple(patches)}")
    return None


def inputs(config: ModelConfig, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """The pipeline's text-to-world call: timestep ``sigma`` per latent frame ``[B, 1, T, 1, 1]`` fp32, a zero
    condition mask ``[B, 1, T, H, W]`` and a zero padding mask ``[1, 1, H, W]`` (at the latents' size: the DiT's
    nearest resize of it is then the identity), the text as it is, no fps."""
    if config.spec.kwargs["concat_padding_mask"] and not has_torchvision():
        raise ValueError(f"cosmos:{config.preset}: {TORCHVISION_REFUSAL}")
    batch, _, frames, height, width = x.shape
    sigma = (t.to(torch.float32) / 1000.0).view(batch, 1, 1, 1, 1).expand(batch, 1, frames, 1, 1)
    return {"hidden_states": x, "timestep": sigma, "encoder_hidden_states": cond["text"],
            "condition_mask": x.new_zeros(batch, 1, frames, height, width),
            "padding_mask": x.new_zeros(1, 1, height, width), "return_dict": False}


def widths(config: ModelConfig) -> tuple[int, dict[str, tuple[int, int]]]:
    k = config.spec.kwargs
    dim = k["num_attention_heads"] * k["attention_head_dim"]
    return dim, {"transformer_blocks": (dim, int(dim * k["mlp_ratio"]))}


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``Cosmos2_5_PredictBasePipeline`` files beside ``transformer/``: ``model_index.json`` and
    ``scheduler/`` (``UniPCMultistepScheduler`` as diffusers' converter writes it: Karras flow sigmas from 200 to
    0.01, flow prediction, flow shift 1); copy the VAE (Wan 2.1's), Reason1 text encoder and tokenizer from the base
    model. The pipeline builds its guardrail (``cosmos_guardrail``) itself."""
    UniPCMultistepScheduler(use_karras_sigmas=True, use_flow_sigmas=True, prediction_type="flow_prediction",
                            sigma_max=200.0, sigma_min=0.01, flow_shift=FLOW_SHIFT).save_config(folder / "scheduler")
    dfolder.write_model_index(
        folder, "Cosmos2_5_PredictBasePipeline",
        {"scheduler": ("diffusers", "UniPCMultistepScheduler"),
         "transformer": ("diffusers", "CosmosTransformer3DModel"), "vae": ("diffusers", "AutoencoderKLWan"),
         "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
         "tokenizer": ("transformers", "AutoTokenizer")})


TEXT_LEN = 512  # Cosmos2_5_PredictBasePipeline's max_sequence_length


def encode_text(pipe: Any, prompts: list[str]) -> list[torch.Tensor]:
    """``Cosmos2_5_PredictBasePipeline.encode_prompt``: Reason1's hidden layers at 512 tokens, each normalised, then
    concatenated, ``[512, 100352]`` per prompt, padding rows included: the pipeline runs Reason1 and the DiT without a
    text mask, so the DiT reads the padded positions' embeddings (FastVideo stores the same)."""
    embeds, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=TEXT_LEN,
                                   device=pipe.text_encoder.device)
    return list(embeds)


# The pipeline cannot be built without its VAE (its __init__ reads vae.config's latent statistics): text loads it too.
ENCODERS = fencoders.Encoders(
    pipeline="Cosmos2_5_PredictBasePipeline", text=("tokenizer", "text_encoder", "vae"), encode_text=encode_text,
    encode_video=lambda pipe, video: fencoders.latent_mean(pipe.vae, video), frame_step=4, pixel_multiple=16,
    stand_ins=(("safety_checker", fencoders.NoSafetyChecker()),), audio_refusal="Cosmos Predict 2.5 makes no sound")


COSMOS = Family(
    name="cosmos",
    presets=PRESETS,
    encoders=ENCODERS,
    architecture=Architecture(
        skeleton=lambda config: skeleton_of(CosmosTransformer3DModel, config.spec.kwargs),
        unit_groups={"transformer_blocks": ("transformer_blocks",)},
        activations={"transformer_blocks": BLOCK_ACTIVATIONS},
        widths=widths,
        self_attention=("transformer_blocks.*.attn1",),
    ),
    forward=Forward(inputs=inputs),
    conditioning=Conditioning(
        spec=cond_spec,
        from_batch=cond_from_batch,
        cfg_dropout_refusal=CFG_DROPOUT_REFUSAL,
        zero=zero_cond,
        defaults=TEXT_MASK_DEFAULT,
    ),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
    training=Training(latent_rule=latent_rule),
)


class CosmosConfig(ModelConfig, tag="cosmos"):
    """A Cosmos Predict 2.5 DiT (presets: tiny, tiny-padded, cosmos-predict2.5-2b, cosmos-predict2.5-14b); the
    shared knobs are :class:`fvx_models.build.ModelConfig`'s. The released presets (and tiny-padded) concatenate the
    padding mask, which needs torchvision to run (not to build or dry-run)."""

    family = COSMOS
