"""Memory per rank of a run, estimated from shapes alone (``--dry-run``): will it fit before any weight is allocated?

Per role (a trainable student or critic, a frozen teacher) and per rank, with params sharded as ``fvx.sharding.plan``
lays them out (padding included):

    params      numel_local * param_bytes           fp32 masters (4), or a frozen role's storage (bf16: 2)
    grads       numel_local * 4                     trainable roles: fp32 local grads, live from backward to update
    optimizer   numel_local * 8                     trainable roles: AdamW's mu and nu in fp32
    ema         numel_local * 4                     roles that keep an EMA

Activations of one differentiated forward of ``batch`` samples of ``S`` tokens each, with ``c`` compute-dtype bytes
(2 for bf16). One block saves, per token, ``a`` fp32 vectors and ``b`` compute-dtype vectors of width ``dim``, and
``f`` compute-dtype vectors of width ``ffn_dim`` (:class:`BlockActivations`; flash attention keeps O(S) statistics):

    block  = S * (4 a dim + c b dim + c f ffn_dim)
    root   = S * 4 * 4 dim                          patch embedding, final norm and modulation, output projection
    remat  = batch * (layers * S * dim * c + 2 block + root)    each block's input, plus one block recomputed with
                                                                as much again for its gradients and temporaries
    eager  = batch * ((layers + 1) * block + root)

Gathered params (transient): sharded, the root's full params in the compute dtype live through the step and one
unit's full params, their compute-dtype grads and the fp32 copy reduce-scattered live during its backward:
``root * (c + 4) + unit * (2 c + 4)``; unsharded, the compute-dtype copy of every param is held for the backward:
``numel * c`` (nothing when the compute dtype is the storage's). A frozen role gathers no grads. The largest role's
figure counts, since roles run one at a time.
"""
from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

from fvx import sharding

GIB = 2**30
H200_BYTES = 141 * 10**9  # HBM3e of one H200


class DitDims(NamedTuple):
    """The sizes of a diffusion transformer that the estimates need; a model family supplies them."""

    layers: int
    dim: int
    ffn_dim: int
    text_len: int  # tokens the cross-attention attends to
    text_dim: int  # width of the text encoder's embeddings
    in_channels: int
    out_channels: int
    patch: tuple[int, int, int]
    freq_dim: int  # width of the sinusoidal timestep embedding


class LatentGrid(NamedTuple):
    """Latent frames, height and width of a video, and the transformer's tokens per sample."""

    frames: int
    height: int
    width: int
    tokens: int


