"""Fine-tune HunyuanVideo 1.5 text-to-video with flow matching (diffusers ``HunyuanVideo15Transformer3DModel``).

The default is the tiny preset on synthetic latents (validation logs latent previews: fvx has no tiny HunyuanVideo 1.5
VAE): about a minute on a 2-core CPU. Its data holds one text embedding, FastVideo's layout, so it runs with
``glyph_text=false``: every prompt is taken to quote no text and the DiT gets the pipeline's empty ByT5 stream.
    python -m fvx.run experiments/finetune_hunyuan_video15.py
FastVideo has no training recipe for HunyuanVideo 1.5. The recipe ``release_480p_t2v`` is the release's own
``train.py`` run as its command line defaults it (the 480p t2v transformer, lr 1e-5, weight decay 0.01, constant lr,
clip 1, logit-normal timesteps through flow shift 3, validation at shift 5, seed 42), on a diffusers folder of the
release and a FastVideo-layout dataset of Qwen2.5-VL embeddings (``text_embedding``, the pipeline's 1000 tokens):
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_hunyuan_video15.py:release_480p_t2v \
        models.student.path=/models/HunyuanVideo-1.5-Diffusers-480p_t2v data.path=/data/hv15/combined_parquet_dataset
fvx's parquet reader does not read a ByT5 glyph column yet, so the recipe runs with ``glyph_text=false`` (the glyph
stream, ``text_2``/``text_mask_2`` in the batch, is for batches made by a script); the 720p model is
``models.student.preset=hunyuanvideo1.5-720p-t2v`` (its pipeline samples at flow shift 9).
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
from fvx_models.hunyuan_video15 import HunyuanVideo15Config


class FinetuneHunyuanVideo15(Experiment):
    models: dict[str, HunyuanVideo15Config] = msgspec.field(
        default_factory=lambda: {"student": HunyuanVideo15Config()})
    method: Finetune = Finetune()


config = FinetuneHunyuanVideo15(
    run=RunConfig(seed=0, steps=120, output_dir="runs/finetune_hunyuan_video15"),
    data=DataConfig(batch_size=2, text_len=8, synthetic=SyntheticConfig(num_samples=64, latent_shape=(4, 2, 8, 8),
                                                                        text_len=8, text_dim=32)),
    models={"student": HunyuanVideo15Config(preset="tiny", glyph_text=False)},
    validation=ValidationConfig(every=60, num_prompts=2, flow_shift=5.0),
    method=Finetune(flow_shift=5.0, optim=AdamWConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0,
                                                      schedule="cosine", warmup_steps=10)),
)


@recipe
def release_480p_t2v() -> FinetuneHunyuanVideo15:
    """The release's train.py (Tencent-Hunyuan/HunyuanVideo-1.5) at its command-line defaults: the 480p t2v
    transformer in bf16 with gradient checkpointing; AdamW lr 1e-5, betas (0.9, 0.999), eps 1e-8, weight decay 0.01
    (the release's non-Muon optimizer: fvx has no Muon), constant lr (its "constant" schedule ignores the warmup), clip
    1; logit-normal(0, 1) timesteps through flow shift 3; batch 1 per rank (the release runs 8 GPUs as one 8-way
    sequence-parallel group, global batch 1; fvx has no sequence parallelism for this family, so 8 ranks of 1); 10000
    steps, checkpoints every 1000 (all kept), seed 42; validation every 100 steps from step 0, one prompt, 50 steps at
    flow shift 5 and the pipeline's guidance 6. Text-to-video only (the release mixes in 30% image-to-video). No
    FastVideo script makes its data: ``data.preprocess`` cuts the 480p model's own clip, 121 frames (31 latent) of
    480x848 at 24 fps (FastVideo's hunyuan15_t2v_480p preset, diffusers' 16:9 default at 480p):
        python -m fvx.run preprocess experiments/finetune_hunyuan_video15.py:release_480p_t2v --videos /data/my_clips \\
            --out /data/my_dataset models.student.path=/models/HunyuanVideo-1.5-Diffusers-480p_t2v"""
    return FinetuneHunyuanVideo15(
        run=RunConfig(seed=42, steps=10000, output_dir="outputs/hunyuan_video15_480p_t2v", log_every=10,
                      checkpoint=CheckpointConfig(every=1000, keep_latest=None)),
        data=DataConfig(path="data/preprocessed", batch_size=8, text_len=1000, cfg_rate=0.0,
                        preprocess=PreprocessConfig(num_frames=121, train_fps=24, max_height=480, max_width=848)),
        models={"student": HunyuanVideo15Config(preset="hunyuanvideo1.5-480p-t2v",
                                                path="models/HunyuanVideo-1.5-Diffusers-480p_t2v",
                                                compute_dtype="bf16", remat=True, glyph_text=False)},
        validation=ValidationConfig(every=100, num_prompts=1, num_steps=50, flow_shift=5.0, guidance_scale=6.0,
                                    seed=42),
        method=Finetune(weighting_scheme="logit_normal", logit_mean=0.0, logit_std=1.0, flow_shift=3.0,
                        optim=AdamWConfig(lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                                          max_grad_norm=1.0, schedule="constant")),
    )
