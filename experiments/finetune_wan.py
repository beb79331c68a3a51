"""Fine-tune Wan with flow matching (FastVideo's `fine_tuning/wan/t2v.yaml`, as an fvx experiment).

The default trains the tiny `world` preset on fvx's toy video world (`fvx.data.toy_world`: coloured bars drifting the
way the prompt says, latents a space-to-depth codec decodes exactly) on a 2-core CPU in about a minute and a half. Its
validation videos go from noise to the prompted bars, and `validation/model/nearest_mse` (the distance of the samples to
the nearest true clip of their prompt) and `prompt_match` say so in numbers:
    python -m fvx.run experiments/finetune_wan.py
The result is the teacher of the default DMD2 run (`experiments/dmd2.py`). FastVideo's recipe is the recipe
`wan21_t2v_1p3b` (Wan 2.1 T2V 1.3B, 8 ranks of batch 1); point its paths at local folders:
    torchrun --nproc-per-node 8 -m fvx.run experiments/finetune_wan.py:wan21_t2v_1p3b \
        models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers data.path=/data/my_dataset/combined_parquet_dataset
Wan 2.2 TI2V-5B is the same family (`models.student.preset=wan2.2-ti2v-5b`, 48-channel latents of the Wan 2.2 VAE).
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
from fvx_models.attention.config import VSAConfig
from fvx_models.wan import WanConfig
from fvx_models.wan_vae import WanVAEConfig

# No FastVideo script writes data/preprocessed or Wan-Syn: the YAMLs' 77 frames (20 latent) of 448x832 at Wan's 16 fps
WAN_448 = PreprocessConfig(num_frames=77, train_fps=16, max_height=448, max_width=832)
# examples/training/finetune/wan_t2v_1.3B/mixkit/preprocess_mixkit_data.sh (its tolerance: FastVideo's default, 2)
MIXKIT = PreprocessConfig(num_frames=77, train_fps=16, max_height=480, max_width=832, video_length_tolerance_range=2.0,
                          samples_per_file=8)


class FinetuneWan(Experiment):
    models: dict[str, WanConfig] = msgspec.field(default_factory=lambda: {"student": WanConfig()})
    vae: WanVAEConfig | SpaceToDepth | None = None  # decodes validation samples; None logs latent previews
    method: Finetune = Finetune()


config = FinetuneWan(
    run=RunConfig(seed=0, steps=800, output_dir="runs/finetune_wan", log_every=1),
    data=DataConfig(batch_size=8, text_len=4, world=WorldConfig(),
                    preprocess=PreprocessConfig(num_frames=4, train_fps=16, max_height=16, max_width=16)),
    models={"student": WanConfig(preset="world")},
    vae=SpaceToDepth(),
    validation=ValidationConfig(every=200, num_prompts=8, num_steps=20, display_scale=4),
    method=Finetune(optim=AdamWConfig(lr=3e-3, max_grad_norm=1.0, schedule="cosine", warmup_steps=50)),
)


@recipe
def wan21_t2v_1p3b() -> FinetuneWan:
    """FastVideo's fine_tuning/wan/t2v.yaml: Wan 2.1 T2V 1.3B, AdamW lr 1e-6, betas (0.9, 0.999), weight decay 0.01,
    constant, clip 1; global batch 8 (8 data-parallel ranks of 1), 20 latent frames of 448x832; 4000 steps,
    checkpoints every 100 (the newest 3 kept); validation every 100 steps, 50 steps at guidance 5. No FastVideo script
    writes its data: ``data.preprocess`` cuts the YAML's 77 frames of 448x832 at Wan's 16 fps:
        python -m fvx.run preprocess experiments/finetune_wan.py:wan21_t2v_1p3b --videos /data/my_clips \\
            --out /data/my_dataset models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers"""
    return FinetuneWan(
        run=RunConfig(seed=1000, steps=4000, output_dir="outputs/wan_finetune",
                      checkpoint=CheckpointConfig(every=100, keep_latest=3)),
        data=DataConfig(path="data/preprocessed", batch_size=8, text_len=512, cfg_rate=0.0, num_latent_t=20,
                        preprocess=WAN_448),
        models={"student": WanConfig(preset="wan2.1-t2v-1.3b", path="models/Wan2.1-T2V-1.3B-Diffusers",
                                     compute_dtype="bf16", remat=True)},
        validation=ValidationConfig(every=100, num_prompts=4, num_steps=50, flow_shift=3.0, guidance_scale=5.0),
        method=Finetune(optim=AdamWConfig(lr=1e-6, betas=(0.9, 0.999), weight_decay=0.01, max_grad_norm=1.0,
                                          schedule="constant"), flow_shift=3.0),
    )


@recipe
def wan21_t2v_1p3b_vsa() -> FinetuneWan:
    """FastVideo's fine_tuning/wan/t2v_vsa.yaml: ``wan21_t2v_1p3b`` with Video Sparse Attention at sparsity 0.9 from
    the first step (the gates start at zero: the dense checkpoint starts as itself), the Wan-Syn 77x448x832 latents
    (no FastVideo script; ``data.preprocess`` as the base's: 77 frames of 448x832 at 16 fps), validation every 50
    steps (4 prompts, 50 steps at guidance 5)."""
    base = wan21_t2v_1p3b()
    return msgspec.structs.replace(
        base, run=msgspec.structs.replace(base.run, output_dir="outputs/phase3.4_wan2.1_finetune_vsa_0.9_v3"),
        data=msgspec.structs.replace(base.data, path="data/Wan-Syn_77x448x832_600k"),
        models={"student": msgspec.structs.replace(base.models["student"], attention="vsa",
                                                   vsa=VSAConfig(sparsity=0.9))},
        validation=msgspec.structs.replace(base.validation, every=50))


@recipe
def world_attn_qat() -> FinetuneWan:
    """Stage 1 of FastVideo's QAD scenario on the toy world: the toy teacher (``runs/teacher``, the README's main
    command) fine-tuned 200 steps with fake-quantized NVFP4 attention (``attention=qat``) at lr 1e-4, so it learns to
    sample well through the low-bit attention it will run with; export it for stage 2 (``experiments/dmd2.py``'s
    ``world_attn_qad``):
        python -m fvx.run experiments/finetune_wan.py:world_attn_qat
        python -m fvx.run export runs/finetune_wan_attn_qat --out runs/teacher_attn_qat"""
    return msgspec.structs.replace(
        config, run=msgspec.structs.replace(config.run, steps=200, output_dir="runs/finetune_wan_attn_qat"),
        models={"student": WanConfig(preset="world", path="runs/teacher", attention="qat")},
        validation=msgspec.structs.replace(config.validation, every=100),
        method=Finetune(optim=AdamWConfig(lr=1e-4, max_grad_norm=1.0, schedule="constant")))


@recipe
def wan21_t2v_1p3b_attn_qat() -> FinetuneWan:
    """Stage 1 of FastVideo's QAD scenario (scenario/qad_wan2_1_mixkit/stage1_attn_qat_finetune.yaml): Wan 2.1 T2V
    1.3B fine-tuned with fake-quantized attention (``attention=qat``: FastVideo's ATTN_QAT_TRAIN), 4 ranks in one
    sequence-parallel group (``--sp 4``: global batch 1), 10% CFG dropout, training at shift 3 (the YAML sets no
    ``models.student.flow_shift``, so FastVideo's ``WanModel`` keeps its default 3.0, ``fastvideo/train/models/wan/
    wan.py:69,94``; its ``pipeline.flow_shift: 1`` is the validation's), 20 latent frames of 480x832
    from the HD-Mixkit latents; AdamW lr 1e-6, betas (0.9, 0.999), weight decay 0.01, constant, clip 1; 4000 steps,
    checkpoints every 500 (all kept); validation every 50 steps (50 steps at guidance 5). Its data is cut as
    FastVideo's mixkit/preprocess_mixkit_data.sh does (77 frames of 480x832 at 16 fps, 8 a file):
        python -m fvx.run preprocess experiments/finetune_wan.py:wan21_t2v_1p3b_attn_qat --videos /data/my_clips \\
            --out /data/my_dataset models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers
        torchrun --nproc-per-node 4 -m fvx.run experiments/finetune_wan.py:wan21_t2v_1p3b_attn_qat --sp 4"""
    base = wan21_t2v_1p3b()
    return msgspec.structs.replace(
        base, run=RunConfig(seed=1000, steps=4000, output_dir="checkpoints/wan_t2v_qat_finetune",
                            checkpoint=CheckpointConfig(every=500, keep_latest=None)),
        data=DataConfig(path="data/HD-Mixkit-Finetune-Wan/combined_parquet_dataset", batch_size=1, text_len=512,
                        cfg_rate=0.1, num_latent_t=20, preprocess=MIXKIT),
        models={"student": msgspec.structs.replace(base.models["student"], attention="qat")},
        validation=ValidationConfig(every=50, num_prompts=4, num_steps=50, flow_shift=1.0, guidance_scale=5.0),
        method=msgspec.structs.replace(base.method, flow_shift=3.0))


@recipe
def world_vsa() -> FinetuneWan:
    """FastWan's recipe on the toy world: the toy teacher (``runs/teacher``, the README's main command) fine-tuned
    with Video Sparse Attention on longer, larger clips (8 frames of 64x64 pixels: an 8x8x8 token grid of 8 tiles),
    its sparsity ramped from dense by 0.25 every 50 steps to 0.75 (each query tile attends to 2 of the 8 key tiles)
    while the zero-initialised gates learn to mix in the coarse tile-mean attention; ``vsa_sparsity`` is logged."""
    return msgspec.structs.replace(
        config, run=msgspec.structs.replace(config.run, steps=300, output_dir="runs/finetune_wan_vsa"),
        data=msgspec.structs.replace(config.data, world=WorldConfig(frames=8, size=64)),
        models={"student": WanConfig(preset="world", path="runs/teacher", attention="vsa",
                                     vsa=VSAConfig(sparsity=0.75, decay_rate=0.25, decay_interval_steps=50))},
        validation=msgspec.structs.replace(config.validation, every=100),
        method=Finetune(optim=AdamWConfig(lr=1e-4, max_grad_norm=1.0, schedule="constant")))
