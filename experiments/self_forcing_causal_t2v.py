"""Self-Forcing: distil a bidirectional teacher into a few-step block-causal student that generates a clip block by
block on its own outputs (FastVideo's `distribution_matching/wan/self_forcing_causal_t2v.yaml`, as an fvx experiment;
`fvx_methods.self_forcing`).

The default is the last step of FastVideo's ODE-init scenario (`scenario/ode_init_self_forcing_wan_causal`) on fvx's
toy world: the causal student that `experiments/kd_causal_t2v.py` distils from the toy teacher's ODE trajectories,
exported, is trained with Self-Forcing against the teacher (and a critic started from the teacher's weights) into a
one-step streaming student, in blocks of 2 latent frames, on a 2-core CPU in about a minute and a half. One step, as
in DMD2's toy default: the toy teacher's own 4-step samples are already about as good as its 20-step ones, so only
fewer steps show what distillation adds (`bench/self_forcing_toy.py`; FastVideo's 4 warped steps are
`method.denoising_steps=[1000,750,500,250] method.warp_denoising_step=true`, at shift 5 KD's t_list). From a fresh
clone, after the README's main command (which exports the teacher to `runs/teacher`):
    python -m fvx_methods.trajectory_cache experiments/kd_causal_t2v.py
    python -m fvx.run experiments/kd_causal_t2v.py
    python -m fvx.run export runs/kd_causal_t2v --out runs/kd_causal_student
    python -m fvx.run experiments/self_forcing_causal_t2v.py
Validation streams the student block by block on its KV cache; its one-step clips start as the KD student's blurred
bars and sharpen into the prompted ones (`validation/student_ema/hit_rate` rises towards the teacher's 20-step samples',
`validation/teacher/...`).

FastVideo's recipe is the recipe `wan21_t2v_1p3b` (a causal Wan 2.1 1.3B student from Self-Forcing's ODE-initialised
weights, a frozen 14B teacher, a 1.3B critic; 8 ranks of batch 1, 21 latent frames of 480x832 from text-only data);
point its paths at local folders, the student at the ODE-init export:
    torchrun --nproc-per-node 8 -m fvx.run experiments/self_forcing_causal_t2v.py:wan21_t2v_1p3b \
        models.student.path=/models/SFWan2.1-T2V-1.3B-ode-init models.teacher.path=/models/Wan2.1-T2V-14B-Diffusers \
        models.critic.path=/models/Wan2.1-T2V-1.3B-Diffusers data.path=/data/vidprom_16k_umt5_text_embed \
        method.negative_prompt_path=/data/sfwan21_negative_prompt.safetensors
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
from fvx_methods.self_forcing import SelfForcing, SelfForcingRoles
from fvx_models.attention.config import VSAConfig
from fvx_models.wan import WanConfig
from fvx_models.wan_causal import WanCausalConfig
from fvx_models.wan_vae import WanVAEConfig


class SelfForcingWanCausal(Experiment):
    models: dict[str, WanCausalConfig | WanConfig] = msgspec.field(
        default_factory=lambda: {"student": WanCausalConfig(), "teacher": WanConfig()})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples; None logs latent previews
    method: SelfForcing = SelfForcing()


TEACHER = "runs/teacher"  # experiments/finetune_wan.py's run, exported (the README's main command)
STUDENT = "runs/kd_causal_student"  # experiments/kd_causal_t2v.py's run, exported (module docstring)
# No FastVideo script writes Wan-Syn_77x448x832: its name's 77 frames (20 latent) of 448x832, at Wan's 16 fps
WAN_SYN = PreprocessConfig(num_frames=77, train_fps=16, max_height=448, max_width=832)
# FastVideo encodes the default negative prompt of its student's init_from, wlsaidhi/SFWan2.1-T2V-1.3B-Diffusers:
# preset sf_wan_t2v_1_3b, Wan's Chinese text (fastvideo/pipelines/basic/wan/presets.py:23,307)
NEGATIVE = "data/sfwan21_negative_prompt.safetensors"

config = SelfForcingWanCausal(
    run=RunConfig(seed=0, steps=400, output_dir="runs/self_forcing_causal_t2v", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": WanCausalConfig(preset="world", path=STUDENT, num_frames_per_block=2),
            "teacher": WanConfig(preset="world", path=TEACHER)},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=100, num_prompts=16, num_steps=20, display_scale=4),
    method=SelfForcing(
        denoising_steps=(1000,), flow_shift=5.0, chunk_size=2, student_sample_type="sde",
        generator_update_interval=2, guidance_scale=1.0,
        optim=AdamWConfig(lr=3e-4, betas=(0.0, 0.999), max_grad_norm=1.0),
        critic_optim=AdamWConfig(lr=1e-3, betas=(0.0, 0.999), max_grad_norm=1.0),
        ema_decay=0.95, validate_teacher=True,
    ),
)


def fastvideo_models() -> dict[str, WanCausalConfig | WanConfig]:
    """FastVideo's roles: a causal Wan 2.1 1.3B student in blocks of 3 latent frames (global attention), a frozen 14B
    teacher and a 1.3B critic, bf16 compute with full activation checkpointing."""
    common = dict(compute_dtype="bf16", remat=True)
    return {"student": WanCausalConfig(preset="wan2.1-t2v-1.3b", path="models/SFWan2.1-T2V-1.3B-ode-init",
                                       num_frames_per_block=3, **common),
            "teacher": WanConfig(preset="wan2.1-t2v-14b", path="models/Wan2.1-T2V-14B-Diffusers", **common),
            "critic": WanConfig(preset="wan2.1-t2v-1.3b", path="models/Wan2.1-T2V-1.3B-Diffusers", **common)}


@recipe
def wan21_t2v_1p3b() -> SelfForcingWanCausal:
    """FastVideo's self_forcing_causal_t2v.yaml: simulate rollout over [1000, 750, 500, 250] warped on the shift-5
    grid (``pipeline.flow_shift: 5``), chunks of 3 latent frames, SDE hops, one exit step shared by every block, no
    context noise, gradients from frame 0; the student updated every 5th step, teacher guidance 4.0 (fvx's ``uncond +
    g (cond - uncond)``, the YAML's note: Self-Forcing's ``cond + 3 (cond - uncond)``); AdamW lr 2e-6 (student) and
    4e-7 (critic), betas (0, 0.999), weight decay 0.01, constant, clip 1; EMA 0.99 from step 200; global batch 8 (8
    ranks of 1), 21 latent frames of 480x832; 4000 steps, checkpoints every 1000 (the newest 3 kept), validation every
    50 steps (the student's 4 steps, streamed). Its data is FastVideo's text-only parquet (fvx's ``preprocess`` makes
    none); the negative prompt is FastVideo's default for its SFWan init_from (``NEGATIVE``):
        python -m fvx.run encode-prompts experiments/self_forcing_causal_t2v.py:wan21_t2v_1p3b \\
            experiments/prompts/sfwan21_negative.txt --out data/sfwan21_negative_prompt.safetensors \\
            models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers"""
    adamw = AdamWConfig(lr=2e-6, betas=(0.0, 0.999), weight_decay=0.01, max_grad_norm=1.0, schedule="constant")
    return SelfForcingWanCausal(
        run=RunConfig(seed=1000, steps=4000, output_dir="outputs/wan2.1_causal_self_forcing",
                      checkpoint=CheckpointConfig(every=1000, keep_latest=3)),
        data=DataConfig(path="data/vidprom_16k_umt5_text_embed", kind="text_only", batch_size=8, text_len=512,
                        cfg_rate=0.0),
        models=fastvideo_models(),
        validation=ValidationConfig(every=50, num_prompts=4),
        method=SelfForcing(
            roles=SelfForcingRoles(student="student", critic="critic", teacher="teacher"),
            denoising_steps=(1000, 750, 500, 250), warp_denoising_step=True, flow_shift=5.0, chunk_size=3,
            student_sample_type="sde", same_step_across_blocks=True, context_noise=0.0, start_gradient_frame=0,
            generator_update_interval=5, guidance_scale=4.0, cfg_uncond="negative_prompt",
            negative_prompt_path=NEGATIVE, latent_shape=(16, 21, 60, 104),
            optim=adamw, critic_optim=msgspec.structs.replace(adamw, lr=4e-7), ema_decay=0.99, ema_start_step=200),
    )



@recipe
def wan21_t2v_1p3b_vsa() -> SelfForcingWanCausal:
    """FastVideo's self_forcing_causal_t2v_vsa.yaml: ``wan21_t2v_1p3b``'s roles on the Wan-Syn 77x448x832 latents (8
    ranks of batch 1, 20 latent frames), rollout over [1000, 750, 500, 250] unwarped, chunks of 3, SDE hops, an exit
    step per block, teacher guidance 4.5; AdamW lr 1e-5 (student) and 8e-6 (critic), betas (0, 0.999), constant, clip
    1; no EMA; checkpoints every 1000 (the newest 3), validation every 50 steps. Its ``vsa.sparsity: 0.9`` selects
    FastVideo's VSA backend for every role: the causal student's attention takes flash or SDPA only and runs dense
    (docs/design.md), so here too; the critic runs VSA in the dense view FastVideo gives it, its gates trained from
    zero (``vsa.sparsity`` 0.9 and the YAML's unused decay 0.03 per step recorded on it); the 14B teacher's zero gates
    make its dense view plain attention, which it runs. No FastVideo script writes Wan-Syn: ``data.preprocess`` cuts
    its 77 frames of 448x832 at 16 fps; the negative prompt is ``wan21_t2v_1p3b``'s (the same file):
        python -m fvx.run preprocess experiments/self_forcing_causal_t2v.py:wan21_t2v_1p3b_vsa \\
            --videos /data/my_clips --out /data/my_dataset models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers"""
    base = wan21_t2v_1p3b()
    adamw = AdamWConfig(lr=1e-5, betas=(0.0, 0.999), weight_decay=0.01, max_grad_norm=1.0, schedule="constant")
    models = fastvideo_models()
    models["critic"] = msgspec.structs.replace(models["critic"], attention="vsa",
                                               vsa=VSAConfig(sparsity=0.9, decay_rate=0.03, decay_interval_steps=1))
    return msgspec.structs.replace(
        base, run=msgspec.structs.replace(base.run, output_dir="outputs/wan2.1_causal_self_forcing_vsa_0.9"),
        data=DataConfig(path="data/Wan-Syn_77x448x832_600k", batch_size=8, text_len=512, cfg_rate=0.0,
                        num_latent_t=20, preprocess=WAN_SYN),
        models=models,
        method=msgspec.structs.replace(
            base.method, warp_denoising_step=False, same_step_across_blocks=False, guidance_scale=4.5,
            latent_shape=None, optim=adamw, critic_optim=msgspec.structs.replace(adamw, lr=8e-6), ema_decay=None,
            ema_start_step=0))
