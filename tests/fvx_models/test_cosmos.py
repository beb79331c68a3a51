"""Cosmos Predict 2.5 (fvx_models.cosmos): the data's Reason1 embedding taken as it is, the DiT called as
Cosmos2_5_PredictBasePipeline calls it (sigma per frame, zero condition and padding masks, no fps, no text mask), the
velocity as it comes (its UniPC steps x0 = x - sigma v), FastVideo's zero unconditional and CFG-dropout refusal, the
released presets' padding mask (torchvision, or one line before the first step), the RoPE table's limit, every param
trained, the activation figures, and a PEFT LoRA file that diffusers' Cosmos 2.5 pipeline loads."""
import json
import types

import pytest
import torch
from diffusers import AutoencoderKLWan, CosmosTransformer3DModel, UniPCMultistepScheduler
from diffusers.models.transformers import transformer_cosmos
from diffusers.pipelines.cosmos.pipeline_cosmos2_5_predict import Cosmos2_5_PredictBasePipeline

from fvx.core import grad, random, role
from fvx_models import build, cosmos, lora, lora_files, wan_vae
from fvx_models.cosmos import CosmosConfig

from family_cases import CASES, cosmos_native, inputs, native_modules, raw_batch  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    model = CosmosConfig(preset="tiny").build()
    return model, model.weights.init(random.key(0))


def test_the_batch_text_is_the_reason1_embedding_as_it_is(tiny):
    model, _ = tiny
    raw = raw_batch(model, random.key(0))
    cond = model.batch(raw)["cond"]
    assert torch.equal(cond["text"], raw["text"]) and torch.equal(cond["text_mask"], raw["text_mask"])
    assert model.cond == {"text": ("L", 48), "text_mask": ("L",)}
    assert CosmosConfig(preset="cosmos-predict2.5-2b").build().cond["text"] == ("L", 100352)
    del raw["text_mask"]
    with pytest.raises(ValueError, match="cosmos needs the batch tensor 'text_mask' \\(the Reason1 text embedding"):
        model.batch(raw)
    narrow = {**raw_batch(model, random.key(0)), "text": torch.zeros(2, 5, 1024)}
    with pytest.raises(ValueError, match=r"cosmos: the batch's cond\['text'\] must be \[B, L, 48\], got "
                                         r"\[2, 5, 1024\]"):
        model.batch(narrow)


def test_the_dit_gets_sigma_per_frame_zero_masks_no_fps_and_the_unmasked_text(tiny):
    model, _ = tiny
    config = CASES["cosmos"].config
    x, t, cond = inputs(model, random.key(1), frames=3)
    kwargs, native = build.native_inputs(config, x, t, cond)
    assert set(kwargs) == {"hidden_states", "timestep", "encoder_hidden_states", "condition_mask", "padding_mask",
                           "return_dict"}  # no fps: FastVideo's DiT ignores its 16, diffusers' would scale RoPE
    assert kwargs["timestep"].dtype == torch.float32 and kwargs["timestep"].shape == (2, 1, 3, 1, 1)
    assert torch.equal(kwargs["timestep"], (t / 1000).view(2, 1, 1, 1, 1).expand(2, 1, 3, 1, 1))
    assert torch.equal(kwargs["condition_mask"], torch.zeros(2, 1, 3, 4, 4))
    assert torch.equal(kwargs["padding_mask"], torch.zeros(1, 1, 4, 4))
    assert kwargs["encoder_hidden_states"] is cond["text"] and torch.equal(native, x)
    half = cosmos.inputs(config, x.bfloat16(), t, cond, False)
    assert half["timestep"].dtype == torch.float32 and half["condition_mask"].dtype == torch.bfloat16


def test_the_text_mask_does_not_reach_the_dit(tiny):
    model, params = tiny
    x, t, cond = inputs(model, random.key(1))
    ones = {**cond, "text_mask": torch.ones_like(cond["text_mask"])}
    assert torch.equal(model.apply(params, x, t, cond), model.apply(params, x, t, ones))


