"""Fine-tune MiniMax-H3 on video and audio together (FastVideo's t2va fine-tuning, `overfit_minimax_h3_t2va.yaml`).

MiniMax-H3 denoises text, video and audio in one packed sequence. Each step draws one shared stage b ~ U(0, 1) per
sample and noises the video at sigma 12 b / (1 + 11 b) and the audio at 3 b / (1 + 2 b); the loss is the sum of the two
modalities' flow-matching losses, logged apart as `video_finetune_loss` and `audio_finetune_loss`. FastVideo's rules
hold: one sample per forward (a batch runs sample by sample; FastVideo's batch is 1 per rank), no CFG dropout, data of
kind t2va (FastVideo's t2va parquet: `vae_latent`, `audio_latent [2, 32, A]`).

The default trains the `world` preset on the toy world with sound (`data.kind=t2va`: the bars, and a stereo tone whose
pitch follows the prompt) on a 2-core CPU in a few minutes; each validation writes a GIF and a `.wav` per prompt, and
`validation/model/nearest_mse` (the picture) and `pitch_match` / `audio_mse` (the sound) show both modalities learning:
    python -m fvx.run experiments/finetune_minimax_h3.py
FastVideo's 400-step overfit on one Crush-Smol record at real size (768x1344, 124 frames: 37 latent frames, 207 audio
latents), with the audio VAE decoding validation samples (copy `audio_vae/` from the base model):
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_minimax_h3.py:minimax_h3_t2va_overfit \\
        models.student.path=/models/MiniMax-H3 data.path=/data/crush-smol_h3_t2va_single_sample_preprocessed \\
        audio_vae.path=/models/MiniMax-H3
"""
import msgspec

from fvx.config import recipe
from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.preprocess import PreprocessConfig
from fvx.data.toy_audio import AudioFrames
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.storage.checkpoint_config import CheckpointConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models import minimax_h3
from fvx_models.minimax_h3 import MiniMaxH3Config
from fvx_models.minimax_h3_audio import MiniMaxH3AudioDecoder

OVERFIT_LATENTS = (24, 37, 48, 84)  # 124 frames of 768x1344: 5 n + 2 = 37 latent frames, 768 / 16, 1344 / 16
# fastvideo/pipelines/preprocess/preprocess_minimax_h3_overfit.py's NUM_FRAMES (124 = 17 n + 5, n = 7), VIDEO_HEIGHT,
# VIDEO_WIDTH, AUDIO_SAMPLE_RATE at MINIMAX_H3_FPS (24)
OVERFIT_CUT = PreprocessConfig(num_frames=124, train_fps=24, max_height=768, max_width=1344, audio_rate=32000)


class FinetuneMiniMaxH3(Experiment):
    models: dict[str, MiniMaxH3Config] = msgspec.field(default_factory=lambda: {"student": MiniMaxH3Config()})
    vae: SpaceToDepth | None = None  # decodes the toy world's validation videos; None logs latent previews
    audio_vae: AudioFrames | MiniMaxH3AudioDecoder | None = None  # decodes validation audio into .wav files
    method: Finetune = Finetune()


config = FinetuneMiniMaxH3(
    run=RunConfig(seed=0, steps=800, output_dir="runs/finetune_minimax_h3", log_every=1),
    data=DataConfig(kind="t2va", batch_size=4, text_len=4, world=WorldConfig(factor=4)),
    models={"student": MiniMaxH3Config(preset="world")},
    vae=SpaceToDepth(factor=4),
    audio_vae=AudioFrames(),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, flow_shift=1.0, display_scale=4),
    method=Finetune(grad_accum=4, optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine",
                                                      warmup_steps=50)),
)


@recipe
def minimax_h3_t2va_overfit() -> FinetuneMiniMaxH3:
    """FastVideo's configs/overfit_minimax_h3_t2va.yaml: MiniMax-H3 on one Crush-Smol record, 124 frames of 768x1344
    (37 latent frames); AdamW lr 5e-5, betas (0.9, 0.999), no weight decay, constant, clip 1; bf16, full gradient
    checkpointing; 400 steps, a checkpoint every 20 (the newest 2 kept); validation at the start and every 20 steps,
    50 steps at guidance 1 (the released model is guidance-distilled), seed 42. FastVideo runs it on 64 GPUs as 8
    sequence-parallel groups of 8 (HSDP 8 x 8), one sample per group: a global batch of 8. fvx has no sequence
    parallelism for MiniMax-H3's packed sequence, so the recipe is 8 ranks of one sample each (the same global batch
    of 8, the dataset's one record repeated), params sharded over the 8. Its data is cut as FastVideo's
    preprocess_minimax_h3_overfit.py sets (124 frames of 768x1344 at 24 fps, audio at 32 kHz; that script resizes
    without cropping, fvx scales to cover and crops):
        python -m fvx.run preprocess experiments/finetune_minimax_h3.py:minimax_h3_t2va_overfit \\
            --videos /data/my_clips --out /data/my_dataset models.student.path=/models/MiniMax-H3"""
    return FinetuneMiniMaxH3(
        run=RunConfig(seed=42, steps=400, output_dir="runs/minimax_h3_t2va_crush_smol_single_sample_overfit",
                      checkpoint=CheckpointConfig(every=20, keep_latest=2)),
        data=DataConfig(path="data/crush-smol_h3_t2va_single_sample_preprocessed", kind="t2va", batch_size=8,
                        text_len=minimax_h3.TEXT_LEN, cfg_rate=0.0, num_latent_t=OVERFIT_LATENTS[1],
                        preprocess=OVERFIT_CUT),
        models={"student": MiniMaxH3Config(preset="minimax-h3", path="data/models/MiniMax-H3", compute_dtype="bf16",
                                           remat=True)},
        audio_vae=MiniMaxH3AudioDecoder(path="data/models/MiniMax-H3"),
        validation=ValidationConfig(every=20, at_start=True, num_prompts=1, latent_shape=OVERFIT_LATENTS,
                                    num_steps=50, flow_shift=1.0, guidance_scale=1.0, fps=24.0, seed=42),
        method=Finetune(optim=AdamWConfig(lr=5e-5, betas=(0.9, 0.999), weight_decay=0.0, max_grad_norm=1.0,
                                          schedule="constant", warmup_steps=0)),
    )
