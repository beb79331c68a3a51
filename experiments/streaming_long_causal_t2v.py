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

FastVideo's only streaming recipe is its world model's, on Matrix-Game 2.0 with actions:
`experiments/worldmodel_matrixgame2.py:zelda_streaming_long_tuning_causal_i2v` (chunks of 9 latent frames with a
fixed overlap of 3 and the re-encoded anchor, streams of 39, a window of 6 frames with 1 sink frame).
"""
import msgspec

from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
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
