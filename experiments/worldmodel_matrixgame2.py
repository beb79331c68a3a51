"""World models: Matrix-Game 2.0, an image-to-video model steered by keyboard and mouse actions, through FastVideo's
world-model scenario (`examples/train/scenario/worldmodel/`): fine-tuning the bidirectional model, diffusion-forcing
SFT of the causal one, Self-Forcing distillation into a few-step streaming student, then streaming long tuning.

The models are `fvx_models.matrixgame2` (bidirectional) and `fvx_models.matrixgame2_causal` (block-causal, KV-cached
with the actions' keys in the cache); the data is FastVideo's Matrix-Game parquet (`data.kind=matrixgame2`: latents,
the first frame's latents and CLIP features, `keyboard_cond` and `mouse_cond` per video frame, no text).

The default fine-tunes the `world` preset from scratch on fvx's toy world with actions: the first frame shows a
lattice of coloured squares and the key held at each frame says where it moves next (W up, S down, A left, D right),
turning mid-clip; `validation/model/action_following` (how often the motion between two frames is the key's; about
1/4 for a model that moves but ignores the keys) rises slowly: 0 -> 0.31 in its 1200 steps (2.5 minutes on 2 CPU
cores), 0.42 with `run.steps=2400` (docs/design.md):
    python -m fvx.run experiments/worldmodel_matrixgame2.py
The whole chain on the toy world, each run from the export of the one before:
    python -m fvx.run export runs/worldmodel_matrixgame2 --out runs/mg2_teacher
    python -m fvx.run experiments/worldmodel_matrixgame2.py:world_dfsft
    python -m fvx.run export runs/worldmodel_matrixgame2_dfsft --out runs/mg2_causal
    python -m fvx.run experiments/worldmodel_matrixgame2.py:world_self_forcing
    python -m fvx.run export runs/worldmodel_matrixgame2_sf --ema --out runs/mg2_sf
    python -m fvx.run experiments/worldmodel_matrixgame2.py:world_streaming_long
FastVideo's recipes (point their paths at local folders; the Zelda data is `mignonjia/zeldam2-clean`, its validation
bundle `mignonjia/zelda_validation_data`):
    zelda_finetune_i2v, zelda_dfsft_causal_i2v, zelda_self_forcing_causal_i2v, zelda_streaming_long_tuning_causal_i2v
    solaris_finetune_i2v, solaris_dfsft_causal_i2v, solaris_self_forcing_causal_i2v
Zelda's distillation is two runs: Self-Forcing (1000 steps), then streaming long tuning from its exported student:
    torchrun --nproc-per-node 8 -m fvx.run experiments/worldmodel_matrixgame2.py:zelda_self_forcing_causal_i2v \
        models.student.path=/models/mg_causal_zelda models.teacher.path=/models/mg_bidirectional_zelda \
        models.critic.path=/models/mg_bidirectional_zelda vae.path=/models/Matrix-Game-2.0-Base-Diffusers \
        data.path=/data/zeldam2-clean
    python -m fvx.run export outputs/zelda_causal_self_forcing --ema --out /models/mg_sf_zelda_1k
    torchrun --nproc-per-node 8 -m fvx.run experiments/worldmodel_matrixgame2.py:zelda_streaming_long_tuning_causal_i2v \
        models.student.path=/models/mg_sf_zelda_1k models.teacher.path=/models/mg_bidirectional_zelda \
        models.critic.path=/models/mg_bidirectional_zelda vae.path=/models/Matrix-Game-2.0-Base-Diffusers \
        data.path=/data/zeldam2-clean

As FastVideo runs them: training at its Wan plugin's `flow_shift` (3.0, `fastvideo/train/models/wan/wan.py:69,94`;
the YAMLs' `pipeline.flow_shift` is their validation's); the teacher's guidance of Solaris's Self-Forcing (4.5) on an
unconditional that is the cond itself (`cfg_uncond="keep"`: `MatrixGame2Model._get_uncond_text_dict` returns the
conditional dict), so it changes nothing, as there. Where fvx differs: validation samples unguided (the YAMLs'
`guidance_scale` 5 or 6 is never read: `matrixgame2_denoising.py` runs no classifier-free guidance) at the data's
length (FastVideo's Self-Forcing validation streams 153 frames with the validation bundle's own actions; fvx's
validation prompts are the data's samples, whose actions cover their own frames); VBench and optical-flow metrics
are FastVideo's callbacks and are not run; the toy world's scores are.
"""
import msgspec

