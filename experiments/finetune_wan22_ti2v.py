"""Fine-tune Wan 2.2 TI2V-5B text-to-video with flow matching (48-channel latents of the Wan 2.2 VAE, one timestep
per token as its pipeline's ``expand_timesteps``).

The default is the tiny TI2V-layout preset on synthetic 48-channel latents (validation logs latent previews: fvx has
no tiny Wan 2.2 VAE): a minute on a 2-core CPU.
    python -m fvx.run experiments/finetune_wan22_ti2v.py
The real model is the same file with overrides, e.g. on a FastVideo-preprocessed dataset encoded with the Wan 2.2
VAE (its flow shift 5):
    python -m fvx.run experiments/finetune_wan22_ti2v.py models.student.preset=wan2.2-ti2v-5b \
        models.student.path=/models/Wan2.2-TI2V-5B-Diffusers models.student.compute_dtype=bf16 \
        models.student.remat=true data.path=/data/my_ti2v_dataset/combined_parquet_dataset data.text_len=512 \
        data.batch_size=8 method.flow_shift=5 validation.flow_shift=5 method.optim.lr=1e-6 --steps 4000 \
        --out runs/wan22_ti2v
FastVideo's FastWan 2.2 LoRA recipe with VSA is the recipe `fastwan22_ti2v_5b_fullattn_lora_vsa`; point its paths at
local folders:
    python -m fvx.run experiments/finetune_wan22_ti2v.py:fastwan22_ti2v_5b_fullattn_lora_vsa \
        models.student.path=/models/FastWan2.2-TI2V-5B-FullAttn-Diffusers \
        data.path=/data/crush-smol_processed_ti2v/combined_parquet_dataset
"""
import msgspec

from fvx.config import recipe
from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig, SyntheticConfig
from fvx.data.preprocess import PreprocessConfig
from fvx.storage.checkpoint_config import CheckpointConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.attention.config import VSAConfig
from fvx_models.lora import LoRAConfig
from fvx_models.wan import WanConfig

# FastVideo's fast_ti2v_fullattn_lora_vsa.yaml adapters: the attention projections and VSA's gate
TI2V_VSA_LORA = LoRAConfig(rank=16, alpha=32.0, target_modules=("to_q", "to_k", "to_v", "to_out", "to_gate_compress"))
# examples/distill/Wan2.2-TI2V-5B-Diffusers/crush_smol/preprocess_wan_data_ti2v_5b.sh (crush-smol_processed_ti2v)
CRUSH_SMOL_TI2V = PreprocessConfig(num_frames=121, train_fps=24, max_height=704, max_width=1280,
                                   video_length_tolerance_range=5.0, samples_per_file=8)


class FinetuneWan22TI2V(Experiment):
    models: dict[str, WanConfig] = msgspec.field(default_factory=lambda: {"student": WanConfig(preset="tiny-ti2v")})
    method: Finetune = Finetune()


config = FinetuneWan22TI2V(
    run=RunConfig(seed=0, steps=300, output_dir="runs/finetune_wan22_ti2v"),
    data=DataConfig(batch_size=4, synthetic=SyntheticConfig(num_samples=64, latent_shape=(48, 2, 8, 8),
                                                             text_len=8, text_dim=32)),
    validation=ValidationConfig(every=100, num_prompts=2, flow_shift=5.0),
    method=Finetune(flow_shift=5.0, optim=AdamWConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0,
                                                      schedule="cosine", warmup_steps=20)),
)


@recipe
def fastwan22_ti2v_5b_fullattn_lora_vsa() -> FinetuneWan22TI2V:
    """FastVideo's fine_tuning/wan/fast_ti2v_fullattn_lora_vsa.yaml: the FastWan 2.2 TI2V 5B FullAttn checkpoint as
    text-to-video (T2V-style data, no first frame), VSA at sparsity 0.8 from the first step (``attention=vsa``; a
    folder without ``to_gate_compress`` weights loads zero gates, a dense start) with LoRA r 16, alpha 32 on to_q,
    to_k, to_v, to_out and to_gate_compress (the gates' adapters are what VSA's coarse branch learns through), the
    base frozen in bf16 (its dit_precision bf16), full remat; training at shift 3 (``WanModel``'s default: the YAML's
    ``pipeline.flow_shift: 5`` is the validation's, ``fastvideo/train/models/wan/wan.py:69,94``); AdamW lr 1e-5,
    betas (0.9, 0.999), weight decay 0.01, constant, no warmup, clip 1; one rank of batch 1 with 5
    gradient-accumulation steps (``data.batch_size`` 5, ``method.grad_accum`` 5), seed 42, 20 latent frames, no CFG
    dropout; 10 steps, checkpoints every 5 (the newest 2); validation off (every_steps 0; 3 steps at guidance 5 and
    shift 5 on the YAML's 77 frames of 480x832, latents 48 x 20 x 30 x 52, when turned on with
    ``validation.every``). Its data, crush-smol_processed_ti2v, is what FastVideo's
    preprocess_wan_data_ti2v_5b.sh writes (121 frames of 704x1280 at 24 fps, 8 a file; the YAML's num_height,
    num_width and num_frames size only FastVideo's validation videos): ``data.preprocess``. Not carried: W&B names
    (``run.wandb.project=fastvideo run.wandb.name=fast_wan_ti2v_fullattn_lora_vsa``, needs wandb) and its 2 data
    workers; its validation pipeline (WanPipeline on validation.json's video/image paths) is fvx's text-to-video
    validation.
        python -m fvx.run preprocess experiments/finetune_wan22_ti2v.py:fastwan22_ti2v_5b_fullattn_lora_vsa \\
            --videos /data/crush-smol --out data/crush-smol_processed_ti2v \\
            models.student.path=/models/Wan2.2-TI2V-5B-Diffusers"""
    return FinetuneWan22TI2V(
        run=RunConfig(seed=42, steps=10, output_dir="outputs/fast_wan_ti2v_fullattn_lora_vsa",
                      checkpoint=CheckpointConfig(every=5, keep_latest=2)),
        data=DataConfig(path="data/crush-smol_processed_ti2v/combined_parquet_dataset", batch_size=5, text_len=512,
                        cfg_rate=0.0, num_latent_t=20, preprocess=CRUSH_SMOL_TI2V),
        models={"student": WanConfig(preset="wan2.2-ti2v-5b", path="models/FastWan2.2-TI2V-5B-FullAttn-Diffusers",
                                     compute_dtype="bf16", remat=True, lora=TI2V_VSA_LORA, attention="vsa",
                                     vsa=VSAConfig(sparsity=0.8))},
        validation=ValidationConfig(every=0, num_steps=3, flow_shift=5.0, guidance_scale=5.0,
                                    latent_shape=(48, 20, 30, 52)),
        method=Finetune(optim=AdamWConfig(lr=1e-5, betas=(0.9, 0.999), weight_decay=0.01, max_grad_norm=1.0,
                                          schedule="constant", warmup_steps=0),
                        flow_shift=3.0, grad_accum=5),
    )
