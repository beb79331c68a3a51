"""Teacher-forcing SFT of a block-causal Wan (FastVideo's `fine_tuning/wan/tfsft_causal_t2v.yaml`, as an fvx
experiment).

Diffusion-forcing SFT (`experiments/dfsft_causal_t2v.py`: a noise level per block) with the *clean* history as
context: each noisy block attends to the clean latents of the blocks before it, in one forward over `[clean |
noisy]` frames (`method.teacher_forcing`), which is what the block sees when the model streams (a KV cache of clean
blocks); FastVideo recommends it as the initialisation of causal distillation. It needs a model attending to all
earlier blocks (`local_attn_size=-1`). The default trains the toy world's causal Wan (blocks of 2 latent frames)
from scratch on 6-frame clips of fvx's toy video world on a 2-core CPU in about a minute and a half (each forward
runs over twice the frames); validation samples it block by block on its KV cache, and
`validation/model/nearest_mse` falls:
    python -m fvx.run experiments/tfsft_causal_t2v.py
FastVideo's recipe is the recipe `wan21_t2v_1p3b` (Wan 2.1 T2V 1.3B, chunks of 3 latent frames, 8 ranks of batch
1); point its paths at local folders:
    torchrun --nproc-per-node 8 -m fvx.run experiments/tfsft_causal_t2v.py:wan21_t2v_1p3b \
        models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers data.path=/data/Wan-Syn_77x448x832_600k
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


class TFSFTWanCausal(Experiment):
    models: dict[str, WanCausalConfig] = msgspec.field(default_factory=lambda: {"student": WanCausalConfig()})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples; None logs latent previews
    method: DFSFT = DFSFT(teacher_forcing=True)


config = TFSFTWanCausal(
    run=RunConfig(seed=0, steps=800, output_dir="runs/tfsft_causal_t2v", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig(frames=6)),
    models={"student": WanCausalConfig(preset="world", num_frames_per_block=2)},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, display_scale=4),
    method=DFSFT(chunk_size=2, teacher_forcing=True,
                 optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)


@recipe
def wan21_t2v_1p3b() -> TFSFTWanCausal:
    """FastVideo's fine_tuning/wan/tfsft_causal_t2v.yaml: causal Wan 2.1 T2V 1.3B from the bidirectional weights,
    global attention, chunks and blocks of 3 latent frames, AdamW lr 2e-6, betas (0.9, 0.999), weight decay 0.01,
    constant, clip 1; global batch 8 (8 ranks of 1), 18 latent frames (69 frames) of 448x832; 4000 steps,
    checkpoints every 1000 (the newest 3 kept). Timesteps on the model's shift-3 grid; the pipeline's shift 5 is the
    validation schedule's (40 steps at guidance 6, every 50; the streaming sampler keeps a KV cache per CFG
    branch). No FastVideo script writes Wan-Syn: ``data.preprocess`` cuts 69 frames of 448x832 at 16 fps:
        python -m fvx.run preprocess experiments/tfsft_causal_t2v.py:wan21_t2v_1p3b --videos /data/my_clips \\
            --out /data/my_dataset models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers"""
    return TFSFTWanCausal(
        run=RunConfig(seed=1000, steps=4000, output_dir="outputs/wan2.1_causal_tfsft",
                      checkpoint=CheckpointConfig(every=1000, keep_latest=3)),
        data=DataConfig(path="data/Wan-Syn_77x448x832_600k", batch_size=8, text_len=512, cfg_rate=0.0,
                        num_latent_t=18, preprocess=WAN_SYN_18),
        models={"student": WanCausalConfig(preset="wan2.1-t2v-1.3b", path="models/Wan2.1-T2V-1.3B-Diffusers",
                                           num_frames_per_block=3, local_attn_size=-1, sink_size=0,
                                           compute_dtype="bf16", remat=True)},
        validation=ValidationConfig(every=50, num_prompts=4, num_steps=40, flow_shift=5.0, guidance_scale=6.0),
        method=DFSFT(chunk_size=3, teacher_forcing=True, flow_shift=3.0,
                     optim=AdamWConfig(lr=2e-6, betas=(0.9, 0.999), weight_decay=0.01, max_grad_norm=1.0,
                                       schedule="constant")),
    )