from fvx.config import recipe
from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.storage.checkpoint_config import CheckpointConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.dfsft import DFSFT
from fvx_methods.finetune import Finetune
from fvx_methods.self_forcing import SelfForcing, SelfForcingRoles
from fvx_methods.streaming_long import StreamingLong
from fvx_models.matrixgame2 import MatrixGame2Config
from fvx_models.matrixgame2_causal import MatrixGame2CausalConfig
from fvx_models.wan_vae import WanVAEConfig


class WorldModelMatrixGame2(Experiment):
    models: dict[str, MatrixGame2CausalConfig | MatrixGame2Config] = msgspec.field(
        default_factory=lambda: {"student": MatrixGame2Config()})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples; None logs latent previews
    method: Finetune | DFSFT | StreamingLong | SelfForcing = Finetune()


config = WorldModelMatrixGame2(
    run=RunConfig(seed=0, steps=1200, output_dir="runs/worldmodel_matrixgame2", log_every=1),
    data=DataConfig(kind="matrixgame2", batch_size=8, world=WorldConfig(frames=4)),
    models={"student": MatrixGame2Config(preset="world")},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=400, num_prompts=16, num_steps=20, flow_shift=5.0, display_scale=4),
    method=Finetune(optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)

# ------------------------------------------------------------------------------------------ the toy world's chain
TEACHER = "runs/mg2_teacher"  # the default run, exported (module docstring)
CAUSAL_STUDENT = "runs/mg2_causal"  # world_dfsft's run, exported
SF_STUDENT = "runs/mg2_sf"  # world_self_forcing's run, its EMA exported
WORLD_LATENTS, LONG_LATENTS = (192, 4, 2, 2), (192, 12, 2, 2)  # the world's 4-frame clips, the streams' 12


@recipe
def world_dfsft() -> WorldModelMatrixGame2:
    """The scenario's second run on the toy world: the causal model (blocks of 2 latent frames) from the fine-tuned
    bidirectional one (``TEACHER``), diffusion-forcing SFT; validation streams it block by block with the keys."""
    return WorldModelMatrixGame2(
        run=RunConfig(seed=0, steps=400, output_dir="runs/worldmodel_matrixgame2_dfsft", log_every=1),
        data=DataConfig(kind="matrixgame2", batch_size=8, world=WorldConfig(frames=4)),
        models={"student": MatrixGame2CausalConfig(preset="world", path=TEACHER, num_frames_per_block=2)},
        vae=SpaceToDepth(),
        validation=ValidationConfig(every=100, num_prompts=8, num_steps=20, flow_shift=5.0, display_scale=4,
                                    latent_shape=WORLD_LATENTS),
        method=DFSFT(chunk_size=2, optim=AdamWConfig(lr=1e-3, max_grad_norm=1.0, schedule="cosine",
                                                     warmup_steps=20)))


@recipe
def world_self_forcing() -> WorldModelMatrixGame2:
    """The third: Self-Forcing of the DFSFT model (``CAUSAL_STUDENT``) into a one-step streaming student, the
    fine-tuned bidirectional model the teacher and the critic's start."""
    return WorldModelMatrixGame2(
        run=RunConfig(seed=0, steps=300, output_dir="runs/worldmodel_matrixgame2_sf", log_every=1),
        data=DataConfig(kind="matrixgame2", batch_size=8, world=WorldConfig(frames=4)),
        models={"student": MatrixGame2CausalConfig(preset="world", path=CAUSAL_STUDENT, num_frames_per_block=2),
                "teacher": MatrixGame2Config(preset="world", path=TEACHER)},
        vae=SpaceToDepth(),
        validation=ValidationConfig(every=100, num_prompts=8, num_steps=20, flow_shift=5.0, display_scale=4,
                                    latent_shape=WORLD_LATENTS),
        method=SelfForcing(
            denoising_steps=(1000,), flow_shift=5.0, chunk_size=2, student_sample_type="sde",
            generator_update_interval=2, optim=AdamWConfig(lr=3e-4, betas=(0.0, 0.999), max_grad_norm=1.0),
            critic_optim=AdamWConfig(lr=1e-3, betas=(0.0, 0.999), max_grad_norm=1.0), ema_decay=0.95,
            validate_teacher=True))


