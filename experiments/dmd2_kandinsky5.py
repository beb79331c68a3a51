"""Distil a few-step Kandinsky 5.0 student with DMD2 while it keeps fake-quantized attention (FastVideo's
`distribution_matching/kandinsky5/dmd2_t2v_480p_qat.yaml`: stage 2 of its Attn-QAT scenario, after the stage-1 QAT
fine-tune `experiments/finetune_kandinsky5.py:kandinsky5_t2v_480p_qat`).

Roles are models, as in `experiments/dmd2.py`: the student plays with ``attention=qat`` (NVFP4 fake-quantized
attention, FastVideo's FASTVIDEO_ATTENTION_BACKEND=ATTN_QAT_TRAIN); the critic has a model entry of its own, dense
(``method.roles.critic``: a model with ``attention=qat`` plays the student only), and so has the frozen teacher. All
three start from the stage-1 export, as FastVideo's distill_dmd_qat.sh passes one export to every init_from (its
loader masks the teacher's and critic's quantized attention back to dense).

The default is the same scenario on the tiny preset and stage 1's synthetic latents (fvx has no toy-world Kandinsky 5
preset), 200 steps in about 20 s on a quiet 2-core CPU. Stage 1 is `finetune_kandinsky5.py`'s default with
fake-quantized attention (under a minute), exported:
    python -m fvx.run experiments/finetune_kandinsky5.py models.student.attention=qat --out runs/finetune_kandinsky5_qat
    python -m fvx.run export runs/finetune_kandinsky5_qat --out runs/kandinsky5_qat
    python -m fvx.run experiments/dmd2_kandinsky5.py
The student samples in one step (``method.denoising_steps=[1000]``): it starts as the stage-1 model's x0 prediction
from pure noise, a blur towards the data's mean, narrower than the teacher's 20-step samples (``validation/teacher``,
sampled at step 0). DMD2 widens the student's samples to the teacher's spread: ``validation/student_ema/latent_std``
rises from 0.43 to 0.53 over the 200 steps and ``latent_mean_abs`` from 0.34 to 0.42, the teacher's samples' being
0.52 and 0.41 (measured: 17.7 s for the 200 steps).
FastVideo's recipe is the recipe `kandinsky5_t2v_480p_dmd2_qat` (8 ranks of batch 1); point its paths at local folders:
    torchrun --nproc-per-node 8 -m fvx.run experiments/dmd2_kandinsky5.py:kandinsky5_t2v_480p_dmd2_qat \
        models.student.path=/runs/k5_qat_export models.critic.path=/runs/k5_qat_export \
        models.teacher.path=/runs/k5_qat_export data.path=/data/kandinsky5_overfit_preprocessed
"""
import msgspec

from fvx.config import recipe
from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig, SyntheticConfig
from fvx.data.preprocess import PreprocessConfig
from fvx.storage.checkpoint_config import CheckpointConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.dmd2 import DMD2, DMD2Roles
from fvx_models.kandinsky5 import FLOW_SHIFT, Kandinsky5Config


class DMD2Kandinsky5(Experiment):
    models: dict[str, Kandinsky5Config] = msgspec.field(
        default_factory=lambda: {"student": Kandinsky5Config(attention="qat"), "critic": Kandinsky5Config(),
                                 "teacher": Kandinsky5Config()})
    method: DMD2 = DMD2(roles=DMD2Roles(critic="critic"))


STAGE1 = "runs/kandinsky5_qat"  # finetune_kandinsky5.py's default with attention=qat, exported (module docstring)
# finetune_kandinsky5.py's default data: the same seed and synthetic set, so the texts are the ones stage 1 learned
SYNTHETIC = SyntheticConfig(num_samples=64, latent_shape=(16, 2, 16, 16), text_len=9, text_dim=32)

config = DMD2Kandinsky5(
    run=RunConfig(seed=0, steps=200, output_dir="runs/dmd2_kandinsky5", log_every=1),
    data=DataConfig(batch_size=4, text_len=9, synthetic=SYNTHETIC),
    models={"student": Kandinsky5Config(path=STAGE1, attention="qat"), "critic": Kandinsky5Config(path=STAGE1),
            "teacher": Kandinsky5Config(path=STAGE1)},
    validation=ValidationConfig(every=50, num_prompts=4, num_steps=20, flow_shift=FLOW_SHIFT),
    method=DMD2(
        roles=DMD2Roles(critic="critic"), rollout_mode="simulate", denoising_steps=(1000,),
        generator_update_interval=5, guidance_scale=1.0, timestep_shift=FLOW_SHIFT, flow_shift=FLOW_SHIFT,
        optim=AdamWConfig(lr=5e-4, betas=(0.0, 0.999), max_grad_norm=1.0),
        critic_optim=AdamWConfig(lr=1e-3, betas=(0.0, 0.999), max_grad_norm=1.0),
        ema_decay=0.95, validate_teacher=True,
    ),
)

