"""Fine-tune Wan 2.2 Animate (a character image animated by a pose video and a face video) with flow matching, full
or LoRA.

The model is given the text, the reference image's CLIP features and Wan-Animate's segment inputs as
``WanAnimatePipeline`` builds them (``fvx_models.wan_animate``; ``data.kind=animate``): the reference and previous
segment's latents with their mask, the pose video's latents and the face video. The latents' first frame is the
reference image's slot, which the DiT denoises with the video and the pipeline drops (so do validation's videos).

The default trains the tiny `world` preset from scratch on fvx's toy world animated: the reference is a clip's first
frame, the pose the clip's bars in white, the face the clip itself; given them and the prompt, the model makes the
clip. About two minutes on a 2-core CPU; validation animates fixed dataset samples, and
`validation/model/continuation_mse` (the distance to the clip the pose came from) falls:
    python -m fvx.run experiments/finetune_wan_animate.py
On Wan2.2-Animate-14B (a local diffusers folder): preprocess your clips, each ``clip.mp4`` beside its caption
``clip.txt``, its pose video ``clip.pose.mp4`` and face video ``clip.face.mp4`` (the face crops, as Wan-Animate's
preprocessing makes them, one per frame), optionally the character image ``clip.ref.png`` (none: the clip's first
frame) and, for the replace mode, ``clip.background.mp4`` and ``clip.mask.mp4`` (white: the character's place), then
train DiffSynth-Studio's LoRA recipe:
    python -m fvx.run preprocess experiments/finetune_wan_animate.py:diffsynth_animate_lora --videos /data/my_clips \\
        --out /data/my_dataset models.student.path=/models/Wan2.2-Animate-14B-Diffusers
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_wan_animate.py:diffsynth_animate_lora \\
        models.student.path=/models/Wan2.2-Animate-14B-Diffusers data.path=/data/my_dataset
"""
import msgspec

from fvx.config import recipe
from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.preprocess import AnimateCut, PreprocessConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.lora import LoRAConfig
from fvx_models.wan import DIFFSYNTH_LORA_TARGETS
from fvx_models.wan_animate import WanAnimateConfig
from fvx_models.wan_vae import WanVAEConfig


class FinetuneWanAnimate(Experiment):
    models: dict[str, WanAnimateConfig] = msgspec.field(
        default_factory=lambda: {"student": WanAnimateConfig(preset="tiny")})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples; None logs latent previews
    method: Finetune = Finetune()


config = FinetuneWanAnimate(
    run=RunConfig(seed=0, steps=300, output_dir="runs/finetune_wan_animate", log_every=1),
    data=DataConfig(kind="animate", batch_size=8, text_len=4, world=WorldConfig(),
                    preprocess=PreprocessConfig(animate=AnimateCut(face_size=16))),  # the world preset's faces
    models={"student": WanAnimateConfig(preset="world")},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=100, num_prompts=8, num_steps=20, display_scale=4),
    method=Finetune(flow_shift=5.0, optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)


@recipe
def diffsynth_animate_lora() -> FinetuneWanAnimate:
    """DiffSynth-Studio's Wan2.2-Animate-14B LoRA recipe (``examples/wanvideo/model_training/lora/
    Wan2.2-Animate-14B.sh``), on 8 ranks: rank 32 (alpha = rank, its default) on the blocks' attention projections
    and FFN (``--lora_target_modules q,k,v,o,ffn.0,ffn.2``), AdamW at lr 1e-4 with its default weight decay 0.01, no
    gradient clipping, a batch of one a rank in bf16 with remat, 480 x 832, timesteps uniform on Wan's shift-5 grid
    with its bell-shaped loss weight, no caption dropout. DiffSynth's 81 frames are the reference slot and 20 latent
    frames; fvx's segment is the pipeline's 77 frames beside the reference, the same 21. Its rate is torch's
    ``ConstantLR`` at its defaults, a third for 5 scheduler steps, which accelerate steps once per rank at each
    update: on 8 ranks a third for the first update (``constant_factor``, 1 step). Its 5 epochs of 100
    repeats are ``run.steps`` here: set them for your data. DiffSynth trains first segments only (no previous frames);
    to teach continuation too, cut longer clips into the pipeline's segments, e.g. ``data.preprocess.num_frames=153
    data.preprocess.animate.segment_frames=77`` (two segments, the second starting on the first's last frame)."""
    return FinetuneWanAnimate(
        run=RunConfig(seed=0, steps=2000, output_dir="runs/wan_animate_lora"),
        data=DataConfig(kind="animate", batch_size=8, text_len=512,
                        preprocess=PreprocessConfig(num_frames=77, max_height=480, max_width=832)),
        models={"student": WanAnimateConfig(preset="wan2.2-animate-14b", compute_dtype="bf16", remat=True,
                                            lora=LoRAConfig(rank=32, alpha=32.0,
                                                            target_modules=DIFFSYNTH_LORA_TARGETS))},
        validation=ValidationConfig(every=500, num_prompts=1, num_steps=20, flow_shift=5.0, guidance_scale=1.0),
        method=Finetune(weighting_scheme="uniform", flow_shift=5.0, loss_weighting="bell",
                        optim=AdamWConfig(lr=1e-4, weight_decay=0.01, max_grad_norm=0.0, schedule="constant_factor",
                                          warmup_steps=1, warmup_factor=1 / 3)),
    )
