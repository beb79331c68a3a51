"""Distil a few-step Wan student from its teacher's ODE trajectories (FastVideo's
`knowledge_distillation/wan/t2v.yaml`, as an fvx experiment).

Two commands: the first caches the teacher's trajectories (for every sample of the data, its 48-step ODE from noise,
the states at the t_list times and the end; resumable, one safetensors file per sample), the second trains on them.
The default distils the teacher that `experiments/finetune_wan.py` trains on fvx's toy video world (exported to
`runs/teacher`) into a *one-step* student (t_list [999, 0]), on a 2-core CPU in a minute or two:
    python -m fvx.run experiments/finetune_wan.py && python -m fvx.run export runs/finetune_wan --out runs/teacher
    python -m fvx_methods.trajectory_cache experiments/kd_t2v.py
    python -m fvx.run experiments/kd_t2v.py
The student starts as a copy of the teacher, whose one-step samples are a blur (no sample is a true clip:
`validation/student/hit_rate` 0); trained to jump from the teacher's noise to where its 48-step ODE ends, its
one-step samples become sharp bars (`hit_rate` 0.5, as the teacher's own many-step samples) and `nearest_mse` falls.
On this toy the teacher's own 4-step samples are already as good as its ODE's, so a 4-step student has nothing to
show; `method.t_list=[999,937,833,624,0]` (with a cache built for it) is FastVideo's. Its recipe is the recipe
`wan21_t2v_1p3b` (a Wan 2.1 T2V 1.3B student, a 14B teacher, 8 ranks of batch 2); point its paths at local folders,
the same in both commands (the run checks that the cache is its teacher's, on its data):
    python -m fvx_methods.trajectory_cache experiments/kd_t2v.py:wan21_t2v_1p3b \
        models.teacher.path=/models/Wan2.1-T2V-14B-Diffusers data.path=/data/Wan-Syn_77x448x832_600k
    torchrun --nproc-per-node 8 -m fvx.run experiments/kd_t2v.py:wan21_t2v_1p3b \
        models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers models.teacher.path=/models/Wan2.1-T2V-14B-Diffusers \
        data.path=/data/Wan-Syn_77x448x832_600k
The cache command also runs under torchrun, each rank building its share of the samples.
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
from fvx_methods.kd import KD
from fvx_models.wan import WanConfig
from fvx_models.wan_vae import WanVAEConfig

T_LIST = (999, 937, 833, 624, 0)  # FastVideo's


class KDWan(Experiment):
    models: dict[str, WanConfig] = msgspec.field(
        default_factory=lambda: {"student": WanConfig(), "teacher": WanConfig(preset="tiny-deep")})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples; None logs latent previews
    method: KD = KD(t_list=T_LIST, cache="runs/kd_t2v_cache")


TEACHER = "runs/teacher"  # experiments/finetune_wan.py's run, exported (module docstring)
# No FastVideo script writes Wan-Syn_77x448x832: its name's 77 frames (20 latent) of 448x832, at Wan's 16 fps
WAN_SYN = PreprocessConfig(num_frames=77, train_fps=16, max_height=448, max_width=832)

config = KDWan(
    run=RunConfig(seed=0, steps=300, output_dir="runs/kd_t2v", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": WanConfig(preset="world", path=TEACHER), "teacher": WanConfig(preset="world", path=TEACHER)},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=100, num_prompts=8, display_scale=4),
    method=KD(t_list=(999, 0), cache="runs/kd_t2v_cache", teacher_steps=48, flow_shift=3.0,
              optim=AdamWConfig(lr=1e-4, max_grad_norm=1.0)),
)


@recipe
def wan21_t2v_1p3b() -> KDWan:
    """FastVideo's knowledge_distillation/wan/t2v.yaml: a Wan 2.1 T2V 1.3B student (full remat) distilled from the
    Wan 2.1 T2V 14B teacher's 48-step ODE trajectories (frozen, bf16; only the cache command loads it) on the grid
    shifted by pipeline.flow_shift 5, t_list [999, 937, 833, 624, 0]; AdamW lr 7e-5, betas (0.9, 0.999), weight
    decay 0.0, constant, no warmup, clip 1; global batch 16 (train_batch_size 2 on each of 8 ranks, no
    accumulation), seed 1000, 20 latent frames of 448x832, no CFG dropout; 10000 steps, checkpoints every 1000 (the
    newest 3 kept); no validation (the YAML has no validation callback). Teacher guidance 1: the YAML's
    teacher_guidance_scale 3.5 is parsed but never applied by FastVideo (its rollout calls the teacher
    conditionally only), and fvx applies the knob, so 1 reproduces FastVideo's cache. FastVideo also logs to W&B
    project kd-wan (``run.wandb.project=kd-wan run.wandb.name=wan2.1_kd_ode_init``, needs wandb); its 4 data
    workers have no fvx knob (``data.prefetch`` reads ahead in a thread). No FastVideo script writes Wan-Syn:
    ``data.preprocess`` cuts its 77 frames of 448x832 at 16 fps:
        python -m fvx.run preprocess experiments/kd_t2v.py:wan21_t2v_1p3b --videos /data/my_clips \\
            --out /data/my_dataset models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers"""
    return KDWan(
        run=RunConfig(seed=1000, steps=10000, output_dir="outputs/wan2.1_kd_ode_init",
                      checkpoint=CheckpointConfig(every=1000, keep_latest=3)),
        data=DataConfig(path="data/Wan-Syn_77x448x832_600k", batch_size=16, text_len=512, cfg_rate=0.0,
                        num_latent_t=20, preprocess=WAN_SYN),
        models={"student": WanConfig(preset="wan2.1-t2v-1.3b", path="models/Wan2.1-T2V-1.3B-Diffusers",
                                     compute_dtype="bf16", remat=True, compile="blocks"),
                "teacher": WanConfig(preset="wan2.1-t2v-14b", path="models/Wan2.1-T2V-14B-Diffusers",
                                     compute_dtype="bf16", compile="blocks")},
        validation=ValidationConfig(every=0),
        method=KD(t_list=T_LIST, cache="data/kd_cache/wan14b_4step", teacher_steps=48, flow_shift=5.0,
                  teacher_guidance_scale=1.0,
                  optim=AdamWConfig(lr=7e-5, betas=(0.9, 0.999), weight_decay=0.0, max_grad_norm=1.0,
                                    schedule="constant", warmup_steps=0)),
    )
