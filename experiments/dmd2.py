"""Distil a few-step Wan student with DMD2 (FastVideo's `distribution_matching/wan/dmd2_t2v.yaml`, as an fvx
experiment; its recipe's student samples in 4 steps).

The default distils the teacher that `experiments/finetune_wan.py` trains on fvx's toy video world (exported to
`runs/teacher`) into a one-step student (`method.denoising_steps=[1000]`), on a 2-core CPU in about a minute:
    python -m fvx.run experiments/finetune_wan.py && python -m fvx.run export runs/finetune_wan --out runs/teacher
    python -m fvx.run experiments/dmd2.py
The student starts as a copy of the teacher, whose own one-step samples are blurred bars; its validation videos sharpen
towards the prompted bars and motion (the README gives the figures measured at 1 and 2 threads; the teacher's many-step
samples, the target, are sampled once per launch: at step 0 of a fresh run). Roles are models: `method.roles` names the
model of `models` that plays each role (student and critic `student`, teacher `teacher`). FastVideo's recipe is the
recipe `wan21_t2v_1p3b` (Wan 2.1 T2V 1.3B in every role, 4 ranks of batch 1); point its paths at local folders:
    torchrun --nproc-per-node 4 -m fvx.run experiments/dmd2.py:wan21_t2v_1p3b \
        models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers models.teacher.path=/models/Wan2.1-T2V-1.3B-Diffusers \
        method.negative_prompt_path=/data/wan21_negative_prompt.safetensors data.path=/data/Wan-Syn_77x448x832_600k
The negative prompt is the UMT5 embedding of Wan's default negative prompt, stored once as a safetensors file (tensor
"text" [1, 512, 4096], optionally "text_mask" [1, 512]). A 14B teacher for a 1.3B student is
`models.teacher.preset=wan2.1-t2v-14b` with its own path.
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
from fvx_methods.dmd2 import DMD2, DMD2Roles
from fvx_models.lora import LoRAConfig
from fvx_models.wan import WanConfig
from fvx_models.wan_vae import WanVAEConfig


class DMD2Wan(Experiment):
    models: dict[str, WanConfig] = msgspec.field(
        default_factory=lambda: {"student": WanConfig(), "teacher": WanConfig(preset="tiny-deep")})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples; None logs latent previews
    method: DMD2 = DMD2()


TEACHER = "runs/teacher"  # experiments/finetune_wan.py's run, exported (module docstring)
# No FastVideo script writes Wan-Syn_77x448x832: its name's 77 frames (20 latent) of 448x832, at Wan's 16 fps
WAN_SYN = PreprocessConfig(num_frames=77, train_fps=16, max_height=448, max_width=832)
# examples/training/finetune/wan_t2v_1.3B/mixkit/preprocess_mixkit_data.sh (its tolerance: FastVideo's default, 2)
MIXKIT = PreprocessConfig(num_frames=77, train_fps=16, max_height=480, max_width=832, video_length_tolerance_range=2.0,
                          samples_per_file=8)

config = DMD2Wan(
    run=RunConfig(seed=0, steps=400, output_dir="runs/dmd2", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": WanConfig(preset="world", path=TEACHER), "teacher": WanConfig(preset="world", path=TEACHER)},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=100, num_prompts=8, num_steps=20, display_scale=4),
    method=DMD2(
        rollout_mode="simulate", denoising_steps=(1000,), generator_update_interval=5, guidance_scale=1.0,
        timestep_shift=3.0,
        optim=AdamWConfig(lr=1e-4, betas=(0.0, 0.999), max_grad_norm=1.0),
        critic_optim=AdamWConfig(lr=4e-4, betas=(0.0, 0.999), max_grad_norm=1.0),
        ema_decay=0.95, validate_teacher=True,
    ),
)


@recipe
def world_lora() -> DMD2Wan:
    """The default run with a LoRA student and a LoRA critic (r 16, alpha 32 on the attention projections) on one
    frozen base that is also the teacher: three roles, one copy of the weights in memory (``--dry-run`` shows it)."""
    adapters = LoRAConfig(rank=16, alpha=32.0, target_modules=("to_q", "to_k", "to_v", "to_out"))
    return msgspec.structs.replace(
        config, run=msgspec.structs.replace(config.run, output_dir="runs/dmd2_lora"),
        models={"student": WanConfig(preset="world", path=TEACHER, lora=adapters),
                "teacher": WanConfig(preset="world", path=TEACHER)},
        method=msgspec.structs.replace(config.method, optim=AdamWConfig(lr=1e-3, betas=(0.0, 0.999), max_grad_norm=1.0),
                                       critic_optim=AdamWConfig(lr=4e-3, betas=(0.0, 0.999), max_grad_norm=1.0)))


@recipe
def wan21_t2v_1p3b() -> DMD2Wan:
    """FastVideo's dmd2_t2v.yaml: Wan 2.1 T2V 1.3B as student, critic and (frozen, bf16) teacher; simulate rollout over
    [1000, 750, 500, 250], the student updated every 5th step, teacher guidance 4.5 (fvx's ``uncond + g (cond -
    uncond)``; the legacy ``w`` would say 3.5), score timesteps shifted by 8; AdamW lr 2e-6 (student) and 8e-6
    (critic), betas (0, 0.999), weight decay 0.01, constant, clip 1; EMA 0.98 from the start; global batch 4 (4 ranks
    of 1), 20 latent frames of 448x832; checkpoints every 20 steps, the newest 3 kept; validation every 50 steps, the
    student's 4 steps converting with the shift-8 grid's levels as FastVideo's DMD validation stage (``sampling_shift``;
    its rollout trains on the models' shift-3 grid). No FastVideo script writes Wan-Syn: ``data.preprocess`` cuts its
    77 frames of 448x832 at 16 fps. The negative prompt is FastVideo's default for Wan 2.1 T2V 1.3B
    (fastvideo/pipelines/basic/wan/presets.py:15):
        python -m fvx.run preprocess experiments/dmd2.py:wan21_t2v_1p3b --videos /data/my_clips \\
            --out /data/my_dataset models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers
        python -m fvx.run encode-prompts experiments/dmd2.py:wan21_t2v_1p3b experiments/prompts/wan21_negative.txt \\
            --out data/wan21_negative_prompt.safetensors models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers"""
    wan = WanConfig(preset="wan2.1-t2v-1.3b", path="models/Wan2.1-T2V-1.3B-Diffusers", compute_dtype="bf16",
                    remat=True, compile="blocks")
    adamw = AdamWConfig(lr=2e-6, betas=(0.0, 0.999), weight_decay=0.01, max_grad_norm=1.0, schedule="constant")
    return DMD2Wan(
        run=RunConfig(seed=1000, steps=4000, output_dir="outputs/wan2.1_dmd2_4steps",
                      checkpoint=CheckpointConfig(every=20, keep_latest=3)),
        data=DataConfig(path="data/Wan-Syn_77x448x832_600k", batch_size=4, text_len=512, cfg_rate=0.0,
                        num_latent_t=20, preprocess=WAN_SYN),
        models={"student": wan, "teacher": wan},
        validation=ValidationConfig(every=50, num_prompts=4),
        method=DMD2(rollout_mode="simulate", denoising_steps=(1000, 750, 500, 250), generator_update_interval=5,
                    guidance_scale=4.5, timestep_shift=8.0, flow_shift=3.0, cfg_uncond="negative_prompt",
                    negative_prompt_path="data/wan21_negative_prompt.safetensors", optim=adamw,
                    critic_optim=msgspec.structs.replace(adamw, lr=8e-6), ema_decay=0.98, ema_start_step=0,
                    sampling_shift=8.0),
    )


# scripts/preprocess/preprocess_train_text_only_dmd.sh's v1_preprocess arguments (text-only data uses samples_per_file;
# the clip geometry it passes is unused without videos)
TEXT_ONLY = PreprocessConfig(num_frames=77, train_fps=16, max_height=448, max_width=832, samples_per_file=8)
TEXT_ONLY_SHAPE = (16, 1, 56, 104)  # one frame of 448x832 through Wan 2.1's VAE (4x temporal, 8x spatial, 16 channels)


@recipe
def wan21_t2v_1p3b_text_only() -> DMD2Wan:
    """FastVideo's scripts/train/train_dmd2_t2v_text_only.sh over dmd2_t2v.yaml (``wan21_t2v_1p3b``'s values but
    these): text-only data (prompts, no videos: the student's samples start from noise, ``method.latent_shape`` one
    latent frame of 448x832, the script's NUM_FRAMES 1 and NUM_LATENT_T 1), 2 ranks of batch 1, the teacher's
    unconditional text zeroed (CFG_UNCOND_TEXT zero; its ON_MISSING ignore has no other channel to apply to on
    Wan), validation on the 16 captions of FastVideo's distribution_matching/wan/dmd2_text_only_validation.json (one
    frame), every 50 steps; output to outputs/wan2.1_dmd2_text_only. FastVideo runs it with FLASH_ATTN
    (``models.student.attention=flash models.teacher.attention=flash`` where flash-attn is installed; the same
    attention as the default SDPA); its W&B names (project distillation_wan_text_only, run wan2.1_dmd2_text_only:
    ``run.wandb.*``, needs wandb), dataloader workers (0) and validation offload/unload switches (memory policy of
    its pipeline-based validation) have no fvx knob. The prompts are cut as its preprocess_train_text_only_dmd.sh
    does (one a line, 512 tokens, 8 a file); the validation captions are encoded from FastVideo's JSON as it is:
        python -m fvx.run preprocess experiments/dmd2.py:wan21_t2v_1p3b_text_only --videos train.txt \\
            --out data/train_text_only_dmd_preprocessed models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers
        python -m fvx.run encode-prompts experiments/dmd2.py:wan21_t2v_1p3b_text_only \\
            /FastVideo/examples/train/configs/distribution_matching/wan/dmd2_text_only_validation.json \\
            --out data/dmd2_text_only_validation.safetensors models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers
        torchrun --nproc-per-node 2 -m fvx.run experiments/dmd2.py:wan21_t2v_1p3b_text_only \\
            models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers models.teacher.path=/models/Wan2.1-T2V-1.3B-Diffusers
    (``preprocess --videos`` and ``encode-prompts`` read a text file, one prompt a line, or such a JSON.)"""
    base = wan21_t2v_1p3b()
    return msgspec.structs.replace(
        base, run=msgspec.structs.replace(base.run, output_dir="outputs/wan2.1_dmd2_text_only"),
        data=DataConfig(path="data/train_text_only_dmd_preprocessed", kind="text_only", batch_size=2, text_len=512,
                        cfg_rate=0.0, num_latent_t=1, preprocess=TEXT_ONLY),
        validation=ValidationConfig(every=50, num_prompts=16, prompts_file="data/dmd2_text_only_validation.safetensors",
                                    latent_shape=TEXT_ONLY_SHAPE),
        method=msgspec.structs.replace(base.method, latent_shape=TEXT_ONLY_SHAPE, cfg_uncond="zero",
                                       negative_prompt_path=None))


@recipe
def world_attn_qad() -> DMD2Wan:
    """Stage 2 of FastVideo's QAD scenario on the toy world: DMD2 of the stage-1 student (``finetune_wan.py``'s
    ``world_attn_qat``, exported to ``runs/teacher_attn_qat``), which keeps its fake-quantized attention, from the
    data's latents against the full-precision toy teacher; the critic has a model entry of its own, dense (a model
    with ``attention=qat`` plays the student only). One step, not FastVideo's three ([1000, 757, 522]): the toy
    teacher's own 3-step samples are already as good as its 20-step ones (``nearest_mse`` 0.064 against 0.067), so
    only one step leaves distillation something to show, as in the default run."""
    return msgspec.structs.replace(
        config, run=msgspec.structs.replace(config.run, output_dir="runs/dmd2_attn_qad"),
        models={"student": WanConfig(preset="world", path="runs/teacher_attn_qat", attention="qat"),
                "critic": WanConfig(preset="world", path=TEACHER), "teacher": WanConfig(preset="world", path=TEACHER)},
        method=msgspec.structs.replace(config.method, roles=DMD2Roles(critic="critic"), rollout_mode="data_latent",
                                       min_timestep_ratio=0.02, max_timestep_ratio=0.98))


@recipe
def wan21_t2v_1p3b_attn_qad() -> DMD2Wan:
    """Stage 2 of FastVideo's QAD scenario (scenario/qad_wan2_1_mixkit/stage2_attn_qat_dmd.yaml): the stage-1 export
    (``finetune_wan.py:wan21_t2v_1p3b_attn_qat``) as the student, its attention still fake-quantized; a dense Wan 2.1
    1.3B teacher and critic (FastVideo runs them with FLASH_ATTN: ``models.teacher.attention=flash`` where flash-attn
    is installed, the same attention); rollout from the data's latents over [1000, 757, 522], the student updated
    every 5th step, score timesteps in [0.02, 0.98], guidance 3 (the legacy ``cond + 2 (cond - uncond)``); AdamW lr
    2e-6, betas (0.9, 0.999), weight decay 0.01, constant, clip 1, for both; 4 ranks of batch 1, 20 latent frames of
    480x832; 2000 steps, checkpoints every 500 (the newest 3); validation every 200 steps (the student's 3 steps).
    Data cut as FastVideo's mixkit/preprocess_mixkit_data.sh does (77 frames of 480x832 at 16 fps, 8 a file); the
    negative prompt is ``wan21_t2v_1p3b``'s (the same file, FastVideo's default for Wan 2.1 T2V 1.3B):
        python -m fvx.run preprocess experiments/dmd2.py:wan21_t2v_1p3b_attn_qad --videos /data/my_clips \\
            --out /data/my_dataset models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers
        python -m fvx.run encode-prompts experiments/dmd2.py:wan21_t2v_1p3b_attn_qad \\
            experiments/prompts/wan21_negative.txt --out data/wan21_negative_prompt.safetensors \\
            models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers
        torchrun --nproc-per-node 4 -m fvx.run experiments/dmd2.py:wan21_t2v_1p3b_attn_qad"""
    wan = WanConfig(preset="wan2.1-t2v-1.3b", path="models/Wan2.1-T2V-1.3B-Diffusers", compute_dtype="bf16",
                    remat=True)
    adamw = AdamWConfig(lr=2e-6, betas=(0.9, 0.999), weight_decay=0.01, max_grad_norm=1.0, schedule="constant")
    return DMD2Wan(
        run=RunConfig(seed=1000, steps=2000, output_dir="checkpoints/wan_t2v_distill_dmd_qat",
                      checkpoint=CheckpointConfig(every=500, keep_latest=3)),
        data=DataConfig(path="data/HD-Mixkit-Finetune-Wan/combined_parquet_dataset", batch_size=4, text_len=512,
                        cfg_rate=0.0, num_latent_t=20, preprocess=MIXKIT),
        models={"student": msgspec.structs.replace(wan, path="checkpoints/wan_t2v_qat_finetune/diffusers",
                                                   attention="qat"),
                "critic": wan, "teacher": wan},
        validation=ValidationConfig(every=200, num_prompts=4),
        method=DMD2(roles=DMD2Roles(critic="critic"), rollout_mode="data_latent", denoising_steps=(1000, 757, 522),
                    generator_update_interval=5, guidance_scale=3.0, min_timestep_ratio=0.02, max_timestep_ratio=0.98,
                    flow_shift=3.0, cfg_uncond="negative_prompt",
                    negative_prompt_path="data/wan21_negative_prompt.safetensors", optim=adamw, critic_optim=adamw),
    )
