"""CLIP image rewards from local folders (transformers' ``CLIPModel``; transformers is imported only here): CLIPScore
(FastVideo's, on ``openai/clip-vit-large-patch14``: ``logits_per_image.diag / 100``) and PickScore (on
``yuvalkirstain/PickScore_v1`` with CLIP-H's processor: ``logit_scale.exp() cos / 26``), both ``logit_scale.exp()
cos(image, text) / divisor`` of the first frame.

transformers comes with the ``rewards`` extra (``pip install -e '.[rewards]'``). A folder holds the model
(``config.json`` with ``model_type`` clip, its weights), its tokenizer and its ``preprocessor_config.json``;
PickScore's processor is CLIP-H's, so it may be another folder (``processor``). Images in [0, 1] are resized
(shortest edge, bicubic with antialiasing), centre-cropped and normalised with the folder's statistics in torch, where
transformers' processor goes through PIL: the scores differ from it by that resampling.
"""
from __future__ import annotations

import json
import pathlib
from typing import Sequence

import torch
import torch.nn.functional as F

CLIPSCORE_DIVISOR = 100.0
PICKSCORE_DIVISOR = 26.0
TEXT_TOKENS = 77


class CLIPReward:
    """``logit_scale.exp() cos(image, text) / divisor`` per sample of images ``[B, 3, H, W]`` in [0, 1]."""

    frames = "first"

    def __init__(self, model, tokenizer, preprocessing: dict, divisor: float):
        self.model, self.tokenizer, self.divisor = model, tokenizer, divisor
        self.mean = torch.tensor(preprocessing["image_mean"]).view(1, 3, 1, 1)
        self.std = torch.tensor(preprocessing["image_std"]).view(1, 3, 1, 1)
        self.size, self.crop = _edge(preprocessing["size"]), _edge(preprocessing["crop_size"])

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """The CLIP input ``[B, 3, crop, crop]`` of images in [0, 1]."""
        h, w = images.shape[-2:]
        scale = self.size / min(h, w)
        size = (max(self.crop, round(h * scale)), max(self.crop, round(w * scale)))
        resized = F.interpolate(images.float(), size=size, mode="bicubic", antialias=True, align_corners=False)
        top, left = (resized.shape[-2] - self.crop) // 2, (resized.shape[-1] - self.crop) // 2
        cropped = resized[..., top:top + self.crop, left:left + self.crop]
        return (cropped - self.mean) / self.std

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        tokens = self.tokenizer(list(prompts), padding=True, truncation=True, max_length=TEXT_TOKENS,
                                return_tensors="pt")
        with torch.no_grad():
            image = _features(self.model.get_image_features(pixel_values=self.pixels(images)))
            text = _features(self.model.get_text_features(input_ids=tokens["input_ids"],
                                                          attention_mask=tokens["attention_mask"]))
            cosine = (F.normalize(image, dim=-1) * F.normalize(text, dim=-1)).sum(-1)
            return self.model.logit_scale.exp() * cosine / self.divisor


def _features(output) -> torch.Tensor:
    """The projected embeddings, whether transformers returns them as a tensor or in an output's pooler_output."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def _edge(size) -> int:
    """A processor size entry (an int, ``{"shortest_edge": n}`` or ``{"height": n, "width": n}``) as one edge."""
    if isinstance(size, int):
        return size
    return int(size.get("shortest_edge") or size["height"])


def load(path: str, *, divisor: float, processor: str | None = None, what: str = "reward") -> CLIPReward:
    """A :class:`CLIPReward` of the CLIP folder ``path`` (and its tokenizer and preprocessing, or ``processor``'s);
    a ValueError names a folder that is missing, is not a CLIP model or lacks its preprocessing."""
    model_folder, processor_folder = pathlib.Path(path), pathlib.Path(processor or path)
    for folder in dict.fromkeys((model_folder, processor_folder)):
        if not folder.is_dir():
            raise ValueError(f"{what}: {str(folder)!r} is not a folder")
    config = model_folder / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if model_type != "clip":
        raise ValueError(f"{what}: {str(model_folder)!r} is not a CLIP model folder (its config.json says model_type "
                         f"{model_type!r}, expected 'clip')")
    preprocessing = processor_folder / "preprocessor_config.json"
    if not preprocessing.is_file():
        raise ValueError(f"{what}: {str(processor_folder)!r} has no preprocessor_config.json (CLIP's image "
                         "statistics); name the processor's folder")
    try:
        from transformers import AutoTokenizer, CLIPModel
    except ImportError:
        raise ValueError(f"{what}: CLIP rewards need transformers: pip install -e '.[rewards]'") from None
    model = CLIPModel.from_pretrained(model_folder, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(processor_folder, local_files_only=True)
    return CLIPReward(model, tokenizer, json.loads(preprocessing.read_text()), divisor)
