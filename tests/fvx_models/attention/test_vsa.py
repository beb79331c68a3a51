"""fvx_models.attention.vsa: tiling against a brute-force partition of the grid, topk counts and the sparsity
schedule by hand, the coarse stage and selection against loops, the fine stage against dense masked attention built
from the selection, the gradients of the gated sum, and the flex / kernel forms against the reference."""
import math
import warnings

import pytest
import torch

from fvx.core import random
from fvx_models.attention import vsa

GRIDS = [(5, 6, 3), (4, 8, 8), (3, 4, 9)]


def qkv(key, grid, heads=2, dim=8, batch=1, n=3):
    shape = (batch, heads, math.prod(grid), dim)
    return [random.normal(k, shape) for k in random.split(key, n)]


def brute_partition(grid, tile=vsa.TILE):
    """The tiles of the grid as lists of grid (row-major) indices, by slicing each sub-block (FastVideo's way)."""
    index = torch.arange(math.prod(grid)).reshape(grid)
    out = []
    for t in range(0, grid[0], tile[0]):
        for h in range(0, grid[1], tile[1]):
            for w in range(0, grid[2], tile[2]):
                out.append(index[t:t + tile[0], h:h + tile[1], w:w + tile[2]].flatten().tolist())
    return out


def dense(q, k, v, mask=None, scale=None):
    """Softmax attention by hand, ``mask [.., L, L]`` True = attend."""
    logits = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return torch.softmax(logits, -1) @ v


def selection_mask(tiles, selected):
    """Token-level [B, H, L, L] mask (grid order) built from the tile selection by loops."""
    parts = brute_partition(tiles.grid, tiles.tile)
    b, h, n, _ = selected.shape
    L = math.prod(tiles.grid)
    mask = torch.zeros(b, h, L, L, dtype=torch.bool)
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                keys = [t for j in selected[bi, hi, i].tolist() for t in parts[j]]
                for tok in parts[i]:
                    mask[bi, hi, tok, keys] = True
    return mask