@recipe
def world_streaming_long() -> WorldModelMatrixGame2:
    """The last: streaming long tuning of the Self-Forcing student (``SF_STUDENT``) on 12-frame clips of keys (three times
    its training length), a window of 4 frames with 2 sink frames, chunks of 4 with 2 frames of overlap whose first
    is re-encoded; validation streams 12 frames and scores each window of 4."""
    return WorldModelMatrixGame2(
        run=RunConfig(seed=0, steps=300, output_dir="runs/worldmodel_matrixgame2_streaming", log_every=1),
        data=DataConfig(kind="matrixgame2", batch_size=8, world=WorldConfig(frames=12, score_window=4)),
        models={"student": MatrixGame2CausalConfig(preset="world", path=SF_STUDENT, num_frames_per_block=2,
                                                   local_attn_size=4, sink_size=2),
                "teacher": MatrixGame2Config(preset="world", path=TEACHER)},
        vae=SpaceToDepth(),
        validation=ValidationConfig(every=100, num_prompts=8, num_steps=20, flow_shift=5.0, display_scale=4,
                                    latent_shape=LONG_LATENTS),
        method=StreamingLong(
            denoising_steps=(1000,), flow_shift=5.0, chunk_size=2, student_sample_type="sde", latent_shape=LONG_LATENTS,
            streaming_chunk_size=4, streaming_fixed_overlap_latents=2, generator_update_interval=2,
            optim=AdamWConfig(lr=3e-4, betas=(0.0, 0.999), max_grad_norm=1.0),
            critic_optim=AdamWConfig(lr=1e-3, betas=(0.0, 0.999), max_grad_norm=1.0), ema_decay=0.99))


# ------------------------------------------------------------------------------------------------ FastVideo's values

ZELDA_DATA = "data/zeldam2-clean"
SOLARIS_DATA = "data/matrixgame2"
MG2_BASE = "models/Matrix-Game-2.0-Base-Diffusers"
ZELDA_BIDIRECTIONAL = "models/mg_bidirectional_zelda"
COMMON = dict(compute_dtype="bf16", remat=True)  # enable_gradient_checkpointing_type: full
CAUSAL = dict(num_frames_per_block=3, local_attn_size=6, sink_size=1)  # the YAMLs' dit_config and the causal default


def _data(path: str, frames: int, ranks: int = 8) -> DataConfig:
    """A Matrix-Game parquet of ``frames`` latent frames, ``ranks`` ranks of batch 1 (``batch_size`` is the global
    batch), no CFG dropout."""
    return DataConfig(path=path, kind="matrixgame2", batch_size=ranks, cfg_rate=0.0, num_latent_t=frames)


def _finetune(lr: float, betas: tuple[float, float], weight_decay: float) -> Finetune:
    return Finetune(optim=AdamWConfig(lr=lr, betas=betas, weight_decay=weight_decay, max_grad_norm=1.0,
                                      schedule="constant"), flow_shift=3.0)


@recipe
def zelda_finetune_i2v() -> WorldModelMatrixGame2:
    """zelda/finetune_i2v.yaml: the bidirectional model from Matrix-Game-2.0-Base, 8 ranks of batch 1, 9 latent frames
    (33 frames) of 480x832, seed 42; AdamW lr 2e-5, betas (0.9, 0.95), no weight decay, constant, clip 1; 60000
    steps, checkpoints every 5000 (the newest 3 kept); validation every 200 steps, 40 steps at the pipeline's shift 5,
    actions overlaid."""
    return WorldModelMatrixGame2(
        run=RunConfig(seed=42, steps=60000, output_dir="outputs/matrixgame_finetune/checkpoints/zelda_with_mg_init",
                      checkpoint=CheckpointConfig(every=5000, keep_latest=3)),
        data=_data(ZELDA_DATA, 9),
        models={"student": MatrixGame2Config(preset="matrix-game-2.0", path=MG2_BASE, **COMMON)},
        vae=WanVAEConfig(preset="wan2.1", path=MG2_BASE),
        validation=ValidationConfig(every=200, num_prompts=4, num_steps=40, flow_shift=5.0),
        method=_finetune(2e-5, (0.9, 0.95), 0.0))


