"""A second time input for Wan: the flow map ``u(x_t, t, r)`` (the average velocity from ``t`` to ``r``) that AnyFlow
and MeanFlow students learn, as FastVideo's ``r_embedder`` adds it (``fastvideo/models/dits/wanvideo.py``,
``WanTimeTextImageEmbedding``).

A ``delta_embedder`` beside the time embedder embeds ``r`` (``delta="r"``) or ``t - r`` (``"t-r"``) and mixes into the
time embedding: ``gated``: ``(1 - g) temb + g demb``; ``additive``: ``temb + g demb`` (``g``: ``gate``, 0.25). Its
params start (``init``) as a copy of the time embedder (FastVideo's and AnyFlow's ``setup_flowmap_model``: with
``gated`` and ``r`` the model is the base Wan on the diagonal, ``u(x, t, t) == v(x, t)``), or as that copy with its
last layer zeroed (``zero``: with ``additive`` the model is the base Wan for every ``r``). A plain Wan folder loads
with them made so; a folder that holds them (an fvx export) loads them. The names are diffusers'
``AnyFlowTransformer3DModel``'s (``condition_embedder.delta_embedder.linear_1``, ...).

diffusers' Wan forward takes one ``timestep`` tensor and hands it to the condition embedder only, so ``t`` and ``r``
travel together as one tensor, concatenated along the batch (``[2B]``, or ``[2B, L]`` per token): no state on the
module, and compilation, sharding and sequence parallelism see an ordinary forward.
"""
from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Mapping

import msgspec
import torch
from diffusers.models.embeddings import TimestepEmbedding
from diffusers.models.transformers.transformer_wan import WanTimeTextImageEmbedding
from torch import nn

from fvx.config import Config

DELTA = "condition_embedder.delta_embedder."
TIME = "condition_embedder.time_embedder."


class REmbedder(Config):
    """The r input: ``fusion`` (``gated`` or ``additive``), ``gate`` (the mixing weight ``g``), ``delta`` (what the
    delta embedder sees: ``r`` or ``t-r``) and ``init`` (``copy`` of the time embedder, or ``zero``: that copy with its
    last layer zeroed)."""

    fusion: Literal["gated", "additive"] = "gated"
    gate: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.25
    delta: Literal["r", "t-r"] = "r"
    init: Literal["copy", "zero"] = "copy"


class TwoTimeEmbedding(WanTimeTextImageEmbedding):
    """Wan's condition embedder with the delta embedder: ``timestep`` holds ``t`` then ``r`` along its first dim."""

    def __init__(self, *args: Any, r_embedder: REmbedder, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.r_embedder = r_embedder
        self.delta_embedder = TimestepEmbedding(in_channels=self.time_embedder.linear_1.in_features,
                                                time_embed_dim=self.time_embedder.linear_2.out_features)

    def _embed(self, embedder: nn.Module, timestep: torch.Tensor, seq_len: int | None,
               like: torch.Tensor) -> torch.Tensor:
        """diffusers' timestep embedding: sinusoids, per-token rows when ``seq_len``, the embedder in its dtype."""
        projected = self.timesteps_proj(timestep)
        if seq_len is not None:
            projected = projected.unflatten(0, (-1, seq_len))
        dtype = next(iter(embedder.parameters())).dtype
        if projected.dtype != dtype and dtype != torch.int8:
            projected = projected.to(dtype)
        return embedder(projected).type_as(like)

    def forward(self, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_image: torch.Tensor | None = None,
                timestep_seq_len: int | None = None) -> tuple[torch.Tensor, ...]:
        t, r = timestep.chunk(2)
        temb = self._embed(self.time_embedder, t, timestep_seq_len, encoder_hidden_states)
        demb = self._embed(self.delta_embedder, r if self.r_embedder.delta == "r" else t - r, timestep_seq_len,
                           encoder_hidden_states)
        gate = self.r_embedder.gate
        temb = (1.0 - gate) * temb + gate * demb if self.r_embedder.fusion == "gated" else temb + gate * demb
        timestep_proj = self.time_proj(self.act_fn(temb))
        encoder_hidden_states = self.text_embedder(encoder_hidden_states)
        if encoder_hidden_states_image is not None:
            encoder_hidden_states_image = self.image_embedder(encoder_hidden_states_image)
        return temb, timestep_proj, encoder_hidden_states, encoder_hidden_states_image


def install(module: nn.Module, r_embedder: REmbedder) -> None:
    """Replace a meta Wan skeleton's condition embedder by :class:`TwoTimeEmbedding` (params on meta)."""
    config = module.config
    dim = config.num_attention_heads * config.attention_head_dim
    with torch.device("meta"):
        module.condition_embedder = TwoTimeEmbedding(
            dim=dim, time_freq_dim=config.freq_dim, time_proj_dim=dim * 6, text_embed_dim=config.text_dim,
            image_embed_dim=config.image_dim, pos_embed_seq_len=config.pos_embed_seq_len, r_embedder=r_embedder)


def derived(r_embedder: REmbedder) -> dict[str, Callable[[Mapping[str, Any]], Any]]:
    """The delta embedder's params as functions of the time embedder's (module docstring): what init draws and what
    a folder without them loads."""
    def copy(name: str) -> Callable[[Mapping[str, Any]], Any]:
        return lambda params: _copied(params[TIME + name])

    def zero(name: str) -> Callable[[Mapping[str, Any]], Any]:
        return lambda params: torch.zeros(tuple(params[TIME + name].shape))

    last = zero if r_embedder.init == "zero" else copy
    return {DELTA + "linear_1.weight": copy("linear_1.weight"), DELTA + "linear_1.bias": copy("linear_1.bias"),
            DELTA + "linear_2.weight": last("linear_2.weight"), DELTA + "linear_2.bias": last("linear_2.bias")}


def _copied(param: Any) -> Any:
    """A tensor's copy (never an alias of another param), or a lazily read param's handle as it is."""
    return param.clone() if isinstance(param, torch.Tensor) else param


def with_r(kwargs: dict[str, Any], r_timestep: torch.Tensor) -> dict[str, Any]:
    """The DiT's arguments with ``r`` (shaped as ``kwargs["timestep"]``) appended to the timestep (docstring)."""
    return {**kwargs, "timestep": torch.cat([kwargs["timestep"], r_timestep])}
