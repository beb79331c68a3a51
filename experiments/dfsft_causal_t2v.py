"""Diffusion-forcing SFT of a block-causal Wan (FastVideo's `fine_tuning/wan/dfsft_causal_t2v.yaml`, as an fvx
experiment).

Every block of latent frames draws its own noise level, so the causal model learns to denoise a block whatever the
state of the blocks before it (`fvx_methods.dfsft`). The default trains the toy world's causal Wan (`world` preset,
blocks of 2 latent frames) from scratch on 6-frame clips of fvx's toy video world on a 2-core CPU in about a
minute; validation samples it as it runs, block by block on its KV cache (3 blocks), so its videos, and
`validation/model/nearest_mse`, show whether a block continues the motion of the blocks before it:
    python -m fvx.run experiments/dfsft_causal_t2v.py
`models.student.path=runs/teacher` starts instead from the bidirectional model `finetune_wan.py` trains (exported as
in the README), as FastVideo starts from Wan 2.1: the causal model loads ordinary Wan folders.
FastVideo's recipes are the recipes `wan21_t2v_1p3b` (Wan 2.1 T2V 1.3B, chunks of 3 latent frames) and `framewise`
(one frame per chunk and per block), 8 ranks of batch 1; point their paths at local folders:
    torchrun --nproc-per-node 8 -m fvx.run experiments/dfsft_causal_t2v.py:wan21_t2v_1p3b \
        models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers data.path=/data/Wan-Syn_77x448x832_600k
Teacher forcing (the clean history as context) is `experiments/tfsft_causal_t2v.py`.
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
from fvx_methods.dfsft import DFSFT
from fvx_models.wan_causal import WanCausalConfig
from fvx_models.wan_vae import WanVAEConfig


# No FastVideo script writes Wan-Syn_77x448x832: the recipe's 18 latent frames (the YAML's 69 frames) of 448x832, at
# Wan's 16 fps (Wan-Syn's own 77-frame clips serve too: data.num_latent_t keeps the first 18)
WAN_SYN_18 = PreprocessConfig(num_frames=69, train_fps=16, max_height=448, max_width=832)


class DFSFTWanCausal(Experiment):
    models: dict[str, WanCausalConfig] = msgspec.field(default_factory=lambda: {"student": WanCausalConfig()})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples; None logs latent previews
    method: DFSFT = DFSFT()


config = DFSFTWanCausal(
    run=RunConfig(seed=0, steps=800, output_dir="runs/dfsft_causal_t2v", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig(frames=6)),
    models={"student": WanCausalConfig(preset="world", num_frames_per_block=2)},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, display_scale=4),
    method=DFSFT(chunk_size=2, optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)


def fastvideo_recipe(frames_per_block: int, output_dir: str) -> DFSFTWanCausal:
    """dfsft_causal_t2v.yaml with blocks and chunks of ``frames_per_block`` latent frames."""
    return DFSFTWanCausal(
        run=RunConfig(seed=1000, steps=4000, output_dir=output_dir,
                      checkpoint=CheckpointConfig(every=1000, keep_latest=3)),
        data=DataConfig(path="data/Wan-Syn_77x448x832_600k", batch_size=8, text_len=512, cfg_rate=0.0,
                        num_latent_t=18, preprocess=WAN_SYN_18),
        models={"student": WanCausalConfig(preset="wan2.1-t2v-1.3b", path="models/Wan2.1-T2V-1.3B-Diffusers",
                                           num_frames_per_block=frames_per_block, compute_dtype="bf16", remat=True)},
        validation=ValidationConfig(every=50, num_prompts=4, num_steps=40, flow_shift=5.0, guidance_scale=6.0),
        method=DFSFT(chunk_size=frames_per_block, flow_shift=3.0,
                     optim=AdamWConfig(lr=2e-6, betas=(0.9, 0.999), weight_decay=0.01, max_grad_norm=1.0,
                                       schedule="constant")),
    )


@recipe
def wan21_t2v_1p3b() -> DFSFTWanCausal:
    """FastVideo's fine_tuning/wan/dfsft_causal_t2v.yaml: causal Wan 2.1 T2V 1.3B from the bidirectional weights,
    chunks and blocks of 3 latent frames, AdamW lr 2e-6, betas (0.9, 0.999), weight decay 0.01, constant, clip 1;
    global batch 8 (8 ranks of 1), 18 latent frames (69 frames) of 448x832; 4000 steps, checkpoints every 1000 (the
    newest 3 kept). Timesteps come from the model's shift-3 training grid (spec §0.4); the pipeline's shift 5 is the
    validation schedule's (40 steps at guidance 6, every 50; the streaming sampler keeps a KV cache per CFG branch).
    FastVideo's recipe does not fix the data's 18 latent frames to whole chunks; fvx checks it. No FastVideo script
    writes Wan-Syn: ``data.preprocess`` cuts 69 frames of 448x832 at 16 fps:
        python -m fvx.run preprocess experiments/dfsft_causal_t2v.py:wan21_t2v_1p3b --videos /data/my_clips \\
            --out /data/my_dataset models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers"""
    return fastvideo_recipe(3, "outputs/wan2.1_causal_dfsft")


@recipe
def framewise() -> DFSFTWanCausal:
    """FastVideo's dfsft_causal_t2v_framewise.yaml: as ``wan21_t2v_1p3b`` but every latent frame is a block and a
    chunk of its own (each frame draws its own noise level). The same data (``preprocess`` as ``wan21_t2v_1p3b``'s)."""
    return fastvideo_recipe(1, "outputs/wan2.1_causal_dfsft_framewise")
