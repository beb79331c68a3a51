"""Ulysses sequence parallelism on Wan-layout DiTs (Wan 2.1/2.2 and the block-causal Wan; ``fvx.distributed.sequence_parallel``).

The token sequence starts after the patch embedding (``T H W`` flattened) and ends at ``proj_out``; the RoPE tables
and per-token timesteps are sliced to the rank's tokens, and self-attention (:class:`UlyssesAttention`) attends over
all tokens of the rank's heads. :func:`self_attention_heads` is Wan's self-attention core (projections, norms, RoPE,
the all-to-all), which the block-causal Wan's attention shares.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_wan import _get_qkv_projections
from torch import nn

from fvx.distributed import sequence_parallel as fsp
from fvx_models.build import ModelConfig


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding of ``x [B, L, heads, head_dim]`` (diffusers' formula, in the tables' fp64)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


def self_attention_heads(attn: nn.Module, hidden_states: torch.Tensor,
                         rotary: tuple[torch.Tensor, torch.Tensor] | None,
                         group: fsp.SPGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Wan block's self-attention q, k, v ``[B, L, heads, head_dim]``: projections, their norms, RoPE (``rotary
    = (cos, sin)`` tables, or None) per token; under sequence parallelism one all-to-all to all tokens of the rank's
    heads (``fvx.distributed.sequence_parallel.to_heads``, the identity without it)."""
    query, key, value = _get_qkv_projections(attn, hidden_states, None)
    query, key = attn.norm_q(query), attn.norm_k(key)
    query, key, value = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
    if rotary is not None:
        query, key = rotate(query, *rotary), rotate(key, *rotary)
    if group.size == 1:
        return query, key, value
    return fsp.to_heads(torch.stack([query, key, value], dim=2), group).unbind(2)


class UlyssesAttention:
    """A Wan block's self-attention on this rank's tokens (diffusers' ``WanAttnProcessor`` for self-attention, which
    has no image branch): q, k, v with their norms and RoPE per token, then one all-to-all to all tokens of the
    rank's heads (``fvx.distributed.sequence_parallel.to_heads``), diffusers' attention as in one process, and one back."""

    def __init__(self, group: fsp.SPGroup) -> None:
        self.group = group

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: Any = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb: Any = None) -> torch.Tensor:
        query, key, value = self_attention_heads(attn, hidden_states, rotary_emb, self.group)
        out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False)
        out = fsp.to_tokens(out, self.group).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _split_timesteps(group: fsp.SPGroup, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """The DiT's forward pre-hook: per-token timesteps ``[B, L]`` become this rank's ``[B, L/P]`` (the condition
    embedder then makes the rank's per-token modulation)."""
    t = kwargs.get("timestep")
    if not (isinstance(t, torch.Tensor) and t.dim() == 2):
        return None
    return args, {**kwargs, "timestep": fsp.split_tokens(t, group)}


def _split_patches(group: fsp.SPGroup, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """The patch embedding's forward hook: ``[B, dim, T, H, W]`` -> this rank's tokens as ``[B, dim, L/P, 1, 1]``,
    which the DiT flattens into its sequence ``[B, L/P, dim]`` as it does the whole one."""
    return fsp.split_tokens(out.flatten(2), group, dim=2)[..., None, None]


def _gather_output(group: fsp.SPGroup, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """``proj_out``'s forward hook: every rank's tokens ``[B, L, C p]``, which the DiT unpatchifies."""
    return fsp.gather_tokens(out, group)


def _split_rope(group: fsp.SPGroup, module: nn.Module, args: tuple, out: tuple) -> tuple:
    """The RoPE module's forward hook: the tables ``[1, L, 1, head_dim]`` of this rank's tokens."""
    return tuple(fsp.split_tokens(table, group).contiguous() for table in out)


def split_token_sequence(config: ModelConfig, module: nn.Module, group: fsp.SPGroup) -> None:
    """The hooks every Wan-layout DiT takes under sequence parallelism: the heads checked, the token sequence split
    after the patch embedding and gathered after ``proj_out``, per-token timesteps sliced."""
    fsp.check_heads(config.spec.kwargs["num_attention_heads"], group, f"{config.family.name}:{config.preset}")
    module.register_forward_pre_hook(functools.partial(_split_timesteps, group), with_kwargs=True)
    module.patch_embedding.register_forward_hook(functools.partial(_split_patches, group))
    module.proj_out.register_forward_hook(functools.partial(_gather_output, group))


def sequence_parallel(config: ModelConfig, module: nn.Module, group: fsp.SPGroup) -> None:
    """Ulysses sequence parallelism on a Wan skeleton: :func:`split_token_sequence`, the RoPE tables sliced to the
    rank's tokens, every block's self-attention :class:`UlyssesAttention`."""
    split_token_sequence(config, module, group)
    module.rope.register_forward_hook(functools.partial(_split_rope, group))
    processor = UlyssesAttention(group)
    for block in module.blocks:
        block.attn1.set_processor(processor)
