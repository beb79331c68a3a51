"""CogVideoX (diffusers ``CogVideoXTransformer3DModel``): a v-prediction DDPM family, trained and sampled as a flow.

CogVideoX denoises ``x = a x0 + b noise`` (``a = sqrt(abar_tau)``, ``b = sqrt(1 - abar_tau)``, ``abar`` the
``CogVideoXDDIMScheduler``'s cumulative product: scaled-linear betas rescaled to zero terminal SNR, then shifted by
``snr_shift_scale``) and predicts ``v = a noise - b x0`` at the integer timestep ``tau``. Dividing by ``s = a + b``
makes that the flow ``x_t = (1 - sigma) x0 + sigma noise`` at ``sigma = b / (a + b)``, so fvx runs it as a flow model:
:func:`inputs` gives the DiT ``s x_t`` at the ``tau`` whose ``abar`` is ``(1 - sigma)^2 / ((1 - sigma)^2 + sigma^2)``
(linear in ``abar`` between the scheduler's integer timesteps), and :func:`output` reads its ``v`` back as the velocity
``noise - x0 = (b - a) s x_t + s v``. Every method then trains and samples it as any flow family.

Its own objective and sampler come through the family's training rules:

- noise levels (:func:`sigma_sampler`): ``tau ~ U{0, ..., 999}``, as diffusers' ``train_cogvideox_lora.py`` draws them;
- loss weight (:func:`loss_weight`): that script's loss is ``1 / (1 - abar) |x0_pred - x0|^2``, which is
  ``1 / s^2 |v_pred - (noise - x0)|^2`` in the flow's terms (``x0_pred - x0 = -sigma (v_pred - v)``);
- sampling levels (:func:`sampling_sigmas`): the DDIM scheduler's trailing timesteps then 0; an Euler step of the flow
  between two of them is exactly its DDIM step (eta 0), so ``validation.schedule=model`` samples as the pipeline does.

Inputs as ``CogVideoXPipeline`` passes them: latents frames first ``[B, T, C, H, W]``, the T5 embedding of all 226
tokens (its pipeline encodes the padding too, without a mask: the data stores every token), the integer-spaced
timestep, and for the rotary presets (5B) the 3-D RoPE tables the pipeline computes from the latent grid; the 2B
presets add sine-cosine positions over exactly ``max_text_seq_length`` text tokens. Image-to-video
(``CogVideoXImageToVideoPipeline``, the ``*-i2v`` presets, ``data.kind=i2v``) adds the first frame's latents on
channels, and its learned position table is a param held frozen (:func:`rebuild_positions`); CogVideoX 1.5's
(``*-1.5-i2v``) has RoPE instead and an "ofs" embedding, which the pipeline always gives 2.0.
"""
from __future__ import annotations

import functools
import pathlib
from typing import Any, Mapping

import torch
from diffusers import CogVideoXDDIMScheduler, CogVideoXTransformer3DModel
from diffusers.models.embeddings import get_3d_rotary_pos_embed
from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid
from torch import nn

from fvx.distributed import memory
from fvx_models import diffusers_folder as dfolder, encoders as fencoders, vp_flow, wan_i2v
from fvx_models.build import ModelConfig
from fvx_models.family import (TEXT_MASK_DEFAULT, Architecture, Checkpoints, Conditioning, Family, Forward, Preset,
                               Training, first_frame_spec, require, skeleton_of)
from fvx_models.model import LatentSpace

# The released pipelines' CogVideoXDDIMScheduler (scheduler_config.json of THUDM/CogVideoX-2b and -5b): only
# ``snr_shift_scale`` differs (a preset option)
SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                 clip_sample=False, set_alpha_to_one=True, steps_offset=0, prediction_type="v_prediction",
                 rescale_betas_zero_snr=True, timestep_spacing="trailing")

