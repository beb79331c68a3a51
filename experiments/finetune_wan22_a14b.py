"""Fine-tune Wan 2.2 A14B text-to-video with flow matching: two experts (the high-noise ``transformer`` at
``t >= 1000 boundary_ratio``, 0.875; the low-noise ``transformer_2`` below), one trained per step as FastVideo's
trainer does (``fastvideo/training/training_pipeline.py:311-343``): the low-noise expert in a fraction
``boundary_ratio`` of the steps, the high-noise one in the others, each step's samples drawn uniformly over the chosen
expert's levels of the unshifted 1000-level grid (``method.flow_shift=1``: FastVideo's trainer replaces the
scheduler with ``FlowMatchEulerDiscreteScheduler()`` before training, ``:536``). Where fvx departs (the high-noise
expert kept to its own timesteps; one AdamW over both experts, so an idle expert still moves by its momentum and
decay, where FastVideo steps only the chosen expert's optimizer and schedule): docs/design.md.

The default is two tiny experts on synthetic latents, decoded by the tiny Wan VAE: a minute on a 2-core CPU.
    python -m fvx.run experiments/finetune_wan22_a14b.py
Train one expert only with ``models.student.trainable=[transformer_2]`` (every step trains it; the other stays as
loaded and takes no optimizer state). The real model is the same file with overrides (a pipeline root holding
transformer/ and transformer_2/; the Wan 2.1 VAE's latents):
    python -m fvx.run experiments/finetune_wan22_a14b.py models.student.preset=wan2.2-t2v-a14b \
        models.student.path=/models/Wan2.2-T2V-A14B-Diffusers models.student.compute_dtype=bf16 \
        models.student.remat=true vae.preset=wan2.1 vae.path=/models/Wan2.2-T2V-A14B-Diffusers \
        data.path=/data/my_dataset/combined_parquet_dataset data.text_len=512 data.batch_size=8 \
        method.optim.lr=1e-6 --steps 4000 --out runs/wan22_a14b
and under torchrun (``torchrun --nproc_per_node 8 -m fvx.run ...``) both experts shard over the ranks.
"""
import msgspec

from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig, SyntheticConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.wan_moe import Wan22MoEConfig
from fvx_models.wan_vae import WanVAEConfig


class FinetuneWan22A14B(Experiment):
    models: dict[str, Wan22MoEConfig] = msgspec.field(default_factory=lambda: {"student": Wan22MoEConfig()})
    vae: WanVAEConfig | None = None  # decodes validation samples; None logs latent previews
    method: Finetune = Finetune()


config = FinetuneWan22A14B(
    run=RunConfig(seed=0, steps=300, output_dir="runs/finetune_wan22_a14b"),
    data=DataConfig(batch_size=4, synthetic=SyntheticConfig(num_samples=64, latent_shape=(16, 2, 16, 16),
                                                             text_len=8, text_dim=32)),
    models={"student": Wan22MoEConfig(preset="tiny")},
    vae=WanVAEConfig(preset="tiny"),
    validation=ValidationConfig(every=100, num_prompts=2),
    method=Finetune(optim=AdamWConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0, schedule="cosine",
                                      warmup_steps=20), flow_shift=1.0),
)
