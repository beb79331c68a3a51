"""Fine-tune Cosmos 3 Omni on text-, image- or video-to-video, full or LoRA.

Cosmos 3 is a vision-language transformer that denoises the video beside its prompt's tokens: there is no text
encoder, so the data's `text_embedding` holds each caption's token ids (`[L, 1]`, the pipeline's tokenization:
its system prompt and chat template around the caption with the sentences its pipeline appends, stating the clip's
duration, frame rate and resolution; `encode-prompts --negative` writes their inverses for a negative prompt).
Latents are the Wan 2.2 VAE's. Its forward packs one prompt-and-video sequence without a
batch axis, so a batch runs sample by sample (`method.grad_accum` micro-batches of one keep one sample's activations
at a time); `models.student.fps` is the clips' frame rate
(it scales the video's time positions; the pipeline's default 24).

The default trains the tiny `world` preset from scratch on fvx's toy world, its prompts' words as token ids (bars of
the prompted colour moving the prompted way); a couple of minutes on a 2-core CPU, and `validation/model/nearest_mse`
falls:
    python -m fvx.run experiments/finetune_cosmos3.py
Image-to-video (the pipeline's `image=`: latent frame 0 the given frame, clean; data of kind i2v); `sample RUN --image
first.png` then makes a video from a picture:
    python -m fvx.run experiments/finetune_cosmos3.py data.kind=i2v models.student.first_frame=true
Video-to-video (the pipeline's `video=`: each clip's first `given_frames` latent frames its own, clean; the pipeline
gives 2, its `condition_frame_indexes_vision`; any t2v data); `sample RUN --video clip.mp4` then continues a video:
    python -m fvx.run experiments/finetune_cosmos3.py models.student.given_frames=2
On Cosmos 3 Omni (a local diffusers folder: transformer/, vae/, text_tokenizer/, scheduler/):
    python -m fvx.run preprocess experiments/finetune_cosmos3.py --videos /data/my_clips --out /data/my_dataset \\
        models.student.preset=cosmos3-omni models.student.path=/models/Cosmos3-Omni data.world=null \\
        data.preprocess.num_frames=93 data.preprocess.max_height=704 data.preprocess.max_width=1280 \\
        data.preprocess.train_fps=24
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_cosmos3.py models.student.preset=cosmos3-omni \\
        models.student.path=/models/Cosmos3-Omni models.student.compute_dtype=bf16 models.student.remat=true \\
        models.student.lora.rank=64 data.world=null data.path=/data/my_dataset data.text_len=512 data.batch_size=8 \\
        method.grad_accum=1 method.optim.lr=1e-4 validation.num_steps=35
"""
import msgspec

from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.cosmos3 import Cosmos3Config


class FinetuneCosmos3(Experiment):
    models: dict[str, Cosmos3Config] = msgspec.field(default_factory=lambda: {"student": Cosmos3Config()})
    vae: SpaceToDepth | None = None  # decodes validation samples (the toy codec); None: latent previews
    method: Finetune = Finetune()


config = FinetuneCosmos3(
    run=RunConfig(seed=0, steps=600, output_dir="runs/finetune_cosmos3", log_every=1),
    data=DataConfig(kind="t2v", batch_size=4, text_len=4, world=WorldConfig(factor=4, text="words")),
    models={"student": Cosmos3Config(preset="world", fps=16.0)},
    vae=SpaceToDepth(factor=4),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, display_scale=4),
    method=Finetune(grad_accum=4, optim=AdamWConfig(lr=1e-3, max_grad_norm=1.0, schedule="cosine",
                                                      warmup_steps=50)),
)