_COGVIDEOX = dict(
    num_attention_heads=30, attention_head_dim=64, in_channels=16, out_channels=16, flip_sin_to_cos=True, freq_shift=0,
    time_embed_dim=512, ofs_embed_dim=None, text_embed_dim=4096, num_layers=30, dropout=0.0, attention_bias=True,
    sample_width=90, sample_height=60, sample_frames=49, patch_size=2, patch_size_t=None, temporal_compression_ratio=4,
    max_text_seq_length=226, activation_fn="gelu-approximate", timestep_activation_fn="silu",
    norm_elementwise_affine=True, norm_eps=1e-5, spatial_interpolation_scale=1.875, temporal_interpolation_scale=1.0,
    use_rotary_positional_embeddings=False, use_learned_positional_embeddings=False, patch_bias=True,
)
COGVIDEOX_2B = _COGVIDEOX
COGVIDEOX_5B = {**_COGVIDEOX, "num_attention_heads": 48, "num_layers": 42, "use_rotary_positional_embeddings": True}
# THUDM/CogVideoX-5b-I2V: the 5B with the image latents on channels and a learned position table
COGVIDEOX_5B_I2V = {**COGVIDEOX_5B, "in_channels": 32, "use_learned_positional_embeddings": True}
# THUDM/CogVideoX1.5-5B: two latent frames a token, no patch bias, RoPE over a 300 x 300 grid (diffusers'
# scripts/convert_cogvideox_to_diffusers.py, version "1.5")
COGVIDEOX15_5B = {**COGVIDEOX_5B, "patch_size_t": 2, "patch_bias": False, "sample_height": 300, "sample_width": 300,
                  "sample_frames": 81}
# THUDM/CogVideoX1.5-5B-I2V: the 1.5 layout with the image latents on channels and the "ofs" embedding (RoPE, no
# position table)
COGVIDEOX15_5B_I2V = {**COGVIDEOX15_5B, "in_channels": 32, "ofs_embed_dim": 512}
OFS = 2.0  # the ofs value CogVideoXImageToVideoPipeline passes a DiT with an ofs embedding
TINY = {**_COGVIDEOX, "num_attention_heads": 2, "attention_head_dim": 16, "time_embed_dim": 32, "text_embed_dim": 32,
        "num_layers": 2, "sample_width": 8, "sample_height": 8, "sample_frames": 5, "max_text_seq_length": 8,
        "use_rotary_positional_embeddings": True}


def _vae(scaling_factor: float, what: str) -> LatentSpace:
    """The CogVideoX VAE's latents (16 channels, 4 x 8 x 8), scaled by ``scaling_factor`` into the DiT's input."""
    return LatentSpace(16, scale=scaling_factor, vae_stride=(4, 8, 8), vae=what)


VAE_2B, VAE_5B = _vae(1.15258426, "CogVideoX (2B)"), _vae(0.7, "CogVideoX (5B)")
TINY_VAE = _vae(1.0, "tiny CogVideoX")
WORLD_CODEC = LatentSpace(192, vae_stride=(1, 8, 8), vae="space-to-depth 8 (fvx.data.toy_world)")

