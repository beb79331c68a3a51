"""Video Sparse Attention (VSA, arXiv 2505.13389): self-attention over video tokens on a (T, H, W) grid that attends
densely only inside the few key tiles a cheap coarse pass ranks highest.

The grid is cut into ``TILE`` = 4x4x4 cubes (edge tiles hold the remainder of a dimension, so they are smaller),
ordered (t-tile, h-tile, w-tile) row-major with their tokens row-major (t, h, w) inside; the padded layout gives each
tile 64 slots, valid tokens first and zeros after. Per (batch, head):

    coarse   q_c, k_c, v_c = per-tile means over VALID tokens             [B, H, n, D]
             scores = q_c k_c^T * scale  [B, H, n, n];  out_c = softmax(scores) v_c, broadcast to the tile's tokens
    select   the top-k key tiles of each query tile by coarse score, k = topk_count(sparsity, n)
    fine     each query token attends (one softmax) to the valid tokens of its tile's k selected key tiles
    output   out_c * gate + out_f   (gate [B, H, L, D], Wan's zero-initialised ``to_gate_compress``), or
             out_c + out_f when gate is None (as FastVideo's kernel does)

With a zero gate and sparsity 0 this is dense attention. Inputs and outputs use SDPA's ``[B, H, L, D]`` with
``L = T * H * W`` in row-major grid order. ``implementation`` picks how the fine stage runs: ``"reference"``
(gather of the selected key tiles, any device), ``"flex"`` (``flex_attention`` with a block mask on the padded
layout) or ``"kernel"`` (FastVideo's ``fastvideo_kernel.video_sparse_attn``, CUDA only). The selection (indices) is
not differentiable; everything else is.
"""
from __future__ import annotations

import importlib
import math
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

TILE = (4, 4, 4)
IMPLEMENTATIONS = ("reference", "flex", "kernel")


class Tiles(NamedTuple):
    """How a (T, H, W) token grid is cut into tiles. ``n`` tiles of at most ``V = prod(tile)`` tokens, ``L`` tokens.

    grid       (T, H, W)
    tile       the tile shape, (4, 4, 4) for VSA
    num_tiles  (nt, nh, nw), tiles per dimension (ceil division)
    sizes      [n] long, valid tokens of each tile (product of its per-dimension sizes)
    order      [L] long, the grid (row-major) index of each token in tile order
    slots      [L] long, the padded slot (``tile * V + position``) of each token in tile order
    where      [L] long, the padded slot of each token in grid order (``where[order] == slots``)
    tile_of    [L] long, the tile of each token in grid order
    valid      [n, V] bool, which padded slots hold a token (the first ``sizes[i]`` of tile i)
    """

    grid: tuple[int, int, int]
    tile: tuple[int, int, int]
    num_tiles: tuple[int, int, int]
    sizes: torch.Tensor
    order: torch.Tensor
    slots: torch.Tensor
    where: torch.Tensor
    tile_of: torch.Tensor
    valid: torch.Tensor

    @property
    def n(self) -> int:
        """Number of tiles."""
        return math.prod(self.num_tiles)

    @property
    def volume(self) -> int:
        """Slots per tile in the padded layout (64 for 4x4x4)."""
        return math.prod(self.tile)


def _check_triple(name: str, value: Sequence[int]) -> tuple[int, int, int]:
    if len(value) != 3 or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in value):
        raise ValueError(f"{name} must be three positive ints (T, H, W), got {value!r}")
    return tuple(value)