@recipe
def solaris_finetune_i2v() -> WorldModelMatrixGame2:
    """solaris/finetune_i2v.yaml: the bidirectional model from Matrix-Game-2.0-Base on Solaris (Minecraft) data, one
    rank of batch 1, 21 latent frames (81 frames) of 448x832, seed 1000; AdamW lr 1e-6, betas (0.9, 0.999), weight
    decay 0.01, constant, clip 1; 1 step (FastVideo's smoke length), checkpoints every 100 (the newest 3);
    validation every 100 steps, 50 steps at shift 3."""
    return WorldModelMatrixGame2(
        run=RunConfig(seed=1000, steps=1, output_dir="outputs/matrixgame2_i2v_finetune",
                      checkpoint=CheckpointConfig(every=100, keep_latest=3)),
        data=_data(SOLARIS_DATA, 21, 1),
        models={"student": MatrixGame2Config(preset="matrix-game-2.0", path=MG2_BASE, **COMMON)},
        vae=WanVAEConfig(preset="wan2.1", path=MG2_BASE),
        validation=ValidationConfig(every=100, num_prompts=4, num_steps=50, flow_shift=3.0),
        method=_finetune(1e-6, (0.9, 0.999), 0.01))


def _dfsft(student: str, data: DataConfig, seed: int, steps: int, every: int, output_dir: str, lr: float,
           betas: tuple[float, float], weight_decay: float, causal: dict) -> WorldModelMatrixGame2:
    return WorldModelMatrixGame2(
        run=RunConfig(seed=seed, steps=steps, output_dir=output_dir, checkpoint=CheckpointConfig(every=every,
                                                                                                keep_latest=3)),
        data=data,
        models={"student": MatrixGame2CausalConfig(preset="matrix-game-2.0", path=student, **causal, **COMMON)},
        vae=WanVAEConfig(preset="wan2.1", path=MG2_BASE),
        validation=ValidationConfig(every=every if every < 200 else 200, num_prompts=4, num_steps=40, flow_shift=5.0),
        method=DFSFT(chunk_size=3, flow_shift=3.0, optim=AdamWConfig(
            lr=lr, betas=betas, weight_decay=weight_decay, max_grad_norm=1.0, schedule="constant")))


@recipe
def zelda_dfsft_causal_i2v() -> WorldModelMatrixGame2:
    """zelda/dfsft_causal_i2v.yaml: the causal model from mg_bidirectional_zelda, chunks of 3 latent frames, a window
    of 6 frames with 1 sink frame; the Zelda fine-tune's data (9 latent frames of 480x832, 8 ranks of 1, seed 42),
    optimizer (AdamW lr 2e-5, betas (0.9, 0.95), no decay, constant, clip 1) and length (60000 steps, checkpoints
    every 5000); validation every 200 steps, streamed over 40 steps (timesteps 1000, 975, ..., 25)."""
    return _dfsft(ZELDA_BIDIRECTIONAL, _data(ZELDA_DATA, 9), 42, 60000, 5000,
                  "outputs/matrixgame_finetune/checkpoints/zelda_causal_dfsft", 2e-5, (0.9, 0.95), 0.0, CAUSAL)


@recipe
def solaris_dfsft_causal_i2v() -> WorldModelMatrixGame2:
    """solaris/dfsft_causal_i2v.yaml: the causal model from Matrix-Game-2.0-Base (global attention: its YAML sets no
    window), chunks of 3 latent frames; 4 ranks of batch 1, 21 latent frames (81 frames) of 352x640, seed 1000; AdamW
    lr 2e-5, betas (0.9, 0.999), weight decay 1e-4, constant, clip 1; 1500 steps, checkpoints every 100 (the newest
    3); validation every 100 steps, 40 streamed steps."""
    return _dfsft(MG2_BASE, _data(SOLARIS_DATA, 21, 4), 1000, 1500, 100, "outputs/matrixgame2_causal_dfsft", 2e-5,
                  (0.9, 0.999), 1e-4, dict(num_frames_per_block=3))


