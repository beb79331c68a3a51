"""HunyuanVideo text-to-video (diffusers ``HunyuanVideoTransformer3DModel``): the family's spec.

Three unit groups: 20 dual-stream blocks (video and text tokens apart, joint attention), 40 single-stream blocks (one
concatenated sequence) and the text token refiner's blocks (run over the text tokens only). Conditioning: the LLaMA
text embedding ``text [B, L, 4096]`` with its mask ``text_mask [B, L]`` (valid tokens first, as the pipeline's
tokenizer pads), and CLIP's pooled embedding ``pooled [B, 768]``. FastVideo's Hunyuan data packs the pooled vector as
row 0 of ``text_embedding``, zero-padded to the LLaMA width (``../shared/spec/fastvideo_train.md`` §3.3): row 0 is
``pooled``, rows 1: are ``text``. ``ENCODERS`` makes those rows with diffusers' ``HunyuanVideoPipeline.encode_prompt``
and stores the VAE's posterior mean unscaled.

The DiT predicts the flow velocity (its pipeline steps ``FlowMatchEulerDiscreteScheduler``). It is
guidance-distilled: it embeds a guidance scale, which its pipeline passes as ``guidance_scale * 1000``
(``HunyuanVideoConfig.embedded_guidance``, default the pipeline's 6.0). Latents are the HunyuanVideo VAE's scaled by
its ``scaling_factor`` 0.476986, as FastVideo's plugin normalises them; FastVideo trains it with flow shift 7.
Two departures from FastVideo's trainer (docs/design.md): padded text tokens are masked, as diffusers' pipeline
(which samples what fvx exports) masks them, and the guidance goes in as fp32 ``g * 1000`` (6000), where FastVideo's
DiT uses the literal 6016.0, bf16's rounding of it (``embedded_guidance=6.016`` reproduces that).
"""
from __future__ import annotations

import pathlib
from typing import Any, Mapping

import msgspec
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoTransformer3DModel
from typing_extensions import Annotated

from fvx.distributed import memory
from fvx_models import diffusers_folder as dfolder
from fvx_models import encoders as fencoders
from fvx_models.build import ModelConfig
from fvx_models.family import (Architecture, Checkpoints, Family, Forward, Preset, pack_pooled,
                               packed_pooled_conditioning, skeleton_of)
from fvx_models.model import LatentSpace

SCALING_FACTOR = 0.476986  # AutoencoderKLHunyuanVideo's scaling_factor
LATENTS = LatentSpace(16, scale=SCALING_FACTOR, vae_stride=(4, 8, 8), vae="HunyuanVideo")
FLOW_SHIFT = 7.0

_HUNYUAN = dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
                num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
                qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
                rope_theta=256.0, rope_axes_dim=(16, 56, 56), image_condition_type=None)

PRESETS: dict[str, Preset] = {
    "tiny": Preset({**_HUNYUAN, "num_attention_heads": 2, "attention_head_dim": 32, "num_layers": 1,
                    "num_single_layers": 2, "num_refiner_layers": 1, "mlp_ratio": 2.0, "text_embed_dim": 32,
                    "pooled_projection_dim": 16, "rope_axes_dim": (8, 12, 12)}, LATENTS, 9),
    "hunyuanvideo-t2v": Preset(_HUNYUAN, LATENTS, 257),  # 256 LLaMA tokens + the packed pooled row
}
"""``HunyuanVideoTransformer3DModel`` constructor arguments per preset (every argument), latent space, and the packed
text length (the LLaMA tokens plus the pooled row)."""

REFINER_MLP_RATIO = 4.0  # the token refiner's own (diffusers does not pass the model's mlp_ratio to it)

# What one unit of each group saves per token it runs over (saved-tensor hooks, bf16, eager: `python
# bench/activations.py`; tests/fvx_models/test_families.py measures it again). The refiner's FFN is 4x its width
# whatever the model's mlp_ratio, so its FFN vectors are counted at width dim.
ACTIVATIONS = {
    "transformer_blocks": memory.BlockActivations(fp32_dim=2.2, compute_dim=16.7, compute_ffn=2.1),
    "single_transformer_blocks": memory.BlockActivations(fp32_dim=2.2, compute_dim=14.5, compute_ffn=2.1),
    "token_refiner": memory.BlockActivations(fp32_dim=0.0, compute_dim=17.7, compute_ffn=0.0),
}