def test_the_output_is_the_velocity_its_exported_scheduler_steps(tiny, tmp_path):
    """The exported UniPC (flow prediction on flow sigmas, shift 1) takes x0 = x - sigma v: v = noise - x0."""
    model, params = tiny
    model.export.folder(params, str(tmp_path))
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "Cosmos2_5_PredictBasePipeline"
    assert index["transformer"] == ["diffusers", "CosmosTransformer3DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKLWan"]
    scheduler = UniPCMultistepScheduler.from_pretrained(tmp_path / "scheduler")
    assert (scheduler.config.prediction_type, scheduler.config.use_flow_sigmas, scheduler.config.flow_shift,
            scheduler.config.use_karras_sigmas, scheduler.config.sigma_max) == ("flow_prediction", True, 1.0, True, 200)
    x0, noise = random.normal(random.key(2), (1, 16, 2, 4, 4)), random.normal(random.key(3), (1, 16, 2, 4, 4))
    scheduler.set_timesteps(4)
    scheduler._step_index = 1
    sigma = scheduler.sigmas[1]
    x = (1 - sigma) * x0 + sigma * noise
    torch.testing.assert_close(scheduler.convert_model_output(noise - x0, sample=x), x0, rtol=0, atol=1e-5)


def test_the_unconditional_is_zero_text_with_a_mask_of_ones_and_cfg_dropout_is_refused(tiny):
    model, _ = tiny
    _, _, cond = inputs(model, random.key(1))
    uncond = model.uncond(cond, "zero")
    assert torch.equal(uncond["text"], torch.zeros_like(cond["text"]))
    assert torch.equal(uncond["text_mask"], torch.ones_like(cond["text_mask"]))
    assert "NotImplementedError for training_cfg_rate > 0" in model.rules.cfg_dropout_refusal
    assert "\n" not in model.rules.cfg_dropout_refusal


def test_every_param_trains_in_text_to_world():
    """A forward and backward of the tiny model reach every param (the condition-mask and padding-mask inputs are
    zero but their patch-embedding columns still belong to a used weight): nothing is held frozen."""
    config = CosmosConfig(preset="tiny")
    assert cosmos.COSMOS.training.held_frozen(config) == frozenset()
    module = CosmosTransformer3DModel(**config.spec.kwargs)
    x, t, cond = inputs(config.build(), random.key(1))
    kwargs, _ = build.native_inputs(config, x, t, cond)
    module(**kwargs)[0].square().mean().backward()
    assert [name for name, p in module.named_parameters() if p.grad is None] == []


def test_latents_beyond_the_rope_table_are_refused_in_one_line(tiny):
    model, _ = tiny
    model.check_latents((1, 16, 128, 256, 256))
    for shape, patches in [((1, 16, 130, 4, 4), "(130, 2, 2)"), ((1, 16, 2, 4, 258), "(2, 2, 129)")]:
        with pytest.raises(ValueError) as error:
            model.check_latents(shape)
        assert f"hold at most (128, 128, 128) patches of (1, 2, 2) along (T, H, W) (max_size (128, 240, 240)), " \
               f"these latents make {patches}" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.skipif(cosmos.has_torchvision(), reason="torchvision is installed here")
def test_a_padding_mask_preset_without_torchvision_builds_and_refuses_in_one_line_before_a_step():
    model = CosmosConfig(preset="tiny-padded").build()
    assert model.memory_spec().groups[0].count == 2  # builds and dry-runs
    x, t, cond = inputs(model, random.key(1))
    params = model.weights.init(random.key(0))
    for call in (lambda: model.check_latents(tuple(x.shape)), lambda: model.apply(params, x, t, cond)):
        with pytest.raises(ValueError, match="concat_padding_mask=True: diffusers' CosmosTransformer3DModel resizes "
                                             "the padding mask with torchvision, which is not installed") as error:
            call()
        assert "\n" not in str(error.value)
    assert CosmosConfig(preset="cosmos-predict2.5-2b").build().memory_spec().groups[0].count == 28


def test_a_padding_mask_preset_equals_the_pipeline_call(monkeypatch):
    """The released structure (the padding mask concatenated: 18 input channels) at tiny size, against the
    pipeline's call with its pixel-sized padding mask; without torchvision, a stand-in for its nearest resize (what
    torchvision's tensor resize computes)."""
    if not cosmos.has_torchvision():
        resize = types.SimpleNamespace(resize=lambda x, size, interpolation: torch.nn.functional.interpolate(
            x, size=size, mode=interpolation))
        monkeypatch.setattr(transformer_cosmos, "transforms", types.SimpleNamespace(
            functional=resize, InterpolationMode=types.SimpleNamespace(NEAREST="nearest")), raising=False)
    config = CosmosConfig(preset="tiny-padded")
    model = config.build()
    params = model.weights.init(random.key(0))
    assert params["patch_embed.proj.weight"].shape == (64, 18 * 4)
    x, t, cond = inputs(model, random.key(1))
    model.check_latents(tuple(x.shape))
    module = CosmosTransformer3DModel(**config.spec.kwargs)
    module.load_state_dict(params)
    with torch.no_grad():
        want = cosmos_native({"transformer": module}, x, t, cond)
    torch.testing.assert_close(model.apply(params, x, t, cond), want, rtol=1e-5, atol=1e-5)


