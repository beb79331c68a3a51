"""Distil a 4-step Wan student with DMD2 (FastVideo's `distribution_matching/wan/dmd2_t2v.yaml`, as an fvx experiment).

The default is a tiny Wan student and critic and a random tiny teacher of another size (`models.teacher`, preset
tiny-deep) on synthetic data: it runs on a 2-core CPU in about two minutes and shows the mechanics, not a useful
model.
    python -m fvx.run experiments/dmd2.py
Roles are models: `method.roles` names the model of `models` that plays each role (student and critic `student`,
teacher `teacher`). The real recipe is the same file with overrides: Wan 2.1 T2V 1.3B for all three roles, simulate rollout, steps
[1000, 750, 500, 250], student updated every 5th step, teacher guidance 4.5 (fvx's `uncond + g (cond - uncond)`; the
legacy `w` form would say 3.5), score timesteps shifted by 8, student AdamW lr 2e-6 and critic lr 8e-6, both with
betas (0, 0.999), weight decay 0.01 and a constant schedule, EMA 0.98 from the start; the frozen teacher
is stored in bf16 (`models.teacher.frozen_dtype`; fp32 where diffusers keeps fp32), half its fp32 bytes. A 14B
teacher for a 1.3B student is `models.teacher.preset=wan2.1-t2v-14b` with its own path. The negative prompt is the
UMT5 embedding of Wan's default negative prompt, stored once as a safetensors file (tensor "text" [1, 512, 4096],
optionally "text_mask" [1, 512]); FastVideo's recipe trains on 4 GPUs with batch 1 each:
    python -m fvx.run experiments/dmd2.py models.student.preset=wan2.1-t2v-1.3b \
        models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers models.student.compute_dtype=bf16 \
        models.student.remat=true models.teacher.preset=wan2.1-t2v-1.3b \
        models.teacher.path=/models/Wan2.1-T2V-1.3B-Diffusers models.teacher.compute_dtype=bf16 \
        method.rollout_mode=simulate method.denoising_steps=[1000,750,500,250] method.generator_update_interval=5 \
        method.guidance_scale=4.5 method.timestep_shift=8 method.flow_shift=3 \
        method.cfg_uncond=negative_prompt method.negative_prompt_path=/data/wan21_negative_prompt.safetensors \
        method.optim.lr=2e-6 method.optim.betas=[0,0.999] method.optim.weight_decay=0.01 method.optim.max_grad_norm=1 \
        method.critic_optim.lr=8e-6 method.critic_optim.betas=[0,0.999] method.critic_optim.weight_decay=0.01 \
        method.critic_optim.max_grad_norm=1 method.ema_decay=0.98 method.ema_start_step=0 \
        data.path=/data/Wan-Syn_77x448x832_600k/combined_parquet_dataset data.text_len=512 data.batch_size=4 \
        --steps 4000 --out runs/wan21_dmd2_4steps
"""
import msgspec

from fvx import random
from fvx.data import DataConfig, SyntheticConfig
from fvx.loop import Experiment, RunConfig
from fvx.optim_config import AdamWConfig
from fvx.validation import ValidationConfig
from fvx_methods.dmd2 import DMD2
from fvx_models.wan import WanConfig
from fvx_models.wan_vae import WanVAEConfig


class DMD2Wan(Experiment):
    models: dict[str, WanConfig] = msgspec.field(
        default_factory=lambda: {"student": WanConfig(), "teacher": WanConfig(preset="tiny-deep")})
    vae: WanVAEConfig | None = None  # decodes validation samples; None logs latent previews
    method: DMD2 = DMD2()

    def build_vae(self):
        return None if self.vae is None else self.vae.build(random.key(self.validation.seed))


config = DMD2Wan(
    run=RunConfig(seed=0, steps=700, output_dir="runs/dmd2", log_every=1),
    data=DataConfig(batch_size=4, synthetic=SyntheticConfig(num_samples=64, latent_shape=(16, 2, 16, 16),
                                                             text_len=8, text_dim=32)),
    models={"student": WanConfig(preset="tiny"), "teacher": WanConfig(preset="tiny-deep")},
    vae=WanVAEConfig(preset="tiny"),
    validation=ValidationConfig(every=100, num_prompts=2),
    method=DMD2(
        rollout_mode="simulate", denoising_steps=(1000, 750, 500, 250), generator_update_interval=5,
        guidance_scale=4.5, timestep_shift=8.0, cfg_uncond="zero",
        optim=AdamWConfig(lr=1e-4, betas=(0.0, 0.999), weight_decay=0.01, max_grad_norm=1.0),
        critic_optim=AdamWConfig(lr=4e-4, betas=(0.0, 0.999), weight_decay=0.01, max_grad_norm=1.0),
        ema_decay=0.98,
    ),
)
