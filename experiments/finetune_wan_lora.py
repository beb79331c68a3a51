"""LoRA fine-tuning of Wan (FastVideo's `fine_tuning/wan/t2v_lora.yaml`: r 16, alpha 32 on to_q, to_k, to_v, to_out).

The default adapts the teacher that `experiments/finetune_wan.py` trains on fvx's toy world (exported to
`runs/teacher`) to a changed world: the prompt that meant red bars now shows green ones. Only the adapters train
(0.2M params against the base's 3M, which stays frozen in bf16 and is never saved); the validation videos turn the
first prompt's bars green, and `validation/model/nearest_mse` (distance to the new world's clips) falls:
    python -m fvx.run experiments/finetune_wan.py && python -m fvx.run export runs/finetune_wan --out runs/teacher
    python -m fvx.run experiments/finetune_wan_lora.py
    python -m fvx.run export runs/finetune_wan_lora --lora --format peft --out runs/lora     # diffusers/PEFT file
    python -m fvx.run export runs/finetune_wan_lora --lora --format comfyui --out runs/lora_comfyui
    python -m fvx.run export runs/finetune_wan_lora --lora --format musubi --out runs/lora_musubi
FastVideo's recipe is `wan21_t2v_1p3b` (Wan 2.1 T2V 1.3B, one GPU); point its paths at local folders:
    python -m fvx.run experiments/finetune_wan_lora.py:wan21_t2v_1p3b \
        models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers \
        data.path=/data/crush-smol_processed_t2v/combined_parquet_dataset
TurboWan with sparse-linear attention (FastVideo's `fine_tuning/wan/turbo_t2v_lora_sla.yaml`) is the recipe
`turbowan21_t2v_1p3b_lora_sla`, and `world_lora_sla` its toy on the CPU (the same teacher, trained under SLA):
    python -m fvx.run experiments/finetune_wan_lora.py:world_lora_sla
    python -m fvx.run experiments/finetune_wan_lora.py:turbowan21_t2v_1p3b_lora_sla \
        models.student.path=/models/TurboWan2.1-T2V-1.3B-Diffusers \
        data.path=/data/crush-smol_processed_t2v/combined_parquet_dataset
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
from fvx_methods.finetune import Finetune
from fvx_models.attention.config import SLAConfig, VSAConfig
from fvx_models.lora import LoRAConfig
from fvx_models.wan import WanConfig
from fvx_models.wan_vae import WanVAEConfig

TEACHER = "runs/teacher"  # experiments/finetune_wan.py's run, exported (module docstring)
T2V_LORA = LoRAConfig(rank=16, alpha=32.0, target_modules=("to_q", "to_k", "to_v", "to_out"))
# examples/training/finetune/wan_t2v_1.3B/crush_smol/preprocess_wan_data_t2v.sh
CRUSH_SMOL_T2V = PreprocessConfig(num_frames=77, train_fps=16, max_height=480, max_width=832,
                                  video_length_tolerance_range=5.0, samples_per_file=8)


class FinetuneWanLoRA(Experiment):
    models: dict[str, WanConfig] = msgspec.field(default_factory=lambda: {"student": WanConfig(lora=T2V_LORA)})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples; None logs latent previews
    method: Finetune = Finetune()


config = FinetuneWanLoRA(
    run=RunConfig(seed=0, steps=300, output_dir="runs/finetune_wan_lora", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig(colours=("green", "blue"))),
    models={"student": WanConfig(preset="world", path=TEACHER, lora=T2V_LORA)},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=100, num_prompts=8, num_steps=20, display_scale=4),
    method=Finetune(optim=AdamWConfig(lr=3e-3, weight_decay=0.0, max_grad_norm=1.0, schedule="cosine",
                                      warmup_steps=20)),
)


@recipe
def wan21_t2v_1p3b() -> FinetuneWanLoRA:
    """FastVideo's fine_tuning/wan/t2v_lora.yaml (its debug run on crush-smol): Wan 2.1 T2V 1.3B with LoRA r 16,
    alpha 32 on to_q, to_k, to_v, to_out (the base frozen in bf16), full remat, flow shift 3; AdamW on the adapters,
    lr 1e-5, betas (0.9, 0.999), weight decay 0.01, constant, no warmup, clip 1; one rank of train_batch_size 1 with
    5 gradient-accumulation steps: global batch 5 per optimizer step (``data.batch_size`` 5, ``method.grad_accum``
    5: micro-batches of one sample), seed 42, 20 latent frames of 480x832, no CFG dropout; 10 steps, checkpoints
    every 5 (the newest 2 kept); validation off (the YAML's every_steps 0; 5 steps at guidance 5 when turned on with
    ``validation.every``). FastVideo also logs to W&B project fastvideo (``run.wandb.project=fastvideo
    run.wandb.name=wan_t2v_lora_debug``, needs wandb); its 2 data workers have no fvx knob. Its data is cut as
    FastVideo's crush_smol/preprocess_wan_data_t2v.sh does (77 frames of 480x832 at 16 fps, 8 a file):
        python -m fvx.run preprocess experiments/finetune_wan_lora.py:wan21_t2v_1p3b --videos /data/my_clips \\
            --out /data/my_dataset models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers"""
    return FinetuneWanLoRA(
        run=RunConfig(seed=42, steps=10, output_dir="outputs/wan_t2v_lora_debug",
                      checkpoint=CheckpointConfig(every=5, keep_latest=2)),
        data=DataConfig(path="data/crush-smol_processed_t2v/combined_parquet_dataset", batch_size=5, text_len=512,
                        cfg_rate=0.0, num_latent_t=20, preprocess=CRUSH_SMOL_T2V),
        models={"student": WanConfig(preset="wan2.1-t2v-1.3b", path="models/Wan2.1-T2V-1.3B-Diffusers",
                                     compute_dtype="bf16", remat=True, lora=T2V_LORA)},
        validation=ValidationConfig(every=0, num_steps=5, flow_shift=3.0, guidance_scale=5.0),
        method=Finetune(optim=AdamWConfig(lr=1e-5, betas=(0.9, 0.999), weight_decay=0.01, max_grad_norm=1.0,
                                          schedule="constant", warmup_steps=0),
                        flow_shift=3.0, grad_accum=5),
    )


@recipe
def fastwan21_t2v_1p3b_vsa() -> FinetuneWanLoRA:
    """FastVideo's fine_tuning/wan/fast_t2v_lora_vsa.yaml: the FastWan 2.1 T2V 1.3B checkpoint (trained for VSA:
    ``models.student.attention=vsa``, sparsity 0.8 from the first step, its ``to_gate_compress`` gates in the base)
    with LoRA r 16, alpha 32 on to_q, to_k, to_v, to_out, full remat, training at shift 3 (``WanModel``'s default:
    the YAML's ``pipeline.flow_shift: 8`` is the validation's, ``fastvideo/train/models/wan/wan.py:69,94``); AdamW
    lr 1e-5, betas (0.9, 0.999), weight decay 0.01, constant, clip 1; one rank of batch 1 with 5
    gradient-accumulation steps, seed 42, 20 latent frames of 480x832, no CFG dropout; 10 steps, checkpoints every 5
    (the newest 2); validation off (3 steps at guidance 3 when turned on). The same crush-smol data (``preprocess`` as
    ``wan21_t2v_1p3b``'s)."""
    base = wan21_t2v_1p3b()
    return msgspec.structs.replace(
        base, run=msgspec.structs.replace(base.run, output_dir="outputs/fast_wan_t2v_lora_vsa"),
        models={"student": msgspec.structs.replace(base.models["student"], path="models/FastWan2.1-T2V-1.3B-Diffusers",
                                                   attention="vsa", vsa=VSAConfig(sparsity=0.8))},
        validation=ValidationConfig(every=0, num_steps=3, flow_shift=8.0, guidance_scale=3.0),
        method=msgspec.structs.replace(base.method, flow_shift=3.0))


@recipe
def turbowan21_t2v_1p3b_lora_sla() -> FinetuneWanLoRA:
    """FastVideo's fine_tuning/wan/turbo_t2v_lora_sla.yaml: TurboWan 2.1 T2V 1.3B (TurboDiffusion's distilled Wan,
    whose self-attention is sparse-linear: ``models.student.attention=sla`` at FastVideo's SLA_ATTN defaults, top-k
    ratio 0.1 of key blocks, blocks of 128 queries and 64 keys, softmax feature map; its trained ``proj_l`` loads
    from the folder as ``blocks.N.attn1.attn_impl.proj_l``) with LoRA r 16, alpha 32 on to_q, to_k, to_v, to_out
    (the base, ``proj_l`` included, frozen in bf16 as FastVideo's ``transformer.requires_grad_(False)``), bf16, full
    remat, training at shift 3; AdamW lr 1e-5, betas (0.9, 0.999), weight decay 0.01, constant, no warmup, clip 1;
    one rank of batch 1 with 5 gradient-accumulation steps (``data.batch_size`` 5, ``method.grad_accum`` 5), seed 42,
    20 latent frames of 480x832 (31200 tokens: 488 key blocks, 48 kept per query block), no CFG dropout; 10 steps,
    checkpoints every 5 (the newest 2 kept); validation every 5 steps from step 0 (the callback's ``run_at_start``)
    at 4 steps, guidance 1 (no CFG), shift 3, on the dataset's prompts. What fvx does not carry: the validation
    sampler is fvx's Euler on the shift-3 flow levels, not FastVideo's TurboDiffusionPipeline (rCM scheduler,
    sigma_max 80), so its 4-step videos are not TurboWan's; its validation prompts file
    (crush_smol/validation.json) is FastVideo's JSON; its 2 data workers and W&B names (``run.wandb.project=fastvideo
    run.wandb.name=turbo_wan_t2v_lora_sla``) as in ``wan21_t2v_1p3b``. The same crush-smol data (``preprocess`` as
    ``wan21_t2v_1p3b``'s)."""
    base = wan21_t2v_1p3b()
    return msgspec.structs.replace(
        base, run=msgspec.structs.replace(base.run, output_dir="outputs/turbo_wan_t2v_lora_sla"),
        models={"student": msgspec.structs.replace(base.models["student"],
                                                   path="models/TurboWan2.1-T2V-1.3B-Diffusers", attention="sla",
                                                   sla=SLAConfig())},
        validation=ValidationConfig(every=5, at_start=True, num_steps=4, flow_shift=3.0, guidance_scale=1.0),
        method=msgspec.structs.replace(base.method, flow_shift=3.0))


@recipe
def world_lora_sla() -> FinetuneWanLoRA:
    """The default run (the toy teacher adapted to green bars) with the student's self-attention sparse-linear, on
    clips large enough for SLA's blocks: 8 frames of 64x64 pixels, an 8x8x8 grid of 512 tokens, so 4 query blocks of
    128 tokens (2 frames) each attend by softmax to 2 of the 8 key blocks of 64 (``sla.topk_ratio`` 0.25) and by
    linear attention to all. The dense teacher's ``proj_l`` starts at zero (the sparse part alone); here the LoRA
    also adapts ``proj_l`` (FastVideo's recipe leaves it frozen: TurboWan's is already trained), so the linear part
    learns to carry what the dropped blocks held while the adapters learn the new world."""
    adapters = LoRAConfig(rank=16, alpha=32.0, target_modules=("to_q", "to_k", "to_v", "to_out", "proj_l"))
    return msgspec.structs.replace(
        config, run=msgspec.structs.replace(config.run, output_dir="runs/finetune_wan_lora_sla"),
        data=msgspec.structs.replace(config.data, world=msgspec.structs.replace(config.data.world, frames=8, size=64)),
        models={"student": WanConfig(preset="world", path=TEACHER, lora=adapters, attention="sla",
                                     sla=SLAConfig(topk_ratio=0.25))})
