"""Block-causal attention over latent frames, and the KV cache that streams it: generic, for any frame-major DiT.

Latent frames form blocks of ``F`` frames. A query of the block that ends at frame ``e`` attends to the keys of the
frames ``a < e`` that lie in its window: ``a >= e - window`` (``window`` -1: all) or ``a < sink`` (the sink frames
stay visible forever, FastVideo's ``sink_size``). Teacher forcing runs a ``[clean | noisy]`` sequence of the same
frames: clean queries attend as above among clean keys, the noisy block ``[s, e)`` attends to the clean frames
``a < s`` and to its own noisy block (FastVideo's teacher-forcing mask; a window is refused there, as FastVideo does).

Attention is planned once per forward from static frame indices (:func:`plan_blocks`): each query block gets the
token ranges of ``[cache | chunk]`` keys it may read, and runs either as one SDPA per query block over those keys
(``"prefix"``, no masked-out FLOPs, flash-friendly; cached keys taken in frame order, so a cached chunk computes what
the full forward does, bit for bit) or as one SDPA with a boolean mask (``"mask"``).

The cache (:class:`KVCache`) is a value of fixed shape: a ring of ``slots`` frames per layer, allocated once for a
stream (:func:`allocate`), holding what the next block can still see. Sink frames keep the first slots; later frames
take the others in turn (:func:`slot_of`), so a stream of any length runs on tensors of one shape, and a compiled
forward under the mask form (whose mask is an input tensor) makes no new graph as the stream grows. A forward over a
chunk returns the chunk's keys and values, and :func:`write` makes the next cache from them, out of place.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

Range = tuple[int, int]  # [start, end) in tokens


class KVCache(NamedTuple):
    """The keys and values (post-norm, post-RoPE) a block-causal model keeps of a stream: per layer ``[B, S, heads,
    head_dim]`` with ``S = len(slots) * tokens_per_frame`` (no layers until :func:`allocate`); ``slots`` the absolute
    latent frame each ring slot holds (-1: none), ``next_frame`` the absolute frame the next chunk starts at."""

    keys: tuple[torch.Tensor, ...] = ()
    values: tuple[torch.Tensor, ...] = ()
    slots: tuple[int, ...] = ()
    next_frame: int = 0

    @property
    def frames(self) -> tuple[int, ...]:
        """The frames held, in order."""
        return tuple(sorted(a for a in self.slots if a >= 0))


def ring_slots(frames: int, *, frames_per_block: int, window: int, sink: int) -> int:
    """How many frames a stream of ``frames`` latent frames keeps cached: every frame under global attention
    (``window`` -1), else the sink frames and the ``window - frames_per_block`` frames before a block."""
    return frames if window == -1 else min(frames, sink + window - frames_per_block)


def empty(frames: int, *, frames_per_block: int, window: int, sink: int) -> KVCache:
    """The cache of a stream of ``frames`` latent frames, holding none yet (its tensors come with :func:`allocate`)."""
    return KVCache(slots=(-1,) * ring_slots(frames, frames_per_block=frames_per_block, window=window, sink=sink))


def allocate(cache: KVCache, *, layers: int, batch: int, tokens_per_frame: int, heads: int, head_dim: int,
             dtype: torch.dtype, device: torch.device) -> KVCache:
    """``cache`` with zero tensors of its fixed shape when it has none yet (a stream's first chunk), else itself."""
    if cache.keys:
        return cache
    shape = (batch, len(cache.slots) * tokens_per_frame, heads, head_dim)
    zeros = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers))
    return cache._replace(keys=zeros, values=tuple(torch.zeros_like(z) for z in zeros))


def slot_of(frame: int, slots: int, sink: int) -> int:
    """The ring slot of absolute ``frame``: its own for a sink frame, else the non-sink slots in turn."""
    return frame if frame < sink else sink + (frame - sink) % (slots - sink)


class QueryBlock(NamedTuple):
    """One block of queries: its token range in the chunk, and the token ranges of ``[cache | chunk]`` it attends."""

    queries: Range
    keys: tuple[Range, ...]


class Frame(NamedTuple):
    """A frame of the key sequence: its absolute index and whether it is a clean (context) frame."""

    index: int
    clean: bool


def visible(key: Frame, end: int, *, window: int, sink: int) -> bool:
    """Whether a query of the block ending at frame ``end`` may read ``key`` (module docstring; an empty ring slot,
    index -1, never)."""
    return 0 <= key.index < end and (window == -1 or key.index >= end - window or key.index < sink)