PRESETS: dict[str, Preset] = {
    "tiny": Preset(TINY, TINY_VAE, 8, {"snr_shift_scale": 1.0}),  # the 5B's layout: RoPE
    # the 2B's layout: sine-cosine positions over exactly 5 text tokens
    "tiny-2b": Preset({**TINY, "use_rotary_positional_embeddings": False, "max_text_seq_length": 5}, TINY_VAE, 5,
                      {"snr_shift_scale": 3.0}),
    # the toy world's (192-channel space-to-depth latents, one frame a latent frame, 4 text tokens)
    "world": Preset({**TINY, "num_attention_heads": 4, "attention_head_dim": 64, "in_channels": 192,
                     "out_channels": 192, "patch_size": 1, "temporal_compression_ratio": 1, "sample_width": 4,
                     "sample_height": 4, "sample_frames": 4, "max_text_seq_length": 4, "num_layers": 3},
                    WORLD_CODEC, 4, {"snr_shift_scale": 1.0}),
    # its image-to-video form (data.kind=i2v: the toy world's first frames given; its table the world's 2 x 2 grid)
    "world-i2v": Preset({**TINY, "num_attention_heads": 4, "attention_head_dim": 64, "in_channels": 384,
                         "out_channels": 192, "patch_size": 1, "temporal_compression_ratio": 1, "sample_width": 2,
                         "sample_height": 2, "sample_frames": 4, "max_text_seq_length": 4, "num_layers": 3,
                         "use_learned_positional_embeddings": True}, WORLD_CODEC, 4, {"snr_shift_scale": 1.0}),
    # image-to-video: the image latents on channels, a learned position table over a 4 x 4 grid of 2 latent frames
    # and exactly 5 text tokens
    "tiny-i2v": Preset({**TINY, "in_channels": 32, "use_learned_positional_embeddings": True, "sample_width": 4,
                        "sample_height": 4, "max_text_seq_length": 5}, TINY_VAE, 5, {"snr_shift_scale": 1.0}),
    "cogvideox-2b": Preset(COGVIDEOX_2B, VAE_2B, 226, {"snr_shift_scale": 3.0}),
    "cogvideox-5b": Preset(COGVIDEOX_5B, VAE_5B, 226, {"snr_shift_scale": 1.0}),
    "cogvideox-5b-i2v": Preset(COGVIDEOX_5B_I2V, VAE_5B, 226, {"snr_shift_scale": 1.0}),
    # CogVideoX 1.5's layout: two latent frames a token
    "tiny-1.5": Preset({**TINY, "patch_size_t": 2, "patch_bias": False}, TINY_VAE, 8, {"snr_shift_scale": 1.0}),
    "cogvideox1.5-5b": Preset(COGVIDEOX15_5B, VAE_5B, 226, {"snr_shift_scale": 1.0}),
    # its image-to-video form: the image latents on channels and the ofs embedding (as wide as the time embedding)
    "tiny-1.5-i2v": Preset({**TINY, "patch_size_t": 2, "patch_bias": False, "in_channels": 32, "ofs_embed_dim": 32},
                           TINY_VAE, 8, {"snr_shift_scale": 1.0}),
    "cogvideox1.5-5b-i2v": Preset(COGVIDEOX15_5B_I2V, VAE_5B, 226, {"snr_shift_scale": 1.0}),
}
"""``CogVideoXTransformer3DModel`` constructor arguments per preset (THUDM/CogVideoX-2b's and -5b's config.json), the
latent space, the text length (T5 at 226 tokens) and the scheduler's SNR shift."""


# ------------------------------------------------------------------------------------------------ the flow's clock


def scheduler(config: ModelConfig) -> CogVideoXDDIMScheduler:
    """A fresh ``CogVideoXDDIMScheduler`` of the preset's pipeline (its ``snr_shift_scale``)."""
    return CogVideoXDDIMScheduler(**SCHEDULER, snr_shift_scale=config.spec.options["snr_shift_scale"])


@functools.lru_cache(maxsize=None)
def alphas_cumprod(snr_shift_scale: float) -> torch.Tensor:
    """``abar [1000]`` float64 of the pipeline's ``CogVideoXDDIMScheduler`` at ``snr_shift_scale``."""
    return CogVideoXDDIMScheduler(**SCHEDULER, snr_shift_scale=snr_shift_scale).alphas_cumprod.to(torch.float64)


def schedule_abar(config: ModelConfig) -> torch.Tensor:
    """``abar [1000]`` float64 of the preset's scheduler."""
    return alphas_cumprod(config.spec.options["snr_shift_scale"])


def sigma_sampler(config: ModelConfig, keys: torch.Tensor, x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CogVideoX's training levels from per-sample keys ``[B, 2]``: ``tau ~ U{0, ..., 999}`` (diffusers'
    ``train_cogvideox_lora.py``: ``torch.randint(0, 1000)``), as ``(sigma [B], t = 1000 sigma [B])``."""
    return vp_flow.integer_levels(schedule_abar(config), keys, x0.device)


def loss_weight(config: ModelConfig, sigma: torch.Tensor) -> torch.Tensor:
    """The per-sample weight ``1 / s^2`` of the velocity loss: the script's ``1 / (1 - abar)`` on the x0 loss, in the
    flow's terms."""
    return vp_flow.x0_loss_weight(sigma)


