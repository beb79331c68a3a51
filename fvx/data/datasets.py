"""Training data: what a run reads (FastVideo's preprocessed parquet, the toy world or a synthetic set) and its config.

A dataset maps indices to a collated batch (``read``); ``fvx.data.batching`` picks the step's batch from it. The
parquet format is ``fvx.data.parquet``; ``fvx.data.preprocess`` writes it from videos and captions.

Batch dict (torch tensors except ``caption``)::

    latents      [B, C, T, H, W] float32   (every kind but "text_only": vae_latent; kind "framepack": a section's)
    first_frame_latents [B, C, T, H, W]    (kinds "i2v", "i2va" and "matrixgame2": first_frame_latent, the VAE
                                            latents of the first frame followed by zero frames, normalised: FastVideo
                                            stores them so)
    image_embeds [B, N, D] float32         (kinds "i2v", "i2va", "matrixgame2" when the data has them, "framepack":
                                            clip_feature, the image encoder's hidden states; FastVideo writes empty
                                            bytes for a model without)
    keyboard     [B, F, K] float32         (kind "matrixgame2": keyboard_cond, one row of keys per video frame,
                                            F = (T - 1) r + 1 for the VAE's time stride r, kept as stored; FastVideo's
                                            universal order W, S, A, D)
    mouse        [B, F, 2] float32         (kind "matrixgame2" when the data has it: mouse_cond, per video frame)
    vace_context [B, C', T, H, W] float32  (kind "vace": vace_context, Wan VACE's control context over the latents'
                                            frames: inactive and reactive latents and the packed mask)
    framepack_history [B, C, 20, H, W]     (kind "framepack": a section's clean history, fvx.data.sections' layout)
    reference_latents [B, C + 4, T, H, W]  (kind "animate": Wan-Animate's mask, reference frame and previous segment;
                                            its latents' frame 0 is the reference image's, fvx_models.wan_animate)
    pose_latents [B, C, T - 1, H, W]       (kind "animate": the pose video's latents)
    face_pixels  [B, 3, 4 (T - 2) + 1, S, S]   (kind "animate": the face video in [-1, 1], stored as uint8)
    frame_indices [B, T + 20] float32      (kind "framepack": the RoPE time positions of the section and its history)
    audio_latents [B, 2, 32, A] float32    (kinds "t2va", "i2va": audio_latent, the stereo audio VAE's latents
                                            [C, F, A] as FastVideo's t2va preprocessing stores them; a stored
                                            leading 1 is dropped; every sample of a batch must have the same length A)
    audio_sample_rate [B] int64            (kinds "t2va", "i2va", when every file has the column: the waveform's
                                            rate, Hz)
    text         [B, text_len, D] float32  (not kind "matrixgame2", which has no text: text_embedding, zero-padded
                                            or cropped; zeroed for CFG-dropped samples)
    text_mask    [B, text_len] float32     (1 = real token; not changed by CFG dropout)
    text_2, text_mask_2  [B, L2, D2], [B, L2]   (with data.text_2_len: text_embedding_2, a second text stream, fvx's
                                            column beside FastVideo's; empty for CFG-dropped samples)
    cfg_dropped  [B] bool                  (whether CFG dropout blanked the sample's text; all False without text)
    index        [B] int64                 (dataset indices)
    caption      list[str]                 (when every file has a caption column)
    sample_index [B] int64                 (added by batch_at: global position in the run's sample stream)
"""
from __future__ import annotations

import functools
from typing import Annotated, Any, Callable, Sequence

import msgspec
import numpy as np
import torch

from fvx.config import Config, validate
from fvx.core import random
from fvx.data.batching import Dataset, collate as collate_samples
from fvx.data.parquet import (AUDIO_KINDS, FIRST_FRAME_KINDS, Kind, ParquetDataset, check_indices, check_kind,
                              find_parquet_files)
from fvx.data import sections as fsections
from fvx.data.preprocess import PreprocessConfig
from fvx.data.sections import SectionsConfig
from fvx.data.toy_world import WorldConfig, extension_context, first_frame_only
from fvx.data.toy_world_animate import reference_latents
from fvx.data.toy_world_actions import random_actions, world_dataset
from fvx.data.toy_world_files import JudgedByWorld

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]


