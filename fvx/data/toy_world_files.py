"""The toy world as media files: :func:`write_videos` writes its clips as mp4 files with caption files (the input of
``python -m fvx.run preprocess``; kind "matrixgame2" adds each clip's keys as a FastVideo action file),
:class:`WorldEncoders` encodes them back exactly (its "text encoder" and codec), and :class:`JudgedByWorld` lets the
world score validation samples of a run trained on the preprocessed files."""
from __future__ import annotations

import pathlib
from typing import Any, Sequence

import msgspec
import numpy as np
import torch

from fvx.core import random
from fvx.data import media, preprocess, toy_world_actions
from fvx.data.toy_world import (GIVEN_FIRST_FRAME, Codec, WorldConfig, WorldDataset, caption, first_frame_only,
                                prompt_texts, space_to_depth, tokens_of_first_frame)
from fvx.data.toy_world_animate import pose_video, reference_latents
from fvx.data.toy_world_sections import section_quality


class JudgedByWorld:
    """A dataset (FastVideo parquet that ``preprocess`` made from :func:`write_videos`' files) whose validation
    samples the world scores: ``sample_quality`` finds each sample's prompt from its caption (and for data that gives
    the first frame, kinds "i2v" and "vace", scores the continuation against the files' own clips), so a run on the
    files logs the figures a run on the built-in world logs."""

    def __init__(self, dataset: Any, world: WorldDataset):
        self.dataset, self.world = dataset, world

    def __len__(self) -> int:
        return len(self.dataset)

    def read(self, indices: Sequence[int]) -> dict[str, Any]:
        return self.dataset.read(indices)

    def where(self, index: int) -> str:
        return self.dataset.where(index)

    def shape_groups(self) -> list[list[int]] | None:
        return self.dataset.shape_groups()

    def sample_quality(self, videos: torch.Tensor, indices: Sequence[int]) -> dict[str, float]:
        if self.world.kind == "matrixgame2":  # the files' own keys and clips (the codec decodes them exactly)
            batch = self.dataset.read(indices)
            truth = Codec(self.world.config.factor).decode(batch["latents"])
            return toy_world_actions.action_quality(videos, batch["keyboard"], truth, self.world.config.speed,
                                                    self.world.config.score_window)
        if self.world.kind == "framepack":  # the files' own sections (the codec decodes them exactly)
            truth = Codec(self.world.config.factor).decode(self.dataset.read(indices)["latents"])
            return section_quality(videos, truth)
        batch = self.dataset.read(indices)
        captions = batch.get("caption") or []
        if len(captions) != len(indices):
            raise ValueError("validation: the data has no captions, so the toy world cannot score its samples "
                             "(data.world=null turns it off)")
        try:
            quality = self.world.caption_quality(videos, captions)
        except ValueError as error:
            raise ValueError(f"validation: {error} (data.world=null turns it off)") from None
        if self.world.kind in GIVEN_FIRST_FRAME:  # continued from the files' first frames: their clips are the truth
            latents = batch["latents"][:, :, 1:] if self.world.kind == "animate" else batch["latents"]  # no reference
            truth = Codec(self.world.config.factor).decode(latents)
            quality["continuation_mse"] = float(((videos.float() - truth) ** 2).mean())
        return quality

    def caption_quality(self, videos: torch.Tensor, captions: Sequence[str]) -> dict[str, float]:
        return self.world.caption_quality(videos, captions)