@pytest.mark.parametrize("grid", GRIDS)
def test_tiles_match_a_brute_force_partition(grid):
    tiles = vsa.tiles_of(grid)
    parts = brute_partition(grid)
    assert tiles.num_tiles == tuple(-(-g // 4) for g in grid) and tiles.n == len(parts)
    assert tiles.sizes.tolist() == [len(p) for p in parts] and int(tiles.sizes.sum()) == math.prod(grid)
    assert tiles.order.tolist() == [t for p in parts for t in p]
    assert sorted(tiles.order.tolist()) == list(range(math.prod(grid)))
    assert tiles.slots.tolist() == [i * 64 + j for i, p in enumerate(parts) for j in range(len(p))]
    assert torch.equal(tiles.where[tiles.order], tiles.slots)
    assert tiles.tile_of.tolist() == [next(i for i, p in enumerate(parts) if t in p) for t in range(len(tiles.order))]
    assert tiles.valid.sum(1).tolist() == tiles.sizes.tolist() and tiles.valid.shape == (len(parts), 64)


@pytest.mark.parametrize("grid", GRIDS)
def test_tile_untile_round_trip_with_zero_padding(key, grid):
    (x,) = qkv(key, grid, n=1)
    tiles = vsa.tiles_of(grid)
    y = vsa.tile(x, tiles)
    assert y.shape == (1, 2, tiles.n, 64, 8)
    assert torch.equal(vsa.untile(y, tiles), x)
    assert torch.all(y[:, :, ~tiles.valid] == 0)
    parts = brute_partition(grid)
    for i, p in enumerate(parts):
        assert torch.equal(y[:, :, i, :len(p)], x[:, :, p])


def test_topk_count_by_hand():
    assert vsa.topk_count(0.9, 10) == 1
    assert vsa.topk_count(0.7, 10) == 3 and math.ceil((1 - 0.7) * 10) == 4  # FastVideo's float formula: 4
    assert vsa.topk_count(0.95, 20) == 1 and math.ceil((1 - 0.95) * 20) == 2
    assert vsa.topk_count(0.0, 10) == 10
    assert vsa.topk_count(0.8, 10) == 2
    assert vsa.topk_count(0.85, 10) == 2
    assert vsa.topk_count(0.99, 10) == 1  # clamped to >= 1
    assert vsa.topk_count(1.0, 7) == 1
    assert vsa.topk_count(0.5, 3) == 2
    assert vsa.topk_count(0.7, 1) == 1
    for bad in [(-0.1, 4), (1.5, 4), (0.5, 0)]:
        with pytest.raises(ValueError):
            vsa.topk_count(*bad)


def test_sparsity_at_both_schedules():
    assert [vsa.sparsity_at(s, 0.9, 0.0, 10) for s in (0, 5, 1000)] == [0.9, 0.9, 0.9]
    ramp = [vsa.sparsity_at(s, 0.9, 0.03, 10) for s in (0, 9, 10, 25, 299, 300, 10_000)]
    assert ramp == [0.0, 0.0, 0.03, 0.06, 0.87, 0.9, 0.9]  # 0.9 // 0.03 == 29.0 in floats; 30 steps here
    # a target that is not a multiple of the rate stops at the last whole multiple (FastVideo's formula)
    assert [vsa.sparsity_at(s, 0.9, 0.4, 1) for s in (1, 2, 3, 9)] == [0.4, 0.8, 0.8, 0.8]
    with pytest.raises(ValueError):
        vsa.sparsity_at(3, 0.9, 0.1, 0)
    with pytest.raises(ValueError):
        vsa.sparsity_at(-1, 0.9, 0.1, 1)


@pytest.mark.parametrize("grid", [(5, 6, 3), (4, 8, 8)])
def test_coarse_and_select_against_loops(key, grid):
    q, k, v = qkv(key, grid)
    tiles = vsa.tiles_of(grid)
    parts = brute_partition(grid)
    scale = 0.3
    scores, out = vsa.coarse(q, k, v, tiles, scale)
    qc, kc, vc = (torch.stack([x[:, :, p].mean(2) for p in parts], 2) for x in (q, k, v))
    want = qc @ kc.transpose(-2, -1) * scale
    torch.testing.assert_close(scores, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(out, torch.softmax(want, -1) @ vc, rtol=0, atol=1e-6)
    count = vsa.topk_count(0.6, tiles.n)
    selected = vsa.select(scores, count)
    assert selected.shape == (*scores.shape[:3], count)
    for row, idx in zip(scores.reshape(-1, tiles.n).tolist(), selected.reshape(-1, count).tolist()):
        best = sorted(range(tiles.n), key=lambda j: -row[j])[:count]
        assert set(idx) == set(best)


@pytest.mark.parametrize("grid", GRIDS)
def test_sparsity_zero_with_zero_gate_is_dense_attention(key, grid):
    q, k, v = qkv(key, grid)
    out = vsa.sparse_attention(q, k, v, grid, 0.0, gate=torch.zeros_like(q))
    torch.testing.assert_close(out, dense(q, k, v), rtol=0, atol=1e-6)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v), rtol=0, atol=1e-6)


def test_gate_none_adds_the_coarse_output_ungated(key):
    grid = (5, 6, 3)
    q, k, v = qkv(key, grid)
    tiles = vsa.tiles_of(grid)
    _, out_c = vsa.coarse(q, k, v, tiles, 8 ** -0.5)
    coarse_tokens = out_c[:, :, tiles.tile_of]
    ungated = vsa.sparse_attention(q, k, v, grid, 0.5)
    zero = vsa.sparse_attention(q, k, v, grid, 0.5, gate=torch.zeros_like(q))
    torch.testing.assert_close(ungated - coarse_tokens, zero, rtol=0, atol=1e-6)
    gate = random.normal(random.key(5), q.shape)
    gated = vsa.sparse_attention(q, k, v, grid, 0.5, gate=gate)
    torch.testing.assert_close(gated, zero + coarse_tokens * gate, rtol=0, atol=1e-6)


@pytest.mark.parametrize("grid,sparsity", [((5, 6, 3), 0.5), ((4, 8, 8), 0.75), ((3, 4, 9), 0.9)])
def test_fine_equals_dense_attention_masked_by_the_selection(key, grid, sparsity):
    q, k, v = qkv(key, grid, batch=2)
    tiles = vsa.tiles_of(grid)
    scale = 8 ** -0.5
    scores, _ = vsa.coarse(q, k, v, tiles, scale)
    selected = vsa.select(scores, vsa.topk_count(sparsity, tiles.n))
    out = vsa.fine(q, k, v, tiles, selected, scale)
    torch.testing.assert_close(out, dense(q, k, v, selection_mask(tiles, selected)), rtol=0, atol=1e-6)


def test_gradients_skip_unselected_tiles_and_gate_gets_coarse_times_upstream(key):
    grid = (4, 8, 8)  # 4 tiles; sparsity 0.5 keeps 2 per query tile
    q, k, v, up = qkv(key, grid, n=4)
    gate = torch.zeros_like(q, requires_grad=True)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    tiles = vsa.tiles_of(grid)
    out = vsa.sparse_attention(q, k, v, grid, 0.5, gate=gate)
    first = tiles.tile_of == 0  # the loss reads query tile 0's tokens only
    (out * up)[:, :, first].sum().backward()
    scores, out_c = vsa.coarse(q.detach(), k.detach(), v.detach(), tiles, 8 ** -0.5)
    selected = vsa.select(scores, 2)
    for bh in range(2):
        chosen = torch.isin(tiles.tile_of, selected[0, bh, 0])
        for g in (k.grad[0, bh], v.grad[0, bh]):
            assert torch.all(g[~chosen] == 0)
            assert torch.all(g[chosen].abs().sum(-1) > 0)
    want = (out_c[:, :, tiles.tile_of] * up) * first[:, None]
    torch.testing.assert_close(gate.grad, want, rtol=0, atol=1e-6)
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v, gate))