class SyntheticConfig(Config):
    """A synthetic dataset: ``num_samples`` standard-normal latents [C, T, H, W] and texts [text_len, text_dim]; for
    kind "i2v" the first-frame latents are the latents' first frame followed by zeros (as stored: the condition of a
    model whose latents have no statistics to normalise by), and ``image_embeds`` (tokens, width) adds normal image
    embeddings; kind "t2va" needs ``audio_shape`` (C, F, A), e.g. (2, 32, 8): normal audio latents; kind "i2va" makes
    both. Kind
    "matrixgame2" makes I2V tensors (``image_embeds`` default (4, 16), the tiny presets' width) and actions per video
    frame: ``keyboard`` one-hot ``[F, 4]`` and ``mouse`` normal x 0.1 ``[F, 2]``, ``F = (T - 1) r + 1`` with ``r``
    ``data.vae_time_stride`` (default 4, Wan's VAE). Kind "vace" makes the toy world's extension context
    (``toy_world.extension_context``: the first frame given) with ``vace_mask_channels`` mask channels (the VAE's
    spatial stride squared: 16 for the tiny Wan VAE). Kind "framepack" cuts sample ``i``'s latents into sections
    (``data.sections``) and takes section ``i mod k``, with normal image features ``image_embeds`` (default (4, 16)).
    Kind "animate" (``latent_shape`` of at least 2 frames: the reference's, then the video's) gives the latents'
    first frame as the reference (mask one), the other frames as pose latents, uniform face pixels in [-1, 1] of
    ``face_size`` (the tiny preset's motion encoder: 8) and normal image features (default (4, 16))."""

    num_samples: PositiveInt = 64
    latent_shape: tuple[PositiveInt, PositiveInt, PositiveInt, PositiveInt] = (16, 1, 8, 8)
    text_len: PositiveInt = 8
    text_dim: PositiveInt = 32
    image_embeds: tuple[PositiveInt, PositiveInt] | None = None
    audio_shape: tuple[PositiveInt, PositiveInt, PositiveInt] | None = None
    vace_mask_channels: PositiveInt = 16
    face_size: PositiveInt = 8


