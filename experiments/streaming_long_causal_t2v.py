"""Streaming long tuning: teach a streaming student to keep generating past the clip length it was distilled on, one
chunk of its own stream per step (FastVideo's `StreamingLongTuningMethod`, LongLive's recipe; its world-model
scenario `scenario/worldmodel/zelda/streaming_long_tuning_causal_i2v.yaml`; `fvx_methods.streaming_long`).

The default continues the Self-Forcing scenario on fvx's toy world: the one-step streaming student that
`experiments/self_forcing_causal_t2v.py` trains on the world's 4-frame clips, exported, streams clips of 12 latent
frames (the prompts alone: text-only data, `method.latent_shape`) on a window of 4 frames with 2 sink frames; each
step extends its stream by 2 new frames after 2 frames of overlap (chunks of 4, the first frame of each re-encoded
through the toy codec), scored by the toy teacher and a critic on the chunk,
so a stream lasts 5 steps. From a fresh clone, after the Self-Forcing scenario's commands (its module docstring):
    python -m fvx.run export runs/self_forcing_causal_t2v --ema --out runs/sf_student
    python -m fvx.run experiments/streaming_long_causal_t2v.py
Validation streams 12-frame clips (3x the training window); the toy world scores each window of 4 frames
(`validation/student_ema/window_<i>/hit_rate`): the Self-Forcing student's later windows drift, streaming tuning holds
them (`bench/streaming_long.py`).

FastVideo's values are the recipe `wan21_t2v_1p3b` (its world-model recipe's streaming knobs on the causal Wan 2.1
T2V 1.3B: chunks of 9 latent frames with a fixed overlap of 3 and the re-encoded anchor, streams of 39, a window of
6 frames with 1 sink frame); point its paths at local folders, the student at a Self-Forcing export:
    torchrun --nproc-per-node 8 -m fvx.run experiments/streaming_long_causal_t2v.py:wan21_t2v_1p3b \
        models.student.path=/models/sf_wan21_t2v_1p3b models.teacher.path=/models/Wan2.1-T2V-14B-Diffusers \
        models.critic.path=/models/Wan2.1-T2V-1.3B-Diffusers vae.path=/models/Wan2.1-T2V-1.3B-Diffusers \
        data.path=/data/vidprom_16k_umt5_text_embed
"""
import msgspec

from fvx.config import recipe
from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.storage.checkpoint_config import CheckpointConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.self_forcing import SelfForcingRoles
from fvx_methods.streaming_long import StreamingLong
from fvx_models.wan import WanConfig
from fvx_models.wan_causal import WanCausalConfig
from fvx_models.wan_vae import WanVAEConfig


class StreamingLongWanCausal(Experiment):
    models: dict[str, WanCausalConfig | WanConfig] = msgspec.field(
        default_factory=lambda: {"student": WanCausalConfig(), "teacher": WanConfig()})
    vae: WanVAEConfig | SpaceToDepth | None = None  # re-encodes the anchor and decodes validation samples
    method: StreamingLong = StreamingLong()


TEACHER = "runs/teacher"  # experiments/finetune_wan.py's run, exported (the README's main command)
STUDENT = "runs/sf_student"  # experiments/self_forcing_causal_t2v.py's run, its EMA exported (module docstring)

config = StreamingLongWanCausal(
    run=RunConfig(seed=0, steps=400, output_dir="runs/streaming_long_causal_t2v", log_every=1),
    data=DataConfig(kind="text_only", batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": WanCausalConfig(preset="world", path=STUDENT, num_frames_per_block=2, local_attn_size=4,
                                       sink_size=2),
            "teacher": WanConfig(preset="world", path=TEACHER)},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=100, num_prompts=16, num_steps=20, display_scale=4, latent_shape=(192, 12, 2, 2)),
    method=StreamingLong(
        denoising_steps=(1000,), flow_shift=5.0, chunk_size=2, student_sample_type="sde",
        streaming_chunk_size=4, streaming_fixed_overlap_latents=2, latent_shape=(192, 12, 2, 2),
        generator_update_interval=2, guidance_scale=1.0,
        optim=AdamWConfig(lr=3e-4, betas=(0.0, 0.999), max_grad_norm=1.0),
        critic_optim=AdamWConfig(lr=1e-3, betas=(0.0, 0.999), max_grad_norm=1.0),
        ema_decay=0.99,
    ),
)


