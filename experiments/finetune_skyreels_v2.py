"""Fine-tune SkyReels-V2 text-to-video with flow matching (Wan's architecture and latents; FastVideo's Wan t2v recipe).

The default is the tiny preset on synthetic latents, decoded by the tiny Wan VAE: a minute on a 2-core CPU.
    python -m fvx.run experiments/finetune_skyreels_v2.py
The real model is the same file with overrides, e.g. SkyReels-V2 T2V 14B (540P) on a FastVideo-preprocessed dataset
(the Wan 2.1 VAE's latents and UMT5 text embeddings, as for Wan), its flow shift 8 for training and validation:
    python -m fvx.run experiments/finetune_skyreels_v2.py models.student.preset=skyreels-v2-t2v-14b \
        models.student.path=/models/SkyReels-V2-T2V-14B-540P-Diffusers models.student.compute_dtype=bf16 \
        models.student.remat=true vae.preset=wan2.1 vae.path=/models/SkyReels-V2-T2V-14B-540P-Diffusers \
        data.path=/data/my_dataset/combined_parquet_dataset data.text_len=512 data.batch_size=8 \
        method.flow_shift=8 validation.flow_shift=8 method.optim.lr=1e-6 --steps 4000 --out runs/skyreels_t2v
"""
import msgspec

from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig, SyntheticConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.skyreels_v2 import SkyReelsV2Config
from fvx_models.wan_vae import WanVAEConfig


class FinetuneSkyReelsV2(Experiment):
    models: dict[str, SkyReelsV2Config] = msgspec.field(default_factory=lambda: {"student": SkyReelsV2Config()})
    vae: WanVAEConfig | None = None  # decodes validation samples; None logs latent previews
    method: Finetune = Finetune()


config = FinetuneSkyReelsV2(
    run=RunConfig(seed=0, steps=300, output_dir="runs/finetune_skyreels_v2"),
    data=DataConfig(batch_size=4, synthetic=SyntheticConfig(num_samples=64, latent_shape=(16, 2, 16, 16),
                                                             text_len=8, text_dim=32)),
    models={"student": SkyReelsV2Config(preset="tiny")},
    vae=WanVAEConfig(preset="tiny"),
    validation=ValidationConfig(every=100, num_prompts=2),
    method=Finetune(optim=AdamWConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0, schedule="cosine",
                                      warmup_steps=20)),
)
