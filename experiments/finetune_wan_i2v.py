"""Fine-tune Wan image-to-video with flow matching (FastVideo's Wan 2.1 I2V 14B fine-tuning, full and LoRA).

The model is given the clip's first frame (its latents, and for Wan 2.1 I2V its CLIP image embedding) and the text,
and denoises the clip (``fvx_models.wan_i2v``). The data is FastVideo's I2V preprocessing (``data.kind=i2v``: the
columns ``first_frame_latent`` and ``clip_feature`` beside the latents and text).

The default trains the tiny `world-i2v` preset from scratch on fvx's toy world as an image-to-video task: given the
first frame and the prompt, continue the bars the way the prompt says (the first frame alone cannot tell left from
right). A few minutes on a 2-core CPU; validation conditions on the first frames of fixed dataset samples, and
`validation/model/continuation_mse` (the distance to the clip the frame came from) falls:
    python -m fvx.run experiments/finetune_wan_i2v.py
FastVideo's recipes are `wan21_i2v_14b_480p` (full) and `wan21_i2v_14b_480p_lora` (LoRA r 32); point their paths
at local folders:
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_wan_i2v.py:wan21_i2v_14b_480p --sp 8 \
        models.student.path=/models/Wan2.1-I2V-14B-480P-Diffusers data.path=/data/crush-smol_processed_i2v
Wan 2.2 A14B I2V is `experiments/finetune_wan22_a14b.py models.student.preset=wan2.2-i2v-a14b data.kind=i2v`
(both experts, boundary 0.9); Wan 2.2 TI2V-5B's image-to-video form is `models.student.first_frame=true` on its
preset (`experiments/finetune_wan22_ti2v.py ... data.kind=i2v`).
"""
import msgspec

from fvx.config import recipe
from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.preprocess import PreprocessConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.storage.checkpoint_config import CheckpointConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.lora import LoRAConfig
from fvx_models.wan import WanConfig
from fvx_models.wan_vae import WanVAEConfig

# examples/training/finetune/wan_i2v_14B_480p/crush_smol/preprocess_wan_data_i2v.sh
CRUSH_SMOL_I2V = PreprocessConfig(num_frames=77, train_fps=16, max_height=480, max_width=832,
                                  video_length_tolerance_range=5.0, samples_per_file=8)


class FinetuneWanI2V(Experiment):
    models: dict[str, WanConfig] = msgspec.field(default_factory=lambda: {"student": WanConfig(preset="tiny-i2v")})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples; None logs latent previews
    method: Finetune = Finetune()


config = FinetuneWanI2V(
    run=RunConfig(seed=0, steps=600, output_dir="runs/finetune_wan_i2v", log_every=1),
    data=DataConfig(kind="i2v", batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": WanConfig(preset="world-i2v")},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, display_scale=4),
    method=Finetune(optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)


def _wan21_i2v_14b_480p(lora: LoRAConfig | None, output_dir: str) -> FinetuneWanI2V:
    return FinetuneWanI2V(
        run=RunConfig(seed=42, steps=2000, output_dir=output_dir,
                      checkpoint=CheckpointConfig(every=1000, keep_latest=3)),
        data=DataConfig(kind="i2v", path="data/crush-smol_processed_i2v/combined_parquet_dataset", batch_size=1,
                        text_len=512, cfg_rate=0.1, num_latent_t=8, preprocess=CRUSH_SMOL_I2V),
        models={"student": WanConfig(preset="wan2.1-i2v-14b-480p", path="models/Wan2.1-I2V-14B-480P-Diffusers",
                                     compute_dtype="bf16", remat=True, lora=lora)},
        validation=ValidationConfig(every=100, num_prompts=4, num_steps=40, flow_shift=3.0, guidance_scale=6.0),
        method=Finetune(optim=AdamWConfig(lr=1e-5, betas=(0.9, 0.999), weight_decay=1e-4, max_grad_norm=1.0,
                                          schedule="constant"), flow_shift=1.0),
    )


@recipe
def wan21_i2v_14b_480p() -> FinetuneWanI2V:
    """FastVideo's examples/training/finetune/wan_i2v_14B_480p/crush_smol/finetune_i2v.sh: Wan 2.1 I2V 14B 480p, 8
    ranks in one sequence-parallel group (``--sp 8``) of train_batch_size 1: global batch 1; 8 latent frames of
    480x832 (77 video frames), CFG dropout 0.1, full remat, bf16 compute over fp32 masters; AdamW lr 1e-5, weight
    decay 1e-4, clip 1, constant; 2000 steps, checkpoints every 1000 (the newest 3 kept); validation every 100, 40
    steps at guidance 6 at the pipeline's flow shift 3. Training noise levels on the unshifted grid (``flow_shift``
    1: sigma uniform on {0.001, ..., 1}, mean 0.5): its legacy pipeline (``fastvideo/training/
    wan_i2v_training_pipeline.py``) builds a shift-3 scheduler, but ``TrainingPipeline.train`` replaces it by
    diffusers' ``FlowMatchEulerDiscreteScheduler()`` (shift 1) before the first step (``training_pipeline.py:536``),
    and the uniform ``u`` indexes that (``_sample_timesteps``). Its ``ema_start_step 0`` and ``num_euler_timesteps``
    are for its distillation pipelines and have no effect on fine-tuning. Its data is cut as FastVideo's
    crush_smol/preprocess_wan_data_i2v.sh does (77 frames of 480x832 at 16 fps, 8 a file):
        python -m fvx.run preprocess experiments/finetune_wan_i2v.py:wan21_i2v_14b_480p --videos /data/my_clips \\
            --out /data/my_dataset models.student.path=/models/Wan2.1-I2V-14B-480P-Diffusers"""
    return _wan21_i2v_14b_480p(None, "checkpoints/wan_i2v_finetune")


@recipe
def wan21_i2v_14b_480p_lora() -> FinetuneWanI2V:
    """FastVideo's .../wan_i2v_14B_480p/crush_smol/finetune_i2v_lora.sh: the full recipe with LoRA rank 32 (alpha
    the rank, FastVideo's default) on FastVideo's default targets, 4 ranks in one SP group (``--sp 4``); the same data
    (``preprocess`` as the full recipe's)."""
    return _wan21_i2v_14b_480p(LoRAConfig(rank=32), "checkpoints/wan_i2v_finetune_lora")
