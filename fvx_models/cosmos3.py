"""Cosmos 3 Omni (diffusers ``Cosmos3OmniTransformer``): NVIDIA's omni model, a vision-language transformer that
denoises video latents beside its prompt's tokens, text-, image- and video-to-video.

Cosmos 3 is one language-model stack (GQA layers with a second set of weights for the generated tokens: a mixture of
transformers) over one packed sequence per sample: the prompt's token ids, which it embeds itself (there is no text
encoder: the "text" a data row stores is the ids, ``[L, 1]`` float32, padded and masked like an embedding), then the
video latents patchified 2 x 2 with a timestep embedding added to each token. The text attends causally; the video
attends to the text and itself. Positions are 3-D mRoPE: the text's count up from 0, the video's start a margin
after them, time scaled by the clip's frame rate (``fps``, the pipeline's default 24) against the model's base rate.
The sequence has no batch axis, so a forward takes one sample (``Training.one_sample``: a batch runs sample by
sample); the index tensors are built
on the host from the prompt's length, as ``Cosmos3OmniPipeline._prepare_text_segment`` and ``_prepare_vision_segment``
build them (the tests compare). It predicts the flow velocity its ``UniPCMultistepScheduler`` steps (``noise - x0``)
at ``t = 1000 sigma`` (the module scales it by its ``timestep_scale``). Latents are the Wan 2.2 VAE's, normalised by
its statistics as the pipeline's ``_encode_video``.

Image-to-video (``first_frame``, ``data.kind=i2v``), as the pipeline's ``image=`` call: latent frame 0 is the given
frame's latents, clean (the pipeline's condition mask), its patches without a timestep embedding or a prediction
(``_prepare_vision_segment(has_image_condition=True)``); the pipeline zeroes that frame's velocity so it stays the
image, and fvx returns the exact velocity toward it, ``(x_t - x_first) / sigma``, so the loss covers the other frames
and samplers land on the image (Wan 2.2 TI2V's form, ``fvx_models.wan_i2v``).

Video-to-video (``given_frames = k``, any t2v data), as the pipeline's ``video=`` call with
``condition_frame_indexes_vision`` ``range(k)`` (its default ``(0, 1)``): the first ``k`` latent frames are the clip's
own, clean condition frames, treated as image-to-video's frame 0. The pipeline encodes the given video repeat-padded to
the clip's length; the Wan 2.2 VAE is causal in time, so its first ``k`` latent frames are the clip's own, and the cond
is the batch's latents (:data:`GIVEN`, normalised in the forward).

fvx trains the video branch: what no video velocity reads is held frozen (the language-model head, the text's final
norm, the last layer's text path after its keys and values: :func:`unused`); the sound and action branches of the omni
release are left. Each prompt states its clip as the pipeline's default prompt augmentation does (its duration and
resolution sentences, their inverses for a negative prompt: :func:`encode_text`), the clip the data's row was cut to,
the video ``sample`` makes, or the clip ``data.preprocess`` cuts for ``encode-prompts``. The preset is diffusers'
defaults, which have no sound or action heads: a folder with them is refused by the config check, naming the
field.
"""
from __future__ import annotations

import pathlib
from typing import Any, Mapping

import msgspec
import torch
from diffusers import Cosmos3OmniTransformer
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3VLTextRotaryEmbedding
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import (get_3d_mrope_ids_text_tokens,
                                                              get_3d_mrope_ids_vae_tokens)
from torch import nn
from typing_extensions import Annotated

from fvx.distributed import memory
from fvx_models import cond as fcond, diffusers_folder as dfolder, encoders as fencoders, wan, wan_i2v
from fvx_models.build import ModelConfig
from fvx_models.family import (TEXT_MASK_DEFAULT, Architecture, Checkpoints, Conditioning, Family, Forward, Preset,
                               Training, first_frame_from_batch, first_frame_spec, require, skeleton_of)

# diffusers' Cosmos3OmniTransformer defaults (the released omni model's video stack: 36 layers of width 4096, 32
# query and 8 key-value heads of 128, Qwen's vocabulary; no sound or action heads), every argument but the load-time
# ``dtype``; a folder's config.json is checked against it
COSMOS3 = dict(
    attention_bias=False, attention_dropout=0.0, head_dim=128, hidden_size=4096, intermediate_size=12288, base_fps=24,
    enable_fps_modulation=True, latent_channel=48, unified_3d_mrope_reset_spatial_ids=True,
    unified_3d_mrope_temporal_modality_margin=15000, latent_patch_size=2, num_attention_heads=32, num_hidden_layers=36,
    num_key_value_heads=8, patch_latent_dim=192, rms_norm_eps=1e-6, rope_scaling=None, rope_theta=5000000.0,
    action_dim=None, action_gen=False, num_embodiment_domains=32, sound_dim=None, sound_gen=False,
    sound_latent_fps=25.0, timestep_scale=0.001, vocab_size=151936, hidden_act="silu", qk_norm_for_text=True,
    use_und_k_norm_for_gen=False, rope_axes_dim=(24, 20, 20),
)
TINY = {**COSMOS3, "head_dim": 16, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "latent_channel": 16, "patch_latent_dim": 64,
        "vocab_size": 64, "rope_axes_dim": (4, 2, 2)}

