"""Fine-tune Helios (long video chunk by chunk on its multi-term memory), full or LoRA, as Helios's stage-1 recipe
trains it: each chunk of latent frames denoised beside the clean frames before it, the memory corrupted in training.

The data is sections in Helios's order (``data.kind=framepack data.sections.order=chunks``): each clip tiled by chunks
of ``data.sections.window`` latent frames from its first frame, each with the 19 frames before it and the clip's
first frame (the first chunk is given none: text-to-video), as Helios's data loader cuts them. Its VAE encodes each
33-frame chunk on its own, so clips hold 33 k frames.

The default trains the tiny `world` preset from scratch on fvx's toy world cut into chunks of 2 frames (bars of the
prompted colour moving the prompted way); a few minutes on a 2-core CPU, and `validation/model/section_mse` (a sampled
chunk against its true frames, given the frames before it) falls:
    python -m fvx.run experiments/finetune_helios.py
On Helios (a local HeliosPipeline folder):
    python -m fvx.run preprocess experiments/finetune_helios.py:helios_stage1 --videos /data/my_clips \\
        --out /data/my_dataset models.student.path=/models/Helios-Base
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_helios.py:helios_stage1 \\
        models.student.path=/models/Helios-Base data.path=/data/my_dataset
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
from fvx_models.helios import HeliosConfig
from fvx_models.lora import LoRAConfig


class FinetuneHelios(Experiment):
    models: dict[str, HeliosConfig] = msgspec.field(default_factory=lambda: {"student": HeliosConfig()})
    vae: SpaceToDepth | None = None  # decodes validation samples (the toy codec); None: latent previews
    method: Finetune = Finetune()


config = FinetuneHelios(
    run=RunConfig(seed=0, steps=600, output_dir="runs/finetune_helios", log_every=1),
    data=DataConfig(kind="framepack", batch_size=8, text_len=4, world=WorldConfig(frames=4, factor=4),
                    sections=SectionsConfig(window=2, order="chunks")),
    models={"student": HeliosConfig(preset="world")},
    vae=SpaceToDepth(factor=4),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, flow_shift=1.0, display_scale=4),
    method=Finetune(flow_shift=1.0, weighting_scheme="logit_normal",
                    optim=AdamWConfig(lr=1e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)


@recipe
def helios_stage1() -> FinetuneHelios:
    """Helios's stage-1 recipe (``scripts/training/configs/stage_1_init.yaml`` of PKU-YuanGroup/Helios), on 8 ranks:
    AdamW at lr 5e-5, a batch of 2 a rank in bf16, logit-normal timesteps at shift 1, no caption dropout, chunks of 9
    latent frames (33 video frames) at 384 x 640, clips of 132 frames at 24 fps (its examples' rate), the memory
    corrupted as its training corrupts it (``fvx_models.helios``). Helios trains a rank-128 LoRA on every linear layer
    beside its three memory patch embeddings in full; an fvx LoRA model trains adapters alone, so this is rank 128 on
    the default attention projections, the memory patches as loaded (full fine-tuning: ``models.student.lora=null``)."""
    return FinetuneHelios(
        run=RunConfig(seed=42, steps=10000, output_dir="runs/helios_stage1"),
        data=DataConfig(kind="framepack", batch_size=16, text_len=512, sections=SectionsConfig(window=9,
                                                                                                 order="chunks"),
                        preprocess=PreprocessConfig(num_frames=132, train_fps=24, max_height=384, max_width=640)),
        models={"student": HeliosConfig(preset="helios", compute_dtype="bf16", remat=True,
                                        lora=LoRAConfig(rank=128))},
        validation=ValidationConfig(every=500, num_prompts=1, num_steps=50, flow_shift=1.0, guidance_scale=5.0),
        method=Finetune(weighting_scheme="logit_normal", flow_shift=1.0,
                        optim=AdamWConfig(lr=5e-5, max_grad_norm=1.0, schedule="constant", warmup_steps=0)),
    )
