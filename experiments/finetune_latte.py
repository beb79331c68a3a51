"""Fine-tune Latte (Latte-1), full or LoRA, with its own objective: epsilon prediction on its DDPM schedule, run as a
flow.

``fvx_models.latte`` runs Latte as a flow model and keeps its training as a DDPM trainer defines it (Latte's and
Allegro's ``train.py``): timesteps uniform over the scheduler's 1000, the plain epsilon loss (as a weighted velocity
loss). The learned-variance half of its output is not trained (DDIM does not read it). Validation samples on the DDIM
scheduler's own levels (``validation.schedule=model``: Euler there is its DDIM step). The data is text-to-video:
FastVideo's t2v parquet, preprocessed with Latte's T5 (120 tokens) and its image VAE frame by frame; Latte-1's clips
are exactly 16 frames (its temporal position table).

The default trains the tiny `world` preset from scratch on fvx's toy world (text-to-video: bars of the prompted colour
moving the prompted way); a few minutes on a 2-core CPU, and `validation/model/nearest_mse` falls:
    python -m fvx.run experiments/finetune_latte.py
On Latte-1 (a local diffusers folder; 16-frame clips at 512x512):
    python -m fvx.run preprocess experiments/finetune_latte.py --videos /data/my_clips --out /data/my_dataset \\
        models.student.preset=latte-1 models.student.path=/models/Latte-1 data.world=null \\
        data.preprocess.num_frames=16 data.preprocess.max_height=512 data.preprocess.max_width=512
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_latte.py models.student.preset=latte-1 \\
        models.student.path=/models/Latte-1 models.student.compute_dtype=bf16 models.student.remat=true \\
        models.student.lora.rank=64 data.world=null data.path=/data/my_dataset data.text_len=120 data.batch_size=8 \\
        method.optim.lr=1e-4 validation.num_steps=50
"""
import msgspec

from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.latte import LatteConfig


class FinetuneLatte(Experiment):
    models: dict[str, LatteConfig] = msgspec.field(default_factory=lambda: {"student": LatteConfig(preset="tiny")})
    vae: SpaceToDepth | None = None  # decodes validation samples (the toy codec); None: latent previews
    method: Finetune = Finetune()


config = FinetuneLatte(
    run=RunConfig(seed=0, steps=800, output_dir="runs/finetune_latte", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig(factor=4)),
    models={"student": LatteConfig(preset="world")},
    vae=SpaceToDepth(factor=4),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, schedule="model", display_scale=4),
    method=Finetune(optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)