def tiles_of(grid: tuple[int, int, int], device=None, tile: tuple[int, int, int] = TILE) -> Tiles:
    """The :class:`Tiles` of a (T, H, W) grid cut into ``tile`` cubes (edge tiles smaller), index tensors on
    ``device``. Tokens inside a tile are row-major over the tile's own (possibly cut) extent, as FastVideo's
    tile partition flattens each sub-block."""
    grid, tile = _check_triple("grid", grid), _check_triple("tile", tile)
    num = tuple(-(-g // s) for g, s in zip(grid, tile))
    volume = math.prod(tile)
    coords = torch.meshgrid(*(torch.arange(g, device=device) for g in grid), indexing="ij")  # 3 x [T, H, W]
    per_dim = []  # per dimension: tile index, offset inside it, and the extent of that tile, each [T, H, W]
    for c, g, s in zip(coords, grid, tile):
        index = c // s
        per_dim.append((index, c % s, torch.clamp(g - index * s, max=s)))
    (it, ot, _), (ih, oh, eh), (iw, ow, ew) = per_dim
    tile_of = ((it * num[1] + ih) * num[2] + iw).reshape(-1)
    where = tile_of * volume + ((ot * eh + oh) * ew + ow).reshape(-1)
    order = torch.argsort(where)
    extents = [torch.clamp(g - torch.arange(k, device=device) * s, max=s) for g, s, k in zip(grid, tile, num)]
    sizes = (extents[0][:, None, None] * extents[1][None, :, None] * extents[2][None, None, :]).reshape(-1)
    valid = torch.arange(volume, device=device)[None, :] < sizes[:, None]
    return Tiles(grid=grid, tile=tile, num_tiles=num, sizes=sizes, order=order, slots=where[order], where=where,
                 tile_of=tile_of, valid=valid)


def tile(x: torch.Tensor, tiles: Tiles) -> torch.Tensor:
    """``x [B, H, L, D]`` in grid order into the padded tile layout ``[B, H, n, V, D]``, padding slots zero."""
    b, h, _, d = x.shape
    padded = x.new_zeros(b, h, tiles.n * tiles.volume, d).index_copy(2, tiles.where, x)
    return padded.view(b, h, tiles.n, tiles.volume, d)


def untile(y: torch.Tensor, tiles: Tiles) -> torch.Tensor:
    """The inverse of :func:`tile` on valid slots: ``y [B, H, n, V, D]`` back to ``[B, H, L, D]`` in grid order."""
    return y.flatten(2, 3).index_select(2, tiles.where)


def topk_count(sparsity: float, n: int) -> int:
    """Key tiles each query tile keeps at ``sparsity`` out of ``n``: FastVideo's ``max(1, min(ceil((1 - s) n), n))``,
    but with ``(1 - s) n`` rounded to 6 decimals first, so float error cannot add a tile (FastVideo's
    ``ceil((1 - 0.7) * 10)`` is ``ceil(3.0000000000000004) = 4``, and ``ceil((1 - 0.95) * 20)`` is 2; here 3 and 1)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive int (number of tiles), got {n!r}")
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity!r}")
    return max(1, min(math.ceil(round((1.0 - sparsity) * n, 6)), n))


def tile_means(x: torch.Tensor, tiles: Tiles) -> torch.Tensor:
    """Per-tile mean of ``x [B, H, L, D]`` over each tile's valid tokens: ``[B, H, n, D]``."""
    b, h, _, d = x.shape
    sums = x.new_zeros(b, h, tiles.n, d).index_add(2, tiles.tile_of, x)
    return sums / tiles.sizes.to(x.dtype)[:, None]


def coarse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: Tiles,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The coarse stage: tile-mean attention. ``q, k, v [B, H, L, D]`` -> scores ``q_c k_c^T * scale [B, H, n, n]``
    (what selection ranks) and per-tile output ``softmax(scores) v_c [B, H, n, D]``."""
    qc, kc, vc = (tile_means(x, tiles) for x in (q, k, v))
    scores = torch.matmul(qc, kc.transpose(-2, -1)) * scale
    return scores, torch.matmul(torch.softmax(scores, dim=-1), vc)


def select(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` highest-scoring key tiles of each query tile: ``scores [B, H, nq, nk]`` ->
    ``[B, H, nq, k]`` long (not differentiable; ties broken by ``torch.topk``)."""
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= scores.shape[-1]:
        raise ValueError(f"k must be an int in [1, {scores.shape[-1]}] (key tiles), got {k!r}")
    return torch.topk(scores.detach(), k, dim=-1).indices


def fine(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: Tiles, selected: torch.Tensor,
         scale: float) -> torch.Tensor:
    """The fine stage, reference form: every query token attends (one softmax) to the valid tokens of the key tiles
    ``selected [B, H, nq, k]`` picked for its tile. Gathers the selected tiles ``[B, H * nq, k * V, D]`` and runs
    one SDPA per query tile with padding masked out, so FLOPs and memory scale with k, not n (no ``[L, L]``
    scores). ``q, k, v [B, H, L, D]`` -> ``[B, H, L, D]``."""
    b, h, _, d = q.shape
    n, volume, kk = tiles.n, tiles.volume, selected.shape[-1]
    qt, kt, vt = (tile(x, tiles) for x in (q, k, v))  # [B, H, n, V, D]
    index = selected.reshape(b, h, n * kk, 1).expand(b, h, n * kk, volume * d)
    ks = torch.gather(kt.flatten(3), 2, index).view(b, h * n, kk * volume, d)
    vs = torch.gather(vt.flatten(3), 2, index).view(b, h * n, kk * volume, d)
    keep = tiles.valid[selected].view(b, h * n, 1, kk * volume)  # padding never attended
    out = F.scaled_dot_product_attention(qt.view(b, h * n, volume, d), ks, vs, attn_mask=keep, scale=scale)
    return untile(out.view(b, h, n, volume, d), tiles)


def block_mask(tiles: Tiles, selected: torch.Tensor):
    """A ``flex_attention`` BlockMask on the padded layout (block = one tile): query tile i reads the key tiles
    ``selected[..., i, :]``. Its mask_mod says the same per token (eager flex applies only the mask_mod; compiled
    flex skips the unlisted blocks) and drops padding keys."""
    from torch.nn.attention.flex_attention import BlockMask

    b, h, n, kk = selected.shape
    volume = tiles.volume
    valid = tiles.valid.reshape(-1)
    chosen = torch.zeros(b, h, n, n, dtype=torch.bool, device=selected.device).scatter(-1, selected, True)

    def keep(batch, head, q_idx, kv_idx):
        return valid[kv_idx] & chosen[batch, head, q_idx // volume, kv_idx // volume]

    counts = torch.full((b, h, n), kk, dtype=torch.int32, device=selected.device)
    # flex wants one column per key block: the first kk hold the selection, the rest (unread) are padding
    indices = torch.cat([selected, selected.new_zeros(b, h, n, n - kk)], -1).to(torch.int32).contiguous()
    length = n * volume
    return BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=volume, mask_mod=keep, seq_lengths=(length, length))


def fine_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: Tiles, selected: torch.Tensor,
              scale: float) -> torch.Tensor:
    """:func:`fine` through ``torch.nn.attention.flex_attention`` on the padded layout (eager here: wrap the caller
    in ``torch.compile`` for a fused kernel). ``[B, H, L, D]`` -> ``[B, H, L, D]``."""
    from torch.nn.attention.flex_attention import flex_attention

    b, h, _, d = q.shape
    qt, kt, vt = (tile(x, tiles).flatten(2, 3) for x in (q, k, v))  # [B, H, n * V, D]
    out = flex_attention(qt, kt, vt, block_mask=block_mask(tiles, selected), scale=scale)
    return untile(out.view(b, h, tiles.n, tiles.volume, d), tiles)


def kernel_available() -> str | None:
    """None when FastVideo's CUDA kernel can run here, else why not (one line)."""
    if not torch.cuda.is_available():
        return "fastvideo-kernel's VSA kernel needs a CUDA device"
    try:
        importlib.import_module("fastvideo_kernel").video_sparse_attn
    except (ImportError, AttributeError) as error:
        return f"fastvideo_kernel.video_sparse_attn is not importable ({error}); install the vsa extra"
    return None


def _kernel(q, k, v, gate, tiles: Tiles, count: int, scale: float) -> torch.Tensor:
    """FastVideo's fused VSA (coarse + selection + fine) on the padded tile layout; CUDA only."""
    try:
        from fastvideo_kernel import video_sparse_attn
    except ImportError as e:
        raise ImportError(f"implementation='kernel' needs fastvideo_kernel.video_sparse_attn, not importable: {e}")
    if q.device.type != "cuda":
        raise ValueError(f"implementation='kernel' needs CUDA tensors, got device {q.device}")
    if not math.isclose(scale, q.shape[-1] ** -0.5):
        raise ValueError(f"implementation='kernel' only supports scale 1/sqrt(D) = {q.shape[-1] ** -0.5}, "
                         f"got {scale}")
    if tiles.tile != TILE:
        raise ValueError(f"implementation='kernel' only supports tile {TILE}, got {tiles.tile}")
    padded = [None if x is None else tile(x, tiles).flatten(2, 3) for x in (q, k, v, gate)]  # [B, H, n * 64, D]
    sizes = tiles.sizes.to(torch.int32)
    out = video_sparse_attn(*padded[:3], sizes, sizes, count, block_size=TILE, compress_attn_weight=padded[3])
    return untile(out.view(*q.shape[:2], tiles.n, tiles.volume, q.shape[-1]), tiles)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: tuple[int, int, int],
                     sparsity: float, gate: torch.Tensor | None = None, scale: float | None = None,
                     implementation: str = "reference") -> torch.Tensor:
    """VSA of ``q, k, v [B, H, L, D]`` (L = T H W, grid order) on ``grid``: ``coarse_out * gate + fine_out``
    (``coarse_out + fine_out`` when ``gate`` is None), each query tile attending finely to its
    ``topk_count(sparsity, n)`` best key tiles. ``scale`` defaults to ``1 / sqrt(D)``. Returns ``[B, H, L, D]``."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one shape [B, H, L, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if gate is not None and gate.shape != q.shape:
        raise ValueError(f"gate must have q's shape {tuple(q.shape)} or be None, got {tuple(gate.shape)}")
    grid = _check_triple("grid", grid)
    if math.prod(grid) != q.shape[2]:
        raise ValueError(f"grid {grid} holds {math.prod(grid)} tokens, but q has L = {q.shape[2]}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    tiles = tiles_of(grid, q.device)
    count = topk_count(sparsity, tiles.n)
    if implementation == "kernel":
        return _kernel(q, k, v, gate, tiles, count, scale)
    scores, out_c = coarse(q, k, v, tiles, scale)
    selected = select(scores, count)
    out_f = (fine if implementation == "reference" else fine_flex)(q, k, v, tiles, selected, scale)
    out_c = out_c.index_select(2, tiles.tile_of)  # [B, H, L, D]: each token gets its tile's coarse output
    return out_f + (out_c if gate is None else out_c * gate)


def sparsity_at(step: int, target: float, decay_rate: float, interval: int) -> float:
    """VSA sparsity at training ``step``. ``decay_rate`` 0: ``target`` at every step (FastVideo's modular trainer).
    Else the legacy trainer's ramp ``min(step // interval, target // decay_rate) * decay_rate``: up by
    ``decay_rate`` every ``interval`` steps, never past the last whole multiple of ``decay_rate`` <= ``target``. The
    count ``target / decay_rate`` is floored after adding 1e-9 (float ``0.9 // 0.03`` is 29, not 30), and the result
    is rounded to 12 decimals (``30 * 0.03`` is 0.8999999999999999)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if not 0.0 <= target <= 1.0:
        raise ValueError(f"target must be in [0, 1], got {target!r}")
    if decay_rate < 0:
        raise ValueError(f"decay_rate must be >= 0 (0: no ramp), got {decay_rate!r}")
    if decay_rate == 0:
        return float(target)
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise ValueError(f"interval must be an int >= 1 (steps per decay), got {interval!r}")
    count = min(step // interval, math.floor(target / decay_rate + 1e-9))
    return round(count * decay_rate, 12)