def plan_blocks(cached: Sequence[int], start: int, frames: int, tokens_per_frame: int, *, frames_per_block: int,
                window: int, sink: int, teacher_forcing: bool = False) -> tuple[QueryBlock, ...]:
    """The query blocks of a chunk of ``frames`` frames starting at absolute frame ``start``, keys ordered
    ``[cache slots | chunk]`` (``cached``: the frame of each slot, -1 empty; teacher forcing: the chunk is ``[clean |
    noisy]``, ``2 frames`` frames). A block's cached keys are listed in frame order."""
    keys = [Frame(a, True) for a in cached]
    keys += [Frame(start + i, teacher_forcing) for i in range(frames)]
    if teacher_forcing:
        keys += [Frame(start + i, False) for i in range(frames)]
    by_frame = sorted(range(len(cached)), key=lambda i: cached[i]) + list(range(len(cached), len(keys)))
    blocks = []
    for first in range(0, frames, frames_per_block):
        s, e = start + first, start + min(first + frames_per_block, frames)
        if teacher_forcing:
            clean = [k.clean and visible(k, e, window=window, sink=sink) for k in keys]
            blocks.append(QueryBlock(_tokens(first, e - s, tokens_per_frame),
                                     _ranges(clean, by_frame, tokens_per_frame)))
            noisy = [(k.clean and k.index < s) or (not k.clean and s <= k.index < e) for k in keys]
            blocks.append(QueryBlock(_tokens(frames + first, e - s, tokens_per_frame),
                                     _ranges(noisy, by_frame, tokens_per_frame)))
        else:
            seen = [visible(k, e, window=window, sink=sink) for k in keys]
            blocks.append(QueryBlock(_tokens(first, e - s, tokens_per_frame),
                                     _ranges(seen, by_frame, tokens_per_frame)))
    return tuple(sorted(blocks, key=lambda b: b.queries))


def _tokens(first_frame: int, count: int, tokens_per_frame: int) -> Range:
    return first_frame * tokens_per_frame, (first_frame + count) * tokens_per_frame


def _ranges(selected: Sequence[bool], order: Sequence[int], tokens_per_frame: int) -> tuple[Range, ...]:
    """The selected key frames, taken in ``order`` (positions in the key sequence), as runs of token ranges."""
    ranges: list[list[int]] = []
    for i in order:
        if not selected[i]:
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
    with ``mask`` when given, else one SDPA per query block over the keys it reads (through diffusers' dispatcher, as
    every family's attention: the model's attention kernel answers)."""
    if mask is not None:
        return dispatch_attention_fn(query, key, value, attn_mask=mask)
    outs = []
    for block in blocks:
        qs = query[:, block.queries[0]:block.queries[1]]
        ks, vs = (_gather(x, block.keys) for x in (key, value))
        outs.append(dispatch_attention_fn(qs, ks, vs))
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]


def _gather(x: torch.Tensor, ranges: Sequence[Range]) -> torch.Tensor:
    """The key/value tokens ``[B, S', heads, head_dim]`` of ``ranges`` along dim 1 (a view for one range or none)."""
    if not ranges:
        return x[:, :0]
    if len(ranges) == 1:
        return x[:, ranges[0][0]:ranges[0][1]]
    return torch.cat([x[:, a:b] for a, b in ranges], dim=1)


def write(cache: KVCache, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], frames: int,
          tokens_per_frame: int, *, frames_per_block: int, window: int, sink: int) -> KVCache:
    """The cache after a chunk of ``frames`` frames with per-layer ``keys``/``values`` ``[B, frames tokens_per_frame,
    heads, head_dim]``: each of its frames the next block (ending ``frames_per_block`` after it) can see written to
    its slot, out of place (``cache`` allocated; its shape unchanged)."""
    start = cache.next_frame
    end = start + frames + frames_per_block
    slots, ring, chunk = list(cache.slots), [], []
    for i in range(frames):
        frame = start + i
        if slots and visible(Frame(frame, True), end, window=window, sink=sink):
            slot = slot_of(frame, len(slots), sink)
            slots[slot] = frame
            ring.append(torch.arange(slot * tokens_per_frame, (slot + 1) * tokens_per_frame))
            chunk.append(torch.arange(i * tokens_per_frame, (i + 1) * tokens_per_frame))
    if not ring:
        return cache._replace(slots=tuple(slots), next_frame=start + frames)
    device = cache.keys[0].device
    at, of = torch.cat(ring).to(device), torch.cat(chunk).to(device)
    new_keys = tuple(c.index_copy(1, at, k.index_select(1, of).to(c.dtype)) for c, k in zip(cache.keys, keys))
    new_values = tuple(c.index_copy(1, at, v.index_select(1, of).to(c.dtype)) for c, v in zip(cache.values, values))
    return KVCache(new_keys, new_values, tuple(slots), start + frames)


def check_cache(cache: KVCache, *, batch: int, layers: int, tokens_per_frame: int, heads: int, head_dim: int,
                who: str) -> None:
    """A ValueError naming what is wrong when ``cache`` cannot serve a chunk of ``batch`` samples of
    ``tokens_per_frame`` tokens per frame (wrong batch, length, layer count or head layout)."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"{who}: the KV cache must be a fvx_models.block_causal.KVCache (Model.causal.empty_cache), "
                         f"got {type(cache).__name__}")
    if not cache.keys:
        return
    if len(cache.keys) != layers or len(cache.values) != layers:
        raise ValueError(f"{who}: the KV cache has {len(cache.keys)} layers, the model {layers}")
    want = (batch, len(cache.slots) * tokens_per_frame, heads, head_dim)
    for i, (k, v) in enumerate(zip(cache.keys, cache.values)):
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"{who}: the KV cache of layer {i} is {tuple(k.shape)}, but a batch of {batch} with "
                             f"{len(cache.slots)} cache slots of {tokens_per_frame} tokens needs {want}")
    if any(a >= cache.next_frame for a in cache.slots):
        raise ValueError(f"{who}: the KV cache's frames {list(cache.frames)} reach past its next frame "
                         f"{cache.next_frame}")
