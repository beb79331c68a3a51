"""A tiny fine-tuning experiment with a callback on every hook, for the callback tests: each hook appends a JSON line
to ``$FVX_TEST_EVENTS``; ``on_step_end`` logs ``probe = 2 loss`` and raises at the step ``$FVX_TEST_RAISE_AT``."""
import json
import os

import msgspec

from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig, SyntheticConfig
from fvx.storage.checkpoint_config import CheckpointConfig
from fvx.training.callbacks import Callback
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.wan import WanConfig


def _record(*event) -> None:
    with open(os.environ["FVX_TEST_EVENTS"], "a") as f:
        f.write(json.dumps(event) + "\n")


def _step_end(context) -> None:
    _record("on_step_end", context.step, sorted(context.metrics))
    context.tracker.scalars(context.step - 1, {"probe": 2 * context.metrics["loss"]})
    if str(context.step) == os.environ.get("FVX_TEST_RAISE_AT"):
        raise RuntimeError("the probe saw enough")


RECORDER = Callback(
    "recorder",
    on_train_start=lambda c: _record("on_train_start", c.step),
    on_step_end=_step_end,
    on_before_optimizer_step=lambda role, grads, params: _record("on_before_optimizer_step", role,
                                                                 sorted(grads) == sorted(params)),
    on_validation_begin=lambda c: _record("on_validation_begin", c.step),
    on_validation_end=lambda c: _record("on_validation_end", c.step),
    on_train_end=lambda c: _record("on_train_end", c.step),
)


class WithCallbacks(Experiment):
    models: dict[str, WanConfig] = msgspec.field(default_factory=lambda: {"student": WanConfig()})
    method: Finetune = Finetune()

    def callbacks(self):
        return (RECORDER,)


config = WithCallbacks(
    run=RunConfig(steps=4, progress=False, checkpoint=CheckpointConfig(every=2, async_save=False)),
    data=DataConfig(batch_size=2, prefetch=0, synthetic=SyntheticConfig(num_samples=8, latent_shape=(16, 1, 4, 4),
                                                                       text_len=8, text_dim=32)),
    validation=ValidationConfig(every=2, num_prompts=1),
    method=Finetune(optim=AdamWConfig(lr=1e-3)),
)
