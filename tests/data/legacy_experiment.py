"""The experiment of tests/data/legacy_run_fvx0.1: a run fvx 0.1 wrote (single-process tensorstore checkpoints 2 and 4,
AdamW's state as one AdamWState) with this config; today's import paths."""
import msgspec

from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig, SyntheticConfig
from fvx.storage.checkpoint_config import CheckpointConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx_methods.finetune import Finetune
from fvx_models.lora import LoRAConfig
from fvx_models.wan import WanConfig


class LegacyExperiment(Experiment):
    models: dict[str, WanConfig] = msgspec.field(default_factory=lambda: {"student": WanConfig()})
    method: Finetune = Finetune()


config = LegacyExperiment(
    run=RunConfig(seed=7, steps=4, output_dir="runs/legacy", progress=False,
                  checkpoint=CheckpointConfig(every=2, keep_latest=None)),
    data=DataConfig(batch_size=2, prefetch=1, synthetic=SyntheticConfig(num_samples=4, latent_shape=(16, 1, 4, 4),
                                                                        text_len=8, text_dim=32)),
    models={"student": WanConfig(preset="tiny", lora=LoRAConfig(rank=2, alpha=4.0, target_modules=("to_q",)))},
    method=Finetune(ema_decay=0.9, optim=AdamWConfig(lr=1e-2, weight_decay=0.01, warmup_steps=1, schedule="cosine")),
)
