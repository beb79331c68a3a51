"""Fine-tune Wan with flow matching (FastVideo's `fine_tuning/wan/t2v.yaml`, as an fvx experiment).

The default is the tiny preset on synthetic latents: it trains on a 2-core CPU in about a minute.
    python -m fvx.run experiments/finetune_wan.py
The full-size run is the same file with overrides, e.g. Wan 2.1 T2V 1.3B on a FastVideo-preprocessed dataset:
    python -m fvx.run experiments/finetune_wan.py models.student.preset=wan2.1-t2v-1.3b \
        models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers models.student.compute_dtype=bf16 \
        models.student.remat=true data.path=/data/my_dataset/combined_parquet_dataset data.text_len=512 \
        data.batch_size=8 method.optim.lr=1e-6 method.optim.weight_decay=0.01 --steps 4000 --out runs/wan_t2v
Wan 2.2 TI2V-5B is the same family (`models.student.preset=wan2.2-ti2v-5b`, 48-channel latents of the Wan 2.2 VAE).
"""
import msgspec

from fvx import random
from fvx.data import DataConfig, SyntheticConfig
from fvx.loop import Experiment, RunConfig
from fvx.optim_config import AdamWConfig
from fvx.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.wan import WanConfig
from fvx_models.wan_vae import WanVAEConfig


class FinetuneWan(Experiment):
    models: dict[str, WanConfig] = msgspec.field(default_factory=lambda: {"student": WanConfig()})
    vae: WanVAEConfig | None = None  # decodes validation samples; None logs latent previews
    method: Finetune = Finetune()

    def build_vae(self):
        return None if self.vae is None else self.vae.build(random.key(self.validation.seed))


config = FinetuneWan(
    run=RunConfig(seed=0, steps=600, output_dir="runs/finetune_wan", log_every=1),
    data=DataConfig(batch_size=4, synthetic=SyntheticConfig(num_samples=64, latent_shape=(16, 2, 16, 16),
                                                             text_len=8, text_dim=32)),
    models={"student": WanConfig(preset="tiny")},
    vae=WanVAEConfig(preset="tiny"),
    validation=ValidationConfig(every=200, num_prompts=2),
    method=Finetune(optim=AdamWConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0, schedule="cosine", warmup_steps=30)),
)
