"""Fine-tune Allegro, full or LoRA, with its own objective: epsilon prediction on its DDPM schedule, run as a flow.

``fvx_models.allegro`` runs Allegro as a flow model and keeps its training as rhymes-ai/Allegro's ``train.py``
defines it: ``DDPMScheduler()`` timesteps uniform over its 1000, the plain epsilon loss (as a weighted velocity loss).
Validation samples on its Euler scheduler's own levels (``validation.schedule=model``: fvx's Euler there is its
deterministic Euler step; the pipeline's ancestral sampler adds fresh noise each step). The data is text-to-video:
FastVideo's t2v parquet, preprocessed with Allegro's T5 (512 tokens) and VAE (in tiles).

The default trains the tiny `world` preset from scratch on fvx's toy world (text-to-video: bars of the prompted colour
moving the prompted way); a few minutes on a 2-core CPU, and `validation/model/nearest_mse` falls:
    python -m fvx.run experiments/finetune_allegro.py
On Allegro (a local diffusers folder; 88-frame clips at 720x1280):
    python -m fvx.run preprocess experiments/finetune_allegro.py --videos /data/my_clips --out /data/my_dataset \\
        models.student.preset=allegro models.student.path=/models/Allegro data.world=null \\
        data.preprocess.num_frames=88 data.preprocess.max_height=720 data.preprocess.max_width=1280
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_allegro.py models.student.preset=allegro \\
        models.student.path=/models/Allegro models.student.compute_dtype=bf16 models.student.remat=true \\
        models.student.lora.rank=64 data.world=null data.path=/data/my_dataset data.text_len=512 data.batch_size=8 \\
        method.optim.lr=1e-4 validation.num_steps=100
"""
import msgspec

from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.allegro import AllegroConfig


class FinetuneAllegro(Experiment):
    models: dict[str, AllegroConfig] = msgspec.field(
        default_factory=lambda: {"student": AllegroConfig(preset="tiny")})
    vae: SpaceToDepth | None = None  # decodes validation samples (the toy codec); None: latent previews
    method: Finetune = Finetune()


config = FinetuneAllegro(
    run=RunConfig(seed=0, steps=800, output_dir="runs/finetune_allegro", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig(factor=4)),
    models={"student": AllegroConfig(preset="world")},
    vae=SpaceToDepth(factor=4),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, schedule="model", display_scale=4),
    method=Finetune(optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)