def latent_grid(frames: int, height: int, width: int, *, vae_stride: Sequence[int],
                patch: Sequence[int]) -> LatentGrid:
    """The latent grid of a ``frames x height x width`` video under a causal video VAE compressing by ``vae_stride``
    (time, height, width; the first frame is kept: ``T = (frames - 1) / st + 1``), and its tokens after patching."""
    st, sh, sw = vae_stride
    if (frames - 1) % st or height % sh or width % sw:
        raise ValueError(f"video {frames}x{height}x{width} does not fit the VAE stride {tuple(vae_stride)}: "
                         f"frames must be 1 + a multiple of {st}, height of {sh}, width of {sw}")
    grid = ((frames - 1) // st + 1, height // sh, width // sw)
    bad = [name for name, size, p in zip(("frames", "height", "width"), grid, patch) if size % p]
    if bad:
        raise ValueError(f"latent grid {grid} is not divisible by the patch {tuple(patch)} in {', '.join(bad)}")
    return LatentGrid(*grid, math.prod(size // p for size, p in zip(grid, patch)))


# -------------------------------------------------------------------------------------------------------- per role


class Role(NamedTuple):
    """One model of a method: its param shapes, whether it trains (grads, AdamW) and keeps an EMA, and the bytes of
    one stored param element (4 for fp32 masters, 2 for a bf16 frozen teacher)."""

    name: str
    shapes: Mapping[str, tuple[int, ...]]
    trainable: bool
    ema: bool = False
    param_bytes: int = 4


class RoleBytes(NamedTuple):
    params: int
    grads: int
    optimizer: int
    ema: int

    @property
    def total(self) -> int:
        return sum(self)


def local_numel(shapes: Mapping[str, Sequence[int]], shard_size: int) -> int:
    """Elements one rank holds of params of ``shapes`` sharded over ``shard_size`` ranks (padding included)."""
    return sum(math.prod(spec.local_shape(shard_size)) for spec in sharding.plan(shapes, shard_size).values())


def role_bytes(role: Role, shard_size: int) -> RoleBytes:
    """Bytes per rank of ``role``'s params, grads, AdamW state and EMA (see the module docstring)."""
    n = local_numel(role.shapes, shard_size)
    return RoleBytes(params=n * role.param_bytes, grads=4 * n if role.trainable else 0,
                     optimizer=8 * n if role.trainable else 0, ema=4 * n if role.ema else 0)


# ----------------------------------------------------------------------------------------------------- activations


class BlockActivations(NamedTuple):
    """Vectors one block saves for its backward, per token: fp32 of width dim, compute dtype of width dim, compute
    dtype of width ffn_dim. The default was measured (saved-tensor hooks, bf16, eager) on diffusers'
    ``WanTransformerBlock``: its norms, modulations, RoPE and residuals run in fp32. Compiled blocks save less."""

    fp32_dim: float = 12
    compute_dim: float = 10
    compute_ffn: float = 2


def block_activation_bytes(dims: DitDims, tokens: int, compute_bytes: int = 2,
                           per_token: BlockActivations = BlockActivations()) -> int:
    """Bytes one block saves for its backward, for one sample of ``tokens`` tokens."""
    width = 4 * per_token.fp32_dim * dims.dim + compute_bytes * (per_token.compute_dim * dims.dim
                                                                 + per_token.compute_ffn * dims.ffn_dim)
    return int(tokens * width)


def activation_bytes(dims: DitDims, tokens: int, batch: int, *, compute_bytes: int = 2, remat: bool = True,
                     per_token: BlockActivations = BlockActivations()) -> int:
    """Peak activation bytes of one differentiated forward and its backward (formulas in the module docstring)."""
    block = block_activation_bytes(dims, tokens, compute_bytes, per_token)
    root = tokens * 16 * dims.dim
    if remat:
        return batch * (dims.layers * tokens * dims.dim * compute_bytes + 2 * block + root)
    return batch * ((dims.layers + 1) * block + root)


def gathered_bytes(role: Role, units: Sequence[str], shard_size: int, compute_bytes: int = 2) -> int:
    """Transient bytes of full (gathered or cast) params while ``role`` computes (module docstring)."""
    numel = {name: math.prod(shape) for name, shape in role.shapes.items()}
    if shard_size == 1:
        return 0 if compute_bytes == role.param_bytes else sum(numel.values()) * compute_bytes
    by_unit = sharding.names_by_unit(numel, units)
    root = sum(numel[name] for name in by_unit.pop(None))
    unit = max((sum(numel[name] for name in names) for names in by_unit.values()), default=0)
    grad_bytes = (compute_bytes + 4) if role.trainable else 0
    return root * (compute_bytes + (4 if role.trainable else 0)) + unit * (compute_bytes + grad_bytes)


# -------------------------------------------------------------------------------------------------------- estimate


class Estimate(NamedTuple):
    """Bytes per rank: each role's state, the activations of one differentiated forward, gathered params."""

    roles: tuple[tuple[str, RoleBytes], ...]
    activations: int
    gathered: int
    capacity: int

    @property
    def total(self) -> int:
        return sum(r.total for _, r in self.roles) + self.activations + self.gathered

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def estimate(roles: Sequence[Role], *, shard_size: int, dims: DitDims, tokens: int, batch_per_rank: int,
             units: Sequence[str] = (), compute_bytes: int = 2, remat: bool = True, capacity: int = H200_BYTES,
             per_token: BlockActivations = BlockActivations()) -> Estimate:
    """The :class:`Estimate` of a run whose roles are sharded over ``shard_size`` ranks (replicas hold the same),
    each rank differentiating ``batch_per_rank`` samples of ``tokens`` tokens at a time (the largest forward with
    grad of the method's steps; the no-grad forwards of other roles free each block's activations as they go)."""
    if not roles:
        raise ValueError("estimate needs at least one role")
    if shard_size < 1 or batch_per_rank < 1 or tokens < 1:
        raise ValueError(f"shard_size, batch_per_rank and tokens must be >= 1, got {shard_size}, {batch_per_rank}, "
                         f"{tokens}")
    return Estimate(
        roles=tuple((role.name, role_bytes(role, shard_size)) for role in roles),
        activations=activation_bytes(dims, tokens, batch_per_rank, compute_bytes=compute_bytes, remat=remat,
                                     per_token=per_token),
        gathered=max(gathered_bytes(role, units, shard_size, compute_bytes) for role in roles),
        capacity=int(capacity),
    )


def format_table(est: Estimate, title: str = "") -> str:
    """The estimate as a text table in GiB, ending with the verdict."""

    def gib(n: int) -> str:
        return f"{n / GIB:9.2f}"

    lines = [title] if title else []
    lines.append(f"{'per rank, GiB':28} {'params':>9} {'grads':>9} {'AdamW':>9} {'EMA':>9} {'total':>9}")
    for name, r in est.roles:
        lines.append(f"{name:28} {gib(r.params)} {gib(r.grads)} {gib(r.optimizer)} {gib(r.ema)} {gib(r.total)}")
    lines.append(f"{'activations':28} {'':39} {gib(est.activations)}")
    lines.append(f"{'gathered params':28} {'':39} {gib(est.gathered)}")
    lines.append(f"{'total':28} {'':39} {gib(est.total)}")
    verdict = "fits" if est.fits else "does NOT fit"
    lines.append(f"{verdict} in {est.capacity / GIB:.1f} GiB: headroom {(est.capacity - est.total) / GIB:.1f} GiB "
                 "(before the allocator's fragmentation and the CUDA/NCCL context, a few GiB)")
    return "\n".join(lines)
