"""Fine-tune Wan 2.1 VACE (Wan with a control branch: a control video, its mask and reference images), or Wan 2.2
VACE-Fun A14B's two VACE experts, with flow matching, full, LoRA, or the context branch alone.

The model is given the text and VACE's control context, ``WanVACEPipeline``'s ``[inactive | reactive | mask]`` of a
control video (``fvx_models.wan_vace``; ``data.kind=vace``: the column ``vace_context`` beside the latents and text).
``models.student.trainable=[context]`` trains only the context branch (VACE's context-adapter tuning: the base Wan
stays as loaded), ``[base]`` only the base DiT.

The default trains the tiny `world` preset from scratch on fvx's toy world as VACE's extension task: the control
video is the clip's first frame then grey frames, masked to be made after the first; given it and the prompt, the
model continues the bars the way the prompt says. A few minutes on a 2-core CPU; validation conditions on the contexts
of fixed dataset samples, and `validation/model/continuation_mse` (the distance to the clip the frame came from) falls:
    python -m fvx.run experiments/finetune_wan_vace.py
On Wan2.1-VACE-1.3B (a local diffusers folder): preprocess your clips, each ``clip.mp4`` beside its caption
``clip.txt``, its control video ``clip.control.mp4`` (depth, pose, edges, a masked source...), optionally its mask
``clip.mask.mp4`` (white: to be made; none: all of it) and reference image ``clip.ref.png``:
    python -m fvx.run preprocess experiments/finetune_wan_vace.py --videos /data/my_clips --out /data/my_dataset \\
        models.student.preset=wan2.1-vace-1.3b models.student.path=/models/Wan2.1-VACE-1.3B-diffusers data.world=null
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_wan_vace.py models.student.preset=wan2.1-vace-1.3b \\
        models.student.path=/models/Wan2.1-VACE-1.3B-diffusers models.student.compute_dtype=bf16 \\
        models.student.remat=true data.world=null data.path=/data/my_dataset data.text_len=512 data.batch_size=8 \\
        method.optim.lr=1e-5
Wan 2.2 VACE-Fun A14B (``fvx_models.wan_vace_moe``: two experts routed at t = 875, one expert trained a step; the
same data) is ``models.student=wan_vace_moe``; ``models.student.trainable=[transformer]`` trains the high-noise
expert alone and ``models.student.parts=[context]`` the experts' context branches alone:
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_wan_vace.py models.student=wan_vace_moe \
        models.student.preset=wan2.2-vace-fun-a14b models.student.path=/models/Wan2.2-VACE-Fun-A14B-diffusers \
        models.student.compute_dtype=bf16 models.student.remat=true data.world=null data.path=/data/my_dataset \
        data.text_len=512 data.batch_size=8 method.optim.lr=1e-5
"""
import msgspec

from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.wan_vace import WanVACEConfig
from fvx_models.wan_vace_moe import WanVACEMoEConfig
from fvx_models.wan_vae import WanVAEConfig


class FinetuneWanVACE(Experiment):
    models: dict[str, WanVACEConfig | WanVACEMoEConfig] = msgspec.field(
        default_factory=lambda: {"student": WanVACEConfig(preset="tiny")})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples; None logs latent previews
    method: Finetune = Finetune()


config = FinetuneWanVACE(
    run=RunConfig(seed=0, steps=600, output_dir="runs/finetune_wan_vace", log_every=1),
    data=DataConfig(kind="vace", batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": WanVACEConfig(preset="world")},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, display_scale=4),
    method=Finetune(optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)
