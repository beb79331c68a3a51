"""Fine-tune Kandinsky 6 video-only (text-to-video, its audio branch frozen), full or LoRA.

Kandinsky 6 denoises video and audio together; given no audio latents its DiT runs the video path alone, as its
pipeline does without an audio VAE, and fvx trains that path: the audio branch's params get no gradient and stay as
loaded. The data is FastVideo's t2v parquet in Kandinsky 5's packed text form (the pooled CLIP row, then the Qwen2.5-VL
tokens after the pipeline's template), preprocessed with its encoders and the HunyuanVideo VAE.

The default trains the tiny `world` preset from scratch on fvx's toy world (text-to-video: bars of the prompted colour
moving the prompted way); about a minute and a half on a 2-core CPU, and `validation/model/nearest_mse` falls:
    python -m fvx.run experiments/finetune_kandinsky6.py
On Kandinsky 6 (a local diffusers folder):
    python -m fvx.run preprocess experiments/finetune_kandinsky6.py --videos /data/my_clips --out /data/my_dataset \\
        models.student.preset=kandinsky6 models.student.path=/models/Kandinsky-6 data.world=null \\
        data.preprocess.num_frames=121 data.preprocess.max_height=512 data.preprocess.max_width=768
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_kandinsky6.py models.student.preset=kandinsky6 \\
        models.student.path=/models/Kandinsky-6 models.student.compute_dtype=bf16 models.student.remat=true \\
        models.student.lora.rank=64 data.world=null data.path=/data/my_dataset data.text_len=1025 data.batch_size=8 \\
        method.optim.lr=1e-4 validation.num_steps=50
"""
import msgspec

from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.kandinsky6 import Kandinsky6Config


class FinetuneKandinsky6(Experiment):
    models: dict[str, Kandinsky6Config] = msgspec.field(
        default_factory=lambda: {"student": Kandinsky6Config(preset="tiny")})
    vae: SpaceToDepth | None = None  # decodes validation samples (the toy codec); None: latent previews
    method: Finetune = Finetune()


config = FinetuneKandinsky6(
    run=RunConfig(seed=0, steps=800, output_dir="runs/finetune_kandinsky6", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": Kandinsky6Config(preset="world")},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, display_scale=4),
    method=Finetune(optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)
