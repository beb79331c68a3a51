"""Fine-tune LTX-Video text-to-video with flow matching; its recipe is a LoRA (Lightricks' LTX-Video-Trainer defaults).

Training noise levels are LTX-Video-Trainer's for every run (the family's sampler, ``fvx_models.ltx_video``): sigma =
sigmoid(N(mu, 1)) with mu of the latents' token count (``models.student.timestep_sampling=uniform`` for its U(0, 1)
mode); the method's ``weighting_scheme`` is refused and its ``flow_shift`` unused. The default is the tiny preset on
synthetic latents (validation logs latent previews: fvx has no tiny LTX VAE), 128 tokens (mu 0.63, median sigma 0.65),
a minute on a 2-core CPU:
    python -m fvx.run experiments/finetune_ltx_video.py
The real 2B model is the same file with overrides, on data preprocessed with T5-XXL (4096 wide; LTXPipeline pads to
128 tokens) and the LTX VAE (128 channels, 8x32x32 compression). Latents the VAE encoded and nobody normalised need
its statistics (``models.student.latents_stats``: the VAE folder; leave it unset for latents already normalised, as
LTX-Video-Trainer stores them); ``models.student.fps`` is the clips' frame rate (the RoPE's time scale, default 25):
    python -m fvx.run experiments/finetune_ltx_video.py models.student.preset=ltx-video-2b \\
        models.student.path=/models/LTX-Video models.student.latents_stats=/models/LTX-Video/vae \\
        models.student.compute_dtype=bf16 models.student.remat=true data.path=/data/my_ltx_dataset \\
        data.text_len=128 data.batch_size=8 method.optim.lr=1e-5 --steps 4000 --out runs/ltx_video
LTX-Video has no FastVideo recipe. The recipe ``ltxv_2b_lora`` is the LoRA fine-tune of Lightricks' LTX-Video-Trainer
(``configs/ltxv_2b_lora.yaml``) at real size; point its paths at local folders:
    python -m fvx.run experiments/finetune_ltx_video.py:ltxv_2b_lora models.student.path=/models/LTX-Video \\
        data.path=/data/my_ltx_dataset
    python -m fvx.run export outputs/ltxv_lora --lora --format peft --out runs/ltxv_lora  # load_lora_weights
"""
import math

import msgspec

from fvx.config import recipe
from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig, SyntheticConfig
from fvx.data.preprocess import PreprocessConfig
from fvx.storage.checkpoint_config import CheckpointConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models import ltx_video
from fvx_models.lora import LoRAConfig
from fvx_models.ltx_video import LTXVideoConfig

TRAINER_LORA = LoRAConfig(rank=32, alpha=32.0, target_modules=("to_k", "to_q", "to_v", "to_out.0"))
BUCKET = (89, 448, 768)  # frames, height, width: LTX-Video-Trainer's validation size and its documented bucket
LATENT_BUCKET = (ltx_video.CHANNELS, (BUCKET[0] - 1) // 8 + 1, BUCKET[1] // 32, BUCKET[2] // 32)  # [128, 12, 14, 24]
MU = ltx_video.shift_mu(math.prod(LATENT_BUCKET[1:]))  # 4032 tokens -> 2.027: validation's shift e^mu


class FinetuneLTXVideo(Experiment):
    models: dict[str, LTXVideoConfig] = msgspec.field(default_factory=lambda: {"student": LTXVideoConfig()})
    method: Finetune = Finetune()


config = FinetuneLTXVideo(
    run=RunConfig(seed=0, steps=300, output_dir="runs/finetune_ltx_video"),
    data=DataConfig(batch_size=4, text_len=8, synthetic=SyntheticConfig(num_samples=64, latent_shape=(8, 2, 8, 8),
                                                                        text_len=8, text_dim=16)),
    models={"student": LTXVideoConfig(preset="tiny")},
    validation=ValidationConfig(every=100, num_prompts=2, flow_shift=3.0),
    method=Finetune(optim=AdamWConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0, schedule="cosine",
                                      warmup_steps=20)),
)


@recipe
def ltxv_2b_lora() -> FinetuneLTXVideo:
    """Lightricks' LTX-Video-Trainer ``configs/ltxv_2b_lora.yaml`` (LTX-Video has no FastVideo recipe): the 2B DiT with
    LoRA r 32, alpha 32 on to_k, to_q, to_v, to_out.0 (A kaiming-uniform, B zeros: PEFT's init), the base frozen in
    bf16, bf16 compute, no gradient checkpointing; torch AdamW on the adapters (lr 2e-4, betas (0.9, 0.999), eps 1e-8,
    weight decay 0.01), clip 1, LinearLR from 1.0 to 0.1 of the lr over the run (fvx's polynomial schedule, power 1,
    down to 2e-5), no warmup; batch 1, no accumulation, seed 42, 1500 steps, a checkpoint every 250 (all kept).
    Timesteps: its shifted logit-normal (``timestep_samplers.py``; the family's sampler, so the method names no
    density): sigma = sigmoid(N(mu, 1)), continuous, with mu of the batch's token count (LTXPipeline's resolution
    shift), at the bucket 768x448x89 (its validation size: 12x14x24 latents, 4032 tokens, mu 2.03, median sigma
    0.884); the DiT is given round(1000 sigma). Captions: its T5 length, 256 tokens. Validation every 100 steps: 2
    prompts at 768x448x89, 50 steps at guidance 3.5, seed 42, the scheduler's shift e^mu (7.59) for that size.
    ``fps``: the pipeline's 25 (LTX-Video-Trainer reads each clip's; set ``models.student.fps`` to your clips'). Not
    carried over: its first-frame conditioning of 10% of the samples (fvx trains text-to-video) and its negative
    validation prompt (give one as a cond file: ``validation.cfg_uncond=negative_prompt
    validation.negative_prompt_path=...``). No FastVideo script: ``data.preprocess`` cuts the bucket, 89 frames (12
    latent) of 448x768, at the pipeline's 25 fps:
        python -m fvx.run preprocess experiments/finetune_ltx_video.py:ltxv_2b_lora --videos /data/my_clips \\
            --out /data/my_dataset models.student.path=/models/LTX-Video"""
    return FinetuneLTXVideo(
        run=RunConfig(seed=42, steps=1500, output_dir="outputs/ltxv_lora",
                      checkpoint=CheckpointConfig(every=250, keep_latest=None)),
        data=DataConfig(path="data/ltxv_preprocessed", batch_size=1, text_len=256, cfg_rate=0.0,
                        num_latent_t=LATENT_BUCKET[1],
                        preprocess=PreprocessConfig(num_frames=BUCKET[0], train_fps=25, max_height=BUCKET[1],
                                                    max_width=BUCKET[2])),
        models={"student": LTXVideoConfig(preset="ltx-video-2b", path="models/LTX-Video", compute_dtype="bf16",
                                          frozen_dtype="bf16", remat=False, lora=TRAINER_LORA)},
        validation=ValidationConfig(every=100, num_prompts=2, latent_shape=LATENT_BUCKET, num_steps=50,
                                    flow_shift=math.exp(MU), guidance_scale=3.5, seed=42),
        method=Finetune(optim=AdamWConfig(lr=2e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                                          max_grad_norm=1.0, schedule="polynomial", power=1.0, lr_end=2e-5,
                                          warmup_steps=0)),
    )
