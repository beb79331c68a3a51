"""Fine-tune Cosmos Predict 2.5 text-to-world with flow matching (FastVideo's `fine_tuning/cosmos/t2v.yaml`).

The default is the tiny preset on synthetic latents (validation logs latent previews), text 48 wide in place of
Reason1's 100352: a minute on a 2-core CPU.
    python -m fvx.run experiments/finetune_cosmos.py
FastVideo's recipe is the recipe `cosmos25_t2w_2b` (Cosmos Predict 2.5 2B, 8 data-parallel ranks of batch 1, flow
shift 1, no CFG dropout: the family refuses it as FastVideo does); point its paths at local folders (a diffusers
Cosmos-Predict2.5-2B pipeline; data FastVideo preprocessed with the Wan 2.1 VAE and Reason1's 100352-wide text
embedding). Its DiT concatenates the padding mask, which diffusers resizes with torchvision: install it to train
(the dry run needs none).
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_cosmos.py:cosmos25_t2w_2b \
        models.student.path=/models/Cosmos-Predict2.5-2B-Diffusers data.path=/data/cosmos_preprocessed
    python -m fvx.run experiments/finetune_cosmos.py:cosmos25_t2w_2b --dry-run --world 8
FastVideo's one-GPU overfitting check of the same model (`overfit_cosmos25_t2w.yaml`) is the recipe
`overfit_cosmos25_t2w`.
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
from fvx_models.cosmos import FLOW_SHIFT, CosmosConfig

# fastvideo/pipelines/preprocess/preprocess_cosmos25_overfit.py's NUM_FRAMES, MAX_HEIGHT, MAX_WIDTH, TRAIN_FPS
OVERFIT_CUT = PreprocessConfig(num_frames=93, train_fps=16, max_height=480, max_width=832)


class FinetuneCosmos(Experiment):
    models: dict[str, CosmosConfig] = msgspec.field(default_factory=lambda: {"student": CosmosConfig()})
    method: Finetune = Finetune()


config = FinetuneCosmos(
    run=RunConfig(seed=0, steps=300, output_dir="runs/finetune_cosmos"),
    data=DataConfig(batch_size=4, text_len=8, synthetic=SyntheticConfig(num_samples=64, latent_shape=(16, 2, 16, 16),
                                                                        text_len=8, text_dim=48)),
    validation=ValidationConfig(every=100, num_prompts=2, flow_shift=FLOW_SHIFT),
    method=Finetune(flow_shift=FLOW_SHIFT, optim=AdamWConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0,
                                                             schedule="cosine", warmup_steps=20)),
)


@recipe
def cosmos25_t2w_2b() -> FinetuneCosmos:
    """FastVideo's fine_tuning/cosmos/t2v.yaml: AdamW lr 1e-5, betas (0.9, 0.999), weight decay 0.01, constant, clip 1;
    global batch 8 (8 data-parallel ranks of 1), no CFG dropout, 24 latent frames (93 frames of 480x832), full
    activation checkpointing; 5000 steps, checkpoints every 500 (the newest 3 kept); validation every 100 steps, 50
    steps at guidance 6; flow shift 1. Its init_from names Cosmos-Predict2-2B-Video2World, a Cosmos 2.0 checkpoint
    that its Cosmos 2.5 plugin does not describe; the model here is Predict 2.5 2B (the one FastVideo's Cosmos tests
    and overfit recipe load). No FastVideo script writes its data (preprocess_cosmos2_5_t2w.sh cuts 77 frames of
    704x1280, 20 latent frames, for finetune_t2w.sh): ``data.preprocess`` cuts the YAML's 93 frames (24 latent) of
    480x832 at 16 fps, as FastVideo's Cosmos 2.5 overfit preprocessing:
        python -m fvx.run preprocess experiments/finetune_cosmos.py:cosmos25_t2w_2b --videos /data/my_clips \\
            --out /data/my_dataset models.student.path=/models/Cosmos-Predict2.5-2B-Diffusers"""
    return FinetuneCosmos(
        run=RunConfig(seed=1000, steps=5000, output_dir="outputs/cosmos_finetune",
                      checkpoint=CheckpointConfig(every=500, keep_latest=3)),
        data=DataConfig(path="data/cosmos_preprocessed", batch_size=8, text_len=512, cfg_rate=0.0, num_latent_t=24,
                        preprocess=OVERFIT_CUT),
        models={"student": CosmosConfig(preset="cosmos-predict2.5-2b", path="models/Cosmos-Predict2.5-2B-Diffusers",
                                        compute_dtype="bf16", remat=True)},
        validation=ValidationConfig(every=100, num_prompts=4, num_steps=50, flow_shift=FLOW_SHIFT, guidance_scale=6.0),
        method=Finetune(optim=AdamWConfig(lr=1e-5, betas=(0.9, 0.999), weight_decay=0.01, max_grad_norm=1.0,
                                          schedule="constant"), flow_shift=FLOW_SHIFT),
    )


@recipe
def overfit_cosmos25_t2w() -> FinetuneCosmos:
    """FastVideo's overfit_cosmos25_t2w.yaml: Cosmos Predict 2.5 2B on one GPU, batch 1, AdamW lr 5e-5, betas
    (0.9, 0.999), no weight decay, constant, clip 1, no CFG dropout, 24 latent frames, full activation checkpointing;
    300 steps, checkpoints every 50 (the newest 2 kept); validation every 150 steps, 35 steps at guidance 7; flow
    shift 1. Its data is cut as FastVideo's preprocess_cosmos25_overfit.py sets (93 frames of 480x832 at 16 fps; that
    script takes the first 93 native frames unscaled, fvx resamples and scales):
        python -m fvx.run preprocess experiments/finetune_cosmos.py:overfit_cosmos25_t2w --videos /data/my_clips \\
            --out /data/my_dataset models.student.path=/models/Cosmos-Predict2.5-2B-Diffusers"""
    return FinetuneCosmos(
        run=RunConfig(seed=42, steps=300, output_dir="outputs/cosmos25_overfit",
                      checkpoint=CheckpointConfig(every=50, keep_latest=2)),
        data=DataConfig(path="data/cosmos25_overfit_preprocessed", batch_size=1, text_len=512, cfg_rate=0.0,
                        num_latent_t=24, preprocess=OVERFIT_CUT),
        models={"student": CosmosConfig(preset="cosmos-predict2.5-2b", path="models/Cosmos-Predict2.5-2B-Diffusers",
                                        compute_dtype="bf16", remat=True)},
        validation=ValidationConfig(every=150, num_prompts=4, num_steps=35, flow_shift=FLOW_SHIFT, guidance_scale=7.0),
        method=Finetune(optim=AdamWConfig(lr=5e-5, betas=(0.9, 0.999), weight_decay=0.0, max_grad_norm=1.0,
                                          schedule="constant"), flow_shift=FLOW_SHIFT),
    )