def sampling_sigmas(config: ModelConfig, num_steps: int) -> torch.Tensor:
    """The pipeline's ``num_steps`` levels ``[K]``: ``CogVideoXDDIMScheduler.set_timesteps`` (trailing spacing) as flow
    levels (the samplers end at 0, its ``final_alpha_cumprod`` 1). For a step count dividing 1000 (its default 50)
    each DDIM step ends on the next one's timestep and Euler on these levels is its sampling; for another count DDIM
    steps ``1000 // num_steps`` back, off the next timestep (and its last step ends at ``tau`` 0, not at 1), and the
    two differ by that much."""
    ddim = scheduler(config)
    ddim.set_timesteps(num_steps)
    return vp_flow.scheduler_levels(schedule_abar(config), ddim.timesteps)


# ------------------------------------------------------------------------------------------------------ the forward


POSITIONS = "patch_embed.pos_embedding"


def image_to_video(config: ModelConfig) -> bool:
    """Whether the preset takes the image latents beside the video's on channels (CogVideoXImageToVideoPipeline)."""
    return config.spec.kwargs["in_channels"] == 2 * config.spec.latents.channels


def learned(config: ModelConfig) -> bool:
    return config.spec.kwargs["use_learned_positional_embeddings"]


def sine_positions(config: ModelConfig) -> torch.Tensor:
    """The sine-cosine position table ``[1, L_text + tokens, dim]`` fp32 diffusers computes for the preset (text rows
    zero), on the CPU."""
    k = config.spec.kwargs
    with torch.device("meta"):
        embed = CogVideoXTransformer3DModel(**k).patch_embed
    table = embed._get_positional_embeddings(k["sample_height"], k["sample_width"], k["sample_frames"], device="cpu")
    return table.float()


def rebuild_positions(module: nn.Module) -> None:
    """The 2B layout's sine-cosine position table (a pure function of the config), on the CPU; a learned table (the
    I2V models': a persistent buffer in diffusers, loaded from the folder) becomes a param on meta, held frozen."""
    embed = module.patch_embed
    if embed.use_learned_positional_embeddings:
        table = embed._buffers.pop("pos_embedding")
        embed.pos_embedding = nn.Parameter(torch.empty(table.shape, device="meta"), requires_grad=False)
    elif embed.use_positional_embeddings:
        table = embed._get_positional_embeddings(embed.sample_height, embed.sample_width, embed.sample_frames)
        embed.register_buffer("pos_embedding", table, persistent=False)


def skeleton(config: ModelConfig) -> nn.Module:
    return skeleton_of(CogVideoXTransformer3DModel, config.spec.kwargs, rebuild_positions)


def derived(config: ModelConfig) -> dict[str, Any]:
    """A learned table a folder lacks, or a drawn model's: diffusers' own initial table, the sine-cosine one."""
    return {POSITIONS: lambda params: sine_positions(config)} if learned(config) else {}


def held_frozen(config: ModelConfig) -> frozenset[str]:
    """The learned position table: diffusers keeps it as a buffer, so its trainers never train it."""
    return frozenset({POSITIONS}) if learned(config) else frozenset()


def latent_rule(config: ModelConfig, shape: tuple[int, ...]) -> str | None:
    """A learned table covers exactly the preset's sample size (diffusers refuses another height or width, and for
    another frame count silently falls back to a sine table)."""
    if not learned(config):
        return None
    k = config.spec.kwargs
    stride = k["temporal_compression_ratio"]
    frames = (shape[2] - 1) * stride + 1
    if (shape[3], shape[4], frames) != (k["sample_height"], k["sample_width"], k["sample_frames"]):
        return (f"its learned position table covers latents of exactly {k['sample_height']} x {k['sample_width']} "
                f"and {k['sample_frames']} video frames ({(k['sample_frames'] - 1) // stride + 1} latent frames), got "
                f"{shape[3]} x {shape[4]} and {shape[2]} latent frames")
    return None


