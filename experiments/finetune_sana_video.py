"""Fine-tune SANA-Video (linear-attention flow DiT on the Wan 2.1 VAE) with flow matching, full or LoRA.

The data is text-to-video (FastVideo's t2v parquet), preprocessed with SANA-Video's own encoders: Gemma-2 through its
pipeline's prompt encoding (the complex human instruction, 300 kept tokens) and the Wan 2.1 VAE
(``fvx_models.sana_video``). Its pipeline samples with a flow DPM-solver at shift 8; validation steps Euler along the
same shift (``validation.flow_shift=8``).

The default trains the tiny `world` preset from scratch on fvx's toy world (text-to-video: bars of the prompted colour
moving the prompted way); a minute or two on a 2-core CPU, and `validation/model/hit_rate` rises:
    python -m fvx.run experiments/finetune_sana_video.py
On SANA-Video 2B 480p (a local diffusers folder; 81-frame clips at 480x832):
    python -m fvx.run preprocess experiments/finetune_sana_video.py --videos /data/my_clips --out /data/my_dataset \\
        models.student.preset=sana-video-2b-480p models.student.path=/models/SANA-Video_2B_480p_diffusers \\
        data.world=null
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_sana_video.py \\
        models.student.preset=sana-video-2b-480p models.student.path=/models/SANA-Video_2B_480p_diffusers \\
        models.student.compute_dtype=bf16 models.student.remat=true data.world=null data.path=/data/my_dataset \\
        data.text_len=300 data.batch_size=8 method.optim.lr=1e-5 validation.flow_shift=8 vae=wan_vae \\
        vae.preset=wan2.1 vae.path=/models/SANA-Video_2B_480p_diffusers
"""
import msgspec

from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.sana_video import SanaVideoConfig
from fvx_models.wan_vae import WanVAEConfig


class FinetuneSanaVideo(Experiment):
    models: dict[str, SanaVideoConfig] = msgspec.field(
        default_factory=lambda: {"student": SanaVideoConfig(preset="tiny")})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples (the Wan 2.1 VAE's); None: previews
    method: Finetune = Finetune()


config = FinetuneSanaVideo(
    run=RunConfig(seed=0, steps=800, output_dir="runs/finetune_sana_video", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": SanaVideoConfig(preset="world")},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, display_scale=4),
    method=Finetune(optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)
