"""``python -m fvx.run EXPERIMENT.py --dry-run``: will the run fit? Per-role bytes per rank and an activation estimate
(fvx.memory) from shapes alone, before any weight is allocated.

Two hooks supply what fvx cannot know: the model family describes its architecture (``Model.memory_spec() ->``
:class:`ModelSpec`, param shapes read off a meta skeleton), and the method names its roles
(``config.method.memory_plan(shapes) ->`` :class:`Plan`: which roles train, keep an EMA, or are frozen in bf16).
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

from fvx import memory


class ModelSpec(NamedTuple):
    """What a model family tells the dry run: param shapes, transformer sizes, unit prefixes (one per block), the
    VAE's compression (time, height, width), the compute dtype's bytes, and whether blocks recompute (remat)."""

    shapes: Mapping[str, tuple[int, ...]]
    dims: memory.DitDims
    units: tuple[str, ...]
    vae_stride: tuple[int, int, int]
    compute_bytes: int
    remat: bool


class Plan(NamedTuple):
    """What a method tells the dry run: its roles, and how many micro-batches a rank's batch is differentiated in
    (gradient accumulation: activations are those of one micro-batch)."""

    roles: tuple[memory.Role, ...]
    micro_batches: int = 1


def parse_video(text: str) -> tuple[int, int, int]:
    """``"81x480x832"`` -> (frames, height, width); a ValueError names a malformed value."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--video {text!r}: expected FRAMESxHEIGHTxWIDTH of positive integers, e.g. 81x480x832")
    return int(parts[0]), int(parts[1]), int(parts[2])


def estimate(spec: ModelSpec, plan: Plan, *, world: int, replicate: int, video: Sequence[int], global_batch: int
             ) -> tuple[memory.Estimate, str]:
    """(the estimate, its title) of ``plan``'s roles sharded over ``world // replicate`` ranks, each rank
    differentiating ``global_batch // world // micro_batches`` samples of ``video`` at a time."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"--world must be a positive int, got {world!r}")
    if replicate < 1 or world % replicate:
        raise ValueError(f"replicate={replicate} must be a positive divisor of --world {world}")
    if global_batch % world:
        raise ValueError(f"data.batch_size {global_batch} is not divisible by --world {world}")
    per_rank = global_batch // world
    if per_rank % plan.micro_batches:
        raise ValueError(f"a rank's batch of {per_rank} is not divisible into {plan.micro_batches} micro-batches")
    grid = memory.latent_grid(*video, vae_stride=spec.vae_stride, patch=spec.dims.patch)
    micro = per_rank // plan.micro_batches
    est = memory.estimate(plan.roles, shard_size=world // replicate, dims=spec.dims, tokens=grid.tokens,
                          batch_per_rank=micro, units=spec.units, compute_bytes=spec.compute_bytes, remat=spec.remat)
    title = (f"{world} ranks ({replicate} replica group(s) x {world // replicate} shards), video "
             f"{'x'.join(map(str, video))} -> latent {grid.frames}x{grid.height}x{grid.width} = {grid.tokens} tokens, "
             f"{micro} sample(s) per rank per forward, compute {8 * spec.compute_bytes}-bit, "
             f"remat {'on' if spec.remat else 'off'}")
    return est, title


def report(config: Any, *, world: int, video: Sequence[int], replicate: int = 1) -> str:
    """The dry-run table of an experiment config: builds the model's skeleton only (meta params)."""
    model = config.model.build()
    describe = getattr(model, "memory_spec", None)
    if describe is None:
        raise ValueError(f"--dry-run: model {getattr(model, 'name', type(model).__name__)} has no memory_spec "
                         "(its family does not describe its shapes)")
    plan_of = getattr(config.method, "memory_plan", None)
    if plan_of is None:
        raise ValueError(f"--dry-run: method {type(config.method).__name__} defines no memory_plan(shapes) "
                         "(which roles it trains, keeps an EMA of, or holds frozen)")
    spec = describe()
    est, title = estimate(spec, plan_of(spec.shapes), world=world, replicate=replicate, video=video,
                          global_batch=config.data.batch_size)
    return memory.format_table(est, f"{model.name}: {title}")