def _roles(student: str, teacher: str, causal: dict) -> dict:
    return {"student": MatrixGame2CausalConfig(preset="matrix-game-2.0", path=student, **causal, **COMMON),
            "teacher": MatrixGame2Config(preset="matrix-game-2.0", path=teacher, **COMMON),
            "critic": MatrixGame2Config(preset="matrix-game-2.0", path=teacher, **COMMON)}


@recipe
def zelda_self_forcing_causal_i2v() -> WorldModelMatrixGame2:
    """zelda/self_forcing_causal_i2v.yaml: student mg_causal_zelda (window 6, 1 sink frame, blocks of 3), teacher and
    critic mg_bidirectional_zelda; simulate rollout over [1000, 750, 500, 250] warped on the shift-5 grid, chunks of
    3, SDE hops, one exit step shared by every block, no context noise, gradients from frame 0; the student updated
    every 5th step, unguided teacher; AdamW lr 3e-6 (student) and 3e-7 (critic), betas (0.9, 0.95), no decay,
    constant, clip 1; EMA 0.99 from step 200; 8 ranks of 1, 9 latent frames of 480x832, seed 1001; 1000 steps,
    checkpoints every 1000 (the newest 1); validation every 100 steps, the student's 4 steps streamed."""
    adamw = AdamWConfig(lr=3e-6, betas=(0.9, 0.95), weight_decay=0.0, max_grad_norm=1.0, schedule="constant")
    return WorldModelMatrixGame2(
        run=RunConfig(seed=1001, steps=1000, output_dir="outputs/zelda_causal_self_forcing",
                      checkpoint=CheckpointConfig(every=1000, keep_latest=1)),
        data=_data(ZELDA_DATA, 9),
        models=_roles("models/mg_causal_zelda", ZELDA_BIDIRECTIONAL, CAUSAL),
        vae=WanVAEConfig(preset="wan2.1", path=MG2_BASE),
        validation=ValidationConfig(every=100, num_prompts=4),
        method=SelfForcing(
            roles=SelfForcingRoles(student="student", critic="critic", teacher="teacher"),
            denoising_steps=(1000, 750, 500, 250), warp_denoising_step=True, flow_shift=5.0, chunk_size=3,
            student_sample_type="sde", same_step_across_blocks=True, context_noise=0.0, start_gradient_frame=0,
            generator_update_interval=5, guidance_scale=1.0, optim=adamw,
            critic_optim=msgspec.structs.replace(adamw, lr=3e-7), ema_decay=0.99, ema_start_step=200))


@recipe
def solaris_self_forcing_causal_i2v() -> WorldModelMatrixGame2:
    """solaris/self_forcing_causal_i2v.yaml: student Matrix-Game-2.0-Base-Distilled (blocks of 3, global attention),
    teacher and critic Matrix-Game-2.0-Base; simulate rollout over [1000, 750, 500, 250] unwarped, chunks of 3, SDE
    hops, an exit step per block, no context noise, gradients from frame 0; the student updated every 5th step,
    teacher guidance 4.5 (on the cond itself, module docstring); AdamW lr 1e-5 (student, weight decay 0.01) and 8e-6 (critic), betas (0, 0.999), constant,
    clip 1; EMA 0.99 from step 200; 4 ranks of 1, 21 latent frames of 352x640, seed 1000; 1 step (its smoke length),
    checkpoints every 1000 (the newest 3); validation every 50 steps."""
    adamw = AdamWConfig(lr=1e-5, betas=(0.0, 0.999), weight_decay=0.01, max_grad_norm=1.0, schedule="constant")
    return WorldModelMatrixGame2(
        run=RunConfig(seed=1000, steps=1, output_dir="outputs/matrixgame2_causal_self_forcing",
                      checkpoint=CheckpointConfig(every=1000, keep_latest=3)),
        data=_data(SOLARIS_DATA, 21, 4),
        models=_roles("models/Matrix-Game-2.0-Base-Distilled-Diffusers", MG2_BASE, dict(num_frames_per_block=3)),
        vae=WanVAEConfig(preset="wan2.1", path=MG2_BASE),
        validation=ValidationConfig(every=50, num_prompts=4),
        method=SelfForcing(
            roles=SelfForcingRoles(student="student", critic="critic", teacher="teacher"),
            denoising_steps=(1000, 750, 500, 250), flow_shift=5.0, chunk_size=3, student_sample_type="sde",
            context_noise=0.0, start_gradient_frame=0, generator_update_interval=5, guidance_scale=4.5,
            cfg_uncond="keep", optim=adamw,
            critic_optim=AdamWConfig(lr=8e-6, betas=(0.0, 0.999), weight_decay=0.01, max_grad_norm=1.0,
                                     schedule="constant"), ema_decay=0.99, ema_start_step=200))


