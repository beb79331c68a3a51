"""Fine-tune LTX-2 or LTX-2.3 text-to-video, its audio branch frozen (FastVideo's `fine_tuning/ltx2` recipes).

LTX-2's DiT makes sound and picture together; FastVideo trains its video only: the ~5.8B params of the audio branch
and the audio<->video cross attention are held frozen (no update, no optimizer state, exported as loaded), the DiT runs
with the modalities isolated, and the noise levels come from LTX-2's own sampler (a logit-normal shifted by the token
count, stretched to [0, 1], 10% uniform: `models.student.timestep_uniform_prob`). `models.student.fps` is the clips'
frame rate (RoPE's time axis; FastVideo's default 24).

The default trains the tiny `world` preset on the toy video world (bars drifting as the prompt says; latents its
space-to-depth codec decodes exactly) on a 2-core CPU in a few minutes; `validation/model/nearest_mse` falls as the
samples become the prompted clips:
    python -m fvx.run experiments/finetune_ltx2.py
FastVideo's recipes, at real size (4 ranks of batch 1; point the paths at local folders; data preprocessed with the
same checkpoint's Gemma + connector: 3840-wide text for LTX-2, 4096 for LTX-2.3):
    torchrun --nproc-per-node 4 -m fvx.run experiments/finetune_ltx2.py:ltx2_t2v \\
        models.student.path=/models/LTX2-Distilled-Diffusers data.path=/data/my_ltx2_dataset
    ... experiments/finetune_ltx2.py:ltx2_t2v_lora      (LoRA r 16 on the video branch's attention)
    ... experiments/finetune_ltx2.py:ltx2_3_t2v         (LTX-2.3; and ltx2_3_t2v_lora)
    ... experiments/finetune_ltx2.py:ltx2_overfit       (FastVideo's 300-step overfit; and ltx2_3_overfit)
    ... experiments/finetune_ltx2.py:ltx2_t2v_nvfp4_qat (NVFP4 quantization-aware: linear layers and video attention;
                                                        and ltx2_3_t2v_nvfp4_qat, ltx2_overfit_nvfp4_qat)
The toy NVFP4 QAT run (the same world, the curated linear layers and the video self-attention fake-quantized):
    python -m fvx.run experiments/finetune_ltx2.py:world_nvfp4_qat
"""
import math

import msgspec

from fvx.config import recipe
from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.preprocess import PreprocessConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.storage.checkpoint_config import CheckpointConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models import ltx2
from fvx_models.linear_qat import LinearQATConfig
from fvx_models.lora import LoRAConfig
from fvx_models.ltx2 import LTX2Config

LATENTS = (128, 11, 15, 26)  # FastVideo's 81 frames of 480x832: (81 - 1) / 8 + 1 latent frames, 480 / 32, 832 / 32
MU = ltx2.shift_mu(math.prod(LATENTS[1:]))  # 4290 tokens -> 2.13: the pipeline's shift e^mu for validation
LORA = LoRAConfig(rank=16, alpha=32.0, target_modules=("to_q", "to_k", "to_v", "to_out"))
CHECKPOINTS = {"2.0": "models/LTX2-Distilled-Diffusers", "2.3": "models/LTX-2.3-Distilled-Diffusers"}
PRESETS = {"2.0": "ltx-2", "2.3": "ltx-2.3"}
# fastvideo/pipelines/preprocess/preprocess_ltx2_overfit.py's NUM_FRAMES, MAX_HEIGHT, MAX_WIDTH, TRAIN_FPS (the YAMLs'
# reference; examples/training/finetune/ltx2/preprocess_ltx2_data_t2v_new.sh's 121 frames of 1088x1920 are not these)
CUT = PreprocessConfig(num_frames=81, train_fps=24, max_height=480, max_width=832)


class FinetuneLTX2(Experiment):
    models: dict[str, LTX2Config] = msgspec.field(default_factory=lambda: {"student": LTX2Config()})
    vae: SpaceToDepth | None = None  # decodes the toy world's validation samples; None logs latent previews
    method: Finetune = Finetune()


config = FinetuneLTX2(
    run=RunConfig(seed=0, steps=800, output_dir="runs/finetune_ltx2", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig()),
    models={"student": LTX2Config(preset="world", fps=16.0)},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, display_scale=4),
    method=Finetune(optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)


def _fastvideo(version: str, *, lora: bool = False, overfit: bool = False, nvfp4: bool = False) -> FinetuneLTX2:
    """FastVideo's LTX-2 (``version`` "2.0") or LTX-2.3 ("2.3") fine-tune: 4 ranks of batch 1 (HSDP shard 4), 81
    frames of 480x832 (11 latent frames), no CFG dropout, full gradient checkpointing; AdamW lr 5e-5 (1e-4 for the
    LoRA: r 16, alpha 32 on to_q/to_k/to_v/to_out), betas (0.9, 0.999), no weight decay, constant, clip 1; 2000 steps,
    a checkpoint every 500 (the newest 2 kept); validation every 250 steps, 8 steps at guidance 1 (the distilled
    checkpoint's). The overfit recipe: 300 steps, validation every 50, no periodic checkpoints. Data: 81 frames of
    480x832 at 24 fps, as FastVideo's preprocess_ltx2_overfit.py (the YAMLs' reference) cuts them, e.g.
        python -m fvx.run preprocess experiments/finetune_ltx2.py:ltx2_t2v --videos /data/my_clips \\
            --out /data/my_dataset models.student.path=/models/LTX2-Distilled-Diffusers
    ``nvfp4``: the NVFP4 quantization-aware recipes (:func:`_nvfp4`)."""
    name = {"2.0": "ltx2", "2.3": "ltx2_3"}[version]
    output = (f"outputs/{name}_overfit{'_nvfp4_attn_qat' if nvfp4 else ''}" if overfit else
              f"outputs/{name}_t2v{'_lora' if lora else ''}{'_nvfp4_qat' if nvfp4 else ''}_finetune")
    student = LTX2Config(preset=PRESETS[version], path=CHECKPOINTS[version], compute_dtype="bf16", remat=True,
                         lora=LORA if lora else None)
    return FinetuneLTX2(
        run=RunConfig(seed=42, steps=300 if overfit else 2000, output_dir=output,
                      checkpoint=CheckpointConfig(every=0, keep_latest=1) if overfit else
                      CheckpointConfig(every=500, keep_latest=2)),
        data=DataConfig(path=f"data/{name}_overfit_preprocessed" if overfit else "data/your_dataset_preprocessed",
                        batch_size=4, text_len=ltx2.TEXT_LEN, cfg_rate=0.0, num_latent_t=LATENTS[1], preprocess=CUT),
        models={"student": _nvfp4(student) if nvfp4 else student},
        validation=ValidationConfig(every=50 if overfit else 250, num_prompts=4, latent_shape=LATENTS, num_steps=8,
                                    flow_shift=math.exp(MU), guidance_scale=1.0, fps=24.0),
        method=Finetune(optim=AdamWConfig(lr=1e-4 if lora else 5e-5, betas=(0.9, 0.999), weight_decay=0.0,
                                          max_grad_norm=1.0, schedule="constant", warmup_steps=0)),
    )


