"""Wan 2.1 T2V and Wan 2.2 TI2V (diffusers ``WanTransformer3DModel``): the family's spec.

Wan predicts the flow velocity ``noise - x0`` natively: diffusers' ``WanPipeline`` feeds the transformer output to
``FlowMatchEulerDiscreteScheduler.step``, which computes ``x_next = x + (sigma_next - sigma) * out``, the Euler step of
``dx/dsigma = noise - x0`` for ``x = (1 - sigma) x0 + sigma noise``; so the output is taken as it is.

Conditioning: UMT5 text embeddings ``text [B, L, text_dim]`` and ``text_mask [B, L]`` (1 = real token; FastVideo's
``text_embedding`` and its padding mask). Wan has no text attention mask: it attends to all ``L`` tokens and was
trained on embeddings zero-padded to 512 (as diffusers' WanPipeline and FastVideo feed it), so the mask only zeroes
the padded positions. Wan 2.2 TI2V-5B denoises the 48-channel latents of the Wan 2.2 VAE (16x spatial compression) and
takes one timestep per token, as its pipeline's ``expand_timesteps``; for text-to-video every token gets the sample's.

Image-to-video (Wan 2.1 I2V 14B, Wan 2.2 TI2V-5B's first-frame form) is ``fvx_models.wan_i2v``'s; Wan 2.1 I2V's
image cross-attention takes the text as exactly 512 tokens (diffusers splits image from text tokens by that count), so
its text is zero-padded to 512 as its pipeline pads it. Sequence parallelism is ``fvx_models.wan_sequence_parallel``'s.
"""
from __future__ import annotations

import pathlib
from typing import Any, Mapping

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed
from torch import nn

from fvx.core import random
from fvx.distributed import memory
from fvx_models import diffusers_folder as dfolder, wan_fastvideo_names, wan_i2v, wan_sequence_parallel, wan_two_time
from fvx_models import encoders as fencoders
from fvx_models.build import ModelConfig
from fvx_models.family import (Architecture, Checkpoints, Conditioning, Family, Forward, Preset, TEXT_MASK_DEFAULT,
                               require, skeleton_of)
from fvx_models.model import LatentSpace

# Per-channel statistics of the Wan 2.1 VAE latents (``AutoencoderKLWan``'s ``latents_mean`` / ``latents_std``).
WAN21_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                      0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
WAN21_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                     3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)
# The same of the 48-channel Wan 2.2 VAE (TI2V-5B's ``vae/config.json``).
WAN22_LATENTS_MEAN = (-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
                      -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
                      -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
                      -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
                      -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
                      0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667)
WAN22_LATENTS_STD = (0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
                     0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
                     0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
                     0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
                     0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
                     0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744)

WORLD_CODEC = LatentSpace(192, vae_stride=(1, 8, 8), vae="space-to-depth 8 (fvx.data.toy_world)")  # exact, unnormalised
WORLD_CODEC_4 = LatentSpace(48, vae_stride=(1, 4, 4), vae="space-to-depth 4 (fvx.data.toy_world)")  # a finer grid
WAN21_VAE = LatentSpace(16, WAN21_LATENTS_MEAN, WAN21_LATENTS_STD, vae_stride=(4, 8, 8), vae="Wan 2.1")
WAN22_VAE = LatentSpace(48, WAN22_LATENTS_MEAN, WAN22_LATENTS_STD, vae_stride=(4, 16, 16), vae="Wan 2.2")
TINY_VAE = LatentSpace(16, (0.0,) * 16, (1.0,) * 16, vae_stride=(4, 4, 4), vae="tiny Wan")  # the tiny Wan VAE's

_WAN = dict(
    patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
    cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
    rope_max_seq_len=1024, pos_embed_seq_len=None,
)
TINY = {**_WAN, "num_attention_heads": 2, "attention_head_dim": 48, "text_dim": 32, "freq_dim": 32, "ffn_dim": 192,
        "num_layers": 2, "rope_max_seq_len": 32}