PRESETS: dict[str, Preset] = {
    "tiny": Preset(TINY, wan.TINY_VAE, 8),
    # the toy world's (48-channel space-to-depth 4 latents, patched 2 x 2; its captions' words as token ids)
    "world": Preset({**TINY, "head_dim": 64, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
                     "latent_channel": 48, "patch_latent_dim": 192, "vocab_size": 16, "rope_axes_dim": (16, 8, 8)},
                    wan.WORLD_CODEC_4, 4),
    "cosmos3-omni": Preset(COSMOS3, wan.WAN22_VAE, 512),
}
"""``Cosmos3OmniTransformer`` constructor arguments per preset, the latent space (the Wan 2.2 VAE's, as the pipeline
normalises it) and the prompt length data rows are padded to (token ids)."""

LAST_TEXT_PATH = ("self_attn.to_q", "self_attn.norm_q", "self_attn.to_out", "post_attention_layernorm",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
ONE_SAMPLE = "its forward packs one prompt-and-video sequence without a batch axis (the pipeline runs batch 1)"


def rebuild(module: nn.Module) -> None:
    """The rotary table (a buffer, a pure function of the config), on the CPU."""
    k = module.config
    module.rotary_emb = Cosmos3VLTextRotaryEmbedding(k.head_dim, k.rope_theta, tuple(k.rope_axes_dim))


def skeleton(config: ModelConfig) -> nn.Module:
    return skeleton_of(Cosmos3OmniTransformer, config.spec.kwargs, rebuild)


def unused(config: ModelConfig) -> frozenset[str]:
    """What no video velocity reads, held frozen: the language-model head and the text's final norm, and the last
    layer's text path after its keys and values (its queries, output and MLP: their output is dropped)."""
    last = f"layers.{config.spec.kwargs['num_hidden_layers'] - 1}."
    return frozenset({"lm_head.weight", "norm.weight", *(f"{last}{module}.weight" for module in LAST_TEXT_PATH)})


GIVEN = "given_latents"
"""Video-to-video's cond tensor: the clip's own latents ``[C, T, H, W]`` as the data stores them (the VAE's scale), of
which the first ``given_frames`` are given."""


def clean_frames(config: Cosmos3Config) -> int:
    """The latent frames held clean: image-to-video's frame 0, or video-to-video's first ``given_frames``."""
    return config.given_frames or int(config.first_frame)


def given_latents(config: Cosmos3Config, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The clean frames' latents ``[B, C, k, H, W]`` in the DiT's scale: the image's (stored so), or the given
    video's, normalised as the training latents are."""
    if config.first_frame:
        return cond["first_frame_latents"][:, :, :1]
    return config.spec.latents.normalize(cond[GIVEN][:, :, :config.given_frames])


def cond_spec(config: Cosmos3Config) -> fcond.Spec:
    """The prompt's token ids ``[L, 1]`` (float32) and their mask; image-to-video adds the first frame's latents
    ``[C, T, H, W]`` (frame 0 read), video-to-video the clip's latents (its first ``given_frames`` read)."""
    given = {GIVEN: (config.spec.latents.channels, "T", "H", "W")} if config.given_frames else {}
    return {"text": ("L", 1), "text_mask": ("L",), **(first_frame_spec(config) if config.first_frame else {}),
            **given}


def cond_from_batch(config: Cosmos3Config, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The token ids and their mask (and image-to-video's first frame); a ValueError names a missing tensor or text
    that is not ids."""
    name = config.family.name
    require(batch, ("text", "text_mask"), name, "the prompt's token ids: parquet column text_embedding")
    if batch["text"].dim() != 3 or batch["text"].shape[2] != 1:
        raise ValueError(f"{name}: text_embedding {list(batch['text'].shape[1:])} must be [L, 1], the prompt's token "
                         "ids (Cosmos 3 embeds its tokens itself); preprocess with its encoders")
    if config.given_frames:  # the clip's own first frames
        require(batch, ("latents",), name, f"the clip's latents, whose first given_frames={config.given_frames} it "
                "continues: video data, or sample --video")
    given = {GIVEN: batch["latents"]} if config.given_frames else {}
    return {"text": batch["text"], "text_mask": batch["text_mask"],
            **(first_frame_from_batch(config, batch) if config.first_frame else {}), **given}


def packed(config: Cosmos3Config, tokens: int, grid: tuple[int, int, int], device: torch.device) -> dict[str, Any]:
    """The packed sequence's layout for a prompt of ``tokens`` ids and latents of ``grid`` ``(T, H, W)``, as the
    pipeline's ``_prepare_text_segment`` and ``_prepare_vision_segment`` build it: the text at positions ``[0, L)``,
    the video's patches after it, every latent frame noised but the clean ones (:func:`clean_frames`: their patches
    get no timestep and no prediction)."""
    k = config.spec.kwargs
    frames, height, width = grid
    patch = k["latent_patch_size"]
    rows, cols = -(-height // patch), -(-width // patch)
    count = frames * rows * cols
    text_positions, offset = get_3d_mrope_ids_text_tokens(tokens, 0, use_float_positions=k["enable_fps_modulation"])
    video_positions, _ = get_3d_mrope_ids_vae_tokens(
        frames, rows, cols, offset + k["unified_3d_mrope_temporal_modality_margin"],
        reset_spatial_indices=k["unified_3d_mrope_reset_spatial_ids"],
        fps=config.fps if k["enable_fps_modulation"] else None, base_fps=float(k["base_fps"]),
        temporal_compression_factor=config.spec.latents.vae_stride[0])
    given = clean_frames(config)
    return {"text_indexes": torch.arange(tokens, device=device), "und_len": tokens, "sequence_length": tokens + count,
            "position_ids": torch.cat([text_positions, video_positions], dim=1).to(device),
            "vision_token_shapes": [(frames, rows, cols)],
            "vision_sequence_indexes": torch.arange(tokens, tokens + count, device=device),
            "vision_mse_loss_indexes": torch.arange(tokens + given * rows * cols, tokens + count, device=device),
            "vision_noisy_frame_indexes": [torch.arange(given, frames, device=device)]}


def inputs(config: Cosmos3Config, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """One sample's call (``x [1, C, T, H, W]``): the prompt's real token ids, the latents as the one vision item
    (image- and video-to-video: the first frames the given ones), each noised patch at the sample's ``t``."""
    ids = cond["text"][0, cond["text_mask"][0].bool(), 0].round().long()
    layout = packed(config, ids.shape[0], tuple(x.shape[2:]), x.device)
    if clean_frames(config):
        x = wan_i2v.clean_frames_input(x, given_latents(config, cond))
    count = layout["vision_mse_loss_indexes"].shape[0]
    return {"input_ids": ids, "vision_tokens": [x], "vision_timesteps": t.expand(count), "return_dict": False,
            **layout}


def output(config: Cosmos3Config, out: Any, x: torch.Tensor, t: Any, cond: Mapping[str, torch.Tensor]
           ) -> torch.Tensor:
    """The vision item's velocity ``[1, C, T, H, W]`` (the module returns one per item); the clean frames' the exact
    velocity toward the given ones, ``(x_t - x_given) / sigma`` (the pipeline holds them clean)."""
    v = out[0][0]
    return wan_i2v.clean_frames_velocity(v, x, t, given_latents(config, cond)) if clean_frames(config) else v


def latent_rule(config: ModelConfig, shape: tuple[int, ...]) -> str | None:
    patch = config.spec.kwargs["latent_patch_size"]
    if shape[3] % patch or shape[4] % patch:
        return f"latents {shape[3]} x {shape[4]} do not divide into its {patch} x {patch} patches"
    if config.given_frames >= shape[2]:
        return (f"given_frames={config.given_frames} leaves none of these latents' {shape[2]} frames to make; set it "
                "below the clip's latent frames")
    return None


def widths(config: ModelConfig) -> tuple[int, dict[str, tuple[int, int]]]:
    k = config.spec.kwargs
    return k["hidden_size"], {"layers": (k["hidden_size"], k["intermediate_size"])}


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``Cosmos3OmniPipeline`` ``model_index.json`` beside ``transformer/``; copy ``text_tokenizer/``,
    ``vae/`` and ``scheduler/`` (its UniPC at the release's flow shift, not read here) from the base model."""
    dfolder.write_model_index(folder, "Cosmos3OmniPipeline", {
        "transformer": ("diffusers", "Cosmos3OmniTransformer"), "vae": ("diffusers", "AutoencoderKLWan"),
        "scheduler": ("diffusers", "UniPCMultistepScheduler"), "text_tokenizer": ("transformers", "AutoTokenizer")})


# ----------------------------------------------------------------------------------------------------- encoding


def encode_text(pipe: Any, prompts: list[str], clips: list[Any]) -> list[torch.Tensor]:
    """``Cosmos3OmniPipeline.tokenize_prompt``'s ids of each prompt for its clip (``fvx.data.preprocess.Clip``): the
    system prompt (a video's, or an image's for one frame) and chat template around the prompt with the duration
    (a video) and resolution sentences appended, their inverses for a negative prompt, then the end and vision-start
    tokens: ``[L_i, 1]`` float32."""
    rows = []
    for prompt, clip in zip(prompts, clips):
        shape = dict(num_frames=clip.frames, height=clip.height, width=clip.width, fps=clip.fps)
        cond, uncond = (pipe.tokenize_prompt("", negative_prompt=prompt, **shape) if clip.negative
                        else pipe.tokenize_prompt(prompt, **shape))
        rows.append(uncond if clip.negative else cond)
    return [torch.tensor(row, dtype=torch.float32)[:, None] for row in rows]


ENCODERS = fencoders.Encoders(
    pipeline="Cosmos3OmniPipeline", text=("text_tokenizer", "vae"), encode_text=encode_text, text_states_clip=True,
    video=("vae", "text_tokenizer"), encode_video=lambda pipe, video: fencoders.latent_mean(pipe.vae, video),
    first_frame=wan.encode_first_frame, frame_step=4, pixel_multiple=32,
    stand_ins=(("safety_checker", fencoders.NoSafetyChecker()),),
    audio_refusal="fvx trains Cosmos 3's video branch; its sound branch is not built here")
"""Cosmos 3's encoders: the pipeline's tokenization (ids, no text encoder; each prompt stating its clip, as the
pipeline's default prompt augmentation does) and the Wan 2.2 VAE's posterior mean,
unnormalised (the latent space normalises); the pipeline cannot be built without both its tokenizer and its VAE, so
each part loads both."""


COSMOS3_FAMILY = Family(
    name="cosmos3",
    presets=PRESETS,
    encoders=ENCODERS,
    architecture=Architecture(
        skeleton=skeleton,
        unit_groups={"layers": ("layers",)},
        # measured (saved-tensor hooks, bf16) per video token, the growth from 16 x 16 to 32 x 32 latents (the
        # prompt's tokens left out, as the dry run counts video tokens); its SwiGLU MLP saves 4 ffn-wide tensors
        activations={"layers": memory.BlockActivations(fp32_dim=3.69, compute_dim=11, compute_ffn=4)},
        widths=widths,
        patch=lambda config: (1, config.spec.kwargs["latent_patch_size"], config.spec.kwargs["latent_patch_size"]),
        whole_graph_refusal=("it keeps only the prompt's real tokens (boolean indexing) and builds the packed "
                             "sequence's index tensors on the host from their count"),
        vsa_refusal="its attention runs over one packed text-and-video sequence, not the video grid's tokens",
    ),
    forward=Forward(inputs=inputs, output=output),
    conditioning=Conditioning(
        spec=cond_spec, from_batch=cond_from_batch, defaults=TEXT_MASK_DEFAULT,
        data_keys=("text", "text_mask", "first_frame_latents"), image=frozenset({"first_frame_latents", GIVEN}),
        cfg_dropout_refusal=("its prompt is token ids: fvx's CFG dropout zeroes text embeddings and keeps their mask, "
                             "which for ids is a prompt of token 0, not an empty one")),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
    training=Training(held_frozen=unused, latent_rule=latent_rule, one_sample=ONE_SAMPLE),
)


class Cosmos3Config(ModelConfig, tag="cosmos3"):
    """A Cosmos 3 Omni transformer, text-to-video (presets: tiny, world, cosmos3-omni). ``fps``: the clips' frame
    rate, which scales the video's time positions (the pipeline's default 24; match ``data.preprocess.train_fps``);
    ``first_frame``: image-to-video, the given first frame as the clean frame 0 (``data.kind=i2v``); ``given_frames``:
    video-to-video, the clip's first ``k`` latent frames clean (the pipeline's ``video=`` call; its default
    ``condition_frame_indexes_vision`` gives 2; module docstring). The shared knobs are
    :class:`fvx_models.build.ModelConfig`'s."""

    family = COSMOS3_FAMILY

    fps: Annotated[float, msgspec.Meta(gt=0)] = 24.0
    first_frame: bool = False
    given_frames: Annotated[int, msgspec.Meta(ge=0)] = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.first_frame and self.given_frames:
            raise ValueError(f"first_frame=true and given_frames={self.given_frames}: give an image (first_frame) or "
                             "the clip's first frames (given_frames), not both")
