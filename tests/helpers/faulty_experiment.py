"""A tiny fine-tuning experiment for the checkpoint, resume and replay tests, with four fault hooks.

- ``method.nan_at_step=k`` (config, so a replay sees it too): step k's latents are NaN, hence its loss and gradients;
  ``method.nan_from_step=k``: every step from k on.
- ``FVX_TEST_HANG_AT_STEP=k`` (environment): step k touches ``$FVX_TEST_SIGNAL`` and sleeps: SIGKILL it mid-step.
- ``FVX_TEST_HANG_IN_SAVE=k`` (environment): the background write of checkpoint k writes its arrays, touches
  ``$FVX_TEST_SIGNAL`` and sleeps: SIGKILL it mid-save, leaving the step's temporary folder behind.
- ``FVX_TEST_PAUSE_AT_STEP=k`` (environment): step k touches ``$FVX_TEST_SIGNAL``, waits 3 s, then goes on: signal it
  mid-step.
- ``FVX_TEST_PAUSE_IN_VALIDATION=1`` (environment): each validation touches ``$FVX_TEST_SIGNAL`` and waits 3 s first:
  signal the start-of-run validation (``validation.every=...`` turns it on).
"""
import os
import pathlib
import time

import msgspec

from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig, SyntheticConfig
from fvx.storage import checkpoint, shard_files
from fvx.storage.checkpoint_config import CheckpointConfig
from fvx.training.callbacks import Callback
from fvx.training.experiment import Experiment, RunConfig
from fvx_methods.finetune import Finetune
from fvx_models.wan import WanConfig

HANG_AT_STEP = os.environ.get("FVX_TEST_HANG_AT_STEP")
HANG_IN_SAVE = os.environ.get("FVX_TEST_HANG_IN_SAVE")
PAUSE_AT_STEP = os.environ.get("FVX_TEST_PAUSE_AT_STEP")
PAUSE_IN_VALIDATION = os.environ.get("FVX_TEST_PAUSE_IN_VALIDATION")


def _signal_and_hang() -> None:
    pathlib.Path(os.environ["FVX_TEST_SIGNAL"]).touch()
    time.sleep(600)


class FaultyFinetune(Finetune, tag="faulty_finetune"):
    nan_at_step: int | None = None
    nan_from_step: int | None = None

    def build(self, models, *, total_steps, **options):
        program = super().build(models, total_steps=total_steps, **options)

        def step_(state, frozen, batch):
            step = int(state.step)
            if HANG_AT_STEP is not None and step == int(HANG_AT_STEP):
                _signal_and_hang()
            if PAUSE_AT_STEP is not None and step == int(PAUSE_AT_STEP):
                _pause()
            if step == self.nan_at_step or (self.nan_from_step is not None and step >= self.nan_from_step):
                batch = {**batch, "latents": batch["latents"] * float("nan")}
            return program.step_(state, frozen, batch)

        return program._replace(step_=step_)


if HANG_IN_SAVE is not None:
    _write = shard_files.write

    def _write_then_hang(folder, *args):
        _write(folder, *args)
        if f"/{HANG_IN_SAVE}{checkpoint.TMP_SUFFIX}/" in str(folder) + "/":
            _signal_and_hang()

    shard_files.write = _write_then_hang


class FaultyExperiment(Experiment):
    models: dict[str, WanConfig] = msgspec.field(default_factory=lambda: {"student": WanConfig()})
    method: FaultyFinetune = FaultyFinetune()

    def callbacks(self):
        if PAUSE_IN_VALIDATION is None:
            return ()
        return (Callback("pause", on_validation_begin=lambda context: _pause()),)


def _pause() -> None:
    pathlib.Path(os.environ["FVX_TEST_SIGNAL"]).touch()
    time.sleep(3)


config = FaultyExperiment(
    run=RunConfig(seed=3, steps=8, output_dir="runs/faulty", progress=False,
                  checkpoint=CheckpointConfig(every=2, keep_latest=None)),
    data=DataConfig(batch_size=4, prefetch=1, synthetic=SyntheticConfig(num_samples=12, latent_shape=(16, 1, 4, 4),
                                                                        text_len=8, text_dim=32)),
    models={"student": WanConfig(preset="tiny")},
    # A schedule that does not depend on run.steps, so a run of 4 steps resumed with --steps 8 is the run of 8 steps.
    method=FaultyFinetune(grad_accum=2, optim=AdamWConfig(lr=1e-3, weight_decay=0.01, warmup_steps=2,
                                                          schedule="constant_with_warmup")),
)