# fastvideo/pipelines/preprocess/preprocess_kandinsky5_overfit.py's cut, as finetune_kandinsky5.py's recipe
KANDINSKY5_480P = PreprocessConfig(num_frames=121, train_fps=24, max_height=512, max_width=768)


@recipe
def kandinsky5_t2v_480p_dmd2_qat() -> DMD2Kandinsky5:
    """FastVideo's dmd2_t2v_480p_qat.yaml (launched by distill_dmd_qat.sh): Kandinsky 5.0 T2V Lite as student,
    critic and frozen teacher, all three from the stage-1 export (``finetune_kandinsky5.py:kandinsky5_t2v_480p_qat``);
    the student's attention fake-quantized (``attention=qat``), the teacher and critic dense; bf16, full remat;
    simulate rollout over [1000, 750, 500, 250], the student updated every 5th step, teacher guidance 4.5 (fvx's
    ``uncond + g (cond - uncond)``) against the negative prompt (Kandinsky5Model's default uncond), score timesteps
    and the models' grid at shift 5 (its ``pipeline.flow_shift``, Kandinsky5Model's ``flow_shift``); AdamW lr 2e-6
    (student) and 8e-6 (critic), betas (0, 0.999), weight decay 0.01, constant, no warmup, clip 1; EMA 0.98 from the
    start; global batch 8 (8 ranks of 1), seed 1000, no CFG dropout, 31 latent frames of 512x768 (121 frames);
    4000 steps, checkpoints every 20 (the newest 3); validation every 50 steps, the student's (EMA's) 4 steps at
    [1000, 750, 500, 250], converting with the shift-5 grid's levels as Kandinsky5DmdDenoisingStage does (its
    scheduler at the pipeline's shift, fastvideo/pipelines/stages/kandinsky5.py:541: ``sampling_shift`` None).
    Carried but unused by the student's sampling: guidance 6.0 (the DMD stage samples without CFG; it is the
    teacher's, ``method.validate_teacher=true``). Not carried: ``disable_custom_init_weights`` (fvx never re-inits
    loaded weights), the W&B names (project distillation_kandinsky5, run kandinsky5_t2v_dmd2_4steps_qat:
    ``run.wandb.*``, needs wandb), 4 data workers, hsdp_shard_dim 8 (fvx shards over the ranks by default). Its
    validation prompts, validation_prompts.json in the data folder, are the dataset's captions in order: fvx
    validates the first ``validation.num_prompts`` of the dataset (4 here; set it to the dataset's size for every
    caption, or ``encode-prompts`` the JSON into ``validation.prompts_file``). Data and negative prompt file are
    stage 1's (its docstring makes them). Export stage 1 (fvx's run folder, as FastVideo converts its checkpoint-1000
    with dcp_to_diffusers) and run:
        python -m fvx.run export outputs/kandinsky5_t2v_qat_finetune --step 1000 \\
            --out outputs/kandinsky5_t2v_qat_finetune/checkpoint-1000-diffusers
        torchrun --nproc-per-node 8 -m fvx.run experiments/dmd2_kandinsky5.py:kandinsky5_t2v_480p_dmd2_qat"""
    stage1 = Kandinsky5Config(preset="kandinsky5-t2v-lite",
                              path="outputs/kandinsky5_t2v_qat_finetune/checkpoint-1000-diffusers",
                              compute_dtype="bf16", remat=True)
    adamw = AdamWConfig(lr=2e-6, betas=(0.0, 0.999), weight_decay=0.01, max_grad_norm=1.0, schedule="constant",
                        warmup_steps=0)
    negative = "data/kandinsky5_negative_prompt.safetensors"
    return DMD2Kandinsky5(
        run=RunConfig(seed=1000, steps=4000, output_dir="outputs/kandinsky5_t2v_dmd2_4steps_qat",
                      checkpoint=CheckpointConfig(every=20, keep_latest=3)),
        data=DataConfig(path="data/kandinsky5_overfit_preprocessed", batch_size=8, text_len=513, cfg_rate=0.0,
                        num_latent_t=31, preprocess=KANDINSKY5_480P),
        models={"student": msgspec.structs.replace(stage1, attention="qat"), "critic": stage1, "teacher": stage1},
        validation=ValidationConfig(every=50, num_prompts=4, flow_shift=FLOW_SHIFT, guidance_scale=6.0,
                                    cfg_uncond="negative_prompt", negative_prompt_path=negative),
        method=DMD2(roles=DMD2Roles(critic="critic"), rollout_mode="simulate", denoising_steps=(1000, 750, 500, 250),
                    generator_update_interval=5, guidance_scale=4.5, timestep_shift=FLOW_SHIFT, flow_shift=FLOW_SHIFT,
                    cfg_uncond="negative_prompt", negative_prompt_path=negative, optim=adamw,
                    critic_optim=msgspec.structs.replace(adamw, lr=8e-6), ema_decay=0.98, ema_start_step=0),
    )
