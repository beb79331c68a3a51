"""Distil a few-step block-causal Wan student from a bidirectional teacher's ODE trajectories (FastVideo's
`knowledge_distillation/wan/causal_t2v.yaml`, as an fvx experiment: the ODE initialisation of Self-Forcing).

As `experiments/kd_t2v.py`, two commands: the first caches the teacher's trajectories (resumable), the second trains
the causal student on them, every block of latent frames at its own t_list time (`fvx_methods.kd`, `kd_causal`).
The default starts the toy world's causal Wan (`world` preset, blocks of 2 latent frames: 2 blocks per clip) from
the weights of the bidirectional teacher that `experiments/finetune_wan.py` trains (exported to `runs/teacher`, as
in the README), on a 2-core CPU in a minute or two:
    python -m fvx_methods.trajectory_cache experiments/kd_causal_t2v.py
    python -m fvx.run experiments/kd_causal_t2v.py
Validation samples the student as it runs, block by block on its KV cache, on t_list [999, 937, 833, 624, 0]
(4 steps per block): made causal, the teacher's weights sample poorly at first, and `validation/student/nearest_mse`,
`hit_rate` and `prompt_match` show the student learning to make and continue the teacher's clips block by block.
The teacher is the bidirectional Wan (`WanConfig`), the student its block-causal form (`WanCausalConfig`, the same
weights). FastVideo's recipe is the recipe
`wan21_t2v_1p3b` (a causal Wan 2.1 T2V 1.3B student in blocks of 3 latent frames from Self-Forcing's causal 1.3B
weights, a 14B teacher, 8 ranks of batch 2); point its paths at local folders, the same in both commands:
    python -m fvx_methods.trajectory_cache experiments/kd_causal_t2v.py:wan21_t2v_1p3b \
        models.teacher.path=/models/Wan2.1-T2V-14B-Diffusers data.path=/data/Wan-Syn_77x448x832_600k
    torchrun --nproc-per-node 8 -m fvx.run experiments/kd_causal_t2v.py:wan21_t2v_1p3b \
        models.student.path=/models/SFWan2.1-T2V-1.3B-Diffusers models.teacher.path=/models/Wan2.1-T2V-14B-Diffusers \
        data.path=/data/Wan-Syn_77x448x832_600k
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
from fvx_methods.kd import KDCausal
from fvx_models.wan import WanConfig
from fvx_models.wan_causal import WanCausalConfig
from fvx_models.wan_vae import WanVAEConfig

T_LIST = (999, 937, 833, 624, 0)  # FastVideo's


class KDWanCausal(Experiment):
    models: dict[str, WanCausalConfig | WanConfig] = msgspec.field(
        default_factory=lambda: {"student": WanCausalConfig(), "teacher": WanConfig()})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples; None logs latent previews
    method: KDCausal = KDCausal(t_list=T_LIST, cache="runs/kd_causal_t2v_cache")


TEACHER = "runs/teacher"  # experiments/finetune_wan.py's run, exported (module docstring)
# No FastVideo script writes Wan-Syn_77x448x832: the recipe's 18 latent frames (the YAML's 69 frames) of 448x832, at
# Wan's 16 fps (Wan-Syn's own 77-frame clips serve too: data.num_latent_t keeps the first 18)
WAN_SYN_18 = PreprocessConfig(num_frames=69, train_fps=16, max_height=448, max_width=832)

config = KDWanCausal(
    run=RunConfig(seed=0, steps=300, output_dir="runs/kd_causal_t2v", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": WanCausalConfig(preset="world", path=TEACHER, num_frames_per_block=2),
            "teacher": WanConfig(preset="world", path=TEACHER)},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=100, num_prompts=8, display_scale=4),
    method=KDCausal(t_list=T_LIST, cache="runs/kd_causal_t2v_cache", num_frames_per_block=2, teacher_steps=48,
                    flow_shift=3.0, optim=AdamWConfig(lr=1e-4, max_grad_norm=1.0)),
)


@recipe
def wan21_t2v_1p3b() -> KDWanCausal:
    """FastVideo's knowledge_distillation/wan/causal_t2v.yaml: a causal Wan 2.1 T2V 1.3B student (blocks of 3 latent
    frames, global attention, no sink, full remat) starting from Self-Forcing's causal weights
    (wlsaidhi/SFWan2.1-T2V-1.3B-Diffusers), distilled from the Wan 2.1 T2V 14B teacher's 48-step ODE trajectories
    (frozen, bf16; only the cache command loads it) on the grid shifted by pipeline.flow_shift 5, t_list [999, 937,
    833, 624, 0], one index per block; AdamW lr 7e-5, betas (0.9, 0.999), weight decay 0.0, constant, no warmup,
    clip 1; global batch 16 (train_batch_size 2 on each of 8 ranks, no accumulation), seed 1000, 448x832, no CFG
    dropout; 10000 steps, checkpoints every 1000 (the newest 3 kept); no validation (the YAML has none). Teacher
    guidance 1: the YAML's 3.5 is parsed but never applied by FastVideo. One departure: FastVideo's 20 latent
    frames are 6 blocks of 3 and a short last block of 2, which fvx refuses (docs/design.md, block-causal Wan), so
    the recipe trains on the first 18 (6 whole blocks); its cache is therefore its own (FastVideo shares the t2v
    recipe's 20-frame cache). FastVideo also logs to W&B project kd-wan (``run.wandb.project=kd-wan
    run.wandb.name=wan2.1_causal_kd_ode_init``, needs wandb); its 4 data workers have no fvx knob. No FastVideo script
    writes Wan-Syn: ``data.preprocess`` cuts the recipe's 69 frames (18 latent) of 448x832 at 16 fps:
        python -m fvx.run preprocess experiments/kd_causal_t2v.py:wan21_t2v_1p3b --videos /data/my_clips \\
            --out /data/my_dataset models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers"""
    return KDWanCausal(
        run=RunConfig(seed=1000, steps=10000, output_dir="outputs/wan2.1_causal_kd_ode_init",
                      checkpoint=CheckpointConfig(every=1000, keep_latest=3)),
        data=DataConfig(path="data/Wan-Syn_77x448x832_600k", batch_size=16, text_len=512, cfg_rate=0.0,
                        num_latent_t=18, preprocess=WAN_SYN_18),
        models={"student": WanCausalConfig(preset="wan2.1-t2v-1.3b", path="models/SFWan2.1-T2V-1.3B-Diffusers",
                                           num_frames_per_block=3, compute_dtype="bf16", remat=True),
                "teacher": WanConfig(preset="wan2.1-t2v-14b", path="models/Wan2.1-T2V-14B-Diffusers",
                                     compute_dtype="bf16")},
        validation=ValidationConfig(every=0),
        method=KDCausal(t_list=T_LIST, cache="data/kd_cache/wan14b_4step_18frames", num_frames_per_block=3,
                        teacher_steps=48, flow_shift=5.0, teacher_guidance_scale=1.0,
                        optim=AdamWConfig(lr=7e-5, betas=(0.9, 0.999), weight_decay=0.0, max_grad_norm=1.0,
                                          schedule="constant", warmup_steps=0)),
    )
