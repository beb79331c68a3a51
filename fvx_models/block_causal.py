"""Block-causal attention over latent frames, and the KV cache that streams it: generic, for any frame-major DiT.

Latent frames form blocks of ``F`` frames. A query of the block that ends at frame ``e`` attends to the keys of the
frames ``a < e`` that lie in its window: ``a >= e - window`` (``window`` -1: all) or ``a < sink`` (the sink frames
stay visible forever, FastVideo's ``sink_size``). Teacher forcing runs a ``[clean | noisy]`` sequence of the same
frames: clean queries attend as above among clean keys, the noisy block ``[s, e)`` attends to the clean frames
``a < s`` and to its own noisy block (FastVideo's teacher-forcing mask; a window is refused there, as FastVideo does).

Attention is planned once per forward from static frame indices (:func:`plan_blocks`): each query block gets the
token ranges of ``[cache | chunk]`` keys it may read, and runs either as one SDPA per query block over those keys
(``"prefix"``, no masked-out FLOPs, flash-friendly) or as one SDPA with a boolean mask (``"mask"``). The cache
(:class:`KVCache`) is a value: a forward over a chunk returns the chunk's keys and values, and :func:`append` makes
the next cache from them, trimmed to what the next block's window can still see.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

Range = tuple[int, int]  # [start, end) in tokens


class KVCache(NamedTuple):
    """The keys and values (post-norm, post-RoPE) a block-causal model has seen, per layer ``[B, S, heads,
    head_dim]`` with ``S = len(frames) * tokens_per_frame``; ``frames`` the absolute latent frame of each held frame
    in order (sink frames first), ``next_frame`` the absolute frame the next block starts at. An empty cache holds
    no layers."""

    keys: tuple[torch.Tensor, ...] = ()
    values: tuple[torch.Tensor, ...] = ()
    frames: tuple[int, ...] = ()
    next_frame: int = 0


class QueryBlock(NamedTuple):
    """One block of queries: its token range in the chunk, and the token ranges of ``[cache | chunk]`` it attends."""

    queries: Range
    keys: tuple[Range, ...]


class Frame(NamedTuple):
    """A frame of the key sequence: its absolute index and whether it is a clean (context) frame."""

    index: int
    clean: bool


def visible(key: Frame, end: int, *, window: int, sink: int) -> bool:
    """Whether a query of the block ending at frame ``end`` may read ``key`` (module docstring)."""
    return key.index < end and (window == -1 or key.index >= end - window or key.index < sink)


def plan_blocks(cached: Sequence[int], start: int, frames: int, tokens_per_frame: int, *, frames_per_block: int,
                window: int, sink: int, teacher_forcing: bool = False) -> tuple[QueryBlock, ...]:
    """The query blocks of a chunk of ``frames`` frames starting at absolute frame ``start``, keys ordered
    ``[cached frames | chunk]`` (teacher forcing: the chunk is ``[clean | noisy]``, ``2 frames`` frames)."""
    keys = [Frame(a, True) for a in cached]
    keys += [Frame(start + i, teacher_forcing) for i in range(frames)]
    if teacher_forcing:
        keys += [Frame(start + i, False) for i in range(frames)]
    blocks = []
    for first in range(0, frames, frames_per_block):
        s, e = start + first, start + min(first + frames_per_block, frames)
        if teacher_forcing:
            clean = [k.clean and visible(k, e, window=window, sink=sink) for k in keys]
            blocks.append(QueryBlock(_tokens(first, e - s, tokens_per_frame), _ranges(clean, tokens_per_frame)))
            noisy = [(k.clean and k.index < s) or (not k.clean and s <= k.index < e) for k in keys]
            blocks.append(QueryBlock(_tokens(frames + first, e - s, tokens_per_frame),
                                     _ranges(noisy, tokens_per_frame)))
        else:
            seen = [visible(k, e, window=window, sink=sink) for k in keys]
            blocks.append(QueryBlock(_tokens(first, e - s, tokens_per_frame), _ranges(seen, tokens_per_frame)))
    return tuple(sorted(blocks, key=lambda b: b.queries))


def _tokens(first_frame: int, count: int, tokens_per_frame: int) -> Range:
    return first_frame * tokens_per_frame, (first_frame + count) * tokens_per_frame


def _ranges(selected: Sequence[bool], tokens_per_frame: int) -> tuple[Range, ...]:
    """Runs of selected frames as token ranges."""
    ranges: list[list[int]] = []
    for i, chosen in enumerate(selected):
        if not chosen:
            continue
        if ranges and ranges[-1][1] == i:
            ranges[-1][1] = i + 1
        else:
            ranges.append([i, i + 1])
    return tuple((a * tokens_per_frame, b * tokens_per_frame) for a, b in ranges)


def mask_of(blocks: Sequence[QueryBlock], queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """The boolean attention mask ``[queries, keys]`` (True: attend) of a plan."""
    mask = torch.zeros(queries, keys, dtype=torch.bool, device=device)
    for block in blocks:
        for a, b in block.keys:
            mask[block.queries[0]:block.queries[1], a:b] = True
    return mask


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: Sequence[QueryBlock],
           mask: torch.Tensor | None = None) -> torch.Tensor:
    """Block-causal attention, ``[B, L, heads, head_dim]`` in and out (keys ``[B, S, heads, head_dim]``): one SDPA
    with ``mask`` when given, else one SDPA per query block over the keys it reads."""
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    outs = []
    for block in blocks:
        qs = q[:, :, block.queries[0]:block.queries[1]]
        ks, vs = (_gather(x, block.keys) for x in (k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs))
    return torch.cat(outs, dim=2).transpose(1, 2) if len(outs) > 1 else outs[0].transpose(1, 2)


def _gather(x: torch.Tensor, ranges: Sequence[Range]) -> torch.Tensor:
    """The key/value tokens ``[B, heads, S', head_dim]`` of ``ranges`` along dim 2 (a view for one range or none)."""
    if not ranges:
        return x[:, :, :0]
    if len(ranges) == 1:
        return x[:, :, ranges[0][0]:ranges[0][1]]
    return torch.cat([x[:, :, a:b] for a, b in ranges], dim=2)


def append(cache: KVCache, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], frames: int,
           tokens_per_frame: int, *, frames_per_block: int, window: int, sink: int) -> KVCache:
    """The cache after a chunk of ``frames`` frames with per-layer ``keys``/``values`` ``[B, frames tokens_per_frame,
    heads, head_dim]``: those appended, then only the frames the next block (ending ``frames_per_block`` after
    ``next_frame``) can see kept."""
    start = cache.next_frame
    held = cache.frames + tuple(range(start, start + frames))
    end = start + frames + frames_per_block
    keep = [visible(Frame(a, True), end, window=window, sink=sink) for a in held]
    joined_k, joined_v = list(keys), list(values)
    if cache.keys:
        joined_k = [torch.cat([c, k], dim=1) for c, k in zip(cache.keys, keys)]
        joined_v = [torch.cat([c, v], dim=1) for c, v in zip(cache.values, values)]
    if not all(keep):
        ranges = _ranges(keep, tokens_per_frame)
        joined_k = [_gather(k.transpose(1, 2), ranges).transpose(1, 2) for k in joined_k]
        joined_v = [_gather(v.transpose(1, 2), ranges).transpose(1, 2) for v in joined_v]
    return KVCache(tuple(joined_k), tuple(joined_v), tuple(a for a, kept in zip(held, keep) if kept),
                   start + frames)


