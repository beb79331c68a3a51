"""Distil a flow map on its own samples: AnyFlow's stage 2 (FastVideo's
`distribution_matching/wan/anyflow_onpolicy_t2v.yaml`, as an fvx experiment): DMD2 with a two-time student that jumps
between the levels of its schedule, `x_r = x_t - ((t - r) / 1000) u(x_t, t, r)`.

The default starts the student from the toy world's teacher (`runs/teacher`, made by the README's main command) with
the r input added (`models.student.r_embedder`), the teacher and the critic from the same folder, and distils it
into a 2-jump student:
    python -m fvx.run experiments/finetune_wan.py && python -m fvx.run export runs/finetune_wan --out runs/teacher
    python -m fvx.run experiments/anyflow.py
Its validation videos are the student's 2-jump samples (`validation/student_ema/nearest_mse`), the teacher's
many-step ones logged once at step 0 as the target. Starting from an AnyFlow pretraining export
(`experiments/anyflow_pretrain.py`) is `models.student.path=runs/anyflow_student` (a folder that holds the r input's
weights loads them); from NVIDIA's released AnyFlow checkpoint (diffusers' `AnyFlowTransformer3DModel`):
`models.student=anyflow models.student.preset=anyflow-wan2.1-t2v-1.3b` and its folder as `models.student.path`.
FastVideo's recipe is the recipe `wan21_t2v_1p3b` (8 ranks of batch 1); its command:
    torchrun --nproc-per-node 8 -m fvx.run experiments/anyflow.py:wan21_t2v_1p3b \
        models.student.path=/models/anyflow_pretrained models.teacher.path=/models/Wan2.1-T2V-1.3B-Diffusers \
        method.negative_prompt_path=/data/wan21_negative_prompt.safetensors data.path=/data/preprocessed
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
from fvx_methods.anyflow import AnyFlow
from fvx_methods.dmd2 import DMD2Roles
from fvx_models.anyflow import AnyFlowConfig
from fvx_models.wan import WanConfig
from fvx_models.wan_two_time import REmbedder
from fvx_models.wan_vae import WanVAEConfig


class AnyFlowWan(Experiment):
    models: dict[str, WanConfig | AnyFlowConfig] = msgspec.field(
        default_factory=lambda: {"student": WanConfig(r_embedder=REmbedder()), "teacher": WanConfig(),
                                 "critic": WanConfig()})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples; None logs latent previews
    method: AnyFlow = AnyFlow()


TEACHER = "runs/teacher"  # experiments/finetune_wan.py's run, exported (module docstring)
ROLES = DMD2Roles(student="student", critic="critic", teacher="teacher")

config = AnyFlowWan(
    run=RunConfig(seed=0, steps=400, output_dir="runs/anyflow", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": WanConfig(preset="world", path=TEACHER, r_embedder=REmbedder()),
            "teacher": WanConfig(preset="world", path=TEACHER), "critic": WanConfig(preset="world", path=TEACHER)},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=100, num_prompts=8, num_steps=20, display_scale=4),
    method=AnyFlow(
        roles=ROLES, denoising_steps=(1000, 500), student_sample_steps=2, generator_update_interval=5,
        guidance_scale=1.0, timestep_shift=3.0,
        optim=AdamWConfig(lr=1e-4, betas=(0.0, 0.999), max_grad_norm=1.0),
        critic_optim=AdamWConfig(lr=4e-4, betas=(0.0, 0.999), max_grad_norm=1.0),
        ema_decay=0.95, validate_teacher=True,
    ),
)


@recipe
def wan21_t2v_1p3b() -> AnyFlowWan:
    """FastVideo's anyflow_onpolicy_t2v.yaml: the AnyFlow-pretrained Wan 2.1 T2V 1.3B student (gated r embedder,
    gate 0.25, delta r), a frozen bf16 Wan 2.1 T2V 14B teacher and a Wan 2.1 T2V 1.3B critic; jumps over
    [999, 937, 833, 624, 0] with the mean velocity (r the next level), the student updated every 5th step, teacher
    guidance 3.0 on the negative prompt, score timesteps shifted by 5 (``pipeline.flow_shift``); AdamW lr 2e-6
    (student) and 8e-6 (critic), betas (0, 0.999), weight decay 0.01, constant, clip 1; global batch 8 (8 ranks of
    1), 21 latent frames of 480x832, remat; 4000 steps, checkpoints every 500 (the newest 3 kept), no validation (the
    YAML has none). Its ``attn_kind: vsa`` waits for the attention issue; ``dmd_score_r_value`` is unused there. No
    FastVideo script writes its data: ``data.preprocess`` cuts the YAML's 81 frames (21 latent) of 480x832 at Wan's
    16 fps. The negative prompt is FastVideo's default for Wan 2.1 T2V (fastvideo/pipelines/basic/wan/presets.py:15):
        python -m fvx.run preprocess experiments/anyflow.py:wan21_t2v_1p3b --videos /data/my_clips \\
            --out /data/my_dataset models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers
        python -m fvx.run encode-prompts experiments/anyflow.py:wan21_t2v_1p3b experiments/prompts/wan21_negative.txt \\
            --out data/wan21_negative_prompt.safetensors models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers"""
    wan = dict(compute_dtype="bf16", remat=True)
    adamw = AdamWConfig(lr=2e-6, betas=(0.0, 0.999), weight_decay=0.01, max_grad_norm=1.0, schedule="constant")
    return AnyFlowWan(
        run=RunConfig(seed=1000, steps=4000, output_dir="outputs/wan2.1_anyflow_onpolicy",
                      checkpoint=CheckpointConfig(every=500, keep_latest=3)),
        data=DataConfig(path="data/preprocessed", batch_size=8, text_len=512, cfg_rate=0.0, num_latent_t=21,
                        preprocess=PreprocessConfig(num_frames=81, train_fps=16, max_height=480, max_width=832)),
        models={"student": WanConfig(preset="wan2.1-t2v-1.3b", path="models/anyflow_pretrained",
                                     r_embedder=REmbedder(fusion="gated", gate=0.25, delta="r"), **wan),
                "teacher": WanConfig(preset="wan2.1-t2v-14b", path="models/Wan2.1-T2V-14B-Diffusers", **wan),
                "critic": WanConfig(preset="wan2.1-t2v-1.3b", path="models/Wan2.1-T2V-1.3B-Diffusers", **wan)},
        validation=ValidationConfig(every=0),
        method=AnyFlow(
            roles=ROLES, rollout_mode="simulate", denoising_steps=(999, 937, 833, 624), warp_denoising_step=False,
            student_sample_steps=4, use_mean_velocity=True, t_list_override=(999.0, 937.0, 833.0, 624.0, 0.0),
            generator_update_interval=5, guidance_scale=3.0, timestep_shift=5.0, flow_shift=3.0,
            cfg_uncond="negative_prompt", negative_prompt_path="data/wan21_negative_prompt.safetensors",
            optim=adamw, critic_optim=msgspec.structs.replace(adamw, lr=8e-6)),
    )