@recipe
def ltx2_t2v() -> FinetuneLTX2:
    """FastVideo's fine_tuning/ltx2/t2v.yaml (see :func:`_fastvideo`)."""
    return _fastvideo("2.0")


@recipe
def ltx2_t2v_lora() -> FinetuneLTX2:
    """FastVideo's fine_tuning/ltx2/t2v_lora.yaml: LoRA on the video branch (the audio branch gets no adapters); data
    as :func:`_fastvideo`'s."""
    return _fastvideo("2.0", lora=True)


@recipe
def ltx2_3_t2v() -> FinetuneLTX2:
    """FastVideo's fine_tuning/ltx2_3/t2v.yaml: LTX-2.3; data cut as :func:`_fastvideo`'s, encoded by LTX-2.3's own
    text encoder:
        python -m fvx.run preprocess experiments/finetune_ltx2.py:ltx2_3_t2v --videos /data/my_clips \\
            --out /data/my_dataset models.student.path=/models/LTX-2.3-Distilled-Diffusers"""
    return _fastvideo("2.3")


@recipe
def ltx2_3_t2v_lora() -> FinetuneLTX2:
    """FastVideo's fine_tuning/ltx2_3/t2v_lora.yaml; data as ``ltx2_3_t2v``'s."""
    return _fastvideo("2.3", lora=True)


@recipe
def ltx2_overfit() -> FinetuneLTX2:
    """FastVideo's configs/overfit_ltx2_t2v.yaml; data as :func:`_fastvideo`'s (preprocess_ltx2_overfit.py's cut)."""
    return _fastvideo("2.0", overfit=True)


@recipe
def ltx2_3_overfit() -> FinetuneLTX2:
    """FastVideo's configs/overfit_ltx2_3_t2v.yaml; data as ``ltx2_3_t2v``'s."""
    return _fastvideo("2.3", overfit=True)


def _nvfp4(student: LTX2Config) -> LTX2Config:
    """FastVideo's NVFP4 quantization-aware student (``quant_config: nvfp4_qat_train`` and ``attention_backend:
    ATTN_QAT_TRAIN``): the curated linear set (``ltx2.NVFP4_LINEARS``, 12 a block) forward through NVFP4, backward
    into the fp32 masters, and the video self-attention fake-quantized (audio and masked text attention dense).
    FastVideo's ``attn_qat_infer: true`` (validate with the sm_120/121 NVFP4 attention kernel, which it stops
    without) is ``models.student.qat.validation=infer`` here: the recipes validate with the training form, so they
    run (and dry-run) on any machine."""
    return msgspec.structs.replace(student, attention="qat", linear_qat=LinearQATConfig())


@recipe
def ltx2_t2v_nvfp4_qat() -> FinetuneLTX2:
    """FastVideo's fine_tuning/ltx2/nvfp4_qat_t2v.yaml: ``ltx2_t2v`` with NVFP4 quantization-aware training
    (:func:`_nvfp4`); on an sm_120/121 GPU add ``models.student.qat.validation=infer`` for FastVideo's validation."""
    return _fastvideo("2.0", nvfp4=True)


@recipe
def ltx2_3_t2v_nvfp4_qat() -> FinetuneLTX2:
    """FastVideo's fine_tuning/ltx2_3/nvfp4_qat_t2v.yaml: ``ltx2_3_t2v`` with NVFP4 quantization-aware training (the
    same 576 linears; LTX-2.3's ``to_gate_logits`` stay dense, as FastVideo's)."""
    return _fastvideo("2.3", nvfp4=True)


@recipe
def ltx2_overfit_nvfp4_qat() -> FinetuneLTX2:
    """FastVideo's configs/overfit_ltx2_t2v_nvfp4_qat.yaml: ``ltx2_overfit`` with NVFP4 quantization-aware
    training."""
    return _fastvideo("2.0", overfit=True, nvfp4=True)


@recipe
def world_nvfp4_qat() -> FinetuneLTX2:
    """The default toy run with NVFP4 quantization-aware training (:func:`_nvfp4`, the reference quantizers on the
    CPU): it learns the world through quantized linears and attention as the dense default does."""
    return msgspec.structs.replace(
        config, run=msgspec.structs.replace(config.run, output_dir="runs/finetune_ltx2_nvfp4_qat"),
        models={"student": _nvfp4(config.models["student"])})