def zero_cond(cond: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Zero embeddings with one valid token: the token refiner pools over the mask, so an all-zero mask would divide
    0 by 0 (an empty prompt still has its begin-of-text token)."""
    mask = torch.zeros_like(cond["text_mask"])
    mask[:, 0] = 1
    return {"text": torch.zeros_like(cond["text"]), "text_mask": mask, "pooled": torch.zeros_like(cond["pooled"])}


def inputs(config: HunyuanVideoConfig, x_t: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    kwargs = {"hidden_states": x_t, "timestep": t, "encoder_hidden_states": cond["text"],
              "encoder_attention_mask": cond["text_mask"], "pooled_projections": cond["pooled"],
              "return_dict": False}
    if config.spec.kwargs["guidance_embeds"]:
        kwargs["guidance"] = torch.full((x_t.shape[0],), config.embedded_guidance * 1000.0, dtype=torch.float32,
                                        device=x_t.device)
    return kwargs


def widths(config: ModelConfig) -> tuple[int, dict[str, tuple[int, int]]]:
    k = config.spec.kwargs
    dim = k["num_attention_heads"] * k["attention_head_dim"]
    ffn = int(dim * k["mlp_ratio"])
    return dim, {"transformer_blocks": (dim, ffn), "single_transformer_blocks": (dim, ffn),
                 "token_refiner": (dim, int(dim * REFINER_MLP_RATIO))}


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``HunyuanVideoPipeline`` files beside ``transformer/``: ``model_index.json`` and ``scheduler/``
    (flow shift 7); copy the VAE, both text encoders and tokenizers from the base model."""
    FlowMatchEulerDiscreteScheduler(shift=FLOW_SHIFT).save_config(folder / "scheduler")
    dfolder.write_model_index(
        folder, "HunyuanVideoPipeline",
        {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
         "transformer": ("diffusers", "HunyuanVideoTransformer3DModel"),
         "vae": ("diffusers", "AutoencoderKLHunyuanVideo"), "text_encoder": ("transformers", "LlamaModel"),
         "tokenizer": ("transformers", "LlamaTokenizerFast"), "text_encoder_2": ("transformers", "CLIPTextModel"),
         "tokenizer_2": ("transformers", "CLIPTokenizer")})


def encode_text(pipe: Any, prompts: list[str]) -> list[torch.Tensor]:
    """``HunyuanVideoPipeline.encode_prompt`` as its ``__call__`` calls it (the LLaMA's ``hidden_states[-3]`` of the
    prompt in its video template, the 95 template tokens cropped, 256 tokens; CLIP's pooled output): each prompt's
    real tokens after its pooled row, ``[1 + L_i, 4096]``."""
    embeds, pooled, mask = pipe.encode_prompt(prompts, device=pipe.text_encoder.device)
    return pack_pooled(pooled, fencoders.real_tokens(embeds, mask))


def llama_tokenizer(path: pathlib.Path) -> Any:
    """The LLaMA's tokenizer as its ``tokenizer.json`` declares it: transformers 5's ``LlamaTokenizerFast`` (which
    ``model_index.json`` names) rebuilds HunyuanVideo's byte-level Llama 3 tokenizer as a SentencePiece one, which
    drops the spaces and pads on the left (transformers 4 read the file as it is)."""
    import transformers

    if (path / "tokenizer.json").is_file():
        return transformers.PreTrainedTokenizerFast.from_pretrained(path)
    return transformers.LlamaTokenizerFast.from_pretrained(path)


ENCODERS = fencoders.Encoders(
    pipeline="HunyuanVideoPipeline", text=("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2"),
    encode_text=encode_text, encode_video=lambda pipe, video: fencoders.latent_mean(pipe.vae, video),
    frame_step=4, pixel_multiple=16, audio_refusal="HunyuanVideo makes no sound",
    own_loaders=(("tokenizer", llama_tokenizer),))
"""HunyuanVideo's encoders: the packed text rows above and the VAE's posterior mean, unscaled (``LATENTS`` applies the
scaling factor in training); 4x temporal compression, 8x spatial times the DiT's 2x2 patch."""


HUNYUAN_VIDEO = Family(
    name="hunyuan_video",
    presets=PRESETS,
    encoders=ENCODERS,
    architecture=Architecture(
        skeleton=lambda config: skeleton_of(HunyuanVideoTransformer3DModel, config.spec.kwargs),
        unit_groups={"transformer_blocks": ("transformer_blocks",),
                     "single_transformer_blocks": ("single_transformer_blocks",),
                     "token_refiner": ("context_embedder.token_refiner.refiner_blocks",)},
        activations=ACTIVATIONS,
        text_groups=frozenset({"token_refiner"}),
        widths=widths,
        self_attention=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn"),
        vsa_refusal="its self-attention runs over the video and text tokens together (one joint sequence)",
    ),
    forward=Forward(inputs=inputs),
    conditioning=packed_pooled_conditioning("text_embed_dim", "pooled_projection_dim",
                                            "the packed [pooled CLIP | LLaMA] text embedding", zero=zero_cond),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
)


class HunyuanVideoConfig(ModelConfig, tag="hunyuan_video"):
    """A HunyuanVideo DiT (presets: tiny, hunyuanvideo-t2v). ``embedded_guidance``: the guidance scale the
    guidance-distilled DiT is told (its pipeline's ``guidance_scale``, passed as ``g * 1000``); required by every
    preset, which all embed guidance."""

    family = HUNYUAN_VIDEO

    embedded_guidance: Annotated[float, msgspec.Meta(gt=0)] | None = 6.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.spec.kwargs["guidance_embeds"] and self.embedded_guidance is None:
            raise ValueError(f"HunyuanVideo preset {self.preset!r} embeds a guidance scale: set "
                             "embedded_guidance (its pipeline's guidance_scale, default 6.0)")
