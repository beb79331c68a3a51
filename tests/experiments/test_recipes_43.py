"""Issue 43's recipes against FastVideo's files, value for value (each value written down here from the YAML or script
named), and LoRA on ``to_gate_compress`` adapting VSA's gate."""
import pathlib

import msgspec
import pytest
import torch

from fvx import config as fconfig
from fvx.core import random
from fvx_models.wan import WanConfig

from family_cases import inputs  # noqa: E402

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[2] / "experiments"


def load(name: str):
    return fconfig.load_experiment(EXPERIMENTS / name)


def adamw(optim) -> tuple:
    return optim.lr, tuple(optim.betas), optim.weight_decay, optim.schedule, optim.warmup_steps, optim.max_grad_norm


def test_kandinsky5_dmd2_qat_is_fastvideos_dmd2_t2v_480p_qat_yaml():
    """distribution_matching/kandinsky5/dmd2_t2v_480p_qat.yaml (+ distill_dmd_qat.sh: one export in every role,
    FASTVIDEO_ATTENTION_BACKEND=ATTN_QAT_TRAIN for the student only)."""
    config = load("dmd2_kandinsky5.py:kandinsky5_t2v_480p_dmd2_qat")
    models, method = config.models, config.method
    export = "outputs/kandinsky5_t2v_qat_finetune/checkpoint-1000-diffusers"  # models.*.init_from
    assert {role: (m.preset, m.path, m.attention) for role, m in models.items()} == {
        "student": ("kandinsky5-t2v-lite", export, "qat"), "critic": ("kandinsky5-t2v-lite", export, "sdpa"),
        "teacher": ("kandinsky5-t2v-lite", export, "sdpa")}
    assert msgspec.structs.asdict(method.roles) == {"student": "student", "critic": "critic", "teacher": "teacher"}
    assert all(m.remat and m.compute_dtype == "bf16" for m in models.values())  # checkpointing full; bf16 training
    assert (method.rollout_mode, method.generator_update_interval, method.guidance_scale, method.denoising_steps) == (
        "simulate", 5, 4.5, (1000, 750, 500, 250))
    assert (method.flow_shift, method.timestep_shift, method.sampling_shift) == (5.0, 5.0, None)  # pipeline.flow_shift
    assert (method.cfg_uncond, method.negative_prompt_path) == (
        "negative_prompt", "data/kandinsky5_negative_prompt.safetensors")  # Kandinsky5Model's default uncond
    assert adamw(method.optim) == (2e-6, (0.0, 0.999), 0.01, "constant", 0, 1.0)
    assert adamw(method.critic_optim)[:5] == (8e-6, (0.0, 0.999), 0.01, "constant", 0)  # fake_score_*
    assert (method.ema_decay, method.ema_start_step) == (0.98, 0)
    data, run = config.data, config.run
    assert (data.path, data.batch_size, data.cfg_rate, data.num_latent_t, data.text_len) == (
        "data/kandinsky5_overfit_preprocessed", 8, 0.0, 31, 513)  # 8 ranks x train_batch_size 1
    cut = data.preprocess
    assert (cut.num_frames, cut.max_height, cut.max_width) == (121, 512, 768)
    assert (run.seed, run.steps, run.output_dir) == (1000, 4000, "outputs/kandinsky5_t2v_dmd2_4steps_qat")
    assert (run.checkpoint.every, run.checkpoint.keep_latest) == (20, 3)
    assert (config.validation.every, config.validation.guidance_scale, config.validation.flow_shift) == (50, 6.0, 5.0)


def test_kandinsky5_dmd2_default_is_the_scenario_on_the_tiny_preset():
    config = load("dmd2_kandinsky5.py")
    assert {role: (m.preset, m.attention) for role, m in config.models.items()} == {
        "student": ("tiny", "qat"), "critic": ("tiny", "sdpa"), "teacher": ("tiny", "sdpa")}
    assert len({m.path for m in config.models.values()}) == 1  # one stage-1 export in every role
    stage1 = load("finetune_kandinsky5.py")
    assert (config.data.synthetic, config.run.seed) == (stage1.data.synthetic, stage1.run.seed)  # its texts


