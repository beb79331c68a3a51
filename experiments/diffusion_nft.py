"""Online RL with DiffusionNFT (FastVideo's `rl/wan/diffusion_nft_pick_clip.yaml`, as an fvx experiment;
`fvx_methods.diffusion_nft`): the model samples, rewards score the samples, and it learns from its own best and worst.

The default fine-tunes the teacher that `experiments/finetune_wan.py` trains on fvx's toy video world (exported to
`runs/teacher`) for its 4-step Euler samples, rewarded by the world's own score of a clip (`world`: `exp(-MSE /
HIT)`, MSE the pixel MSE to the nearest true clip of its prompt: 1 for a true clip, 1/e at the hit threshold), on a
2-core CPU in about 5 minutes:
    python -m fvx.run experiments/finetune_wan.py && python -m fvx.run export runs/finetune_wan --out runs/teacher
    python -m fvx.run experiments/diffusion_nft.py
Each step samples 4 batches of 8 (2 prompts x 4 copies each) with the slow-moving old policy, scores them, and
trains the student towards the better samples of each prompt's group, in one AdamW update (2 micro-batches x 3
timesteps). It samples on evenly spaced levels (`method.sampling.spacing=even`: 1, 0.9, 0.75, 0.5 at shift 3), not
FastVideo's `set_timesteps` levels (1, 0.858, 0.602, 0.0089), which at 4 steps spend one model call near 0 and
leave the sample to a hop from 0.602. `reward/avg` rises in TensorBoard; validation videos carry their reward in the
caption. The recipe `world_lora` trains LoRA adapters instead (old policy and reference on the same frozen base).
FastVideo's recipe is `wan21_t2v_1p3b_pick_clip` (Wan 2.1 T2V 1.3B, PickScore + CLIPScore from local CLIP folders,
4 ranks); point its paths at local folders:
    torchrun --nproc-per-node 4 -m fvx.run experiments/diffusion_nft.py:wan21_t2v_1p3b_pick_clip \
        models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers data.path=/data/pickscore_text_only_preprocessed \
        method.reward_models.pickscore.path=/models/PickScore_v1 \
        method.reward_models.pickscore.processor=/models/CLIP-ViT-H-14-laion2B-s32B-b79K \
        method.reward_models.clipscore.path=/models/clip-vit-large-patch14
CLIP rewards need transformers: `pip install -e '.[rewards]'`.
"""
import msgspec

from fvx.config import recipe
from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.toy_world import SpaceToDepth, WorldConfig
from fvx.storage.checkpoint_config import CheckpointConfig
from fvx.training.experiment import Experiment, RunConfig
from fvx.training.validation import ValidationConfig
from fvx_methods.diffusion_nft import DiffusionNFT, RewardModel, Sampling
from fvx_models.lora import LoRAConfig
from fvx_models.wan import WanConfig
from fvx_models.wan_vae import WanVAEConfig


class DiffusionNFTWan(Experiment):
    models: dict[str, WanConfig] = msgspec.field(default_factory=lambda: {"student": WanConfig()})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes samples for the rewards and validation
    method: DiffusionNFT = DiffusionNFT(reward_fn={"world": 1.0})


TEACHER = "runs/teacher"  # experiments/finetune_wan.py's run, exported (module docstring)
WORLD = WorldConfig(num_samples=8)  # one row per prompt: a group is a prompt

config = DiffusionNFTWan(
    run=RunConfig(seed=0, steps=150, output_dir="runs/diffusion_nft", log_every=1),
    data=DataConfig(kind="text_only", batch_size=8, text_len=4, world=WORLD),
    models={"student": WanConfig(preset="world", path=TEACHER)},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=50, num_prompts=8, num_steps=4, latent_shape=WORLD.latent_shape,
                                display_scale=4),
    method=DiffusionNFT(
        reward_fn={"world": 1.0}, sampling=Sampling(num_steps=4, spacing="even"), flow_shift=3.0,
        num_batches_per_epoch=4, num_video_per_prompt=4, train_batch_size=16, grad_accum=2,
        latent_shape=WORLD.latent_shape,
        optim=AdamWConfig(lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-4, max_grad_norm=1.0), ema_decay=0.9,
    ),
)


