"""Fine-tune Kandinsky 6 on video (text-to-video, its audio branch frozen) or on video and audio together, full or
LoRA.

Kandinsky 6 denoises video and audio together; given no audio latents its DiT runs the video path alone, as its
pipeline does with sample_audio=False, and by default fvx trains that path: the audio branch's params get no gradient
and stay as loaded. With `models.student.train_audio=true` it trains both (data of kind t2va): each sample's video and
audio are noised at one level (the DiT has one timestep) and the loss is the sum of the two, logged apart as
`video_finetune_loss` and `audio_finetune_loss`. The data is FastVideo's t2v (or t2va) parquet in Kandinsky 5's packed
text form (the pooled CLIP row, then the Qwen2.5-VL tokens after the pipeline's template), preprocessed with its
encoders: the HunyuanVideo VAE, and for t2va the MMAudio VAE (`audio_latents [1, 20, A]`).

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
Image-to-video (the pipeline's `image=`: the first frame's latents appended as a clean reference frame; data of kind
i2v, whose `first_frame_latent` the preprocessing encodes as the pipeline encodes the image); `sample RUN --image
first.png` then makes a video from a picture:
    python -m fvx.run experiments/finetune_kandinsky6.py data.kind=i2v models.student.first_frame=true
The toy world with sound (a stereo tone whose pitch follows the prompt), video and audio trained together; each
validation writes a GIF and a `.wav` per prompt, and `pitch_match` / `audio_mse` show the sound learning:
    python -m fvx.run experiments/finetune_kandinsky6.py models.student.train_audio=true data.kind=t2va \\
        audio_vae=audio_frames
Image-to-video with sound (the pipeline's `image=` call with `sample_audio`; data of kind i2va: t2va's sound with i2v's
first frame); `sample RUN --image first.png` then writes a video and its `.wav`:
    python -m fvx.run experiments/finetune_kandinsky6.py models.student.train_audio=true \\
        models.student.first_frame=true data.kind=i2va audio_vae=audio_frames
On Kandinsky 6 with its audio (preprocess at the audio VAE's rate; the audio decoder reads `audio_vae/` and `vocoder/`
of the base model for validation):
    python -m fvx.run preprocess experiments/finetune_kandinsky6.py --videos /data/my_clips --out /data/my_av_dataset \\
        models.student.preset=kandinsky6 models.student.path=/models/Kandinsky-6 data.world=null data.kind=t2va \\
        data.preprocess.num_frames=121 data.preprocess.max_height=512 data.preprocess.max_width=768 \\
        data.preprocess.audio_rate=44100
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_kandinsky6.py models.student.preset=kandinsky6 \\
        models.student.path=/models/Kandinsky-6 models.student.train_audio=true models.student.compute_dtype=bf16 \\
        models.student.remat=true data.world=null data.kind=t2va data.path=/data/my_av_dataset data.text_len=1025 \\
        data.batch_size=8 method.optim.lr=1e-5 validation.num_steps=50 audio_vae=kandinsky6_audio \\
        audio_vae.path=/models/Kandinsky-6
"""
import msgspec

from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.toy_audio import AudioFrames
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.kandinsky6 import Kandinsky6Config
from fvx_models.kandinsky6_audio import Kandinsky6AudioDecoder


class FinetuneKandinsky6(Experiment):
    models: dict[str, Kandinsky6Config] = msgspec.field(
        default_factory=lambda: {"student": Kandinsky6Config(preset="tiny")})
    vae: SpaceToDepth | None = None  # decodes validation samples (the toy codec); None: latent previews
    audio_vae: AudioFrames | Kandinsky6AudioDecoder | None = None  # decodes a joint model's validation audio (.wav)
    method: Finetune = Finetune()


config = FinetuneKandinsky6(
    run=RunConfig(seed=0, steps=800, output_dir="runs/finetune_kandinsky6", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": Kandinsky6Config(preset="world")},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, display_scale=4),
    method=Finetune(optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)