def check_cache(cache: KVCache, *, batch: int, layers: int, tokens_per_frame: int, heads: int, head_dim: int,
                who: str) -> None:
    """A ValueError naming what is wrong when ``cache`` cannot serve a chunk of ``batch`` samples of
    ``tokens_per_frame`` tokens per frame (wrong batch, length, layer count or head layout)."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"{who}: the KV cache must be a fvx_models.block_causal.KVCache, got {type(cache).__name__}")
    if not cache.keys:
        if cache.frames:
            raise ValueError(f"{who}: the KV cache holds frames {list(cache.frames)} but no keys")
        return
    if len(cache.keys) != layers or len(cache.values) != layers:
        raise ValueError(f"{who}: the KV cache has {len(cache.keys)} layers, the model {layers}")
    want = (batch, len(cache.frames) * tokens_per_frame, heads, head_dim)
    for i, (k, v) in enumerate(zip(cache.keys, cache.values)):
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"{who}: the KV cache of layer {i} is {tuple(k.shape)}, but a batch of {batch} with "
                             f"{len(cache.frames)} cached frames of {tokens_per_frame} tokens needs {want}")
    if cache.frames and cache.frames[-1] >= cache.next_frame:
        raise ValueError(f"{who}: the KV cache's frames {list(cache.frames)} reach past its next frame "
                         f"{cache.next_frame}")