class WorldEncoders:
    """The world's "text encoder" (a prompt's caption -> its fixed text, ``toy_world.prompt_texts``) and its exact
    codec: what ``preprocess`` encodes the clips of :func:`write_videos` with (``fvx.data.preprocess.Encoder``), so the
    parquet it writes holds what the built-in dataset makes (kind "matrixgame2": its image embedding is the first
    frame's latent tokens)."""

    def __init__(self, config: WorldConfig, kind: str = "t2v"):
        self.config, self.kind = config, kind
        self.texts = {caption(config, c, d): torch.from_numpy(text)
                      for (c, d), text in zip(config.prompts, prompt_texts(config))}

    def identity(self) -> dict[str, Any]:
        return {"model": "the toy world", "world": msgspec.to_builtins(self.config)}

    def encode_text(self, prompts: list[str], clips: Any = None) -> list[torch.Tensor]:
        unknown = [p for p in prompts if p not in self.texts]
        if unknown:
            known = ", ".join(map(repr, self.texts))
            raise ValueError(f"the toy world's text encoder knows only its prompts ({known}), not {unknown[0]!r}")
        return [self.texts[p].clone() for p in prompts]

    def encode_text_2(self, prompts: list[str]) -> None:
        return None

    def encode_video(self, video: torch.Tensor) -> torch.Tensor:
        return space_to_depth(video.float(), self.config.factor)

    def encode_first_frame(self, video: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(first_frame_only(space_to_depth(video.float().numpy(), self.config.factor)))

    def encode_image(self, frame: torch.Tensor) -> torch.Tensor | None:
        """None, or for kinds "matrixgame2", "framepack" and "animate" the latent tokens ``[h w, 3 f^2]`` of ``frame
        [3, H, W]`` in [0, 1]."""
        if self.kind not in ("matrixgame2", "framepack", "animate"):
            return None
        latents = space_to_depth(2 * frame.float()[:, None].numpy() - 1, self.config.factor)
        return torch.from_numpy(tokens_of_first_frame(latents))

    def encode_audio(self, waveform: torch.Tensor, rate: int) -> torch.Tensor:
        raise ValueError("the toy world's media files carry no sound (its t2va and i2va data are built in)")

    def encode_context(self, video: torch.Tensor, mask: torch.Tensor | None,
                       references: list[torch.Tensor]) -> torch.Tensor:
        """Kind "vace"'s context through the codec, laid out as VACE's pipeline lays it out: the control video outside
        and inside the mask (``mask [1, T, H, W]``, None: ones), the mask ``f x f`` pixels to a cell, each reference
        image's frame (its latents, zeros, a zero mask) in front."""
        mask = torch.ones_like(video[:1]) if mask is None else (mask > 0.5).to(video.dtype)
        video = video.float()
        context = torch.cat([self.encode_video(video * (1 - mask)), self.encode_video(video * mask),
                             space_to_depth(mask.float(), self.config.factor)])
        for image in references:
            latent = self.encode_video(image[:, None])
            front = torch.cat([latent, torch.zeros_like(latent), torch.zeros_like(context[2 * len(latent):, :1])])
            context = torch.cat([front, context], dim=1)
        return context

    def encode_references(self, references: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([self.encode_video(image[:, None]) for image in reversed(references)], dim=1)  # the last first

    def encode_animation(self, reference: torch.Tensor, pose: torch.Tensor, face: torch.Tensor,
                         previous: torch.Tensor | None = None, background: torch.Tensor | None = None,
                         mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Kind "animate"'s inputs through the codec (``fvx.data.toy_world_animate``'s layout): the reference frame
        (mask one), then the previous frames ``[3, P, H, W]`` (mask one; None: none) and zeros, or in the replace
        mode the ``background`` behind them with the latent cells its ``mask [1, F, H, W]`` (1: to be made) keeps at
        one (nearest), the pose video's latents, the face pixels as given (the codec is frame-wise: a video frame is a
        latent frame)."""
        latent = self.encode_video(reference.float()[:, None])
        segment = (torch.zeros(latent.shape[0], pose.shape[1], *latent.shape[2:]) if background is None
                   else self.encode_video(background.float()))
        given = 0 if previous is None else previous.shape[1]
        if previous is not None:
            segment[:, :given] = self.encode_video(previous.float())
        keep = None if mask is None else preprocess.kept_cells(mask, *latent.shape[2:])
        return {"reference_latents": reference_latents(latent, segment, given, keep),
                "pose_latents": self.encode_video(pose.float()), "face_pixels": face, "reference": latent}


def write_videos(config: WorldConfig, folder: str, seed: int = 0, kind: str = "t2v") -> list[str]:
    """Write the world's ``num_samples`` clips as lossless mp4 files (RGB H.264, ``fps``) with caption files
    (``world_NNNNN.mp4`` + ``.txt``), the layout ``preprocess --videos`` reads; returns the videos' names. Clip ``i``
    is :meth:`WorldDataset.clip` ``(i)`` of the world drawn from ``key(seed)``; kind "matrixgame2" writes the world with
    actions and each clip's ``keyboard [T, 4]`` and ``mouse [T, 2]`` as its action file ``world_NNNNN.npz``; kind "vace"
    each clip's control video of VACE's extension task (the world's kind "vace" samples): ``world_NNNNN.control.mp4``
    its first frame then grey frames (8-bit grey, 128) and ``world_NNNNN.mask.mp4`` black on the first frame (kept),
    white after (to be made); kind "animate" each clip's pose video ``world_NNNNN.pose.mp4`` (its bars in white) and
    face video ``world_NNNNN.face.mp4`` (the clip itself; preprocessing holds its frames for the face encoder), the
    world's kind "animate" samples (``fvx.data.toy_world_animate``)."""
    out = pathlib.Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    world = toy_world_actions.world_dataset(config, random.key(seed), kind=kind, collate=lambda samples, indices: {})
    names = []
    for index in range(config.num_samples):
        colour, direction = world.prompts[index % len(world.prompts)]
        pixels = ((world.clip(index) + 1) * 127.5).round().clip(0, 255).astype(np.uint8)  # [3, T, H, W]
        name = f"world_{index:05d}"
        media.write_video(out / f"{name}.mp4", pixels.transpose(1, 2, 3, 0), config.fps)
        if kind == "matrixgame2":
            sample = world.sample(index)
            np.savez(out / f"{name}.npz", keyboard=sample["keyboard"], mouse=sample["mouse"])
            (out / f"{name}.txt").write_text(sample["caption"] + "\n")
        else:
            (out / f"{name}.txt").write_text(caption(config, colour, direction) + "\n")
        if kind == "vace":
            control, mask = np.full_like(pixels, 128), np.full_like(pixels, 255)
            control[:, 0], mask[:, 0] = pixels[:, 0], 0
            media.write_video(out / f"{name}.control.mp4", control.transpose(1, 2, 3, 0), config.fps)
            media.write_video(out / f"{name}.mask.mp4", mask.transpose(1, 2, 3, 0), config.fps)
        if kind == "animate":
            pose = ((pose_video(world.clip(index)) + 1) * 127.5).round().astype(np.uint8)
            media.write_video(out / f"{name}.pose.mp4", pose.transpose(1, 2, 3, 0), config.fps)
            media.write_video(out / f"{name}.face.mp4", pixels.transpose(1, 2, 3, 0), config.fps)
        names.append(f"{name}.mp4")
    return names
