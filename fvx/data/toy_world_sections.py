"""The toy world cut into FramePack's sections (data kind "framepack", ``fvx.data.sections``): next-section prediction
a tiny model learns on a CPU, scored against the true frames of each section.

Sample ``i`` is section ``(i // P) mod k`` of the world's clip ``i`` (``P`` prompts, ``k`` sections a clip holds), so
the prompts stay ``i mod P`` and every section of every prompt is seen. Its image features are the clip's first
frame's latent tokens (the codec's, ``[h w, C]``: what an image encoder tells the DiT of the start image).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from fvx.data import sections as fsections
from fvx.data.toy_world import HIT, WorldConfig, WorldDataset, tokens_of_first_frame


def section_quality(videos: torch.Tensor, truth: torch.Tensor) -> dict[str, float]:
    """For decoded sections ``[N, 3, W, H, W']`` in [0, 1] and their true frames (the same shape): ``section_mse``
    (mean pixel MSE) and ``hit_rate`` (the fraction within the world's hit distance)."""
    if videos.shape != truth.shape:
        raise ValueError(f"section_quality: samples {list(videos.shape)} are not the sections' frames "
                         f"{list(truth.shape)}")
    mse = ((videos.float() - truth.float()) ** 2).mean(dim=(1, 2, 3, 4))
    return {"section_mse": float(mse.mean()), "hit_rate": float((mse < HIT).float().mean())}


class SectionWorldDataset(WorldDataset):
    """The world of kind "framepack" (module docstring), cut by ``sections``."""

    def __init__(self, config: WorldConfig, key: torch.Tensor, *, kind: str, collate: Callable[..., dict],
                 sections: fsections.SectionsConfig):
        super().__init__(config, key, kind=kind, collate=collate)
        self.sections = sections
        self.count = fsections.check(config.frames, sections, "data.world.frames")

    def section(self, index: int) -> int:
        return (index // len(self.prompts)) % self.count

    def sample(self, index: int) -> dict[str, Any]:
        sample = super().sample(index)
        clip = torch.from_numpy(sample["latents"])
        part = fsections.cut(clip, self.sections)[self.section(index)]
        return {**sample, "latents": part["latents"].numpy(), "framepack_history": part["history"].numpy(),
                "frame_indices": part["frame_indices"].numpy(),
                "image_embeds": tokens_of_first_frame(sample["latents"])}

    def where(self, index: int) -> str:
        return f"world sample {index} (section {self.section(index)})"

    def sample_quality(self, videos: torch.Tensor, indices: Sequence[int]) -> dict[str, float]:
        """:func:`section_quality` of decoded samples ``[N, 3, W, H, W']`` in [0, 1] of dataset samples ``indices``
        against their sections' true frames; a section given no frame (Helios's first: text-to-video) against the
        nearest of its prompt's true clips."""
        window, truth = fsections.section_frames(self.sections), []
        for video, i in zip(videos, map(int, indices)):
            section = self.section(i)
            first = fsections.first_frame(self.sections, section)
            if self.sections.order == "one_frame":  # the clip's last frame, made from its first
                truth.append(torch.from_numpy(self.clip(i))[:, -1:] / 2 + 0.5)
            elif self.sections.order == "chunks" and section == 0:
                clips = self.references()[i % len(self.prompts), :, :, first:first + window]  # [S, 3, W, H, W']
                errors = ((clips - video.float()) ** 2).flatten(1).mean(1)
                truth.append(clips[int(errors.argmin())])
            else:
                truth.append(torch.from_numpy(self.clip(i))[:, first:first + window] / 2 + 0.5)
        return section_quality(videos, torch.stack(truth))

    def caption_quality(self, videos: torch.Tensor, captions: Sequence[str]) -> dict[str, float]:
        raise ValueError("the toy world's sections are scored against their own clips' frames, which captions do "
                         "not give")
