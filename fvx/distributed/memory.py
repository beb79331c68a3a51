"""Memory per rank of a run, estimated from shapes alone (``--dry-run``): will it fit before any weight is allocated?

Per role (a trainable student or critic, a frozen teacher) and per rank, with params sharded as
``fvx.distributed.sharding.plan`` lays them out (padding included):

    params      numel_local * param_bytes           fp32 masters (4), or a frozen role's storage (bf16: 2)
    grads       numel_local * 4                     trainable roles: fp32 local grads, live from backward to update
    optimizer   numel_local * 8                     trainable roles: AdamW's mu and nu in fp32
    ema         numel_local * 4                     roles that keep an EMA

Activations of one differentiated forward of ``batch`` samples of ``S`` video tokens each (``L`` text tokens), with
``c`` compute-dtype bytes (2 for bf16). A model's units come in groups (:class:`UnitGroup`: Wan has one, HunyuanVideo
its dual- and single-stream blocks and its token refiner); a unit of group ``g`` saves, per token it runs over (``S``,
or ``L`` for a text refiner), ``a_g`` fp32 vectors and ``b_g`` compute-dtype vectors of width ``dim_g`` and ``f_g``
compute-dtype vectors of width ``ffn_g`` (:class:`BlockActivations`, the family's measurement; flash attention keeps
O(S) statistics), and ``p_g`` compute-dtype elements per pair of the ``tokens_g + j_g`` tokens of its joint sequence
(an attention mask it builds over them: HunyuanVideo 1.5's; ``j_g`` the text and image tokens beside the video's):

    block_g = tokens_g * (4 a_g dim_g + c b_g dim_g + c f_g ffn_g) + c p_g (tokens_g + j_g)^2
    root    = S * 4 * 4 dim                         patch embedding, final norm and modulation, output projection
    remat   = batch * (sum_g n_g tokens_g dim_g c + 2 max_g block_g + root)   each unit's input, plus one unit
                                                    recomputed with as much again for its gradients and temporaries
    eager   = batch * (sum_g n_g block_g + max_g block_g + root)

Gathered params (transient): sharded, the root's full params in the compute dtype live through the step (and their fp32
gradients), two units' full params at a time (the one computing and the next one, prefetched; every unit's when units
keep them from forward to backward, ``reshard_after_forward=False`` without remat), and one unit's compute-dtype grads
and the fp32 copy reduce-scattered during its backward: ``root * (c + 4) + (unit_1 + unit_2) * c + unit * (c + 4)``;
unsharded, the compute-dtype copy of every param is held for the backward: ``numel * c`` (nothing when the compute dtype
is the storage's). A frozen role gathers no grads. The largest role's figure counts, since roles run one at a time.
"""
from __future__ import annotations

import math
from typing import Hashable, Mapping, NamedTuple, Sequence

from fvx.distributed import gathers, sharding

GIB = 2**30
H200_BYTES = 141 * 10**9  # HBM3e of one H200


class BlockActivations(NamedTuple):
    """Vectors one unit saves for its backward, per token: fp32 of width dim, compute dtype of width dim, compute
    dtype of width ffn_dim; and compute-dtype elements per pair of the tokens of its joint sequence (``pairs``: a
    ``[B, 1, S, S]`` attention mask it builds), which holds ``joint_tokens`` beside the video's. A model family
    measures them for each of its unit groups (saved-tensor hooks, bf16, eager; tests/fvx_models check them);
    compiled units save less."""

    fp32_dim: float
    compute_dim: float
    compute_ffn: float
    pairs: float = 0.0
    joint_tokens: int = 0


class UnitGroup(NamedTuple):
    """One group of units of a model, as the estimate sees it: how many, their widths, what each saves per token,
    and whether they run over the text tokens (a token refiner) instead of the video's."""

    name: str
    count: int
    dim: int
    ffn_dim: int
    saved: BlockActivations
    text_tokens: bool = False