def test_fastwan22_ti2v_lora_vsa_is_fastvideos_fast_ti2v_fullattn_lora_vsa_yaml():
    """fine_tuning/wan/fast_ti2v_fullattn_lora_vsa.yaml (data: Wan2.2-TI2V-5B-Diffusers/crush_smol/
    preprocess_wan_data_ti2v_5b.sh)."""
    config = load("finetune_wan22_ti2v.py:fastwan22_ti2v_5b_fullattn_lora_vsa")
    student, method = config.models["student"], config.method
    assert (student.preset, student.path, student.compute_dtype, student.remat) == (
        "wan2.2-ti2v-5b", "models/FastWan2.2-TI2V-5B-FullAttn-Diffusers", "bf16", True)
    assert (student.lora.rank, student.lora.alpha, student.lora.target_modules) == (
        16, 32.0, ("to_q", "to_k", "to_v", "to_out", "to_gate_compress"))
    assert (student.attention, student.vsa.sparsity, student.vsa.decay_rate) == ("vsa", 0.8, 0.0)
    assert not student.first_frame  # T2V-style data
    assert adamw(method.optim) == (1e-5, (0.9, 0.999), 0.01, "constant", 0, 1.0)
    assert (method.grad_accum, method.flow_shift) == (5, 3.0)  # WanModel's shift 3; pipeline.flow_shift 5 validates
    data, run = config.data, config.run
    assert (data.path, data.batch_size, data.cfg_rate, data.num_latent_t) == (
        "data/crush-smol_processed_ti2v/combined_parquet_dataset", 5, 0.0, 20)
    cut = data.preprocess
    assert (cut.num_frames, cut.train_fps, cut.max_height, cut.max_width, cut.samples_per_file) == (
        121, 24, 704, 1280, 8)
    assert (run.seed, run.steps, run.output_dir) == (42, 10, "outputs/fast_wan_ti2v_fullattn_lora_vsa")
    assert (run.checkpoint.every, run.checkpoint.keep_latest) == (5, 2)
    validation = config.validation
    assert (validation.every, validation.num_steps, validation.guidance_scale, validation.flow_shift) == (
        0, 3, 5.0, 5.0)
    assert validation.latent_shape == (48, 20, 30, 52)  # 77 frames of 480x832 through the Wan 2.2 VAE


@pytest.fixture(scope="module")
def gated_lora_model():
    lora = fconfig.run_experiment(EXPERIMENTS / "finetune_wan22_ti2v.py")["TI2V_VSA_LORA"]
    model = WanConfig(preset="tiny-ti2v", lora=lora, attention="vsa").build()
    return model, {**model.weights.init(random.key(0)), **model.weights.initial(random.key(0))}  # fp32 base + adapters


def test_lora_on_to_gate_compress_adapts_every_blocks_vsa_gate(gated_lora_model):
    model, params = gated_lora_model
    gates = sorted(name for name in params if "to_gate_compress.lora_" in name)
    assert gates == [f"blocks.{n}.to_gate_compress.{part}.weight" for n in (0, 1) for part in ("lora_A", "lora_B")]
    assert set(gates) <= model.weights.trained_names
    x, t, cond = inputs(model, random.key(1), frames=8, size=16)
    before = model.apply(params, x, t, cond)
    gate_b = "blocks.0.to_gate_compress.lora_B.weight"
    moved = {**params, gate_b: torch.full_like(params[gate_b], 0.05)}
    assert (model.apply(moved, x, t, cond) - before).abs().max() > 1e-4  # the adapter reaches the gate's output
    trainable = {name: p.clone().requires_grad_() for name, p in moved.items()}
    model.apply(trainable, x, t, cond).square().mean().backward()
    assert trainable["blocks.0.to_gate_compress.lora_A.weight"].grad.abs().max() > 0


def test_dmd2_text_only_is_fastvideos_train_dmd2_t2v_text_only_script():
    """scripts/train/train_dmd2_t2v_text_only.sh over dmd2_t2v.yaml (its values) and wan21_t2v_1p3b's (the YAML's)."""
    config, base = load("dmd2.py:wan21_t2v_1p3b_text_only"), load("dmd2.py:wan21_t2v_1p3b")
    data, method, validation = config.data, config.method, config.validation
    assert (data.path, data.kind, data.batch_size, data.num_latent_t) == (
        "data/train_text_only_dmd_preprocessed", "text_only", 2, 1)  # DATA_PATH, text_only, NUM_GPUS 2, NUM_LATENT_T
    assert data.preprocess.samples_per_file == 8 and data.text_len == 512  # SAMPLES_PER_FILE, TEXT_MAX_LENGTH
    assert method.latent_shape == validation.latent_shape == (16, 1, 56, 104)  # NUM_FRAMES 1 of 448x832
    assert (method.cfg_uncond, method.negative_prompt_path) == ("zero", None)  # CFG_UNCOND_TEXT zero
    assert (validation.prompts_file, validation.num_prompts, validation.every) == (
        "data/dmd2_text_only_validation.safetensors", 16, 50)  # the JSON's 16 captions
    assert config.run.output_dir == "outputs/wan2.1_dmd2_text_only"
    def rest(c):  # what the script leaves as dmd2_t2v.yaml has it
        method = msgspec.structs.replace(c.method, latent_shape=None, cfg_uncond="zero", negative_prompt_path=None)
        return c.models, method, c.run.seed, c.run.steps, c.run.checkpoint

    assert rest(config) == rest(base)
