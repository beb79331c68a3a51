"""Fine-tune HunyuanVideo FramePack (image-to-video by next-section prediction), full or LoRA, as musubi-tuner trains
it.

The data is sections (``data.kind=framepack``): each clip cut into windows of ``data.sections.window`` latent frames
after its first frame, each with the clean history a sampler gives it (``data.sections.order``: FramePack's inverted
anti-drifting order, or ``vanilla`` for FramePack-F1), as musubi-tuner's ``fpack_cache_latents.py`` caches them. The
DiT takes one sample per forward (sections differ in their frame positions), so a batch runs sample by sample;
``method.grad_accum`` micro-batches of one keep one section's activations at a time.

The default trains the tiny `world` preset from scratch on fvx's toy world cut into sections of 2 frames (the start
frame, the frames after the section, and the prompt given; bars of the prompted colour moving the prompted way); a
few minutes on a 2-core CPU, and `validation/model/section_mse` (a sampled section against its true frames) falls:
    python -m fvx.run experiments/finetune_framepack.py
musubi-tuner's one-frame training (`--one_frame`, its default layout: the clip's last frame made from its first, at RoPE
position `data.sections.window`, beside a zero post and zero 2x and 4x history; on real data the two frames are each
encoded alone, as musubi-tuner encodes its control and target images); `sample RUN --image control.png` then makes that
one frame (`section_mse` falls on the toy world too):
    python -m fvx.run experiments/finetune_framepack.py data.sections.order=one_frame data.sections.window=4
On FramePack (a local HunyuanVideoFramepackPipeline folder: HunyuanVideo's VAE and text encoders, lllyasviel's
FramePackI2V_HY as transformer/, SigLIP from lllyasviel/flux_redux_bfl as image_encoder/ and feature_extractor/):
    python -m fvx.run preprocess experiments/finetune_framepack.py:musubi_framepack_lora --videos /data/my_clips \\
        --out /data/my_dataset models.student.path=/models/FramePack
    python -m fvx.run experiments/finetune_framepack.py:musubi_framepack_lora models.student.path=/models/FramePack \\
        data.path=/data/my_dataset --steps 4000
"""
import msgspec

from fvx.config import recipe
from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.preprocess import PreprocessConfig
from fvx.data.sections import SectionsConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.hunyuan_framepack import FramepackConfig, musubi_lora_targets
from fvx_models.lora import LoRAConfig


class FinetuneFramepack(Experiment):
    models: dict[str, FramepackConfig] = msgspec.field(default_factory=lambda: {"student": FramepackConfig()})
    vae: SpaceToDepth | None = None  # decodes validation samples (the toy codec); None: latent previews
    method: Finetune = Finetune()


config = FinetuneFramepack(
    run=RunConfig(seed=0, steps=600, output_dir="runs/finetune_framepack", log_every=1),
    data=DataConfig(kind="framepack", batch_size=4, text_len=4, world=WorldConfig(frames=5, factor=4),
                    sections=SectionsConfig(window=2)),
    models={"student": FramepackConfig(preset="world")},
    vae=SpaceToDepth(factor=4),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, display_scale=4),
    method=Finetune(grad_accum=4, optim=AdamWConfig(lr=1e-3, max_grad_norm=1.0, schedule="cosine",
                                                      warmup_steps=50)),
)


@recipe
def musubi_framepack_lora() -> FinetuneFramepack:
    """musubi-tuner's FramePack LoRA command (docs/framepack.md): rank 32 at its ``--network_alpha`` default 1, AdamW at
    lr 2e-4 (its adamw8bit's weight decay 0.01), constant, clip 1; ``--timestep_sampling shift --discrete_flow_shift
    3.0`` (a logit-normal draw, shifted by 3); one sample a step; the DiT told guidance 1.0 (its
    ``--guidance_scale`` default); sections of 9 latent frames in the inverted anti-drifting order, clips of 640 x 640
    (its default resolution); the adapted layers musubi-tuner's: every linear layer of the dual- and single-stream
    blocks but their norms' (``hunyuan_framepack.musubi_lora_targets``). Its epoch count depends on the data: set
    ``--steps``."""
    student = FramepackConfig(preset="framepack-i2v", compute_dtype="bf16", remat=True, embedded_guidance=1.0)
    return FinetuneFramepack(
        run=RunConfig(seed=42, steps=4000, output_dir="runs/framepack_lora"),
        data=DataConfig(kind="framepack", batch_size=1, text_len=257, sections=SectionsConfig(window=9),
                        preprocess=PreprocessConfig(num_frames=129, train_fps=30, max_height=640, max_width=640)),
        models={"student": msgspec.structs.replace(student, lora=LoRAConfig(
            rank=32, alpha=1.0, target_modules=musubi_lora_targets(student)))},
        validation=ValidationConfig(every=500, num_prompts=1, num_steps=25, flow_shift=3.0),
        method=Finetune(weighting_scheme="logit_normal", flow_shift=3.0,
                        optim=AdamWConfig(lr=2e-4, weight_decay=0.01, max_grad_norm=1.0, schedule="constant",
                                          warmup_steps=0)),
    )