class DataConfig(Config):
    """Where the data comes from and how it is batched.

    ``path``: a parquet file, or a folder searched recursively for ``*.parquet`` (in FastVideo's order: sorted by
    real-path string); None = the toy video world ``world`` when set (``fvx.data.toy_world``: shapes moving as the
    prompt says, latents a codec decodes exactly), else ``synthetic`` (Gaussian noise latents); a ``path`` with
    ``world`` set reads the files and lets the world score validation samples (its clips written as files and
    preprocessed). ``preprocess``: how ``python -m fvx.run preprocess`` cuts clips for this data. ``batch_size`` is
    global (summed over ranks). ``text_len`` is the length text embeddings are padded or cropped to. ``cfg_rate``: the
    fraction of samples whose text embedding is zeroed (fixed per dataset index, as FastVideo). ``num_latent_t``: keep
    the first ``num_latent_t`` latent frames of every sample (FastVideo's ``data.num_latent_t``; None keeps them all;
    audio latents are kept whole). ``kind``: what a sample holds (the module docstring): "t2v" video latents and text,
    "text_only", "i2v" adds the first frame, "t2va" adds audio latents (parquet, ``synthetic.audio_shape`` or the
    world's tones), "i2va" both. ``text_2_len``: read a second text stream (the parquet's ``text_embedding_2``,
    HunyuanVideo 1.5's ByT5 glyph text) padded or cropped to this length as ``text_2``/``text_mask_2`` (None: not read;
    a CFG-dropped sample's is empty). ``batch_by_shape``: batch each latent shape apart (parquet data preprocessed with
    ``preprocess.buckets``, or images beside videos), so a batch never mixes shapes; off, a batch of mixed shapes is an
    error naming the samples. Kind "matrixgame2" (Matrix-Game 2.0: first frame, image embedding, keyboard and mouse
    actions per video frame, no text, so no CFG dropout): ``vae_time_stride`` (the VAE's video frames per latent frame,
    4 for Wan; the toy world's is 1) checks that every sample's actions cover its latents
    (``(T - 1) r + 1`` rows); None checks only at least ``T`` rows.
    Kind "framepack" (FramePack's next-section prediction): samples are sections of clips, a window of latents
    with its clean history (``fvx.data.sections``); the toy world and synthetic clips are cut by ``sections``
    (parquet data was cut by ``preprocess``, which reads it too). Kind "animate" (Wan-Animate's segments): latents
    whose frame 0 is the reference image's, with its reference, pose and face inputs.
    ``prefetch``: batches computed ahead in a background thread (0 = synchronous).
    """

    path: str | None = None
    kind: Kind = "t2v"
    batch_size: PositiveInt = 1
    text_len: PositiveInt = 512
    cfg_rate: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    num_latent_t: PositiveInt | None = None
    text_2_len: PositiveInt | None = None
    batch_by_shape: bool = False
    vae_time_stride: PositiveInt | None = None
    prefetch: Annotated[int, msgspec.Meta(ge=0)] = 2
    synthetic: SyntheticConfig = SyntheticConfig()
    world: WorldConfig | None = None
    preprocess: PreprocessConfig = PreprocessConfig()
    sections: SectionsConfig = SectionsConfig()

    def __post_init__(self) -> None:
        if self.kind == "animate" and self.num_latent_t == 1:
            raise ValueError("data.num_latent_t=1: kind 'animate' keeps at least 2 latent frames (the reference's, "
                             "then the video's)")
        if self.kind == "matrixgame2" and self.cfg_rate > 0:
            raise ValueError(f"data.cfg_rate={self.cfg_rate}: data.kind='matrixgame2' has no text to drop (FastVideo's "
                             "Matrix-Game recipes use training_cfg_rate 0); set data.cfg_rate=0")


# ----------------------------------------------------------------------------------------------------------- datasets


def open_dataset(config: DataConfig, key: torch.Tensor) -> Dataset:
    """The dataset ``config`` describes: FastVideo parquet at ``config.path``, else synthetic samples from ``key``.

    ``key`` also fixes which samples CFG dropout blanks. Raises ConfigError for an invalid config and ValueError for
    a path without readable FastVideo-format parquet.
    """
    config = validate(config)
    samples_key, dropout_key = random.split(key, 2)
    stride = config.vae_time_stride
    if stride is None and config.kind == "matrixgame2":  # the toy codec's 1; synthetic data's Wan 4; files unknown
        stride = 1 if config.world is not None else (4 if config.path is None else None)
    collate = functools.partial(collate_samples, text_len=config.text_len, cfg_rate=config.cfg_rate,
                                dropout_key=dropout_key, num_latent_t=config.num_latent_t, text_2_len=config.text_2_len,
                                action_stride=stride)
    if config.path is None and config.world is not None:
        return world_dataset(config.world, samples_key, kind=config.kind, collate=collate, sections=config.sections)
    if config.path is None:
        return SyntheticDataset(config.synthetic, samples_key, kind=config.kind, collate=collate, time_stride=stride,
                                sections=config.sections)
    files = ParquetDataset(find_parquet_files(config.path), kind=config.kind, collate=collate,
                           second_text=config.text_2_len is not None, by_shape=config.batch_by_shape)
    if config.world is not None:  # files of the toy world (``write-videos`` -> ``preprocess``): the world judges
        return JudgedByWorld(files, world_dataset(config.world, samples_key, kind=config.kind, collate=collate,
                                                  sections=config.sections))
    return files



