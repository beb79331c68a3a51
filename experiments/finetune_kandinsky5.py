"""Fine-tune Kandinsky 5.0 text-to-video with flow matching (FastVideo's `fine_tuning/kandinsky5/t2v_480p_qat.yaml`).

The default is the tiny preset on synthetic latents (validation logs latent previews: fvx has no tiny HunyuanVideo
VAE): a minute on a 2-core CPU. Its data text is FastVideo's packed Kandinsky 5 embedding, ``[1 + L, D]``: row 0 the
pooled CLIP vector zero-padded to the Qwen width, rows 1: the Qwen tokens.
    python -m fvx.run experiments/finetune_kandinsky5.py
The real model is the same file with overrides, on a dataset FastVideo preprocessed for Kandinsky 5
(`fastvideo/pipelines/preprocess/preprocess_kandinsky5_overfit.py`: HunyuanVideo VAE latents, flow shift 5, 480p):
    python -m fvx.run experiments/finetune_kandinsky5.py models.student.preset=kandinsky5-t2v-lite \
        models.student.path=/models/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers models.student.compute_dtype=bf16 \
        models.student.remat=true data.path=/data/kandinsky5_preprocessed data.text_len=513 data.num_latent_t=31 \
        data.batch_size=8 method.optim.lr=5e-5 --steps 2000 --out runs/kandinsky5_t2v
FastVideo's recipe is the recipe `kandinsky5_t2v_480p_qat` (8 ranks of batch 1, fake-quantized attention); point its
paths at local folders:
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_kandinsky5.py:kandinsky5_t2v_480p_qat \
        models.student.path=/models/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers data.path=/data/kandinsky5_preprocessed
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
from fvx_models.kandinsky5 import FLOW_SHIFT, Kandinsky5Config


class FinetuneKandinsky5(Experiment):
    models: dict[str, Kandinsky5Config] = msgspec.field(default_factory=lambda: {"student": Kandinsky5Config()})
    method: Finetune = Finetune()


config = FinetuneKandinsky5(
    run=RunConfig(seed=0, steps=300, output_dir="runs/finetune_kandinsky5"),
    data=DataConfig(batch_size=4, text_len=9, synthetic=SyntheticConfig(num_samples=64, latent_shape=(16, 2, 16, 16),
                                                                        text_len=9, text_dim=32)),
    validation=ValidationConfig(every=100, num_prompts=2, flow_shift=FLOW_SHIFT),
    method=Finetune(flow_shift=FLOW_SHIFT, optim=AdamWConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0,
                                                             schedule="cosine", warmup_steps=20)),
)


@recipe
def kandinsky5_t2v_480p_qat() -> FinetuneKandinsky5:
    """FastVideo's fine_tuning/kandinsky5/t2v_480p_qat.yaml: Kandinsky 5.0 T2V Lite (sft 5s), AdamW lr 5e-5, betas
    (0.9, 0.999), weight decay 1e-4, constant, clip 1; global batch 8 (8 data-parallel ranks of 1), 31 latent frames
    of 512x768, CFG dropout 0.1, data seed 1000; full activation checkpointing, bf16; 2000 steps, checkpoints every
    500 (the newest 3 kept); validation every 250 steps, 25 steps at guidance 6 against the negative prompt, flow
    shift 5; Attn-QAT (its FASTVIDEO_ATTENTION_BACKEND=ATTN_QAT_TRAIN: ``attention=qat``, fake-quantized NVFP4
    attention in every attention module). Its data is cut as FastVideo's preprocess_kandinsky5_overfit.py sets (121
    frames of 512x768 at 24 fps; that script stretches the first 121 native frames, fvx resamples, scales and crops);
    the negative prompt is FastVideo's default for the model (fastvideo/pipelines/basic/kandinsky5/presets.py:6):
        python -m fvx.run preprocess experiments/finetune_kandinsky5.py:kandinsky5_t2v_480p_qat \\
            --videos /data/my_clips --out /data/my_dataset \\
            models.student.path=/models/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers
        python -m fvx.run encode-prompts experiments/finetune_kandinsky5.py:kandinsky5_t2v_480p_qat \\
            experiments/prompts/kandinsky5_negative.txt --out data/kandinsky5_negative_prompt.safetensors \\
            models.student.path=/models/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers"""
    return FinetuneKandinsky5(
        run=RunConfig(seed=1000, steps=2000, output_dir="outputs/kandinsky5_t2v_qat_finetune",
                      checkpoint=CheckpointConfig(every=500, keep_latest=3)),
        data=DataConfig(path="data/kandinsky5_overfit_preprocessed", batch_size=8, text_len=513, cfg_rate=0.1,
                        num_latent_t=31,
                        preprocess=PreprocessConfig(num_frames=121, train_fps=24, max_height=512, max_width=768)),
        models={"student": Kandinsky5Config(preset="kandinsky5-t2v-lite",
                                            path="models/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers",
                                            compute_dtype="bf16", remat=True, attention="qat")},
        validation=ValidationConfig(every=250, num_prompts=4, num_steps=25, flow_shift=FLOW_SHIFT, guidance_scale=6.0,
                                    cfg_uncond="negative_prompt",
                                    negative_prompt_path="data/kandinsky5_negative_prompt.safetensors"),
        method=Finetune(optim=AdamWConfig(lr=5e-5, betas=(0.9, 0.999), weight_decay=1e-4, max_grad_norm=1.0,
                                          schedule="constant"), flow_shift=FLOW_SHIFT),
    )
