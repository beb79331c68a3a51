"""Video Sparse Attention (``fvx_models.attention.vsa``) and sparse-linear attention (``fvx_models.attention.sla``)
against dense attention (``F.scaled_dot_product_attention``) as the token count grows: median time of a forward
(``--backward``: forward + backward of a sum of squares) over alternating repeats after a warm-up, and analytic FLOPs
per call (a multiply-add is 2 FLOPs), summed over heads:

    dense    4 L^2 D                         Q K^T and A V over all L tokens
    coarse   4 n^2 D                         tile-mean attention over n = #tiles (means and softmax not counted)
    fine     4 (n V) (k V) D                 the reference's padded tiles: n V query slots (V = 64) against k V keys

with ``k = topk_count(sparsity, n)`` key tiles per query tile. SLA's, over ``L`` tokens in ``Mq`` query blocks of
``bq`` and ``Nk`` key blocks of ``bk``, ``c = int(topk_ratio Nk)`` kept:

    select   2 Mq Nk D                       the pooled scores (block means not counted)
    sparse   4 (Mq bq) (c bk) D              the reference's padded query blocks against their c key blocks
    linear   6 L D^2                         phi(k)^T v, phi(q) (.), and proj_l (feature maps, normaliser not counted)

Ratios are dense / sparse (> 1: the sparse kernel cheaper). On a GPU the
same measurement runs through :func:`vsa_vs_dense` (``bench/gpu.py`` imports it), with the ``"flex"`` (compiled) or
``"kernel"`` (FastVideo's fused kernel) implementations as well.

On a CPU that other jobs share, pass ``--threads 1``: with 2 intra-op threads and one core busy elsewhere, VSA's
many memory-bound ops (tiling, gathers) slow down ~6x while SDPA barely does, and the table says little.
    python bench/attention.py [--grids 4x8x8 8x16x16 12x24x24] [--sparsity 0.8 0.9] [--heads 2] [--head-dim 64]
                              [--repeats 3] [--backward] [--threads N] [--device cpu] [--implementation reference]
                              [--topk-ratio 0.1 0.25] [--block-q 128] [--block-k 64] [--sla-implementation reference]
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parents[1]))  # the repository root: fvx, fvx_models, ...
from common import alternate  # noqa: E402
from fvx_models.attention import sla, vsa  # noqa: E402

DEFAULT_GRIDS = ("4x8x8", "8x16x16", "12x24x24")


def vsa_flops(grid: tuple[int, int, int], heads: int, head_dim: int, sparsity: float) -> dict[str, int]:
    """Analytic forward FLOPs of one call per batch element: dense, and VSA's coarse and fine stages (see above)."""
    tiles = math.prod(-(-g // t) for g, t in zip(grid, vsa.TILE))
    volume, tokens = math.prod(vsa.TILE), math.prod(grid)
    k = vsa.topk_count(sparsity, tiles)
    return {"dense": 4 * tokens * tokens * head_dim * heads, "coarse": 4 * tiles * tiles * head_dim * heads,
            "fine": 4 * tiles * volume * k * volume * head_dim * heads, "tiles": tiles, "k": k}


def vsa_vs_dense(device, grid: tuple[int, int, int], heads: int, head_dim: int, sparsity: float,
                 implementation: str = "reference", batch: int = 1, dtype: torch.dtype = torch.float32,
                 repeats: int = 3, backward: bool = False, seed: int = 0) -> dict[str, float]:
    """Median seconds per call of dense SDPA and of VSA (``implementation``) on random ``[batch, heads, L, head_dim]``
    q, k, v with a random gate, on ``device``; ``"flex"`` runs under ``torch.compile`` on CUDA. Returns seconds
    ``dense_s``, ``vsa_s`` and the FLOPs ``dense_flops``, ``coarse_flops``, ``fine_flops`` of :func:`vsa_flops`."""
    device = torch.device(device)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    shape = (batch, heads, math.prod(grid), head_dim)
    q, k, v, gate = (torch.randn(shape, generator=generator).to(device, dtype) for _ in range(4))
    if backward:
        q, k, v, gate = (x.requires_grad_() for x in (q, k, v, gate))

    attend = vsa.sparse_attention
    if implementation == "flex" and device.type == "cuda":
        attend = torch.compile(vsa.sparse_attention, dynamic=False)

    def run(fn):
        def call():
            if not backward:
                with torch.no_grad():
                    return fn()
            out = fn()
            torch.autograd.grad(out.float().square().sum(), (q, k, v))
        return call

    fns = {"dense_s": run(lambda: F.scaled_dot_product_attention(q, k, v)),
           "vsa_s": run(lambda: attend(q, k, v, grid, sparsity, gate=gate, implementation=implementation))}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = alternate(fns, repeats=repeats, warmup=1, sync=sync)
    flops = {f"{name}_flops": value * batch for name, value in vsa_flops(grid, heads, head_dim, sparsity).items()
             if name in ("dense", "coarse", "fine")}
    return times | flops


def sla_flops(tokens: int, heads: int, head_dim: int, topk_ratio: float, block_q: int = 128,
              block_k: int = 64) -> dict[str, int]:
    """Analytic forward FLOPs of one SLA call per batch element: dense, and SLA's selection, sparse and linear parts
    (see above), with the blocks counted ``c`` of ``Nk``."""
    mq, nk = -(-tokens // block_q), -(-tokens // block_k)
    c = sla.topk_count(topk_ratio, nk)
    return {"dense": 4 * tokens * tokens * head_dim * heads, "select": 2 * mq * nk * head_dim * heads,
            "sparse": 4 * mq * block_q * c * block_k * head_dim * heads,
            "linear": 6 * tokens * head_dim * head_dim * heads, "blocks": nk, "c": c}


def sla_vs_dense(device, tokens: int, heads: int, head_dim: int, topk_ratio: float, block_q: int = 128,
                 block_k: int = 64, implementation: str = "reference", batch: int = 1,
                 dtype: torch.dtype = torch.float32, repeats: int = 3, backward: bool = False,
                 seed: int = 0) -> dict[str, float]:
    """Median seconds per call of dense SDPA and of SLA (``implementation``) on random ``[batch, heads, tokens,
    head_dim]`` q, k, v with a random ``proj_l``, on ``device`` (``backward``: forward + backward of a sum of
    squares, into q, k, v and ``proj_l``). Returns ``dense_s``, ``sla_s`` and the FLOPs of :func:`sla_flops`."""
    device = torch.device(device)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    shape = (batch, heads, tokens, head_dim)
    q, k, v = (torch.randn(shape, generator=generator).to(device, dtype) for _ in range(3))
    projection = torch.nn.Linear(head_dim, head_dim, device=device, dtype=dtype)
    with torch.no_grad():
        projection.weight.copy_(torch.randn(head_dim, head_dim, generator=generator) * head_dim ** -0.5)
    wrt = (q, k, v, *projection.parameters())
    if backward:
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        wrt = (q, k, v, *projection.parameters())

    def run(fn, inputs):
        def call():
            if not backward:
                with torch.no_grad():
                    return fn()
            torch.autograd.grad(fn().float().square().sum(), inputs)
        return call

    fns = {"dense_s": run(lambda: F.scaled_dot_product_attention(q, k, v), (q, k, v)),
           "sla_s": run(lambda: sla.sparse_linear_attention(q, k, v, projection, topk_ratio, block_q, block_k,
                                                            implementation=implementation), wrt)}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = alternate(fns, repeats=repeats, warmup=1, sync=sync)
    flops = {f"{name}_flops": value * batch for name, value in
             sla_flops(tokens, heads, head_dim, topk_ratio, block_q, block_k).items()
             if name in ("dense", "select", "sparse", "linear")}
    return times | flops


def parse_grid(text: str) -> tuple[int, int, int]:
    """``"4x8x8"`` -> ``(4, 8, 8)``."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"grid must look like TxHxW with positive ints, got {text!r}")
    return tuple(int(p) for p in parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grids", type=parse_grid, nargs="+", default=[parse_grid(g) for g in DEFAULT_GRIDS],
                        help="token grids TxHxW (e.g. 16x32x32 as well: ~1 min more on 2 CPU cores)")
    parser.add_argument("--sparsity", type=float, nargs="+", default=[0.8, 0.9])
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backward", action="store_true", help="time forward + backward instead of forward")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--implementation", choices=vsa.IMPLEMENTATIONS, default="reference")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--topk-ratio", type=float, nargs="+", default=[0.1, 0.25],
                        help="SLA's top-k ratios (0.1: FastVideo's and TurboWan's)")
    parser.add_argument("--block-q", type=int, default=128)
    parser.add_argument("--block-k", type=int, default=64)
    parser.add_argument("--sla-implementation", choices=sla.IMPLEMENTATIONS, default="reference")
    parser.add_argument("--skip-vsa", action="store_true", help="only the SLA table")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, batch {args.batch}, "
          f"heads {args.heads}, head dim {args.head_dim}, {args.dtype}, VSA {args.implementation}, "
          f"{'forward + backward' if args.backward else 'forward'}, median of {args.repeats}")
    if not args.skip_vsa:
        vsa_table(args, dtype)
    if args.topk_ratio:
        sla_table(args, dtype)


def vsa_table(args: argparse.Namespace, dtype: torch.dtype) -> None:
    """The VSA rows: each grid at each sparsity."""
    header = (f"{'grid':>10} {'L':>6} {'sparsity':>8} {'k/n':>8} {'dense ms':>9} {'VSA ms':>9} {'time x':>7} "
              f"{'dense GFLOP':>11} {'VSA GFLOP':>10} {'FLOP x':>7}")
    print(header)
    print("-" * len(header))
    for grid in args.grids:
        for sparsity in args.sparsity:
            r = vsa_vs_dense(args.device, grid, args.heads, args.head_dim, sparsity, args.implementation,
                             batch=args.batch, dtype=dtype, repeats=args.repeats, backward=args.backward)
            counts = vsa_flops(grid, args.heads, args.head_dim, sparsity)
            sparse_flops = r["coarse_flops"] + r["fine_flops"]
            print(f"{'x'.join(map(str, grid)):>10} {math.prod(grid):>6} {sparsity:>8.2f} "
                  f"{counts['k']:>3}/{counts['tiles']:<4} {r['dense_s'] * 1e3:>9.1f} {r['vsa_s'] * 1e3:>9.1f} "
                  f"{r['dense_s'] / r['vsa_s']:>7.2f} {r['dense_flops'] / 1e9:>11.3f} {sparse_flops / 1e9:>10.3f} "
                  f"{r['dense_flops'] / sparse_flops:>7.2f}")


def sla_table(args: argparse.Namespace, dtype: torch.dtype) -> None:
    """The SLA rows: each grid's token count at each top-k ratio (a ratio that keeps no block is skipped, named)."""
    print(f"\nSLA {args.sla_implementation}, blocks {args.block_q} x {args.block_k}")
    header = (f"{'L':>6} {'ratio':>6} {'c/Nk':>8} {'dense ms':>9} {'SLA ms':>9} {'time x':>7} {'dense GFLOP':>11} "
              f"{'SLA GFLOP':>10} {'(linear)':>9} {'FLOP x':>7}")
    print(header)
    print("-" * len(header))
    for grid in args.grids:
        tokens = math.prod(grid)
        for ratio in args.topk_ratio:
            counts = sla_flops(tokens, args.heads, args.head_dim, ratio, args.block_q, args.block_k)
            if counts["c"] < 1:
                print(f"{tokens:>6} {ratio:>6.2f} {counts['c']:>3}/{counts['blocks']:<4} keeps no key block: skipped")
                continue
            r = sla_vs_dense(args.device, tokens, args.heads, args.head_dim, ratio, args.block_q, args.block_k,
                             args.sla_implementation, batch=args.batch, dtype=dtype, repeats=args.repeats,
                             backward=args.backward)
            sparse_flops = r["select_flops"] + r["sparse_flops"] + r["linear_flops"]
            print(f"{tokens:>6} {ratio:>6.2f} {counts['c']:>3}/{counts['blocks']:<4} {r['dense_s'] * 1e3:>9.1f} "
                  f"{r['sla_s'] * 1e3:>9.1f} {r['dense_s'] / r['sla_s']:>7.2f} {r['dense_flops'] / 1e9:>11.3f} "
                  f"{sparse_flops / 1e9:>10.3f} {r['linear_flops'] / 1e9:>9.3f} "
                  f"{r['dense_flops'] / sparse_flops:>7.2f}")


if __name__ == "__main__":
    main()