class SyntheticDataset:
    """Sample i is a function of (key, i) alone: latents and text are normal draws from split(fold_in(key, i))."""

    def __init__(self, config: SyntheticConfig, key: torch.Tensor, *, kind: Kind, collate: Callable[..., dict],
                 time_stride: int | None = None, sections: SectionsConfig = SectionsConfig()):
        check_kind(kind)
        self.time_stride, self.sections = time_stride or 4, sections
        if kind == "framepack":
            fsections.check(config.latent_shape[1], sections, "data.synthetic.latent_shape")
        if kind == "animate" and config.latent_shape[1] < 2:
            raise ValueError(f"data.synthetic.latent_shape {list(config.latent_shape)}: kind 'animate' needs at "
                             "least 2 latent frames (the reference's, then the video's)")
        if kind in AUDIO_KINDS and config.audio_shape is None:
            raise ValueError(f"data.synthetic.audio_shape must be set, e.g. [2, 32, 8], for data.kind={kind!r} "
                             "(synthetic audio latents [C, F, A])")
        self.config, self.key, self.kind, self._collate = config, key, kind, collate

    def __len__(self) -> int:
        return self.config.num_samples

    def sample(self, index: int) -> dict[str, Any]:
        """Sample ``index`` uncollated: latents [C, T, H, W] (not text_only), text [text_len, text_dim] (not
        matrixgame2), the I2V tensors (i2v, i2va, matrixgame2), the actions (matrixgame2) and audio latents
        ``audio_shape`` (t2va, i2va), float32."""
        latents_key, text_key = random.split(random.fold_in(self.key, index), 2)
        sample = {"caption": f"synthetic sample {index}", "where": self.where(index)}
        if self.kind != "matrixgame2":
            sample["text"] = random.normal(text_key, (self.config.text_len, self.config.text_dim)).numpy()
        if self.kind != "text_only":
            sample["latents"] = random.normal(latents_key, self.config.latent_shape).numpy()
        if self.kind in FIRST_FRAME_KINDS:
            sample["first_frame_latents"] = first_frame_only(sample["latents"])
            shape = self.config.image_embeds or ((4, 16) if self.kind == "matrixgame2" else None)
            if shape is not None:
                sample["image_embeds"] = random.normal(random.fold_in(latents_key, 1), shape).numpy()
        if self.kind == "matrixgame2":
            frames = (self.config.latent_shape[1] - 1) * self.time_stride + 1
            sample.update(random_actions(random.fold_in(latents_key, 3), frames))
        if self.kind == "vace":
            sample["vace_context"] = extension_context(sample["latents"], self.config.vace_mask_channels)
        if self.kind in AUDIO_KINDS:
            sample["audio_latents"] = random.normal(random.fold_in(latents_key, 2), self.config.audio_shape).numpy()
        if self.kind == "animate":
            sample.update(synthetic_animation(sample["latents"], self.config.face_size, random.fold_in(latents_key, 4)),
                          image_embeds=random.normal(random.fold_in(latents_key, 1),
                                                     self.config.image_embeds or (4, 16)).numpy())
        if self.kind == "framepack":  # section i mod k of the sample's clip, and normal image features
            parts = fsections.cut(torch.from_numpy(sample["latents"]), self.sections)
            part = parts[index % len(parts)]
            sample.update(latents=part["latents"].numpy(), framepack_history=part["history"].numpy(),
                          frame_indices=part["frame_indices"].numpy(),
                          image_embeds=random.normal(random.fold_in(latents_key, 1),
                                                     self.config.image_embeds or (4, 16)).numpy())
        return sample

    def read(self, indices: Sequence[int]) -> dict[str, Any]:
        indices = check_indices(indices, len(self))
        return self._collate([self.sample(i) for i in indices], indices)

    def where(self, index: int) -> str:
        return f"synthetic sample {index}"


def synthetic_animation(latents: Any, face_size: int, key: torch.Tensor) -> dict[str, Any]:
    """Kind animate's inputs of synthetic latents ``[C, T + 1, H, W]``: the first frame as the given reference (mask
    one; a first segment's zero latents after it), the other frames as the pose latents, uniform face pixels."""
    channels, frames, height, width = latents.shape
    reference = reference_latents(torch.from_numpy(latents[:, :1]), torch.zeros(channels, frames - 1, height, width))
    face = random.uniform(key, (3, 4 * (frames - 2) + 1, face_size, face_size), minval=-1.0, maxval=1.0)
    return {"reference_latents": reference.numpy(), "pose_latents": np.ascontiguousarray(latents[:, 1:]),
            "face_pixels": face.numpy()}


