"""``python -m fvx.run EXPERIMENT.py --dry-run``: will the run fit? Per-role bytes per rank and an activation estimate
(fvx.distributed.memory) from shapes alone, before any weight is allocated.

Two hooks supply what fvx cannot know: each role's model family describes its architecture (``Model.memory_spec() ->``
``fvx.distributed.memory.ModelSpec``, param shapes read off a meta skeleton), and the method says what it holds of each
role (``config.method.held_roles() ->`` ``fvx.core.state.HeldRole``s: which roles train, keep an EMA, or are frozen in
their frozen dtype), in how many micro-batches a rank's batch is differentiated (``config.method.grad_accum``, or
``config.method.micro_batches(data)`` for a method whose accumulation means another thing) and,
when it carries state across steps, its bytes per sample (``config.method.carried_bytes(models, latent_grid)``).

Before it prints, the dry run refuses what the run refuses from the config and the skeletons alone, through the same
functions (``fvx.training.config_checks.check_models``, and the method's ``check_latent_frames(models, frames)`` on the
samples it estimates, when the experiment or ``--video`` gives them): nothing it accepts is refused by the run's checks
of the config, the roles' models and the clip's length. What needs the files (the data's samples, a negative prompt,
the weights) is checked by the run alone.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

from fvx.core.state import HeldRole
from fvx.data import datasets, sections
from fvx.distributed import memory
from fvx.training.config_checks import check_models
from fvx.training.experiment import build_models, run_keys


class Plan(NamedTuple):
    """What a method tells the dry run: its roles (the first is the one the data feeds, whose latent grid the video
    maps to), and how many micro-batches a rank's batch is differentiated in (gradient accumulation: activations are
    those of one micro-batch)."""

    roles: tuple[memory.Role, ...]
    micro_batches: int = 1


def plan_of(held: Sequence[HeldRole], specs: dict[str, memory.ModelSpec], micro_batches: int = 1) -> Plan:
    """The dry run's plan of a method's held roles: a trained role at fp32 with grads and AdamW state (params alone
    without an optimizer), a frozen one at its model's frozen dtype; each on its ``model`` role's spec."""
    def spec(role: HeldRole) -> memory.ModelSpec:
        return specs[role.model or role.name]

    roles = tuple(memory.Role(role.name, spec(role), trainable=role.trainable, ema=role.ema, optimizer=role.optimizer,
                              **({} if role.trainable else {"param_bytes": spec(role).frozen_bytes}))
                  for role in held)
    return Plan(roles=roles, micro_batches=micro_batches)


def parse_video(text: str) -> tuple[int, int, int]:
    """``"81x480x832"`` -> (frames, height, width); a ValueError names a malformed value."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--video {text!r}: expected FRAMESxHEIGHTxWIDTH of positive integers, e.g. 81x480x832")
    return int(parts[0]), int(parts[1]), int(parts[2])


DEFAULT_VIDEO = (81, 480, 832)  # what the dry run assumes when neither --video nor the experiment's data says