class ModelSpec(NamedTuple):
    """What a model family tells the dry run (``Model.memory_spec()``): param shapes read off the meta skeleton, the
    unit prefixes (what gathers as one), the unit groups, the root's width, the text length it attends to, the VAE's
    compression (time, height, width), the patch, the compute dtype's bytes, whether units recompute (remat) and
    drop their gathered params after the forward (reshard), the bytes of a param stored frozen (2 for a bf16 teacher
    or LoRA base); which params a trained role trains (``trained``, None: all) out of all ``shapes`` (a LoRA model's
    include its adapters), which belong to the architecture (``architecture``, None: all; what a frozen role holds),
    and the identities of what a trained role holds frozen (``base_id``) and of the whole frozen architecture
    (``whole_id``): equal ids are one copy in memory."""

    shapes: Mapping[str, tuple[int, ...]]
    units: tuple[str, ...]
    groups: tuple[UnitGroup, ...]
    dim: int
    text_len: int
    vae_stride: tuple[int, int, int]
    patch: tuple[int, int, int]
    compute_bytes: int
    remat: bool
    reshard: bool = True
    frozen_bytes: int = 2
    trained: frozenset[str] | None = None
    architecture: frozenset[str] | None = None
    base_id: Hashable = None
    whole_id: Hashable = None

    def part(self, names: frozenset[str] | None) -> dict[str, tuple[int, ...]]:
        """The shapes of ``names`` (None: all)."""
        return dict(self.shapes) if names is None else {n: s for n, s in self.shapes.items() if n in names}

    def held(self) -> dict[str, tuple[int, ...]]:
        """The shapes a trained role holds frozen: the architecture's params it does not train."""
        trained = self.trained or frozenset()
        return {n: s for n, s in self.part(self.architecture).items() if self.trained is not None and n not in trained}


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
    return tokens_of(((frames - 1) // st + 1, height // sh, width // sw), patch)


def tokens_of(latents: Sequence[int], patch: Sequence[int]) -> LatentGrid:
    """The tokens of a latent ``(T, H, W)`` grid after patching."""
    bad = [name for name, size, p in zip(("frames", "height", "width"), latents, patch) if size % p]
    if bad:
        raise ValueError(f"latent grid {tuple(latents)} is not divisible by the patch {tuple(patch)} in "
                         f"{', '.join(bad)}")
    return LatentGrid(*latents, math.prod(size // p for size, p in zip(latents, patch)))


# -------------------------------------------------------------------------------------------------------- per role


class Role(NamedTuple):
    """One model of a method: its :class:`ModelSpec`, whether it trains (grads, AdamW; ``optimizer=False``: the
    trained params alone, as an old policy holds them) and keeps an EMA, and the bytes of one stored param element
    (4 for fp32 masters, 2 for a bf16 frozen teacher)."""

    name: str
    model: ModelSpec
    trainable: bool
    ema: bool = False
    param_bytes: int = 4
    optimizer: bool = True

    @property
    def differentiated(self) -> bool:
        return self.trainable and self.optimizer


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
    """Bytes per rank of ``role``'s params, grads, AdamW state and EMA (see the module docstring): the params it
    trains, or a frozen role's whole architecture. What a trained role holds frozen is :func:`base_rows`'."""
    spec = role.model
    n = local_numel(spec.part(spec.trained if role.trainable else spec.architecture), shard_size)
    return RoleBytes(params=n * role.param_bytes, grads=4 * n if role.differentiated else 0,
                     optimizer=8 * n if role.differentiated else 0, ema=4 * n if role.ema else 0)


def base_rows(roles: Sequence[Role], shard_size: int) -> list[tuple[str, RoleBytes]]:
    """One row per distinct frozen base of the trained roles (a LoRA base, an expert left frozen), named by the
    roles that share it; a base that is a frozen role's whole model (the teacher) is that role's row and adds
    nothing."""
    whole = {role.model.whole_id: role.name for role in roles if not role.trainable}
    sharing: dict[Hashable, list[Role]] = {}
    for role in roles:
        if role.trainable and role.model.held():
            sharing.setdefault(role.model.base_id, []).append(role)
    rows = []
    for identity, members in sharing.items():
        names = "+".join(role.name for role in members)
        if identity in whole:
            rows.append((f"  base of {names} = {whole[identity]}", RoleBytes(0, 0, 0, 0)))
            continue
        n = local_numel(members[0].model.held(), shard_size)
        rows.append((f"base of {names}", RoleBytes(n * members[0].model.frozen_bytes, 0, 0, 0)))
    return rows


# ----------------------------------------------------------------------------------------------------- activations


def block_activation_bytes(group: UnitGroup, tokens: int, compute_bytes: int = 2) -> int:
    """Bytes one unit of ``group`` saves for its backward, for one sample of ``tokens`` tokens."""
    s = group.saved
    width = 4 * s.fp32_dim * group.dim + compute_bytes * (s.compute_dim * group.dim + s.compute_ffn * group.ffn_dim)
    return int(tokens * width + compute_bytes * s.pairs * (tokens + s.joint_tokens) ** 2)


def activation_bytes(spec: ModelSpec, tokens: int, batch: int, *, compute_bytes: int | None = None,
                     remat: bool | None = None) -> int:
    """Peak activation bytes of one differentiated forward and its backward (formulas in the module docstring);
    ``compute_bytes`` and ``remat`` default to the spec's."""
    c = spec.compute_bytes if compute_bytes is None else compute_bytes
    remat = spec.remat if remat is None else remat
    if not spec.groups:
        raise ValueError("activation_bytes: the model spec has no unit groups")

    def tokens_of(group: UnitGroup) -> int:
        return spec.text_len if group.text_tokens else tokens

    blocks = [block_activation_bytes(g, tokens_of(g), c) for g in spec.groups]
    root = tokens * 16 * spec.dim
    if remat:
        inputs = sum(g.count * tokens_of(g) * g.dim * c for g in spec.groups)
        return batch * (inputs + 2 * max(blocks) + root)
    return batch * (sum(g.count * b for g, b in zip(spec.groups, blocks)) + max(blocks) + root)


def gathered_bytes(role: Role, shard_size: int, compute_bytes: int | None = None) -> int:
    """Transient bytes of full (gathered or cast) params while ``role`` computes (module docstring); gradients only
    of the params it trains."""
    c = role.model.compute_bytes if compute_bytes is None else compute_bytes
    spec = role.model
    numel = {name: math.prod(shape) for name, shape in
             (spec.shapes if role.trainable else spec.part(spec.architecture)).items()}
    trained = (spec.trained if spec.trained is not None else frozenset(numel)) if role.trainable else frozenset()
    if shard_size == 1:  # a cast copy of every param not stored in the compute dtype
        stored = {name: role.param_bytes if name in trained or not role.trainable else spec.frozen_bytes
                  for name in numel}
        return sum(n * c for name, n in numel.items() if stored[name] != c)

    def grads(names, grad_bytes: int) -> int:
        return sum(numel[name] * grad_bytes for name in names if name in trained)

    by_unit = gathers.names_by_unit(numel, spec.units)
    root = by_unit.pop(None, [])
    fulls = sorted((sum(numel[name] for name in names) * c for names in by_unit.values()), reverse=True)
    kept = sum(fulls[:2]) if spec.reshard or spec.remat else sum(fulls)
    unit_grads = max((grads(names, c + 4) for names in by_unit.values()), default=0)
    return sum(numel[name] for name in root) * c + grads(root, 4) + kept + unit_grads


# -------------------------------------------------------------------------------------------------------- estimate


class Estimate(NamedTuple):
    """Bytes per rank: each role's state, the activations of one differentiated forward, gathered params, and what
    the method carries across steps (a stream's KV cache and latents)."""

    roles: tuple[tuple[str, RoleBytes], ...]
    activations: int
    gathered: int
    capacity: int
    carried: int = 0

    @property
    def total(self) -> int:
        return sum(r.total for _, r in self.roles) + self.activations + self.gathered + self.carried

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def estimate(roles: Sequence[Role], *, shard_size: int, tokens: int, batch_per_rank: int,
             capacity: int = H200_BYTES) -> Estimate:
    """The :class:`Estimate` of a run whose roles are sharded over ``shard_size`` ranks (replicas hold the same),
    each rank differentiating ``batch_per_rank`` samples of ``tokens`` tokens at a time through its largest trainable
    role (the no-grad forwards of other roles free each unit's activations as they go)."""
    if not roles:
        raise ValueError("estimate needs at least one role")
    if shard_size < 1 or batch_per_rank < 1 or tokens < 1:
        raise ValueError(f"shard_size, batch_per_rank and tokens must be >= 1, got {shard_size}, {batch_per_rank}, "
                         f"{tokens}")
    differentiated = [role for role in roles if role.differentiated] or list(roles)
    return Estimate(
        roles=tuple((role.name, role_bytes(role, shard_size)) for role in roles) + tuple(base_rows(roles, shard_size)),
        activations=max(activation_bytes(role.model, tokens, batch_per_rank) for role in differentiated),
        gathered=max(gathered_bytes(role, shard_size) for role in roles),
        capacity=int(capacity),
    )


def format_table(est: Estimate, title: str = "") -> str:
    """The estimate as a text table in GiB, ending with the verdict."""

    def gib(n: int) -> str:
        return f"{n / GIB:9.2f}"

    lines = [title] if title else []
    lines.append(f"{'per rank, GiB':34} {'params':>9} {'grads':>9} {'AdamW':>9} {'EMA':>9} {'total':>9}")
    for name, r in est.roles:
        lines.append(f"{name:34} {gib(r.params)} {gib(r.grads)} {gib(r.optimizer)} {gib(r.ema)} {gib(r.total)}")
    lines.append(f"{'activations':34} {'':39} {gib(est.activations)}")
    lines.append(f"{'gathered params':34} {'':39} {gib(est.gathered)}")
    if est.carried:
        lines.append(f"{'carried across steps':34} {'':39} {gib(est.carried)}")
    lines.append(f"{'total':34} {'':39} {gib(est.total)}")
    verdict = "fits" if est.fits else "does NOT fit"
    lines.append(f"{verdict} in {est.capacity / GIB:.1f} GiB: headroom {(est.capacity - est.total) / GIB:.1f} GiB "
                 "(before the allocator's fragmentation and the CUDA/NCCL context, a few GiB)")
    return "\n".join(lines)