def test_the_released_presets_are_the_converters_configs():
    """Every constructor argument, as diffusers' convert_cosmos_to_diffusers writes Cosmos-2.5-Predict-Base-2B."""
    kwargs = CosmosConfig(preset="cosmos-predict2.5-2b").spec.kwargs
    signature = __import__("inspect").signature(CosmosTransformer3DModel.__init__).parameters
    assert sorted(kwargs) == sorted(name for name in signature if name != "self")
    assert (kwargs["in_channels"], kwargs["rope_scale"], kwargs["concat_padding_mask"], kwargs["extra_pos_embed_type"],
            kwargs["use_crossattn_projection"], kwargs["crossattn_proj_in_channels"]) == (
        17, (1.0, 3.0, 3.0), True, None, True, 100352)
    shapes = CosmosConfig(preset="cosmos-predict2.5-2b").build().memory_spec().shapes
    assert tuple(shapes["crossattn_proj.0.weight"]) == (1024, 100352)
    assert tuple(shapes["patch_embed.proj.weight"]) == (2048, 72)
    assert CosmosConfig(preset="cosmos-predict2.5-2b").spec.latents.mean[0] == -0.7571


# ----------------------------------------------------------------------------------------------------------- LoRA


def test_a_peft_lora_file_loads_with_the_cosmos_pipeline_and_equals_fvx_lora(tmp_path):
    pytest.importorskip("peft")
    targets = ("to_q", "to_k", "to_v", "to_out", "ff.net")
    adapted = CosmosConfig(frozen_dtype="fp32", lora=lora.LoRAConfig(rank=4, alpha=8.0, target_modules=targets)).build()
    base = adapted.weights.base(random.key(0))
    fresh = adapted.weights.initial(random.key(1))
    adapters = {name: random.normal(random.fold_in(random.key(1), i), tuple(p.shape)) * 0.1
                if name.endswith(lora.B) else p for i, (name, p) in enumerate(fresh.items())}
    assert len(adapted.export.adapters.args[0].modules) == 2 * (2 * 4 + 2)
    written = adapted.export.adapters(adapters, str(tmp_path), "peft")
    assert [p.name for p in written.files.values()] == [lora_files.PEFT_FILE]
    (transformer,) = native_modules(CASES["cosmos"], base).values()
    pipe = Cosmos2_5_PredictBasePipeline(text_encoder=None, tokenizer=None, transformer=transformer,
                                         vae=AutoencoderKLWan(**wan_vae.PRESETS["tiny"]),
                                         scheduler=UniPCMultistepScheduler(), safety_checker=lambda *a, **k: None)
    pipe.load_lora_weights(str(tmp_path), weight_name=lora_files.PEFT_FILE)
    x, t, cond = inputs(adapted, random.key(2))
    with torch.no_grad():
        loaded = cosmos_native({"transformer": pipe.transformer}, x, t, cond)
    ours = adapted.apply(role.with_trained(base, adapters), x, t, cond)
    plain = CosmosConfig(frozen_dtype="fp32").build().apply(base, x, t, cond)
    assert (ours - plain).abs().max() > 1e-3  # the adapters change the output
    torch.testing.assert_close(loaded.float(), ours, rtol=1e-5, atol=1e-5)


def test_lora_fine_tuning_reaches_every_adapter():
    model = CosmosConfig(lora=lora.LoRAConfig(rank=4, alpha=8.0, target_modules=("to_", "ff.net"))).build()
    x, t, cond = inputs(model, random.key(1))
    base, adapters = model.weights.base(random.key(0)), model.weights.initial(random.key(1))
    grads = grad.grad(lambda a: model.apply(role.with_trained(base, a), x, t, cond).square().mean())(adapters)
    assert all(bool(g.abs().sum()) for name, g in grads.items() if name.endswith(lora.B))