@recipe
def world_lora() -> DiffusionNFTWan:
    """The default with a LoRA student (r 16, alpha 32 on the attention projections): its old policy holds adapters
    only and its reference is the base with the adapters off, three roles on one frozen base (``--dry-run``)."""
    adapters = LoRAConfig(rank=16, alpha=32.0, target_modules=("to_q", "to_k", "to_v", "to_out"))
    return msgspec.structs.replace(
        config, run=msgspec.structs.replace(config.run, output_dir="runs/diffusion_nft_lora"),
        models={"student": WanConfig(preset="world", path=TEACHER, lora=adapters)},
        method=msgspec.structs.replace(config.method, optim=msgspec.structs.replace(config.method.optim, lr=1e-3)))


@recipe
def wan21_t2v_1p3b_pick_clip() -> DiffusionNFTWan:
    """FastVideo's diffusion_nft_pick_clip.yaml: Wan 2.1 T2V 1.3B, full fine-tuning (a frozen reference copy; the
    old policy is the student's params in the state), one latent frame of 448x832 (single-frame RL), text-only
    PickScore prompts. Rewards PickScore + CLIPScore (weights 1, 1) of the first frame; 25-step Euler ODE sampling at
    the pipeline's shift 8 on the levels of ``FlowMatchEulerDiscreteScheduler(shift=8).set_timesteps(25)`` as
    FastVideo's sampler (sigma 1 ... 0.293, 0.060); per step 48 sampling batches of 24 prompts (4 ranks x 6), each
    prompt 24 times; inner micro-batches of 24 (4 x 6), the first 24 of the 25 levels (sigma 1 ... 0.293), gradient
    accumulation 48 (one update per step); beta 0.1, kl_beta 1e-4, adv_clip_max 5, adv_mode all, old-policy decay
    type 1; AdamW lr 3e-5, betas (0.9, 0.999), weight decay 1e-4, constant, clip 1; EMA 0.9 from the first update,
    validated; 100000 steps, checkpoints every 30 (the newest 3 kept); validation every 10 steps, 16 prompts, 40
    steps at shift 8 on the same scheduler's levels (FastVideo's validation reuses ``method.sampling`` with its own
    step count: sigma 1 ... 0.060), seed 42."""
    wan = WanConfig(preset="wan2.1-t2v-1.3b", path="models/Wan2.1-T2V-1.3B-Diffusers", compute_dtype="bf16",
                    remat=True, compile="blocks")
    return DiffusionNFTWan(
        run=RunConfig(seed=42, steps=100000, output_dir="outputs/wan2.1_diffusion_nft_pick_clip",
                      checkpoint=CheckpointConfig(every=30, keep_latest=3)),
        data=DataConfig(path="data/pickscore_text_only_preprocessed", kind="text_only", batch_size=24,
                        text_len=512, cfg_rate=0.0),
        models={"student": wan},
        vae=WanVAEConfig(path="models/Wan2.1-T2V-1.3B-Diffusers/vae"),
        validation=ValidationConfig(every=10, num_prompts=16, num_steps=40, flow_shift=8.0, seed=42),
        method=DiffusionNFT(
            reward_fn={"pickscore": 1.0, "clipscore": 1.0},
            reward_models={"pickscore": RewardModel(path="models/PickScore_v1",
                                                    processor="models/CLIP-ViT-H-14-laion2B-s32B-b79K"),
                           "clipscore": RewardModel(path="models/clip-vit-large-patch14")},
            sampling=Sampling(num_steps=25, scheduler="flow_match_euler", spacing="set_timesteps", trajectory="ode"),
            flow_shift=8.0,
            num_batches_per_epoch=48, num_inner_epochs=1, num_video_per_prompt=24, train_batch_size=24,
            grad_accum=48, timestep_fraction=0.99, beta=0.1, kl_beta=1e-4, decay_type=1, adv_mode="all",
            adv_clip_max=5.0,
            optim=AdamWConfig(lr=3e-5, betas=(0.9, 0.999), weight_decay=1e-4, max_grad_norm=1.0, schedule="constant"),
            ema_decay=0.9, ema_update_after_step=0, validate_ema=True, latent_shape=(16, 1, 56, 104)),
    )
