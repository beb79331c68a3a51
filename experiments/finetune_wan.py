"""Fine-tune Wan with flow matching (FastVideo's `fine_tuning/wan/t2v.yaml`, as an fvx experiment).

The default trains the tiny `world` preset on fvx's toy video world (`fvx.data.toy_world`: coloured bars drifting the
way the prompt says, latents a space-to-depth codec decodes exactly) on a 2-core CPU in about a minute and a half. Its
validation videos go from noise to the prompted bars, and `validation/model/nearest_mse` (the distance of the samples to
the nearest true clip of their prompt) and `prompt_match` say so in numbers:
    python -m fvx.run experiments/finetune_wan.py
The result is the teacher of the default DMD2 run (`experiments/dmd2.py`). FastVideo's recipe is the recipe
`wan21_t2v_1p3b` (Wan 2.1 T2V 1.3B, 8 ranks of batch 1); point its paths at local folders:
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_wan.py:wan21_t2v_1p3b \
        models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers data.path=/data/my_dataset/combined_parquet_dataset
Wan 2.2 TI2V-5B is the same family (`models.student.preset=wan2.2-ti2v-5b`, 48-channel latents of the Wan 2.2 VAE).
"""
import msgspec

from fvx.config import recipe
from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.storage.checkpoint_config import CheckpointConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.wan import WanConfig
from fvx_models.wan_vae import WanVAEConfig


class FinetuneWan(Experiment):
    models: dict[str, WanConfig] = msgspec.field(default_factory=lambda: {"student": WanConfig()})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples; None logs latent previews
    method: Finetune = Finetune()


config = FinetuneWan(
    run=RunConfig(seed=0, steps=800, output_dir="runs/finetune_wan", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": WanConfig(preset="world")},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, display_scale=4),
    method=Finetune(optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)


@recipe
def wan21_t2v_1p3b() -> FinetuneWan:
    """FastVideo's fine_tuning/wan/t2v.yaml: Wan 2.1 T2V 1.3B, AdamW lr 1e-6, betas (0.9, 0.999), weight decay 0.01,
    constant, clip 1; global batch 8 (8 data-parallel ranks of 1), 20 latent frames of 448x832; 4000 steps,
    checkpoints every 100 (the newest 3 kept); validation every 100 steps, 50 steps at guidance 5."""
    return FinetuneWan(
        run=RunConfig(seed=1000, steps=4000, output_dir="outputs/wan_finetune",
                      checkpoint=CheckpointConfig(every=100, keep_latest=3)),
        data=DataConfig(path="data/preprocessed", batch_size=8, text_len=512, cfg_rate=0.0, num_latent_t=20),
        models={"student": WanConfig(preset="wan2.1-t2v-1.3b", path="models/Wan2.1-T2V-1.3B-Diffusers",
                                     compute_dtype="bf16", remat=True)},
        validation=ValidationConfig(every=100, num_prompts=4, num_steps=50, flow_shift=3.0, guidance_scale=5.0),
        method=Finetune(optim=AdamWConfig(lr=1e-6, betas=(0.9, 0.999), weight_decay=0.01, max_grad_norm=1.0,
                                          schedule="constant"), flow_shift=3.0),
    )
