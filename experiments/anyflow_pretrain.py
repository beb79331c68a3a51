"""Train a flow map: AnyFlow's stage 1 (FastVideo's `distribution_matching/wan/anyflow_pretrain_t2v.yaml`, as an fvx
experiment), a two-time Wan `u(x_t, t, r)` that samples in any number of steps.

The default starts from the teacher that `experiments/finetune_wan.py` trains on fvx's toy video world (exported to
`runs/teacher`), with the r input added (`models.student.r_embedder`: FastVideo's gated delta embedder, a copy of the
time embedder, so the student starts as the teacher on the diagonal `r = t`), and trains it on the world's data:
    python -m fvx.run experiments/finetune_wan.py && python -m fvx.run export runs/finetune_wan --out runs/teacher
    python -m fvx.run experiments/anyflow_pretrain.py
Validation samples the student in 1, 2 and 4 jumps (`validation/student_<n>step/nearest_mse`): the teacher's own
1-step sample is the blurred mean of the bars; the flow map's sharpens. FastVideo's recipe is the recipe
`wan21_t2v_1p3b` (8 ranks of batch 4); point its paths at local folders:
    torchrun --nproc-per-node 8 -m fvx.run experiments/anyflow_pretrain.py:wan21_t2v_1p3b \
        models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers data.path=/data/preprocessed \
        method.negative_prompt_path=/data/wan21_negative_prompt.safetensors
The negative prompt is the unconditional cond of its fused guidance (3.0): the UMT5 embedding of Wan's negative prompt
as a safetensors file (tensor "text" [1, 512, 4096]). Its export is the student the on-policy stage starts from.
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
from fvx_methods.anyflow_pretrain import AnyFlowPretrain
from fvx_models.anyflow import AnyFlowConfig
from fvx_models.wan import WanConfig
from fvx_models.wan_two_time import REmbedder
from fvx_models.wan_vae import WanVAEConfig


class AnyFlowPretrainWan(Experiment):
    models: dict[str, WanConfig | AnyFlowConfig] = msgspec.field(
        default_factory=lambda: {"student": WanConfig(r_embedder=REmbedder())})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples; None logs latent previews
    method: AnyFlowPretrain = AnyFlowPretrain()


TEACHER = "runs/teacher"  # experiments/finetune_wan.py's run, exported (module docstring)

config = AnyFlowPretrainWan(
    run=RunConfig(seed=0, steps=300, output_dir="runs/anyflow_pretrain", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": WanConfig(preset="world", path=TEACHER, r_embedder=REmbedder())},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=100, num_prompts=8, display_scale=4),
    method=AnyFlowPretrain(optim=AdamWConfig(lr=3e-4, max_grad_norm=1.0), shift=3.0, weight_type="uniform"),
)


@recipe
def wan21_t2v_1p3b() -> AnyFlowPretrainWan:
    """FastVideo's anyflow_pretrain_t2v.yaml: Wan 2.1 T2V 1.3B with the gated r embedder (gate 0.25, delta r);
    diffusion ratio 0.5, consistency ratio 0.25, epsilon 5, beta08 weights, fused guidance 3.0, time shift 5
    (``pipeline.flow_shift``); AdamW lr 5e-5, betas (0.9, 0.999), no weight decay, constant, clip 1; global batch 32
    (8 ranks of 4), 21 latent frames of 480x832, remat; 6000 steps, checkpoints every 500 (the newest 3 kept). No
    FastVideo script writes its data: ``data.preprocess`` cuts the YAML's 81 frames (21 latent) of 480x832 at Wan's
    16 fps. The negative prompt is FastVideo's default for Wan 2.1 T2V 1.3B (fastvideo/pipelines/basic/wan/
    presets.py:15):
        python -m fvx.run preprocess experiments/anyflow_pretrain.py:wan21_t2v_1p3b --videos /data/my_clips \\
            --out /data/my_dataset models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers
        python -m fvx.run encode-prompts experiments/anyflow_pretrain.py:wan21_t2v_1p3b \\
            experiments/prompts/wan21_negative.txt --out data/wan21_negative_prompt.safetensors \\
            models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers"""
    return AnyFlowPretrainWan(
        run=RunConfig(seed=1000, steps=6000, output_dir="outputs/wan2.1_anyflow_pretrain",
                      checkpoint=CheckpointConfig(every=500, keep_latest=3)),
        data=DataConfig(path="data/preprocessed", batch_size=32, text_len=512, cfg_rate=0.0, num_latent_t=21,
                        preprocess=PreprocessConfig(num_frames=81, train_fps=16, max_height=480, max_width=832)),
        models={"student": WanConfig(preset="wan2.1-t2v-1.3b", path="models/Wan2.1-T2V-1.3B-Diffusers",
                                     compute_dtype="bf16", remat=True,
                                     r_embedder=REmbedder(fusion="gated", gate=0.25, delta="r"))},
        method=AnyFlowPretrain(
            diffusion_ratio=0.5, consistency_ratio=0.25, epsilon=5.0, weight_type="beta08", fuse_guidance_scale=3.0,
            negative_prompt_path="data/wan21_negative_prompt.safetensors", shift=5.0,
            optim=AdamWConfig(lr=5e-5, betas=(0.9, 0.999), weight_decay=0.0, max_grad_norm=1.0,
                              schedule="constant")),
    )