def test_gradients_of_the_ungated_sum_are_finite_and_match_dense_at_sparsity_zero(key):
    grid = (5, 6, 3)
    q, k, v = (x.requires_grad_() for x in qkv(key, grid))
    out = vsa.sparse_attention(q, k, v, grid, 0.0, gate=torch.zeros_like(q))
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = torch.autograd.grad(dense(q, k, v).square().sum(), (q, k, v))
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


def test_bad_inputs_raise_one_line_value_errors(key):
    q, k, v = qkv(key, (4, 4, 4))
    cases = [dict(grid=(4, 4, 5)), dict(grid=(4, 4)), dict(implementation="triton"), dict(sparsity=1.5),
             dict(gate=torch.zeros(1, 2, 64, 4))]
    for case in cases:
        args = dict(grid=(4, 4, 4), sparsity=0.5) | case
        with pytest.raises(ValueError) as e:
            vsa.sparse_attention(q, k, v, **args)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("grid,sparsity", [((5, 6, 3), 0.5), ((4, 8, 8), 0.0)])
def test_flex_equals_reference_on_cpu(key, grid, sparsity):
    q, k, v, gate = qkv(key, grid, n=4)
    want = vsa.sparse_attention(q, k, v, grid, sparsity, gate=gate)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # flex_attention without torch.compile
        got = vsa.sparse_attention(q, k, v, grid, sparsity, gate=gate, implementation="flex")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_kernel_without_fastvideo_kernel_or_cuda_raises(key):
    q, k, v = qkv(key, (4, 4, 4))
    try:
        import fastvideo_kernel
        del fastvideo_kernel
    except ImportError:
        with pytest.raises(ImportError):
            vsa.sparse_attention(q, k, v, (4, 4, 4), 0.5, implementation="kernel")
    else:
        with pytest.raises(ValueError):
            vsa.sparse_attention(q, k, v, (4, 4, 4), 0.5, implementation="kernel")


@pytest.mark.cuda
def test_kernel_matches_reference_on_cuda(key):
    pytest.importorskip("fastvideo_kernel")
    grid = (8, 8, 12)
    q, k, v, gate = (x.cuda().to(torch.bfloat16) for x in qkv(key, grid, heads=2, dim=64, n=4))
    got = vsa.sparse_attention(q, k, v, grid, 0.75, gate=gate, implementation="kernel").float()
    want = vsa.sparse_attention(*(x.float() for x in (q, k, v)), grid, 0.75, gate=gate.float())
    torch.testing.assert_close(got, want, rtol=0, atol=3e-2)


@pytest.mark.cuda
def test_reference_and_flex_on_cuda_match_cpu_values_and_gradients(key):
    grid = (5, 6, 3)
    q, k, v, gate = qkv(key, grid, n=4)
    inputs = [x.requires_grad_() for x in (q, k, v, gate)]
    want = vsa.sparse_attention(q, k, v, grid, 0.5, gate=gate)
    want_grads = torch.autograd.grad(want.square().sum(), inputs)
    for implementation in ("reference", "flex"):
        cuda = [x.detach().cuda().requires_grad_() for x in inputs]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            got = vsa.sparse_attention(*cuda[:3], grid, 0.5, gate=cuda[3], implementation=implementation)
            grads = torch.autograd.grad(got.square().sum(), cuda)
        torch.testing.assert_close(got.detach().cpu(), want.detach(), rtol=0, atol=1e-5)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g.cpu(), w, rtol=0, atol=1e-4)
