"""Causal consistency distillation of a block-causal Wan (FastVideo's `consistency_model/wan/causal_cd_t2v.yaml`, as
an fvx experiment).

No ODE cache: a frozen teacher takes one guided Euler step between neighbouring levels of an N-level grid, and the
student learns to give, from the first level, the clean video its own EMA gives from the second, every forward
teacher-forced on the clean history (`fvx_methods.causal_cd`). As in FastVideo's recipe, student, teacher and EMA all
start from one checkpoint: by default the weights of the teacher that `experiments/finetune_wan.py` trains (exported
to `runs/teacher`, as in the README), as the toy world's causal Wan (`world` preset) in blocks of 4 latent frames, so
each 4-frame toy clip is one block: those weights start as they were trained, bidirectional within the block. (In
blocks of 2 they sample poorly at any number of steps, and causal CD distils a causal model, it does not make one:
FastVideo runs it on a teacher-forcing checkpoint. The tests run it on 1- and 2-frame blocks.) On a 2-core CPU in
about a minute, on FastVideo's grid (N 48 at shift 5), with a faster EMA than the recipe's (0.9 from the start) and
no guidance (the toy teacher never saw an empty prompt):
    python -m fvx.run experiments/causal_cd_t2v.py
Validation samples the student's EMA in one step, streamed on its KV cache: the weights start as a many-step model
whose one-step samples are a blur (`validation/student_ema/hit_rate` 0), and the distilled student's one-step samples
are sharp bars, a quarter of them true clips of their prompt.
FastVideo's recipe is the recipe `wan21_t2v_1p3b` (a causal Wan 2.1 T2V 1.3B as student, teacher and EMA from one
teacher-forcing checkpoint, 8 ranks of batch 1); point its paths at local folders (the YAML's checkpoint is the
teacher-forcing model, e.g. `experiments/tfsft_causal_t2v.py:wan21_t2v_1p3b` exported):
    torchrun --nproc-per-node 8 -m fvx.run experiments/causal_cd_t2v.py:wan21_t2v_1p3b \
        models.student.path=/models/causal_tf models.teacher.path=/models/causal_tf \
        method.negative_prompt_path=/data/wan21_negative_prompt.safetensors data.path=/data/Wan-Syn_77x448x832_600k
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
from fvx_methods.causal_cd import CausalCD, CausalCDRoles
from fvx_models.wan import WanConfig
from fvx_models.wan_causal import WanCausalConfig
from fvx_models.wan_vae import WanVAEConfig


class CausalCDWan(Experiment):
    models: dict[str, WanCausalConfig | WanConfig] = msgspec.field(
        default_factory=lambda: {"student": WanCausalConfig(), "teacher": WanCausalConfig()})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples; None logs latent previews
    method: CausalCD = CausalCD(guidance_scale=1.0)


TEACHER = "runs/teacher"  # experiments/finetune_wan.py's run, exported (module docstring)
# No FastVideo script writes Wan-Syn_77x448x832: the recipe's 18 latent frames (the YAML's 69 frames) of 448x832, at
# Wan's 16 fps (Wan-Syn's own 77-frame clips serve too: data.num_latent_t keeps the first 18)
WAN_SYN_18 = PreprocessConfig(num_frames=69, train_fps=16, max_height=448, max_width=832)

config = CausalCDWan(
    run=RunConfig(seed=0, steps=300, output_dir="runs/causal_cd_t2v", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": WanCausalConfig(preset="world", path=TEACHER, num_frames_per_block=4, frozen_dtype="fp32")},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=100, num_prompts=16, display_scale=4),
    method=CausalCD(roles=CausalCDRoles(student="student", teacher="student", ema="student"), discrete_steps=48,
                    guidance_scale=1.0, flow_shift=5.0, ema_decay=0.9, ema_start_step=0, sampling_steps=1,
                    optim=AdamWConfig(lr=1e-4, max_grad_norm=1.0)),
)


@recipe
def wan21_t2v_1p3b() -> CausalCDWan:
    """FastVideo's consistency_model/wan/causal_cd_t2v.yaml: a causal Wan 2.1 T2V 1.3B student (blocks of 3 latent
    frames, global attention, no sink, full remat) and its frozen teacher (bf16), both from the teacher-forcing
    checkpoint (the YAML's `init_from`, all three roles; the EMA starts from the student's own initial weights, the
    same checkpoint); grid of N 48 levels at pipeline.flow_shift 5, teacher guidance 3 (FastVideo's CD writes
    ``uncond + g (cond - uncond)`` as fvx does) against the negative prompt; EMA 0.99 blended from the initial
    weights after every update from iteration 200; AdamW lr 2e-6, betas (0.9, 0.999), weight decay 0.01, constant, no
    warmup, clip 1; global batch 8 (8 ranks of 1, no accumulation), seed 1000, 18 latent frames (69 frames) of
    448x832, no CFG dropout; 3000 steps, checkpoints every 1000 (the newest 3 kept); no validation (the YAML has no
    validation callback). The negative prompt is a cond file fvx reads (``method.negative_prompt_path``; FastVideo
    encodes its pipeline's default negative prompt at start). FastVideo also logs to W&B project distillation_wan_r
    (``run.wandb.project=distillation_wan_r run.wandb.name=wan2.1_causal_cd_shift5``, needs wandb); its 4 data workers
    have no fvx knob. No FastVideo script writes Wan-Syn: ``data.preprocess`` cuts 69 frames of 448x832 at 16 fps.
    The negative prompt is FastVideo's default for Wan 2.1 T2V (fastvideo/pipelines/basic/wan/presets.py:15):
        python -m fvx.run preprocess experiments/causal_cd_t2v.py:wan21_t2v_1p3b --videos /data/my_clips \\
            --out /data/my_dataset models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers
        python -m fvx.run encode-prompts experiments/causal_cd_t2v.py:wan21_t2v_1p3b \\
            experiments/prompts/wan21_negative.txt --out data/wan21_negative_prompt.safetensors \\
            models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers"""
    wan = WanCausalConfig(preset="wan2.1-t2v-1.3b", path="models/Wan2.1-T2V-1.3B-Diffusers", num_frames_per_block=3,
                          local_attn_size=-1, sink_size=0, compute_dtype="bf16")
    return CausalCDWan(
        run=RunConfig(seed=1000, steps=3000, output_dir="outputs/wan2.1_causal_cd",
                      checkpoint=CheckpointConfig(every=1000, keep_latest=3)),
        data=DataConfig(path="data/Wan-Syn_77x448x832_600k", batch_size=8, text_len=512, cfg_rate=0.0,
                        num_latent_t=18, preprocess=WAN_SYN_18),
        models={"student": msgspec.structs.replace(wan, remat=True), "teacher": wan},
        validation=ValidationConfig(every=0),
        method=CausalCD(roles=CausalCDRoles(student="student", teacher="teacher", ema="student"), discrete_steps=48,
                        guidance_scale=3.0, flow_shift=5.0, cfg_uncond="negative_prompt",
                        negative_prompt_path="data/wan21_negative_prompt.safetensors", ema_decay=0.99,
                        ema_start_step=200, ema_start="blend",
                        optim=AdamWConfig(lr=2e-6, betas=(0.9, 0.999), weight_decay=0.01, max_grad_norm=1.0,
                                          schedule="constant", warmup_steps=0)),
    )