def rotary(config: ModelConfig, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The RoPE tables ``CogVideoXPipeline._prepare_rotary_positional_embeddings`` makes for latents ``x [B, T, C, H,
    W]`` (the 5B layout), or None."""
    k = config.spec.kwargs
    if not k["use_rotary_positional_embeddings"]:
        return None
    p, p_t = k["patch_size"], k["patch_size_t"]
    grid = (x.shape[3] // p, x.shape[4] // p)
    if p_t is not None:  # CogVideoX 1.5: a slice of the sample grid, one position per two latent frames
        return get_3d_rotary_pos_embed(embed_dim=k["attention_head_dim"], crops_coords=None, grid_size=grid,
                                       temporal_size=(x.shape[1] + p_t - 1) // p_t, grid_type="slice",
                                       max_size=(k["sample_height"] // p, k["sample_width"] // p), device=x.device)
    crops = get_resize_crop_region_for_grid(grid, k["sample_width"] // p, k["sample_height"] // p)
    return get_3d_rotary_pos_embed(embed_dim=k["attention_head_dim"], crops_coords=crops, grid_size=grid,
                                   temporal_size=x.shape[1], device=x.device)


def inputs(config: ModelConfig, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """The DiT's arguments: ``s x_t`` at the scheduler timestep of ``sigma = t / 1000`` (module docstring), beside the
    image latents on channels for image-to-video (not scaled: the pipeline concatenates them as they are), the text
    embedding as stored (a preset with a position table takes exactly its ``max_text_seq_length`` tokens), the RoPE
    tables."""
    sigma = t.float() / 1000
    k = config.spec.kwargs
    text, length = cond["text"], k["max_text_seq_length"]
    if (not k["use_rotary_positional_embeddings"] or learned(config)) and text.shape[1] != length:
        raise ValueError(f"{config.family.name}:{config.preset}: its position table holds exactly {length} text "
                         f"tokens, got {text.shape[1]} (data.text_len={length})")
    hidden = vp_flow.model_input(x, sigma)
    if image_to_video(config):
        given = wan_i2v.given_frames(x.transpose(1, 2), cond, config.family.name).transpose(1, 2)
        hidden = torch.cat([hidden, given.to(hidden.dtype)], dim=2)
    ofs = None if k["ofs_embed_dim"] is None else t.new_full((x.shape[0],), OFS)  # the pipeline's one value a row
    return {"hidden_states": hidden, "encoder_hidden_states": text,
            "timestep": vp_flow.timestep_of(schedule_abar(config), sigma), "image_rotary_emb": rotary(config, x),
            "ofs": ofs, "return_dict": False}


def output(config: ModelConfig, out: Any, x: torch.Tensor, t: torch.Tensor,
           cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The DiT's ``v`` as the flow velocity ``noise - x0 = s ((b - a) x_t + v)`` (module docstring)."""
    return vp_flow.velocity_of_v(out[0], x, t.float() / 1000)


def widths(config: ModelConfig) -> tuple[int, dict[str, tuple[int, int]]]:
    k = config.spec.kwargs
    dim = k["num_attention_heads"] * k["attention_head_dim"]
    return dim, {"blocks": (dim, 4 * dim)}


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``CogVideoXPipeline`` (``CogVideoXImageToVideoPipeline``) files beside ``transformer/``:
    ``model_index.json`` and ``scheduler/`` (its ``CogVideoXDDIMScheduler``); copy the VAE, T5 text encoder and
    tokenizer from the base model."""
    scheduler(config).save_config(folder / "scheduler")
    pipeline = "CogVideoXImageToVideoPipeline" if image_to_video(config) else "CogVideoXPipeline"
    dfolder.write_model_index(folder, pipeline, {
        "scheduler": ("diffusers", "CogVideoXDDIMScheduler"),
        "transformer": ("diffusers", "CogVideoXTransformer3DModel"), "vae": ("diffusers", "AutoencoderKLCogVideoX"),
        "text_encoder": ("transformers", "T5EncoderModel"), "tokenizer": ("transformers", "T5Tokenizer")})


# ----------------------------------------------------------------------------------------------------- encoding


TEXT_LEN = 226


def encode_text(pipe: Any, prompts: list[str]) -> list[torch.Tensor]:
    """T5's last hidden state at 226 tokens (``CogVideoXPipeline._get_t5_prompt_embeds``), every token: the pipeline
    encodes the padding without a mask and the DiT attends to all of it."""
    embeds = pipe._get_t5_prompt_embeds(prompts, max_sequence_length=TEXT_LEN, device=pipe.text_encoder.device)
    return list(embeds)


ENCODERS = fencoders.Encoders(
    pipeline="CogVideoXPipeline", text=("tokenizer", "text_encoder"), encode_text=encode_text,
    encode_video=lambda pipe, video: fencoders.latent_mean(pipe.vae, video), first_frame=fencoders.scaled_first_frame,
    frame_step=4, pixel_multiple=16, audio_refusal="CogVideoX makes no sound")
"""CogVideoX's encoders: T5 at 226 tokens (all of them), the VAE's posterior mean in its own scale (the preset's
``scaling_factor`` scales it into the DiT's input) and, for image-to-video, the first frame's latents scaled as its
pipeline scales them."""


def cond_spec(config: ModelConfig) -> dict[str, tuple]:
    """The T5 text and its mask; image-to-video adds the first frame's latents ``[C, T, H, W]`` (then zero frames)."""
    spec = {"text": ("L", config.spec.kwargs["text_embed_dim"]), "text_mask": ("L",)}
    if image_to_video(config):
        spec.update(first_frame_spec(config))
    return spec


def cond_from_batch(config: ModelConfig, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    names = tuple(cond_spec(config))
    require(batch, names, config.family.name, "the T5 text embedding of all 226 tokens, its mask and, for "
            "image-to-video, the first frame's latents: parquet column first_frame_latent of data.kind='i2v' data")
    return {name: batch[name] for name in names}


COGVIDEOX = Family(
    name="cogvideox",
    presets=PRESETS,
    encoders=ENCODERS,
    architecture=Architecture(
        skeleton=skeleton,
        unit_groups={"blocks": ("transformer_blocks",)},
        # measured (saved-tensor hooks, bf16): 15 dim and 2 ffn in bf16 per token (its text tokens included)
        activations={"blocks": memory.BlockActivations(fp32_dim=0, compute_dim=15, compute_ffn=2)},
        widths=widths,
        init_rules={"pos_embedding": lambda key, shape: torch.zeros(shape)},  # replaced by ``derived``'s table
        derived=derived,
        self_attention=("transformer_blocks.*.attn1",),
        vsa_refusal="its self-attention runs over the text tokens and the video's together",
    ),
    forward=Forward(inputs=inputs, layout="BTCHW", output=output),
    conditioning=Conditioning(spec=cond_spec, from_batch=cond_from_batch,
                              data_keys=("text", "text_mask", "first_frame_latents"),
                              image=frozenset({"first_frame_latents"}), defaults=TEXT_MASK_DEFAULT),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
    training=Training(held_frozen=held_frozen, latent_rule=latent_rule, sigma_sampler=sigma_sampler,
                      loss_weight=loss_weight, sampling_sigmas=sampling_sigmas),
)


class CogVideoXConfig(ModelConfig, tag="cogvideox"):
    """A CogVideoX DiT (presets: tiny, tiny-2b, world, cogvideox-2b, cogvideox-5b, image-to-video tiny-i2v, world-i2v,
    cogvideox-5b-i2v, CogVideoX 1.5's tiny-1.5, cogvideox1.5-5b, tiny-1.5-i2v, cogvideox1.5-5b-i2v), trained and
    sampled as a flow with its own noise levels, loss weight and DDIM levels (module docstring); the shared knobs are
    :class:`fvx_models.build.ModelConfig`'s."""

    family = COGVIDEOX
