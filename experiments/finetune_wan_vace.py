"""Fine-tune Wan 2.1 VACE (Wan with a control branch: a control video, its mask and reference images), or Wan 2.2
VACE-Fun A14B's two VACE experts, with flow matching, full, LoRA, or the context branch alone.

The model is given the text and VACE's control context, ``WanVACEPipeline``'s ``[inactive | reactive | mask]`` of a
control video (``fvx_models.wan_vace``; ``data.kind=vace``: the column ``vace_context`` beside the latents and text).
``models.student.trainable=[context]`` trains only the context branch (VACE's context-adapter tuning: the base Wan
stays as loaded), ``[base]`` only the base DiT.

The default trains the tiny `world` preset from scratch on fvx's toy world as VACE's extension task: the control
video is the clip's first frame then grey frames, masked to be made after the first; given it and the prompt, the
model continues the bars the way the prompt says. A few minutes on a 2-core CPU; validation conditions on the contexts
of fixed dataset samples, and `validation/model/continuation_mse` (the distance to the clip the frame came from) falls:
    python -m fvx.run experiments/finetune_wan_vace.py
On Wan2.1-VACE-1.3B (a local diffusers folder): preprocess your clips, each ``clip.mp4`` beside its caption
``clip.txt``, its control video ``clip.control.mp4`` (depth, pose, edges, a masked source...), optionally its mask
``clip.mask.mp4`` (white: to be made; none: all of it) and reference image ``clip.ref.png``:
    python -m fvx.run preprocess experiments/finetune_wan_vace.py --videos /data/my_clips --out /data/my_dataset \\
        models.student.preset=wan2.1-vace-1.3b models.student.path=/models/Wan2.1-VACE-1.3B-diffusers data.world=null
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_wan_vace.py models.student.preset=wan2.1-vace-1.3b \\
        models.student.path=/models/Wan2.1-VACE-1.3B-diffusers models.student.compute_dtype=bf16 \\
        models.student.remat=true data.world=null data.path=/data/my_dataset data.text_len=512 data.batch_size=8 \\
        method.optim.lr=1e-5
Wan 2.2 VACE-Fun A14B (``fvx_models.wan_vace_moe``: two experts routed at t = 875, one expert trained a step; the
same data) is ``models.student=wan_vace_moe``; ``models.student.trainable=[transformer]`` trains the high-noise
expert alone and ``models.student.parts=[context]`` the experts' context branches alone:
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_wan_vace.py models.student=wan_vace_moe \\
        models.student.preset=wan2.2-vace-fun-a14b models.student.path=/models/Wan2.2-VACE-Fun-A14B-diffusers \\
        models.student.compute_dtype=bf16 models.student.remat=true data.world=null data.path=/data/my_dataset \\
        data.text_len=512 data.batch_size=8 method.optim.lr=1e-5
DiffSynth-Studio's LoRA and full scripts for it are the recipes ``diffsynth_vace_fun_a14b_lora`` and ``..._full`` (their
high-noise runs; ``models.student.trainable=[transformer_2]`` the low-noise ones):
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_wan_vace.py:diffsynth_vace_fun_a14b_lora \\
        models.student.path=/models/Wan2.2-VACE-Fun-A14B-diffusers data.path=/data/my_dataset
"""
import msgspec

from fvx.config import recipe
from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.preprocess import PreprocessConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.lora import LoRAConfig
from fvx_models.wan import DIFFSYNTH_LORA_TARGETS
from fvx_models.wan_vace import WanVACEConfig
from fvx_models.wan_vace_moe import WanVACEMoEConfig
from fvx_models.wan_vae import WanVAEConfig


class FinetuneWanVACE(Experiment):
    models: dict[str, WanVACEConfig | WanVACEMoEConfig] = msgspec.field(
        default_factory=lambda: {"student": WanVACEConfig(preset="tiny")})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples; None logs latent previews
    method: Finetune = Finetune()


