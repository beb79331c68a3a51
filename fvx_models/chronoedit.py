"""ChronoEdit (diffusers ``ChronoEditTransformer3DModel``): image editing as a short video of Wan 2.1 I2V.

ChronoEdit-14B is Wan 2.1 I2V 14B trained to edit images: the input image is the video's given first frame and the
edited image its last. Its DiT is Wan's with one change, in its RoPE: with two latent frames (the input and the
edit, ``ChronoEditPipeline`` without temporal reasoning) the edit's temporal position is ``rope_temporal_skip_len - 1``
instead of 1, as if the reasoning frames lay between; with more latent frames (the reasoning trajectory) the
positions are Wan's. Its pipeline calls it exactly as ``WanImageToVideoPipeline`` calls Wan 2.1 I2V (``[x_t | mask |
first-frame latents]`` on channels, the CLIP image embedding, the UMT5 text padded to 512 tokens), so the spec is
Wan's (its inputs, conditioning, I2V data, encoders and original layout) with ChronoEdit's skeleton, presets and
pipeline files.

Data: clips whose first frame is the input image and whose last latent frame is the edit (``data.kind=i2v``, the
same columns as Wan 2.1 I2V): 5 frames for an edit (two latent frames: the first frame, then four frames of the
edited image), more for a reasoning trajectory.
"""
from __future__ import annotations

import pathlib

from diffusers import ChronoEditTransformer3DModel, FlowMatchEulerDiscreteScheduler
from diffusers.models.transformers.transformer_chronoedit import ChronoEditRotaryPosEmbed
from torch import nn

from fvx_models import diffusers_folder as dfolder, wan
from fvx_models.build import ModelConfig
from fvx_models.family import Preset, skeleton_of

SKIP = {"rope_temporal_skip_len": 8}  # diffusers' default, the temporal window the edit's position ends

PRESETS: dict[str, Preset] = {
    "tiny": Preset({**wan.PRESETS["tiny-i2v"].kwargs, **SKIP}, wan.TINY_VAE, 8, wan.PRESETS["tiny-i2v"].options),
    # the toy world's editing model: Wan's world-i2v (first frame given, no image embedding)
    "world": Preset({**wan.PRESETS["world-i2v"].kwargs, **SKIP}, wan.WORLD_CODEC, 4,
                    wan.PRESETS["world-i2v"].options),
    # ChronoEdit-14B: Wan 2.1 I2V 14B's architecture (the model it was trained from), at 720p's flow shift
    "chronoedit-14b": Preset({**wan.WAN21_I2V_14B, **SKIP}, wan.WAN21_VAE, 512, {"flow_shift": 5.0, **wan.I2V}),
}
"""``ChronoEditTransformer3DModel`` constructor arguments per preset (Wan's and ``rope_temporal_skip_len``), the
latent space and the text length."""


def rebuild_rope(module: nn.Module) -> None:
    """Recompute ChronoEdit's RoPE tables (a pure function of the config) on the CPU in a module built on meta."""
    k = module.config
    module.rope = ChronoEditRotaryPosEmbed(k.attention_head_dim, k.patch_size, k.rope_max_seq_len,
                                           temporal_skip_len=k.rope_temporal_skip_len)


def skeleton(config: ModelConfig) -> nn.Module:
    return skeleton_of(ChronoEditTransformer3DModel, config.spec.kwargs, rebuild_rope)


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``ChronoEditPipeline`` files beside the exported ``transformer/``: ``model_index.json`` and
    ``scheduler/`` (a ``FlowMatchEulerDiscreteScheduler`` with the preset's flow shift, the scheduler its pipeline
    declares); copy the VAE, UMT5 text encoder, tokenizer, CLIP image encoder and image processor from the base
    model."""
    FlowMatchEulerDiscreteScheduler(shift=config.spec.options["flow_shift"]).save_config(folder / "scheduler")
    components = {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
                  "transformer": ("diffusers", "ChronoEditTransformer3DModel"),
                  "vae": ("diffusers", "AutoencoderKLWan"), "text_encoder": ("transformers", "UMT5EncoderModel"),
                  "tokenizer": ("transformers", "AutoTokenizer")}
    if config.spec.kwargs.get("image_dim"):
        components.update(image_encoder=("transformers", "CLIPVisionModel"),
                          image_processor=("transformers", "CLIPImageProcessor"))
    dfolder.write_model_index(folder, "ChronoEditPipeline", components)


CHRONOEDIT = wan.WAN.variant(
    name="chronoedit",
    presets=PRESETS,
    architecture={"skeleton": skeleton, "sequence_parallel": None},
    checkpoints={"pipeline_files": pipeline_files},
)
"""Wan's spec with ChronoEdit's presets, skeleton and pipeline; no sequence parallelism (its RoPE is not Wan's)."""


class ChronoEditConfig(ModelConfig, tag="chronoedit"):
    """A ChronoEdit DiT (presets: tiny, world, chronoedit-14b); the shared knobs are
    :class:`fvx_models.build.ModelConfig`'s. Its data is Wan 2.1 I2V's (``data.kind=i2v``) and its folders are
    diffusers' ChronoEdit pipelines; the encoders are Wan's record."""

    family = CHRONOEDIT
