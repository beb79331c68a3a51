"""Fine-tune HunyuanVideo text-to-video with flow matching (FastVideo's `fine_tuning/hunyuan/t2v.yaml`).

The default is the tiny preset on synthetic latents (validation logs latent previews: fvx has no tiny HunyuanVideo
VAE): a minute on a 2-core CPU. Its data text is FastVideo's packed Hunyuan embedding, ``[1 + L, D]``: row 0 the
pooled CLIP vector zero-padded to the LLaMA width, rows 1: the LLaMA tokens.
    python -m fvx.run experiments/finetune_hunyuan.py
The real model is the same file with overrides, on a dataset FastVideo preprocessed for Hunyuan (flow shift 7; the
DiT is told the guidance scale it was distilled at, ``models.student.embedded_guidance``, default 6):
    python -m fvx.run experiments/finetune_hunyuan.py models.student.preset=hunyuanvideo-t2v \
        models.student.path=/models/HunyuanVideo-Diffusers models.student.compute_dtype=bf16 \
        models.student.remat=true data.path=/data/my_hunyuan_dataset/combined_parquet_dataset data.text_len=257 \
        data.batch_size=8 method.flow_shift=7 validation.flow_shift=7 method.optim.lr=1e-5 --steps 4000 \
        --out runs/hunyuan_t2v
"""
import msgspec

from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig, SyntheticConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.finetune import Finetune
from fvx_models.hunyuan_video import HunyuanVideoConfig


class FinetuneHunyuan(Experiment):
    models: dict[str, HunyuanVideoConfig] = msgspec.field(default_factory=lambda: {"student": HunyuanVideoConfig()})
    method: Finetune = Finetune()


config = FinetuneHunyuan(
    run=RunConfig(seed=0, steps=300, output_dir="runs/finetune_hunyuan"),
    data=DataConfig(batch_size=4, text_len=9, synthetic=SyntheticConfig(num_samples=64, latent_shape=(16, 2, 16, 16),
                                                                        text_len=9, text_dim=32)),
    validation=ValidationConfig(every=100, num_prompts=2, flow_shift=7.0),
    method=Finetune(flow_shift=7.0, optim=AdamWConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0,
                                                      schedule="cosine", warmup_steps=20)),
)
