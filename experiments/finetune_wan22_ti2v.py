"""Fine-tune Wan 2.2 TI2V-5B text-to-video with flow matching (48-channel latents of the Wan 2.2 VAE, one timestep
per token as its pipeline's ``expand_timesteps``).

The default is the tiny TI2V-layout preset on synthetic 48-channel latents (validation logs latent previews: fvx has
no tiny Wan 2.2 VAE): a minute on a 2-core CPU.
    python -m fvx.run experiments/finetune_wan22_ti2v.py
The real model is the same file with overrides, e.g. on a FastVideo-preprocessed dataset encoded with the Wan 2.2
VAE (its flow shift 5):
    python -m fvx.run experiments/finetune_wan22_ti2v.py models.student.preset=wan2.2-ti2v-5b \
        models.student.path=/models/Wan2.2-TI2V-5B-Diffusers models.student.compute_dtype=bf16 \
        models.student.remat=true data.path=/data/my_ti2v_dataset/combined_parquet_dataset data.text_len=512 \
        data.batch_size=8 method.flow_shift=5 validation.flow_shift=5 method.optim.lr=1e-6 --steps 4000 \
        --out runs/wan22_ti2v
"""
import msgspec

from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig, SyntheticConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.wan import WanConfig


class FinetuneWan22TI2V(Experiment):
    models: dict[str, WanConfig] = msgspec.field(default_factory=lambda: {"student": WanConfig(preset="tiny-ti2v")})
    method: Finetune = Finetune()


config = FinetuneWan22TI2V(
    run=RunConfig(seed=0, steps=300, output_dir="runs/finetune_wan22_ti2v"),
    data=DataConfig(batch_size=4, synthetic=SyntheticConfig(num_samples=64, latent_shape=(48, 2, 8, 8),
                                                             text_len=8, text_dim=32)),
    validation=ValidationConfig(every=100, num_prompts=2, flow_shift=5.0),
    method=Finetune(flow_shift=5.0, optim=AdamWConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0,
                                                      schedule="cosine", warmup_steps=20)),
)
