"""Fine-tune EasyAnimate V5.1, full or LoRA: its MMDiT on the Magvit VAE's latents, a flow model.

EasyAnimate V5.1 is trained as aigc-apps/EasyAnimate's ``scripts/train.py`` trains it with ``loss_type="flow"``
(``(1 - sigma) x0 + sigma noise``, the target ``noise - x0``), which is fvx's fine-tuning. The data is text-to-video:
FastVideo's t2v parquet, preprocessed with its Qwen2-VL (all 256 rows of the chat-templated prompt) and Magvit VAE.

The default trains the tiny `world` preset from scratch on fvx's toy world (text-to-video: bars of the prompted colour
moving the prompted way); about a minute and a half on a 2-core CPU, and `validation/model/nearest_mse` falls:
    python -m fvx.run experiments/finetune_easyanimate.py
On EasyAnimate V5.1 12B (a local diffusers folder; 49-frame clips at 512x512):
    python -m fvx.run preprocess experiments/finetune_easyanimate.py --videos /data/my_clips --out /data/my_dataset \\
        models.student.preset=easyanimate-v5.1-12b models.student.path=/models/EasyAnimateV5.1-12b-zh-diffusers \\
        data.world=null data.preprocess.num_frames=49 data.preprocess.max_height=512 data.preprocess.max_width=512
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_easyanimate.py \\
        models.student.preset=easyanimate-v5.1-12b models.student.path=/models/EasyAnimateV5.1-12b-zh-diffusers \\
        models.student.compute_dtype=bf16 models.student.remat=true models.student.lora.rank=64 data.world=null \\
        data.path=/data/my_dataset data.text_len=256 data.batch_size=8 method.optim.lr=1e-4 validation.num_steps=50
"""
import msgspec

from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.easyanimate import EasyAnimateConfig


class FinetuneEasyAnimate(Experiment):
    models: dict[str, EasyAnimateConfig] = msgspec.field(
        default_factory=lambda: {"student": EasyAnimateConfig(preset="tiny")})
    vae: SpaceToDepth | None = None  # decodes validation samples (the toy codec); None: latent previews
    method: Finetune = Finetune()


config = FinetuneEasyAnimate(
    run=RunConfig(seed=0, steps=800, output_dir="runs/finetune_easyanimate", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": EasyAnimateConfig(preset="world")},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, display_scale=4),
    method=Finetune(optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)