def fastvideo_models() -> dict[str, WanCausalConfig | WanConfig]:
    """The roles of FastVideo's Self-Forcing recipe with its world model's attention: a causal Wan 2.1 1.3B student in
    blocks of 3 latent frames on a window of 6 frames with 1 sink frame, a frozen 14B teacher and a 1.3B critic, fp32
    params with bf16 compute and full activation checkpointing."""
    common = dict(compute_dtype="bf16", remat=True)
    return {"student": WanCausalConfig(preset="wan2.1-t2v-1.3b", path="models/sf_wan21_t2v_1p3b",
                                       num_frames_per_block=3, local_attn_size=6, sink_size=1, **common),
            "teacher": WanConfig(preset="wan2.1-t2v-14b", path="models/Wan2.1-T2V-14B-Diffusers", **common),
            "critic": WanConfig(preset="wan2.1-t2v-1.3b", path="models/Wan2.1-T2V-1.3B-Diffusers", **common)}


@recipe
def wan21_t2v_1p3b() -> StreamingLongWanCausal:
    """FastVideo's scenario/worldmodel/zelda/streaming_long_tuning_causal_i2v.yaml, its knobs on Wan 2.1 T2V (no
    MatrixGame actions): one streaming stage over steps [0, 3000) of streams of 39 latent frames, chunks of 9 with a
    fixed overlap of 3 (6 new frames a step after the first 9) whose first frame is re-encoded by the VAE (k 1),
    whole blocks required; rollout blocks of 3, [1000, 750, 500, 250] warped on the shift-5 grid, SDE hops, one exit
    step shared by every block, no context noise, gradients from frame 0; score timesteps in [round(20),
    round(980)]; the student updated every 5th step, unguided teacher; AdamW lr 3e-6 (student) and 3e-7 (critic),
    betas (0.9, 0.95), no weight decay, constant, clip 1; EMA 0.99 from step 200; global batch 8 (8 ranks of 1),
    39 latent frames (153 frames) of 480x832, seed 1001; 3000 steps, checkpoints every 1000 (the newest 2 kept),
    validation every 100 steps."""
    adamw = AdamWConfig(lr=3e-6, betas=(0.9, 0.95), weight_decay=0.0, max_grad_norm=1.0, schedule="constant")
    stage = {"stage": "streaming_long", "start_step": 0, "end_step": 3000, "num_latent_t": 39,
             "streaming_training": True, "streaming_chunk_size": 9, "streaming_max_length": 39,
             "streaming_fixed_overlap_latents": 3}
    return StreamingLongWanCausal(
        run=RunConfig(seed=1001, steps=3000, output_dir="outputs/zelda_causal_long_tuning",
                      checkpoint=CheckpointConfig(every=1000, keep_latest=2)),
        data=DataConfig(path="data/vidprom_16k_umt5_text_embed", kind="text_only", batch_size=8, text_len=512,
                        cfg_rate=0.0),
        models=fastvideo_models(),
        vae=WanVAEConfig(preset="wan2.1", path="models/Wan2.1-T2V-1.3B-Diffusers", encoder=True),
        validation=ValidationConfig(every=100, num_prompts=4),
        method=StreamingLong(
            roles=SelfForcingRoles(student="student", critic="critic", teacher="teacher"),
            denoising_steps=(1000, 750, 500, 250), warp_denoising_step=True, flow_shift=5.0, chunk_size=3,
            student_sample_type="sde", same_step_across_blocks=True, context_noise=0.0, start_gradient_frame=0,
            generator_update_interval=5, guidance_scale=1.0, min_timestep_ratio=0.02, max_timestep_ratio=0.98,
            multi_phased_distill_schedule=[stage], streaming_chunk_size=9, streaming_max_length=39,
            streaming_fixed_overlap_latents=3, streaming_reencode_overlap_anchor=True, streaming_anchor_inject_k=1,
            streaming_require_full_blocks=True, latent_shape=(16, 39, 60, 104),
            optim=adamw, critic_optim=msgspec.structs.replace(adamw, lr=3e-7), ema_decay=0.99, ema_start_step=200),
    )
