"""Fine-tune Mochi 1 (an asymmetric joint-attention flow DiT) with flow matching, full or LoRA.

Mochi runs on an inverted clock and its joint attention is one masked call in fvx (``fvx_models.mochi``), so its
blocks compile as any family's. The data is text-to-video (FastVideo's t2v parquet), preprocessed with Mochi's own
encoders: T5-XXL at 256 tokens and the Mochi VAE (12 channels; 6 frames a latent frame: clips of 6 k + 1 frames).

The default trains the tiny `world` preset from scratch on fvx's toy world (text-to-video: bars of the prompted colour
moving the prompted way); a minute or two on a 2-core CPU, and `validation/model/hit_rate` rises:
    python -m fvx.run experiments/finetune_mochi.py
On Mochi 1 (a local diffusers folder of genmo/mochi-1-preview; 37-frame clips at 480x848):
    python -m fvx.run preprocess experiments/finetune_mochi.py --videos /data/my_clips --out /data/my_dataset \\
        models.student.preset=mochi-1 models.student.path=/models/mochi-1-preview data.world=null \\
        data.preprocess.num_frames=37 data.preprocess.max_height=480 data.preprocess.max_width=848
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_mochi.py models.student.preset=mochi-1 \\
        models.student.path=/models/mochi-1-preview models.student.compute_dtype=bf16 models.student.remat=true \\
        models.student.lora.rank=16 data.world=null data.path=/data/my_dataset data.text_len=256 \\
        data.batch_size=8 method.optim.lr=2e-4
"""
import msgspec

from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.mochi import MochiConfig


class FinetuneMochi(Experiment):
    models: dict[str, MochiConfig] = msgspec.field(default_factory=lambda: {"student": MochiConfig(preset="tiny")})
    vae: SpaceToDepth | None = None  # decodes validation samples (the toy codec); None: latent previews
    method: Finetune = Finetune()


config = FinetuneMochi(
    run=RunConfig(seed=0, steps=800, output_dir="runs/finetune_mochi", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": MochiConfig(preset="world")},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, display_scale=4),
    method=Finetune(optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)