def estimate(plan: Plan, *, world: int, replicate: int, video: Sequence[int] | None = None, global_batch: int,
             capacity: int = memory.H200_BYTES, sp: int = 1, latents: Sequence[int] | None = None,
             carried: Callable[[memory.LatentGrid], int] | None = None,
             history: Callable[[memory.LatentGrid], int] | None = None) -> tuple[memory.Estimate, str]:
    """(the estimate, its title) of ``plan``'s roles sharded over ``world // replicate`` ranks, each rank
    differentiating ``global_batch // (world // sp) // micro_batches`` samples at a time of ``video`` (pixels
    ``(frames, height, width)``) or of ``latents`` (latent ``(T, H, W)``), of whose tokens it holds ``1 / sp`` under
    sequence parallelism (the all-to-all buffers are not counted); ``carried(grid)``: the bytes the method carries
    across steps per sample (for each of the rank's samples); ``history(grid)``: the tokens each forward carries
    beside the grid's (a section's clean history)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"--world must be a positive int, got {world!r}")
    if replicate < 1 or world % replicate:
        raise ValueError(f"replicate={replicate} must be a positive divisor of --world {world}")
    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1 or world % sp:
        raise ValueError(f"--sp {sp!r} must be a positive divisor of --world {world}")
    groups = world // sp  # data-parallel groups: each reads its own samples
    if global_batch % groups:
        raise ValueError(f"data.batch_size {global_batch} is not divisible by the {groups} data-parallel groups "
                         f"(--world {world} / --sp {sp})")
    per_rank = global_batch // groups
    if per_rank % plan.micro_batches:
        raise ValueError(f"a rank's batch of {per_rank} is not divisible into {plan.micro_batches} micro-batches")
    spec = plan.roles[0].model
    if latents is not None:
        grid, shown = memory.tokens_of(latents, spec.patch), "the experiment's latents"
    else:
        grid = memory.latent_grid(*video, vae_stride=spec.vae_stride, patch=spec.patch)
        shown = f"video {'x'.join(map(str, video))} -> latent"
    extra = 0 if history is None else history(grid)
    tokens = grid.tokens + extra
    if tokens % sp:
        raise ValueError(f"{shown} {grid.frames}x{grid.height}x{grid.width}: {tokens} tokens per sample do not "
                         f"split over --sp {sp} ranks")
    micro = per_rank // plan.micro_batches
    est = memory.estimate(plan.roles, shard_size=world // replicate, tokens=tokens // sp, batch_per_rank=micro,
                          capacity=capacity)
    if carried is not None:
        est = est._replace(carried=per_rank * carried(grid))
    title = (f"{world} ranks ({replicate} replica group(s) x {world // replicate} shards), {shown} "
             f"{grid.frames}x{grid.height}x{grid.width} = {grid.tokens} tokens"
             + (f" + {extra} of the section's history" if extra else "")
             + (f" ({tokens // sp} per rank: sequence parallel over {sp})" if sp > 1 else "")
             + f", {micro} sample(s) per rank per forward, compute {8 * spec.compute_bytes}-bit, "
             f"remat {'on' if spec.remat else 'off'}")
    return est, title


def data_latents(config: Any) -> tuple[int, int, int] | None:
    """Latent ``(T, H, W)`` of the experiment's samples, as its data gives them (one sample read, no weight loaded;
    the method's ``latent_shape`` for data without latents); when the data cannot be read here (a recipe's paths on
    another machine), the method's or the validation's ``latent_shape``, else None."""
    try:
        sample = datasets.open_dataset(config.data, run_keys(config.run.seed)[1]).read([0])
    except (ValueError, OSError):
        sample = {}
    if "latents" in sample:
        return tuple(int(s) for s in sample["latents"].shape[-3:])
    shape = getattr(config.method, "latent_shape", None) or getattr(config.validation, "latent_shape", None)
    return None if shape is None else tuple(shape[-3:])


def check_frames(config: Any, models: dict[str, Any], frames: int) -> None:
    """The method's refusal of samples of ``frames`` latent frames (its optional ``check_latent_frames``, which its
    batch check calls with the run's first batch): clips that are not whole blocks of a block-causal model."""
    check = getattr(config.method, "check_latent_frames", None)
    if check is not None:
        check(models, frames)


def report(config: Any, *, world: int, video: Sequence[int] | None = None, replicate: int = 1, sp: int = 1,
           device_memory_gib: float | None = None) -> str:
    """The dry-run table of an experiment config against a device of ``device_memory_gib`` GiB (default: an H200's
    usable memory): builds each role's model skeleton only (meta params). The samples are ``video`` when given, else
    the experiment's own (:func:`data_latents`), else :data:`DEFAULT_VIDEO` (said in the title)."""
    if device_memory_gib is not None and not 0 < device_memory_gib < float("inf"):
        raise ValueError(f"--device-memory must be a positive number of GiB, got {device_memory_gib}")
    capacity = memory.H200_BYTES if device_memory_gib is None else int(device_memory_gib * memory.GIB)
    held = getattr(config.method, "held_roles", None)
    if held is None:
        raise ValueError(f"--dry-run: method {type(config.method).__name__} defines no held_roles() (which roles it "
                         "trains, keeps an EMA of, or holds frozen)")
    models = build_models(config)
    check_models(config, models)  # what the run refuses before it reads a file (fvx.training.experiment.prepare)
    split = getattr(config.method, "micro_batches", None)
    plan = plan_of(held(), {role: model.memory_spec() for role, model in models.items()},
                   getattr(config.method, "grad_accum", 1) if split is None else split(config.data))
    latents = data_latents(config) if video is None else None
    carried = getattr(config.method, "carried_bytes", None)
    patch = plan.roles[0].model.patch  # a section's forward also carries its clean history's tokens
    history = ((lambda grid: sections.history_tokens(grid.height, grid.width, patch))
               if config.data.kind == "framepack" else None)
    est, title = estimate(plan, world=world, replicate=replicate, global_batch=config.data.batch_size,
                          capacity=capacity, sp=sp, latents=latents,
                          video=video if video is not None or latents is not None else DEFAULT_VIDEO,
                          carried=None if carried is None else lambda grid: carried(models, grid), history=history)
    if video is None and latents is None:
        title += " (its data cannot be read here: --video FRAMESxHEIGHTxWIDTH to choose)"
    else:  # samples the experiment or --video gives, not the assumed default: the method's refusal of their length
        check_frames(config, models, latents[0] if latents is not None else
                     memory.latent_grid(*video, vae_stride=plan.roles[0].model.vae_stride,
                                        patch=plan.roles[0].model.patch).frames)
    names = ", ".join(dict.fromkeys(model.name for model in models.values()))
    device = ("an H200 (141 GB, as CUDA reports it; --device-memory GiB for another)" if device_memory_gib is None
              else f"a device of {device_memory_gib:g} GiB")
    return memory.format_table(est, f"{names}: {title}") + f"\ncapacity assumed: {device}"
