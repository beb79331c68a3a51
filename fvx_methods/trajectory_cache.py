"""A teacher's ODE trajectories, cached as a dataset: built once by their own resumable command, then read by
knowledge distillation (``fvx_methods.kd``) in place of the experiment's data.

    python -m fvx_methods.trajectory_cache EXPERIMENT.py[:recipe] [a.b=value ...] [--batch N]
    torchrun --nproc_per_node N -m fvx_methods.trajectory_cache EXPERIMENT.py[:recipe] [a.b=value ...]

The experiment is the KD run's own (its ``method`` says the teacher role, ``t_list``, ``teacher_steps``,
``flow_shift``, the guidance and the ``cache`` folder; its ``data`` the prompts). For dataset sample ``i`` (its
latents give only the shape, its ``cond`` the prompt, both as the teacher's model makes them): the noise
``eps_i = normal(fold_in(noise_key, i))`` ``[C, T, H, W]``, from which the teacher integrates the probability-flow
ODE with Euler steps ``x <- x + (sigma' - sigma) v`` over ``validation.many_step_sigmas(teacher_steps, shift)``,
``v`` its velocity under classifier-free guidance ``uncond + g (cond - uncond)`` (``flow.cfg``, the unconditional
cond ``model.uncond(cond, cfg_uncond, negative)``) when ``teacher_guidance_scale`` g is not 1. The levels
``t / 1000`` of the nonzero ``t`` of ``t_list`` are inserted into that grid, so the recorded states sit *exactly*
at the t_list times (FastVideo instead requires every t_list value to appear on its integer teacher grid).

The folder::

    metadata.json                  written first, before any sample: what the cache is (:func:`metadata`)
    samples/00000012.safetensors   sample 12, fp32 in the model's (normalised) latent scale: ``states [S, C, T, H,
                                   W]`` at ``times [S]`` (int64: the nonzero t_list values, descending), ``x0 [C, T,
                                   H, W]`` (where the ODE ends: the target), ``cond.<name>`` (the sample's cond
                                   tensors, whatever the family's are), ``cfg_dropped`` when the data says; the
                                   caption in the file's metadata. No pickle anywhere.
    COMPLETE                       written last, once every sample is there

Resumable and reproducible: samples are computed in fixed groups of ``--batch`` consecutive indices (group ``g``
holds ``[g b, (g + 1) b)``; rank ``r`` of ``N`` processes builds the groups ``g % N == r``), each file is written
atomically (a temporary file, fsync, rename, fsync of the folder), and a restart skips the files that exist and
recomputes only groups that miss some. A group is always computed whole, so every file is bit-identical to an
uninterrupted build's. A restart whose metadata differs (another teacher, data, t_list, seed, ...) is refused with
one line naming the field. Bad input exits 2 with one line, before anything is written.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import sys
import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import msgspec
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from fvx import config as fconfig
from fvx.core import flow, random, role
from fvx.data import batching, datasets, parquet
from fvx.storage import files
from fvx.training import progress, validation
from fvx.training.experiment import build_models, load_config, run_keys
from fvx_models.model import check_shared_data, Model, Params

FORMAT = 1
METADATA, COMPLETE, SAMPLES = "metadata.json", "COMPLETE", "samples"
COND_PREFIX = "cond."
HASHED_ROWS = 4  # the dataset rows whose content identifies it
DEFAULT_BATCH = 16  # samples per teacher forward
COMMAND = "python -m fvx_methods.trajectory_cache"
BUILD_HINT = f"{COMMAND} EXPERIMENT.py [the run's overrides]"
TRAINING_SKIPS = ("seed", "batch", "t_list", "times", "teacher.params_sha256", "data.source")
"""Metadata a resumed build must match but a training run does not compare: it reads the cache as data, so the
times it needs are checked (a subset of the cache's) instead of the whole t_list, and the teacher is known by its id
rather than by loading it to hash."""


class CacheError(ValueError):
    """A trajectory cache that cannot be used or built; one line naming the folder, field or value."""


class Trajectory(NamedTuple):
    """What the teacher integrates and where its states are recorded (a KD method's ``trajectory()``): ``t_list``
    (descending timesteps ending in 0), the Euler steps and shift of its grid, its guidance, the cache ``folder``
    and the ``teacher`` role."""

    t_list: tuple[int, ...]
    teacher_steps: int
    shift: float
    guidance_scale: float
    cfg_uncond: str
    negative_prompt_path: str | None
    folder: str
    teacher: str

    @property
    def times(self) -> tuple[int, ...]:
        """The timesteps whose states are recorded: the nonzero ``t_list`` values (0 is ``x0`` itself)."""
        return tuple(t for t in self.t_list if t > 0)


def cache_keys(run_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(teacher_key, noise_key) = split(run_key, 4)[2:]`` (a KD method's state uses the first two): the teacher's
    params when it has no folder, and the per-sample ODE noise."""
    keys = random.split(run_key, 4)
    return keys[2], keys[3]


# ---------------------------------------------------------------------------------------------------------- the ODE


def ode_levels(trajectory: Trajectory) -> tuple[torch.Tensor, list[int]]:
    """``(levels [N + 1], positions [S])``: the teacher's Euler grid, descending from 1 and ending at 0, with the
    recorded levels ``t / 1000`` inserted; ``levels[positions[s]]`` is ``trajectory.times[s] / 1000`` exactly."""
    grid = validation.many_step_sigmas(trajectory.teacher_steps, trajectory.shift)
    recorded = flow.denoising_sigmas(trajectory.times)
    levels = torch.unique(torch.cat([grid, recorded, torch.zeros(1)])).flip(0)
    positions = [int(torch.nonzero(levels == level)[0]) for level in recorded]
    return levels, positions


def integrate(velocity: flow.ApplyFn, params: Params, noise: torch.Tensor, cond: Any, levels: torch.Tensor,
              positions: Sequence[int],
              on_step: Callable[[float], None] = lambda fraction: None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(states [B, S, C, T, H, W], x0 [B, C, T, H, W])`` fp32: Euler from ``noise`` (at ``levels[0]``) down the
    ``levels``, the state before the step from ``levels[positions[s]]`` recorded as ``states[:, s]``, and the end;
    ``on_step(fraction)`` after each step (the fraction of the ODE it took)."""
    x, states = noise.float(), {}
    for i in range(len(levels) - 1):
        if i in positions:
            states[i] = x
        v = velocity(params, x, flow.to_timestep(levels[i]).expand(x.shape[0]).to(x.device), cond)
        x = x + (levels[i + 1] - levels[i]).to(x.device) * v.float()
        on_step(1 / (len(levels) - 1))
    return torch.stack([states[i] for i in positions], dim=1), x


def teacher_velocity(teacher: Model, trajectory: Trajectory, negative: Any = None) -> flow.ApplyFn:
    """The teacher's velocity under its guidance: ``flow.cfg`` of the conditional and unconditional calls, or the
    conditional call alone at scale 1."""
    return validation.guided(teacher.apply, lambda cond: teacher.uncond(cond, trajectory.cfg_uncond, negative),
                             trajectory.guidance_scale)


def sample_noise(key: torch.Tensor, indices: torch.Tensor, shape: Sequence[int], device: Any) -> torch.Tensor:
    """``[B, *shape]``: sample ``i``'s noise ``normal(fold_in(key, i))``, whatever group or rank computes it."""
    return random.normal_each(random.fold_in(key, indices), tuple(shape), device=device)


# -------------------------------------------------------------------------------------------------------- the files


def sample_path(folder: pathlib.Path, index: int) -> pathlib.Path:
    return folder / SAMPLES / f"{index:08d}.safetensors"


def encode_sample(states: torch.Tensor, times: Sequence[int], x0: torch.Tensor, cond: Mapping[str, torch.Tensor],
                  extra: Mapping[str, torch.Tensor], caption: str | None) -> bytes:
    """One sample's safetensors bytes (deterministic: the same tensors give the same bytes)."""
    tensors = {"states": states, "times": torch.tensor(list(times), dtype=torch.int64), "x0": x0,
               **{COND_PREFIX + name: t for name, t in cond.items()}, **extra}
    tensors = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    return save(tensors, metadata=None if caption is None else {"caption": caption})


def read_sample(path: pathlib.Path) -> tuple[dict[str, torch.Tensor], str | None]:
    """A sample file's tensors and caption; a DataError names a missing or unreadable file."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}, (handle.metadata() or {}).get("caption")
    except (SafetensorError, OSError) as error:
        raise parquet.DataError(f"trajectory cache sample {str(path)!r} cannot be read: {error}") from None


def stale_temporaries(folder: pathlib.Path, indices: Sequence[int]) -> list[pathlib.Path]:
    """The temporary files a killed build left for ``indices`` (this rank's samples: no other live process writes
    them)."""
    names = {sample_path(folder, i).name for i in indices}
    return [p for p in (folder / SAMPLES).glob(".*.tmp") if p.name[1:].rsplit(".", 2)[0] in names]


# ----------------------------------------------------------------------------------------------------- the metadata


def params_sha256(params: Params) -> str:
    """A hash of every param's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(params):
        tensor = params[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def teacher_identity(teacher: Model, params: Params | None = None) -> dict[str, Any]:
    """``name`` (family and preset), ``id`` (what its frozen params are: ``base_id(whole_model=True)`` as text, less
    the placement flag, so a sharded training run's teacher is the same) and, given its params, ``params_sha256``."""
    parts = [str(part) for part in teacher.weights.base_id(whole_model=True) if not isinstance(part, bool)]
    identity: dict[str, Any] = {"name": teacher.name, "id": "/".join(parts)}
    if params is not None:
        identity["params_sha256"] = params_sha256(params)
    return identity


def data_identity(dataset: batching.Dataset, source: Any = None) -> dict[str, Any]:
    """``samples`` (the count), ``rows_sha256`` (the tensors of the first rows, as the dataset reads them) and,
    given the data config, ``source`` (where the data comes from)."""
    digest = hashlib.sha256()
    raw = dataset.read(list(range(min(HASHED_ROWS, len(dataset)))))
    for name in sorted(raw):
        if isinstance(raw[name], torch.Tensor):
            tensor = raw[name].detach().cpu().contiguous()
            digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)};".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    identity: dict[str, Any] = {"samples": len(dataset), "rows_sha256": digest.hexdigest()}
    if source is not None:
        identity["source"] = source
    return identity


def metadata(trajectory: Trajectory, teacher: dict[str, Any], dataset: dict[str, Any], **build: Any) -> dict:
    """What a cache is: its format, the teacher (:func:`teacher_identity`), the data (:func:`data_identity`), the
    ODE (``t_list``, the recorded ``times``, ``teacher_steps``, ``shift``, ``guidance``) and what else a build
    records (``build``: the ``seed`` and ``batch``)."""
    guided = trajectory.guidance_scale != 1.0
    record = {"format": FORMAT, "teacher": teacher, "data": dataset, "t_list": list(trajectory.t_list),
              "times": list(trajectory.times),
              "teacher_steps": trajectory.teacher_steps, "shift": trajectory.shift,
              "guidance": {"scale": trajectory.guidance_scale, "uncond": trajectory.cfg_uncond if guided else None,
                           "negative_prompt": trajectory.negative_prompt_path if guided else None}}
    return json.loads(files.json_bytes({**record, **build}))  # as the file holds it


def first_difference(expected: Mapping[str, Any], found: Mapping[str, Any]) -> str | None:
    """``"field: the cache has X, this run Y"`` for the first entry of ``expected`` that ``found`` lacks or holds
    otherwise (nested dicts by dotted path, ``fvx.config.differences``), else None. Entries ``found`` has beyond
    ``expected`` are not checked."""
    for path, there, value in fconfig.differences(found, expected):
        if value is not fconfig.MISSING:
            shown = "(missing)" if there is fconfig.MISSING else json.dumps(there)
            return f"{path}: the cache has {shown}, this run {json.dumps(value)}"
    return None


def for_training(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` without the :data:`TRAINING_SKIPS` entries: what a training run compares."""
    out = {name: value for name, value in record.items() if name not in TRAINING_SKIPS}
    return {name: {k: v for k, v in value.items() if f"{name}.{k}" not in TRAINING_SKIPS}
            if isinstance(value, Mapping) else value for name, value in out.items()}


def read_metadata(folder: pathlib.Path) -> dict[str, Any] | None:
    """The cache's metadata, None when it has none; a CacheError when it is not valid JSON."""
    path = folder / METADATA
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CacheError(f"trajectory cache metadata {str(path)!r} is not valid JSON: {error}") from None


# ----------------------------------------------------------------------------------------------------- reading it


class CacheDataset:
    """A complete cache as a dataset (``fvx.data.datasets``'s protocol). ``read(indices)`` gives the batch as a method
    sees it: ``latents [B, C, T, H, W]`` (the targets ``x0``, in the model's scale), ``trajectory [B, K, C, T, H, W]``
    (the states at the ``times`` asked for, in that order), ``cond`` (the cached cond tensors), ``index [B]``, and
    ``cfg_dropped`` and ``caption`` when cached. Sample ``i`` is dataset sample ``i`` of ``source``, whose
    ``sample_quality`` (the toy world's) it forwards."""

    def __init__(self, folder: pathlib.Path, positions: Sequence[int], length: int, source: Any = None):
        self.folder, self.positions, self.length = folder, list(positions), length
        quality = getattr(source, "sample_quality", None)
        if quality is not None:
            self.sample_quality = quality

    def __len__(self) -> int:
        return self.length

    def read(self, indices: Sequence[int]) -> dict[str, Any]:
        samples = [read_sample(sample_path(self.folder, int(i))) for i in indices]
        tensors = [s for s, _ in samples]
        batch: dict[str, Any] = {
            "latents": torch.stack([s["x0"] for s in tensors]),
            "trajectory": torch.stack([s["states"][self.positions] for s in tensors]),
            "cond": {name[len(COND_PREFIX):]: torch.stack([s[name] for s in tensors])
                     for name in tensors[0] if name.startswith(COND_PREFIX)},
            "index": torch.tensor([int(i) for i in indices], dtype=torch.int64)}
        if "cfg_dropped" in tensors[0]:
            batch["cfg_dropped"] = torch.stack([s["cfg_dropped"] for s in tensors])
        if all(caption is not None for _, caption in samples):
            batch["caption"] = [caption for _, caption in samples]
        return batch

    def where(self, index: int) -> str:
        return f"{str(sample_path(self.folder, index))!r}"


def open_cache(folder: str | os.PathLike, expected: Mapping[str, Any], times: Sequence[int],
               source: Any = None) -> CacheDataset:
    """The complete cache at ``folder`` whose metadata matches ``expected`` (:func:`for_training`) and holds the
    states at every ``times``; else a one-line CacheError that names the cache-building command or the field."""
    folder = pathlib.Path(folder)
    found = read_metadata(folder)
    if found is None:
        raise CacheError(f"trajectory cache {str(folder)!r} does not exist; build it first with: {BUILD_HINT}")
    if not (folder / COMPLETE).is_file():
        have = sum(1 for _ in (folder / SAMPLES).glob("*.safetensors")) if (folder / SAMPLES).is_dir() else 0
        total = found.get("data", {}).get("samples", "?")
        raise CacheError(f"trajectory cache {str(folder)!r} is incomplete ({have} of {total} samples); finish it "
                         f"with: {BUILD_HINT} (it resumes)")
    difference = first_difference(expected, found)
    if difference is not None:
        raise CacheError(f"trajectory cache {str(folder)!r} was built for another run: {difference}; rebuild it "
                         f"into a new method.cache folder with: {BUILD_HINT}")
    missing = [t for t in times if t not in found["times"]]
    if missing:
        raise CacheError(f"trajectory cache {str(folder)!r} holds states at t = {found['times']}, but "
                         f"method.t_list needs t = {missing} too; build a cache for this t_list (a new "
                         f"method.cache folder) with: {BUILD_HINT}")
    return CacheDataset(folder, [found["times"].index(t) for t in times], found["data"]["samples"], source)


# ---------------------------------------------------------------------------------------------------- building it


class Build(NamedTuple):
    """What a build did: samples written now, samples found from before, the total, whether it is complete."""

    written: int
    found: int
    total: int
    complete: bool


def trajectory_of(config: Any) -> Trajectory:
    """The experiment's trajectory (its method's ``trajectory()``), or a ConfigError for a method without one."""
    method = getattr(config, "method", None)
    if not callable(getattr(method, "trajectory", None)):
        raise fconfig.ConfigError(f"method {type(method).__name__} builds no trajectory cache; use an experiment "
                                  "whose method is kd or kd_causal (fvx_methods.kd)")
    return method.trajectory()


def groups_of(total: int, batch: int, rank: int, world: int) -> list[list[int]]:
    """This rank's groups: ``[g b, (g + 1) b)`` (cut at ``total``) for every ``g`` with ``g % world == rank``."""
    return [list(range(g * batch, min(total, (g + 1) * batch)))
            for g in range(-(-total // batch)) if g % world == rank]


def start(folder: pathlib.Path, record: Mapping[str, Any]) -> None:
    """Write the metadata of a new cache, or refuse (one line naming the field) one built for something else."""
    found = read_metadata(folder)
    if found is None:
        if folder.exists() and any(not p.name.endswith(".tmp") for p in folder.iterdir()):
            raise CacheError(f"method.cache {str(folder)!r} is a non-empty folder without {METADATA}: not a "
                             "trajectory cache; choose another folder")
        folder.mkdir(parents=True, exist_ok=True)
        files.write_json(folder / METADATA, record)  # first: before the samples folder, before any sample
        found = record
    difference = first_difference(record, found)
    if difference is not None:
        raise CacheError(f"trajectory cache {str(folder)!r} was built otherwise: {difference}; build into a new "
                         "method.cache folder, or restore that setting")
    (folder / SAMPLES).mkdir(parents=True, exist_ok=True)


def teacher_batch(teacher: Model, dataset: batching.Dataset, indices: Sequence[int]) -> dict[str, Any]:
    """Dataset rows ``indices`` as the teacher sees them (``sample_index`` = the dataset index), checked: latents
    that fit it (only their shape is used) and its cond."""
    batch = teacher.batch({**dataset.read(list(indices)), "sample_index": torch.tensor(list(indices))})
    if "latents" not in batch:
        raise CacheError("the trajectory cache takes the sample shape from the data's latents, but the data has none "
                         "(data.kind='text_only'?)")
    teacher.check_latents(tuple(batch["latents"].shape), where="the data's latents")
    return batch


def compute_group(teacher: Model, velocity: flow.ApplyFn, params: Params, dataset: batching.Dataset,
                  indices: Sequence[int], noise_key: torch.Tensor, trajectory: Trajectory,
                  on_step: Callable[[float], None] = lambda fraction: None) -> list[bytes]:
    """The files of the samples ``indices`` (one teacher batch), in order; ``on_step`` as :func:`integrate`'s."""
    batch = teacher_batch(teacher, dataset, indices)
    device = next(iter(params.values())).device
    levels, positions = ode_levels(trajectory)
    noise = sample_noise(noise_key, batch["sample_index"], batch["latents"].shape[1:], device)
    cond = {name: t.to(device) for name, t in batch["cond"].items()}
    with torch.no_grad():
        states, x0 = integrate(velocity, params, noise, cond, levels, positions, on_step)
    captions = batch.get("caption") or [None] * len(indices)
    dropped = batch.get("cfg_dropped")
    return [encode_sample(states[row], trajectory.times, x0[row], {n: t[row] for n, t in cond.items()},
                          {} if dropped is None else {"cfg_dropped": dropped[row]}, captions[row])
            for row in range(len(indices))]


def build(config: Any, *, batch: int | None = None, rank: int = 0, world: int = 1, progress: bool = False,
          after_write: Callable[[int], None] | None = None) -> Build:
    """Build (or finish) the experiment ``config``'s cache: this rank's missing samples, ``batch`` per teacher
    forward (None: the cache's own when it was begun before, else :data:`DEFAULT_BATCH`), then ``COMPLETE`` once
    all are there. Everything is checked (models, data, negative prompt, teacher weights, the metadata of a cache
    begun before) before anything is written. ``after_write(i)`` runs after sample ``i``'s file is in place (tests
    inject a failure there)."""
    trajectory = trajectory_of(config)
    folder = pathlib.Path(trajectory.folder)
    if batch is None:
        batch = (read_metadata(folder) or {}).get("batch", DEFAULT_BATCH)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise CacheError(f"--batch must be a positive int, got {batch!r}")
    models = build_models(config)
    check_shared_data(models, data_role=trajectory.teacher)
    teacher = models[trajectory.teacher]
    method_key, data_key = run_keys(config.run.seed)
    teacher_key, noise_key = cache_keys(method_key)
    dataset = datasets.open_dataset(config.data, data_key)
    negative = (teacher.load_negative(trajectory.negative_prompt_path, "method.negative_prompt_path")
                if trajectory.guidance_scale != 1.0 and trajectory.cfg_uncond == "negative_prompt" else None)
    velocity = teacher_velocity(teacher, trajectory, negative)
    groups = groups_of(len(dataset), batch, rank, world)
    teacher_batch(teacher, dataset, [0])  # the data fits the teacher
    params = role.frozen_params(teacher_key, {trajectory.teacher: (teacher, True)})[trajectory.teacher]
    source = {name: value for name, value in msgspec.to_builtins(config.data).items()
              if name not in ("batch_size", "prefetch")}
    record = metadata(trajectory, teacher_identity(teacher, params), data_identity(dataset, source),
                      t_list=list(trajectory.t_list), seed=config.run.seed, batch=batch)
    start(folder, record)
    mine = [i for group in groups for i in group]
    for temp in stale_temporaries(folder, mine):
        temp.unlink(missing_ok=True)
    found = sum(sample_path(folder, i).is_file() for i in mine)
    written = 0
    todo = [g for g in groups if not all(sample_path(folder, i).is_file() for i in g)]
    with _progress(sum(map(len, todo)), progress) as bar:
        for group in todo:
            payloads = compute_group(teacher, velocity, params, dataset, group, noise_key, trajectory,
                                     on_step=lambda fraction, n=len(group): bar.update(n * fraction))
            for index, payload in zip(group, payloads):
                if sample_path(folder, index).is_file():
                    continue
                files.write_atomic(sample_path(folder, index), payload)
                written += 1
                if after_write is not None:
                    after_write(index)
    complete = all(sample_path(folder, i).is_file() for i in range(len(dataset)))
    if complete and not (folder / COMPLETE).is_file():
        files.write_json(folder / COMPLETE, {"format": FORMAT, "samples": len(dataset)})
    return Build(written, found, len(dataset), complete)


def _progress(samples: int, show: bool) -> Any:
    """The build's progress in samples (moving with every ODE step), their rate and what is left, when ``show``."""
    return progress.bar(samples, desc="teacher ODE", unit="sample", show=show,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total} samples [{elapsed}<{remaining}, "
                                   "{rate_fmt}]")  # whole samples done, though the bar moves with each ODE step


# ------------------------------------------------------------------------------------------------- the command line


USAGE = f"{COMMAND} EXPERIMENT.py[:recipe] [a.b.c=value ...] [--batch N] [--help]"
BAD_INPUT = (fconfig.ConfigError, ValueError, FileNotFoundError)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=COMMAND, usage=USAGE, description=(
        "Build the teacher's ODE-trajectory cache of a KD experiment (fvx_methods.kd): for every sample of its "
        "data, the teacher's states at the method's t_list times and the final x0, one safetensors file each, in "
        "method.cache. Resumable: run it again after an interruption and it writes only what is missing. Under "
        "torchrun each rank builds its own groups of samples."))
    parser.add_argument("experiment", help="the KD experiment file (a Python file that assigns `config`)")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. method.teacher_steps=24")
    parser.add_argument("--batch", type=int, help=f"samples per teacher forward (default {DEFAULT_BATCH}, or the "
                                                  "cache's own when it resumes one: part of its metadata, so every "
                                                  "file is what one uninterrupted build writes)")
    return parser.parse_intermixed_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 built (or already complete); 2 bad input (one line on stderr, nothing written)."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    began = time.perf_counter()
    try:
        config = load_config(args.experiment, args.overrides)
        for line in fconfig.repeated(args.overrides) if rank == 0 else ():
            print(f"note: {line}", file=sys.stderr)
        done = build(config, batch=args.batch, rank=rank, world=world, progress=True)
    except BAD_INPUT as error:
        print(f"{COMMAND}: error: {error}", file=sys.stderr)
        return 2
    folder = trajectory_of(config).folder
    state = "complete" if done.complete else "not complete yet (other ranks are still building)"
    print(f"trajectory cache {folder}: wrote {done.written} samples in {time.perf_counter() - began:.1f} s "
          f"({done.found} were there); {state}, {done.total} samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