WAN21_1_3B = {**_WAN, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}
WAN21_14B = {**_WAN, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
WAN21_I2V_14B = {**WAN21_14B, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}
WAN22_5B = {**_WAN, "num_attention_heads": 24, "in_channels": 48, "out_channels": 48, "ffn_dim": 14336,
            "num_layers": 30}

# What one Wan block saves per token (saved-tensor hooks, bf16, eager: `python bench/activations.py`): its norms,
# modulations, RoPE and residuals run in fp32. tests/fvx_models/test_families.py measures it again on the tiny model.
BLOCK_ACTIVATIONS = memory.BlockActivations(fp32_dim=12, compute_dim=10, compute_ffn=2)
# With one timestep per token (Wan 2.2 TI2V) each block also saves its per-token modulation in fp32.
PER_TOKEN_T_ACTIVATIONS = {"blocks": memory.BlockActivations(fp32_dim=20, compute_dim=10, compute_ffn=2)}
# With the image embedding's own cross-attention (Wan 2.1 I2V's added_kv_proj_dim) each block also saves its output.
IMAGE_ATTENTION_ACTIVATIONS = {"blocks": memory.BlockActivations(fp32_dim=12, compute_dim=12, compute_ffn=2)}
I2V = {"i2v": wan_i2v.CONCAT, "activations": IMAGE_ATTENTION_ACTIVATIONS}  # Wan 2.1 I2V's, beside its flow shift
TI2V = {"flow_shift": 5.0, "expand_timesteps": True, "activations": PER_TOKEN_T_ACTIVATIONS}

PRESETS: dict[str, Preset] = {
    "tiny": Preset(TINY, TINY_VAE, 8, {"flow_shift": 3.0}),
    # a tiny model of another size (3 heads, 3 layers, wider FFN) on the same latents and text: a tiny DMD2 teacher
    "tiny-deep": Preset({**TINY, "num_attention_heads": 3, "ffn_dim": 288, "num_layers": 3}, TINY_VAE, 8,
                        {"flow_shift": 3.0}),
    # the tiny model in Wan 2.2 TI2V's layout: 48 channels with the 2.2 VAE's statistics, per-token timesteps
    "tiny-ti2v": Preset({**TINY, "in_channels": 48, "out_channels": 48}, WAN22_VAE, 8, TI2V),
    # the toy video world's model (fvx.data.toy_world: 48-channel space-to-depth latents of 32x32 clips, 4 text tokens)
    "world": Preset({**TINY, "in_channels": 192, "out_channels": 192, "patch_size": (1, 1, 1),
                     "num_attention_heads": 4, "attention_head_dim": 64, "ffn_dim": 512, "num_layers": 3}, WORLD_CODEC, 4, {"flow_shift": 3.0}),
    "wan2.1-t2v-1.3b": Preset(WAN21_1_3B, WAN21_VAE, 512, {"flow_shift": 3.0}),
    "wan2.1-t2v-14b": Preset(WAN21_14B, WAN21_VAE, 512, {"flow_shift": 5.0}),
    "wan2.2-ti2v-5b": Preset(WAN22_5B, WAN22_VAE, 512, TI2V),
    # Wan 2.1 I2V's layout, tiny: [x | 4-channel mask | first-frame latents] in, a 16-wide image embedding
    "tiny-i2v": Preset({**TINY, "in_channels": 36, "image_dim": 16, "added_kv_proj_dim": 96}, TINY_VAE, 8,
                       {"flow_shift": 3.0, **I2V}),
    # the toy world's image-to-video model: [x | mask | first frame] (192 + 1 + 192 channels), no image embedding
    "world-i2v": Preset({**TINY, "in_channels": 385, "out_channels": 192, "patch_size": (1, 1, 1),
                         "num_attention_heads": 4, "attention_head_dim": 64, "ffn_dim": 512, "num_layers": 3},
                        WORLD_CODEC, 4, {"flow_shift": 3.0, "i2v": wan_i2v.CONCAT}),
    "wan2.1-i2v-14b-480p": Preset(WAN21_I2V_14B, WAN21_VAE, 512, {"flow_shift": 3.0, **I2V}),
    "wan2.1-i2v-14b-720p": Preset(WAN21_I2V_14B, WAN21_VAE, 512, {"flow_shift": 5.0, **I2V}),
}
"""``WanTransformer3DModel`` constructor arguments per preset (every argument, so a config.json can be checked), the
latent space and the text length (UMT5 pads to 512 tokens; the model accepts any length)."""


def rebuild_rope(module: nn.Module) -> None:
    """Recompute the RoPE tables (a pure function of the config) on the CPU in a module built on meta."""
    config = module.config
    module.rope = WanRotaryPosEmbed(config.attention_head_dim, config.patch_size, config.rope_max_seq_len)


def scale_shift_init(key: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """diffusers' ``scale_shift_table`` init: N(0, 1) / sqrt(dim)."""
    return random.normal(key, shape) / shape[-1] ** 0.5


def text_cond_spec(config: ModelConfig) -> dict[str, tuple]:
    return {"text": ("L", config.spec.kwargs["text_dim"]), "text_mask": ("L",)}


def cond_spec(config: ModelConfig) -> dict[str, tuple]:
    return {**text_cond_spec(config), **wan_i2v.cond_spec(config)}


def text_cond_from_batch(config: ModelConfig, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The UMT5 embedding and its padding mask (FastVideo's ``text_embedding``, padded to ``data.text_len``)."""
    require(batch, ("text", "text_mask"), config.family.name, "the UMT5 text embedding and its mask")
    return {"text": batch["text"], "text_mask": batch["text_mask"]}


def cond_from_batch(config: ModelConfig, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {**text_cond_from_batch(config, batch), **wan_i2v.cond_from_batch(config, batch)}


def masked_text(cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The text embedding with its padded positions zeroed."""
    return cond["text"] * cond["text_mask"][..., None].to(cond["text"].dtype)


def timesteps(config: ModelConfig, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t [B]``, or one per token ``[B, T H W / patch]`` for presets with per-token timesteps (Wan 2.2 TI2V; the
    first frame's tokens at 0 in its image-to-video form)."""
    if not config.spec.options.get("expand_timesteps"):
        return t
    p_t, p_h, p_w = config.spec.kwargs["patch_size"]
    _, _, frames, height, width = x_t.shape
    per_frame = (height // p_h) * (width // p_w)
    if wan_i2v.form(config) == wan_i2v.FIRST_FRAME:
        return wan_i2v.first_frame_timesteps(t, frames // p_t, per_frame)
    return t[:, None].expand(x_t.shape[0], (frames // p_t) * per_frame)


def inputs(config: ModelConfig, x_t: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    kwargs = {"hidden_states": image_input(config, x_t, cond), "timestep": timesteps(config, x_t, t),
              "encoder_hidden_states": masked_text(cond), "return_dict": False}
    if "image_embeds" in cond:
        kwargs["encoder_hidden_states"] = padded_text(kwargs["encoder_hidden_states"], config)
        kwargs["encoder_hidden_states_image"] = cond["image_embeds"]
    return kwargs


def image_input(config: ModelConfig, x_t: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The DiT's ``hidden_states``: ``x_t``, with the given first frame in an image-to-video form."""
    kind = wan_i2v.form(config)
    if kind == wan_i2v.CONCAT:
        return wan_i2v.concat_input(config, x_t, cond)
    if kind == wan_i2v.FIRST_FRAME:
        return wan_i2v.first_frame_input(x_t, cond)
    return x_t


I2V_TEXT_LEN = 512  # the text tokens diffusers' Wan image cross-attention expects after the image tokens


def padded_text(text: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Text ``[B, L, D]`` zero-padded to 512 tokens (a ValueError for more): Wan 2.1 I2V's attention splits its
    context into image and text tokens by that count."""
    if text.shape[1] > I2V_TEXT_LEN:
        raise ValueError(f"{config.family.name}:{config.preset}: its image cross-attention takes at most "
                         f"{I2V_TEXT_LEN} text tokens, got {text.shape[1]} (data.text_len)")
    return torch.nn.functional.pad(text, (0, 0, 0, I2V_TEXT_LEN - text.shape[1]))


def output(config: ModelConfig, out: Any, x: torch.Tensor, t: torch.Tensor,
           cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The DiT's velocity; in the first-frame image-to-video form, the first frame's the exact one toward the
    given frame."""
    if wan_i2v.form(config) == wan_i2v.FIRST_FRAME:
        return wan_i2v.first_frame_velocity(out[0], x, t, cond)
    return out[0]


def widths(config: ModelConfig) -> tuple[int, dict[str, tuple[int, int]]]:
    k = config.spec.kwargs
    dim = k["num_attention_heads"] * k["attention_head_dim"]
    return dim, {"blocks": (dim, k["ffn_dim"])}


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``WanPipeline`` files beside the exported ``transformer/``: ``model_index.json`` and ``scheduler/``
    (a ``FlowMatchEulerDiscreteScheduler`` with the preset's flow shift). The VAE, text encoder and tokenizer that
    model_index.json names are not fvx's to write: copy them from the base model."""
    options = config.spec.options
    FlowMatchEulerDiscreteScheduler(shift=options["flow_shift"]).save_config(folder / "scheduler")
    components = {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
                  "transformer": ("diffusers", "WanTransformer3DModel"), "vae": ("diffusers", "AutoencoderKLWan"),
                  "text_encoder": ("transformers", "UMT5EncoderModel"), "tokenizer": ("transformers", "AutoTokenizer")}
    pipeline = "WanPipeline"
    if "i2v" in options:
        pipeline = "WanImageToVideoPipeline"
        if config.spec.kwargs.get("image_dim"):
            components.update(image_encoder=("transformers", "CLIPVisionModel"),
                              image_processor=("transformers", "CLIPImageProcessor"))
    dfolder.write_model_index(folder, pipeline, components, boundary_ratio=None,
                              expand_timesteps=bool(options.get("expand_timesteps", False)))


ORIGINAL_ROOT = {"patch_embedding": "patch_embedding", "condition_embedder.text_embedder.linear_1": "text_embedding.0",
                 "condition_embedder.text_embedder.linear_2": "text_embedding.2",
                 "condition_embedder.time_embedder.linear_1": "time_embedding.0",
                 "condition_embedder.time_embedder.linear_2": "time_embedding.2",
                 "condition_embedder.time_proj": "time_projection.1", "proj_out": "head.head",
                 "scale_shift_table": "head.modulation",
                 # the CLIP image embedding's projection (I2V): LayerNorm, Linear, GELU (no params), Linear, LayerNorm
                 "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
                 "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
                 "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
                 "condition_embedder.image_embedder.norm2": "img_emb.proj.4",
                 "condition_embedder.image_embedder.pos_embed": "img_emb.emb_pos"}  # FLF2V's (pos_embed_seq_len)
ORIGINAL_BLOCK = {"scale_shift_table": "modulation", "norm2": "norm3", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
                  **{f"{attention}.{projection}": f"{original}.{short}"
                     for attention, original in (("attn1", "self_attn"), ("attn2", "cross_attn"))
                     for projection, short in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "o"),
                                               ("add_k_proj", "k_img"), ("add_v_proj", "v_img"), ("norm_q", "norm_q"),
                                               ("norm_k", "norm_k"), ("norm_added_k", "norm_k_img"))}}
"""diffusers' Wan names -> the original checkpoints' (Wan-AI's repository; what ComfyUI and musubi-tuner load), the
inverse of diffusers' ``convert_wan_transformer_to_diffusers`` (and of the ``TRANSFORMER_KEYS_RENAME_DICT`` of its
``scripts/convert_wan_to_diffusers.py``, which also names FLF2V's ``img_emb.emb_pos``): the root's modules, and a
block's (``norm2``, the cross-attention norm, is the original ``norm3``)."""


def original_name(name: str) -> str | None:
    """A param's or module's name in Wan's original checkpoints (``blocks.3.attn1.to_q.weight`` ->
    ``blocks.3.self_attn.q.weight``); None for a name the original layout does not have."""
    prefix, table = "", ORIGINAL_ROOT
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit():
        prefix, table, name = f"blocks.{parts[1]}.", ORIGINAL_BLOCK, parts[2]
    for module, original in table.items():
        if name == module or name.startswith(module + "."):
            return prefix + original + name[len(module):]
    return None


def skeleton(config: ModelConfig) -> nn.Module:
    """diffusers' Wan on meta, with the r input (``fvx_models.wan_two_time``) when the config asks for it."""
    module = skeleton_of(WanTransformer3DModel, config.spec.kwargs, rebuild_rope)
    if config.two_time:
        wan_two_time.install(module, config.r_embedder)
    return module


def with_r(config: ModelConfig, kwargs: dict[str, Any], x_t: torch.Tensor, r: torch.Tensor) -> dict[str, Any]:
    return wan_two_time.with_r(kwargs, timesteps(config, x_t, r))


# DiffSynth-Studio's Wan LoRA targets (its recipes' "q,k,v,o,ffn.0,ffn.2", name suffixes of its Wan blocks: the self-
# and cross-attention projections and the FFN) as diffusers' module substrings
DIFFSYNTH_LORA_TARGETS = tuple(f"{attention}.{projection}" for attention in ("attn1", "attn2")
                               for projection in ("to_q", "to_k", "to_v", "to_out.0")) + ("ffn.net.0.proj", "ffn.net.2")

# FastVideo's NVFP4 linear QAT profile for Wan (fastvideo/layers/quantization/nvfp4_qat_config.py DEFAULT_FP4_LAYERS,
# matched as substrings of its module names: to_q/k/v/out and ffn.fc_in/fc_out) in diffusers' names
NVFP4_LINEARS = tuple(f"blocks.*.{suffix}" for suffix in (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v",
    "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2"))


def encode_text(pipe: Any, prompts: list[str]) -> list[torch.Tensor]:
    """UMT5's last hidden state at 512 tokens (``WanPipeline.encode_prompt``), each prompt's real tokens."""
    embeds, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=TEXT_LEN,
                                   device=pipe.text_encoder.device)
    return fencoders.real_tokens(embeds, fencoders.token_mask(pipe.tokenizer, TEXT_LEN, prompts, clean=True))


def encode_first_frame(pipe: Any, video: torch.Tensor) -> torch.Tensor:
    """I2V's condition: the first frame then zero (mid-grey) frames, encoded (the mean) and normalised by the VAE's
    latent statistics, as FastVideo's ``ImageVAEEncodingStage`` stores it."""
    condition = torch.cat([video[:, :, :1], torch.zeros_like(video[:, :, 1:])], dim=2)
    return normalized(pipe, fencoders.latent_mean(pipe.vae, condition).float())


def normalized(pipe: Any, latents: torch.Tensor) -> torch.Tensor:
    """VAE latents ``[B, C, t, h, w]`` in the VAE's own scale normalised by its latent statistics (the I2V and
    Animate pipelines' conditions)."""
    shape = (1, -1, 1, 1, 1)
    mean = torch.tensor(pipe.vae.config.latents_mean, device=latents.device).view(shape)
    std = torch.tensor(pipe.vae.config.latents_std, device=latents.device).view(shape)
    return (latents - mean) / std


def encode_image(pipe: Any, frames: torch.Tensor) -> torch.Tensor:
    """The CLIP image encoder's penultimate hidden states of the first frame
    (``WanImageToVideoPipeline.encode_image``)."""
    return pipe.encode_image(fencoders.pil_images(frames), device=frames.device)


TEXT_LEN = 512
ENCODERS = fencoders.Encoders(
    pipeline="WanPipeline", text=("tokenizer", "text_encoder"), encode_text=encode_text,
    encode_video=lambda pipe, video: fencoders.latent_mean(pipe.vae, video), frame_step=4, pixel_multiple=16,
    image=("image_processor", "image_encoder"), encode_image=encode_image, first_frame=encode_first_frame,
    image_wanted=lambda config: bool(config.spec.kwargs.get("image_dim")), audio_refusal="Wan makes no sound")
"""Wan's encoders (every Wan-layout family's: SkyReels-V2, AnyFlow, block-causal Wan, Wan 2.2 A14B): UMT5 at 512
tokens, the VAE's posterior mean, I2V's normalised first frame, and the CLIP image features of a model that reads them
(Wan 2.1 I2V's ``image_dim``; Wan 2.2's I2V folders have no image encoder)."""


WAN = Family(
    name="wan",
    presets=PRESETS,
    encoders=ENCODERS,
    architecture=Architecture(
        skeleton=skeleton,
        unit_groups={"blocks": ("blocks",)},
        activations={"blocks": BLOCK_ACTIVATIONS},
        widths=widths,
        init_rules={"scale_shift_table": scale_shift_init},
        sequence_parallel=wan_sequence_parallel.sequence_parallel,
        derived=lambda config: wan_two_time.derived(config.r_embedder) if config.two_time else {},
        self_attention=("blocks.*.attn1",),
        linear_qat=NVFP4_LINEARS,
    ),
    forward=Forward(
        inputs=inputs,
        output=output,
        with_r=with_r,
    ),
    conditioning=Conditioning(
        spec=cond_spec,
        from_batch=cond_from_batch,
        data_keys=("text", "text_mask", *sorted(wan_i2v.IMAGE_COND)),
        image=wan_i2v.IMAGE_COND,
        defaults=TEXT_MASK_DEFAULT,
    ),
    checkpoints=Checkpoints(
        pipeline_files=pipeline_files,
        original_name=original_name,
        stored_names=wan_fastvideo_names.diffusers_names,
    ),
)


class WanConfig(ModelConfig, tag="wan"):
    """A Wan 2.1 T2V or I2V or Wan 2.2 TI2V-5B DiT (presets: tiny, tiny-deep, tiny-ti2v, tiny-i2v, world, world-i2v,
    wan2.1-t2v-1.3b, wan2.1-t2v-14b, wan2.2-ti2v-5b, wan2.1-i2v-14b-480p, wan2.1-i2v-14b-720p); the shared knobs are
    :class:`fvx_models.build.ModelConfig`'s. ``r_embedder``: a second time input, a flow map ``u(x_t, t, r)``
    (``fvx_models.wan_two_time``; AnyFlow, MeanFlow). ``first_frame``: Wan 2.2 TI2V's image-to-video form, the first
    latent frame given (``fvx_models.wan_i2v``; presets with per-token timesteps)."""

    family = WAN
    r_embedder: wan_two_time.REmbedder | None = None
    first_frame: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.first_frame and not self.spec.options.get("expand_timesteps"):
            raise ValueError(f"models.<role>.first_frame: wan preset {self.preset!r} has no per-token timesteps; the "
                             "first-frame image-to-video form is Wan 2.2 TI2V's (presets tiny-ti2v, wan2.2-ti2v-5b)")

    @property
    def two_time(self) -> bool:
        return self.r_embedder is not None
