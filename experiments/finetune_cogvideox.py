"""Fine-tune CogVideoX (2B, 5B), full or LoRA, with its own objective: v-prediction on its DDPM schedule, run as a flow.

``fvx_models.cogvideox`` runs CogVideoX as a flow model and keeps its training as diffusers'
``examples/cogvideo/train_cogvideox_lora.py`` defines it: timesteps uniform over the scheduler's 1000, the loss its
``1 / (1 - abar)``-weighted x0 error (as a weighted velocity loss). Validation samples on the DDIM scheduler's own
levels (``validation.schedule=model``: Euler there is its DDIM step). The data is text-to-video: FastVideo's t2v
parquet, preprocessed with CogVideoX's T5 (all 226 tokens) and VAE.

The default trains the tiny `world` preset from scratch on fvx's toy world (text-to-video: bars of the prompted colour
moving the prompted way); a few minutes on a 2-core CPU, and `validation/model/hit_rate` rises:
    python -m fvx.run experiments/finetune_cogvideox.py
Image-to-video (the toy world's first frames given; `validation/model/continuation_mse` falls):
    python -m fvx.run experiments/finetune_cogvideox.py models.student.preset=world-i2v data.kind=i2v
On CogVideoX-2b (a local diffusers folder; 49-frame clips at 480x720):
    python -m fvx.run preprocess experiments/finetune_cogvideox.py --videos /data/my_clips --out /data/my_dataset \\
        models.student.preset=cogvideox-2b models.student.path=/models/CogVideoX-2b data.world=null \\
        data.preprocess.num_frames=49 data.preprocess.max_height=480 data.preprocess.max_width=720
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_cogvideox.py models.student.preset=cogvideox-2b \\
        models.student.path=/models/CogVideoX-2b models.student.compute_dtype=bf16 models.student.remat=true \\
        models.student.lora.rank=64 data.world=null data.path=/data/my_dataset data.text_len=226 data.batch_size=8 \\
        method.optim.lr=1e-4 validation.num_steps=50
CogVideoX-5b-I2V takes `data.kind=i2v` data (preprocess stores each clip's first frame encoded alone) at exactly its
trained size, 49 frames at 480x720 (its learned position table): `models.student.preset=cogvideox-5b-i2v
data.kind=i2v` with the commands above.
"""
import msgspec

from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.cogvideox import CogVideoXConfig


class FinetuneCogVideoX(Experiment):
    models: dict[str, CogVideoXConfig] = msgspec.field(
        default_factory=lambda: {"student": CogVideoXConfig(preset="tiny")})
    vae: SpaceToDepth | None = None  # decodes validation samples (the toy codec); None: latent previews
    method: Finetune = Finetune()


config = FinetuneCogVideoX(
    run=RunConfig(seed=0, steps=800, output_dir="runs/finetune_cogvideox", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": CogVideoXConfig(preset="world")},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, schedule="model", display_scale=4),
    method=Finetune(optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)
