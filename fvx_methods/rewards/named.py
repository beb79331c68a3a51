"""Rewards by name, as a method's ``reward_fn`` names them (FastVideo's ``pickscore`` and ``clipscore``, and the toy
world's ``world``); models come from local folders only."""
from __future__ import annotations

from typing import Any

from fvx_methods.rewards import clip
from fvx_methods.rewards.reward import Reward

KNOWN = ("clipscore", "pickscore", "world")


def named(name: str, *, path: str | None = None, processor: str | None = None, world: Any = None,
          where: str = "method.reward_models") -> Reward:
    """The reward ``name``: CLIPScore or PickScore from the local CLIP folder ``path`` (PickScore's processor from
    ``processor`` when given), or the toy world's from its config ``world``; a ValueError says what is missing."""
    if name in ("clipscore", "pickscore"):
        if path is None:
            model = "yuvalkirstain/PickScore_v1" if name == "pickscore" else "openai/clip-vit-large-patch14"
            raise ValueError(f"{where}.{name}: {name} needs the local folder of its CLIP model ({model}); fvx "
                             "downloads nothing")
        divisor = clip.PICKSCORE_DIVISOR if name == "pickscore" else clip.CLIPSCORE_DIVISOR
        return clip.load(path, divisor=divisor, processor=processor, what=f"{where}.{name}")
    if name == "world":
        if world is None:
            raise ValueError("the world reward scores the toy world's clips: the experiment's data must be the world "
                             "(data.world)")
        from fvx_methods.rewards.world import WorldReward

        return WorldReward(world)
    raise ValueError(f"unknown reward {name!r}; known: {', '.join(KNOWN)}")