config = FinetuneWanVACE(
    run=RunConfig(seed=0, steps=600, output_dir="runs/finetune_wan_vace", log_every=1),
    data=DataConfig(kind="vace", batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": WanVACEConfig(preset="world")},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, display_scale=4),
    method=Finetune(optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)


def _diffsynth_vace_fun(student: WanVACEMoEConfig, lr: float, output_dir: str) -> FinetuneWanVACE:
    """What DiffSynth-Studio's two Wan2.2-VACE-Fun-A14B scripts share, on 8 ranks of one sample in bf16 with remat:
    the high-noise expert's run (``--max_timestep_boundary 0.358``: timestep ids [0, 358) of its shift-5 grid, t from
    900 up, ``train_boundary_ratio=0.9``; the router still splits at 0.875), 17 frames at 480 x 832 with the control
    video and reference image (``--extra_inputs vace_video,vace_reference_image``), timesteps uniform with its
    bell-shaped loss weight, AdamW with weight decay 0.01 and no clipping, torch's ``ConstantLR`` a third for the first
    update (as ``finetune_wan_animate.py:diffsynth_animate_lora`` counts it on 8 ranks); validation as its inference,
    50 steps at shift 5 and guidance 5."""
    return FinetuneWanVACE(
        run=RunConfig(seed=0, steps=2000, output_dir=output_dir),
        data=DataConfig(kind="vace", batch_size=8, text_len=512,
                        preprocess=PreprocessConfig(num_frames=17, max_height=480, max_width=832)),
        models={"student": msgspec.structs.replace(
            student, preset="wan2.2-vace-fun-a14b", compute_dtype="bf16", remat=True, train_boundary_ratio=0.9,
            trainable=("transformer",), parts=("context",))},
        validation=ValidationConfig(every=500, num_prompts=1, num_steps=50, flow_shift=5.0, guidance_scale=5.0),
        method=Finetune(weighting_scheme="uniform", flow_shift=5.0, loss_weighting="bell",
                        optim=AdamWConfig(lr=lr, weight_decay=0.01, max_grad_norm=0.0, schedule="constant_factor",
                                          warmup_steps=1, warmup_factor=1 / 3)),
    )


@recipe
def diffsynth_vace_fun_a14b_lora() -> FinetuneWanVACE:
    """DiffSynth-Studio's Wan2.2-VACE-Fun-A14B LoRA script (``examples/wanvideo/model_training/lora/
    Wan2.2-VACE-Fun-A14B.sh``), its high-noise run: rank 32 (alpha = rank, its default) on the VACE branch alone
    (``--lora_base_model vace``: the context blocks' attention projections and FFN, ``--lora_target_modules
    q,k,v,o,ffn.0,ffn.2``), lr 1e-4; the rest :func:`_diffsynth_vace_fun`'s. Its low-noise run
    (``--min_timestep_boundary 0.358``, below t = 900): ``models.student.trainable=[transformer_2]``. Its 5 epochs of
    100 repeats are ``run.steps`` here: set them for your data."""
    lora = LoRAConfig(rank=32, alpha=32.0, target_modules=DIFFSYNTH_LORA_TARGETS)
    return _diffsynth_vace_fun(WanVACEMoEConfig(lora=lora), 1e-4, "runs/wan_vace_fun_high_noise_lora")


@recipe
def diffsynth_vace_fun_a14b_full() -> FinetuneWanVACE:
    """DiffSynth-Studio's Wan2.2-VACE-Fun-A14B full script (``examples/wanvideo/model_training/full/
    Wan2.2-VACE-Fun-A14B.sh``), its high-noise run: the VACE branch trained whole (``--trainable_models vace``), lr 5e-5
    ("consistent with the settings in the original paper"); the rest :func:`_diffsynth_vace_fun`'s. Its low-noise run:
    ``models.student.trainable=[transformer_2]``. Its 2 epochs of 100 repeats are ``run.steps`` here."""
    return _diffsynth_vace_fun(WanVACEMoEConfig(), 5e-5, "runs/wan_vace_fun_high_noise_full")

