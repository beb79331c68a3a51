"""Fine-tune ChronoEdit (image editing as a two-frame video of Wan 2.1 I2V) with flow matching, full or LoRA.

The model is given the input image as the clip's first frame (its latents, and for ChronoEdit-14B its CLIP image
embedding) and the instruction, and denoises the clip whose last latent frame is the edit (``fvx_models.chronoedit``;
the data is Wan 2.1 I2V's, ``data.kind=i2v``: 5-frame clips, the input image then four frames of the edited one).

The default trains the tiny `world` preset from scratch on fvx's toy world cut to two latent frames, as an editing
task: given a frame of bars and the prompt, draw where the bars are two frames later (the frame alone cannot tell
left from right). A few minutes on a 2-core CPU; validation edits the first frames of fixed dataset samples and
`validation/model/continuation_mse` (the distance to the true edit) falls:
    python -m fvx.run experiments/finetune_chronoedit.py
On ChronoEdit-14B (a local diffusers folder; data preprocessed from your 5-frame clips with its encoders):
    python -m fvx.run preprocess experiments/finetune_chronoedit.py --videos /data/my_edits --out /data/my_dataset \\
        models.student.preset=chronoedit-14b models.student.path=/models/ChronoEdit-14B-Diffusers \\
        data.world=null data.preprocess.num_frames=5
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_chronoedit.py models.student.preset=chronoedit-14b \\
        models.student.path=/models/ChronoEdit-14B-Diffusers models.student.compute_dtype=bf16 \\
        models.student.remat=true models.student.lora.rank=32 data.world=null data.path=/data/my_dataset \\
        data.text_len=512 data.batch_size=8 method.optim.lr=1e-4
"""
import msgspec

from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.chronoedit import ChronoEditConfig
from fvx_models.wan_vae import WanVAEConfig


class FinetuneChronoEdit(Experiment):
    models: dict[str, ChronoEditConfig] = msgspec.field(
        default_factory=lambda: {"student": ChronoEditConfig(preset="tiny")})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples; None logs latent previews
    method: Finetune = Finetune()


config = FinetuneChronoEdit(
    run=RunConfig(seed=0, steps=600, output_dir="runs/finetune_chronoedit", log_every=1),
    data=DataConfig(kind="i2v", batch_size=8, text_len=4, world=WorldConfig(frames=2)),
    models={"student": ChronoEditConfig(preset="world")},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, display_scale=4),
    method=Finetune(optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)