@recipe
def zelda_streaming_long_tuning_causal_i2v() -> WorldModelMatrixGame2:
    """zelda/streaming_long_tuning_causal_i2v.yaml (the second run after ``zelda_self_forcing_causal_i2v``): student
    the 1k-step Self-Forcing export, teacher and critic mg_bidirectional_zelda; one streaming stage over steps [0,
    3000) of streams of 39 latent frames, chunks of 9 with a fixed overlap of 3 (6 new frames a step after the first
    9) whose first frame is re-encoded by the VAE (k 1), whole blocks required; rollout blocks of 3, [1000, 750, 500,
    250] warped on the shift-5 grid, SDE hops, one exit step shared by every block, no context noise, gradients from
    frame 0; score timesteps in [round(20), round(980)]; the student updated every 5th step, unguided teacher; AdamW
    lr 3e-6 (student) and 3e-7 (critic), betas (0.9, 0.95), no weight decay, constant, clip 1; EMA 0.99 from step
    200; 8 ranks of 1, 39 latent frames (153 frames) of 480x832, seed 1001; 3000 steps, checkpoints every 1000 (the
    newest 2 kept), validation every 100 steps."""
    adamw = AdamWConfig(lr=3e-6, betas=(0.9, 0.95), weight_decay=0.0, max_grad_norm=1.0, schedule="constant")
    stage = {"stage": "streaming_long", "start_step": 0, "end_step": 3000, "num_latent_t": 39,
             "streaming_training": True, "streaming_chunk_size": 9, "streaming_max_length": 39,
             "streaming_fixed_overlap_latents": 3}
    return WorldModelMatrixGame2(
        run=RunConfig(seed=1001, steps=3000, output_dir="outputs/zelda_causal_long_tuning",
                      checkpoint=CheckpointConfig(every=1000, keep_latest=2)),
        data=_data(ZELDA_DATA, 39),
        models=_roles("models/mg_sf_distilled_zelda_1k_steps", ZELDA_BIDIRECTIONAL, CAUSAL),
        vae=WanVAEConfig(preset="wan2.1", path=MG2_BASE, encoder=True),
        validation=ValidationConfig(every=100, num_prompts=4),
        method=StreamingLong(
            roles=SelfForcingRoles(student="student", critic="critic", teacher="teacher"),
            denoising_steps=(1000, 750, 500, 250), warp_denoising_step=True, flow_shift=5.0, chunk_size=3,
            student_sample_type="sde", same_step_across_blocks=True, context_noise=0.0, start_gradient_frame=0,
            generator_update_interval=5, guidance_scale=1.0, min_timestep_ratio=0.02, max_timestep_ratio=0.98,
            multi_phased_distill_schedule=[stage], streaming_chunk_size=9, streaming_max_length=39,
            streaming_fixed_overlap_latents=3, streaming_reencode_overlap_anchor=True, streaming_anchor_inject_k=1,
            streaming_require_full_blocks=True, latent_shape=(16, 39, 60, 104),
            optim=adamw, critic_optim=msgspec.structs.replace(adamw, lr=3e-7), ema_decay=0.99, ema_start_step=200))
