"""The generic training loop: build, then step, log and show progress. It knows no model family and no method.

An experiment's root config subclasses :class:`Experiment` and adds a ``model`` (whose ``build()`` gives the model
interface) and a ``method`` (whose ``build(model, total_steps=...)`` gives an ``fvx.state.Program``). Step ``s`` runs
on ``batch_at(s)`` with the step key ``fold_in(key, s)``, so any step can be recomputed from the config alone.
"""
from __future__ import annotations

import pathlib
import time
from typing import Annotated, Any

import msgspec
import torch

from fvx import config as fconfig
from fvx import data, random, tracking
from fvx.config import Config
from fvx.state import Program, TrainState


class RunConfig(Config):
    """Where a run writes, how long it runs, and its seed (every key of the run derives from it)."""

    seed: int = 0
    steps: Annotated[int, msgspec.Meta(ge=0)] = 100
    output_dir: str = "runs/default"
    log_every: Annotated[int, msgspec.Meta(ge=1)] = 1
    progress: bool = True


class Experiment(Config):
    """The root of an experiment config; subclasses add ``model`` and ``method``."""

    run: RunConfig = RunConfig()
    data: data.DataConfig = data.DataConfig()


class Setup(msgspec.Struct, frozen=True):
    """Everything a run builds from its config before the first step."""

    model: Any
    program: Program
    dataset: Any
    data_key: torch.Tensor
    method_key: torch.Tensor


def setup(config: Experiment) -> Setup:
    """Build the model, the method's program and the dataset; keys are split off ``key(config.run.seed)``."""
    method_key, data_key = random.split(random.key(config.run.seed))
    model = config.model.build()
    program = config.method.build(model, total_steps=config.run.steps)
    dataset = data.open_dataset(config.data, data_key)
    return Setup(model=model, program=program, dataset=dataset, data_key=data_key, method_key=method_key)


def batch_fn(config: Experiment, built: Setup, *, rank: int = 0, world: int = 1):
    """``step -> this rank's batch``: a pure function of the config's seed."""
    def at(step: int):
        return data.batch_at(built.dataset, built.data_key, step, batch_size=config.data.batch_size,
                             rank=rank, world=world)
    return at


def prepare(config: Experiment, *, rank: int = 0, world: int = 1) -> tuple[Setup, TrainState]:
    """Build everything and check the first batch against the method, writing nothing: bad input fails here."""
    built = setup(config)
    built.program.check(batch_fn(config, built, rank=rank, world=world)(0))
    return built, built.program.init(built.method_key)


def train(config: Experiment, *, rank: int = 0, world: int = 1,
          prepared: tuple[Setup, TrainState] | None = None) -> TrainState:
    """Run ``config.run.steps`` steps from the initial state; log to TensorBoard on rank 0; return the final state."""
    out = pathlib.Path(config.run.output_dir)
    built, state = prepared if prepared is not None else prepare(config, rank=rank, world=world)
    if rank == 0:
        fconfig.dump(config, out)
    with tracking.open_tracker(out / "tb", rank=rank) as tracker:
        if rank == 0:
            tracker.hparams(msgspec.to_builtins(config))
        state = run_steps(config, built, state, range(int(state.step), config.run.steps), tracker,
                          rank=rank, world=world)
    return state


def run_steps(config: Experiment, built: Setup, state: TrainState, steps: range, tracker: tracking.Tracker, *,
              rank: int = 0, world: int = 1) -> TrainState:
    """Take ``steps`` with ``built.program.step_`` on prefetched batches, logging every ``config.run.log_every``."""
    global_batch = config.data.batch_size
    progress = _progress_bar(config, steps, rank)
    with data.Prefetcher(batch_fn(config, built, rank=rank, world=world), steps, depth=config.data.prefetch) as batches:
        for step, batch in batches:
            start = time.perf_counter()
            state, metrics = built.program.step_(state, batch)
            values = {name: float(value) for name, value in metrics.items()}  # waits for the step
            elapsed = time.perf_counter() - start
            if step % config.run.log_every == 0 or step == steps.stop - 1:
                tracker.scalars(step, {**values, "step_time_s": elapsed, "samples_per_s": global_batch / elapsed})
            if progress is not None:
                progress.set_postfix(loss=f"{values.get('loss', float('nan')):.4g}", refresh=False)
                progress.update(1)
    if progress is not None:
        progress.close()
    return state


def _progress_bar(config: Experiment, steps: range, rank: int):
    if rank != 0 or not config.run.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=len(steps), initial=0, desc="train", unit="step", dynamic_ncols=True)
