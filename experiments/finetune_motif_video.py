"""Fine-tune Motif-Video (text-to-video, or image-to-video), full or LoRA: its dual- then single-stream flow DiT on
the Wan 2.1 VAE's latents.

Motif-Video predicts the flow velocity, so fvx's fine-tuning is its objective; text-to-video feeds the DiT's
first-frame condition and mask channels zeros, as ``MotifVideoPipeline`` does. The data is text-to-video: FastVideo's
t2v parquet, preprocessed with its T5Gemma-2 text encoder (512 tokens) and the Wan 2.1 VAE.

The default trains the tiny `world` preset from scratch on fvx's toy world (text-to-video: bars of the prompted colour
moving the prompted way); about a minute on a 2-core CPU, and `validation/model/nearest_mse` falls:
    python -m fvx.run experiments/finetune_motif_video.py
Image-to-video (``MotifVideoImage2VideoPipeline``'s first-frame condition; the toy world's first frames given, and
`validation/model/continuation_mse` falls; a model with an image embedder also reads SigLIP's features):
    python -m fvx.run experiments/finetune_motif_video.py data.kind=i2v models.student.first_frame=true
On Motif-Video (a local diffusers folder; 121-frame clips at 736x1280):
    python -m fvx.run preprocess experiments/finetune_motif_video.py --videos /data/my_clips --out /data/my_dataset \\
        models.student.preset=motif-video models.student.path=/models/Motif-Video data.world=null \\
        data.preprocess.num_frames=121 data.preprocess.max_height=736 data.preprocess.max_width=1280
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_motif_video.py models.student.preset=motif-video \\
        models.student.path=/models/Motif-Video models.student.compute_dtype=bf16 models.student.remat=true \\
        models.student.lora.rank=64 data.world=null data.path=/data/my_dataset data.text_len=512 data.batch_size=8 \\
        method.optim.lr=1e-4 validation.num_steps=50
"""
import msgspec

from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.motif_video import MotifVideoConfig


class FinetuneMotifVideo(Experiment):
    models: dict[str, MotifVideoConfig] = msgspec.field(
        default_factory=lambda: {"student": MotifVideoConfig(preset="tiny")})
    vae: SpaceToDepth | None = None  # decodes validation samples (the toy codec); None: latent previews
    method: Finetune = Finetune()


config = FinetuneMotifVideo(
    run=RunConfig(seed=0, steps=800, output_dir="runs/finetune_motif_video", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": MotifVideoConfig(preset="world")},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, display_scale=4),
    method=Finetune(optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)
