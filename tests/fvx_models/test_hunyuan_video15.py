"""HunyuanVideo 1.5 (fvx_models.hunyuan_video15): the presets as released, the batch's two text streams, the DiT's
inputs as the t2v pipeline makes them (zero condition latents and mask, the zero image placeholder, t as given and
kept fp32 under bf16), the empty glyph stream, the params the DiT does not use measured and held frozen (no optimizer
state, unchanged by a step, exported as loaded), fine-tuning with them held, the exported pipeline files, a PEFT LoRA
file that diffusers' transformer loads, and bad input as one clear error."""
import inspect
import json
import math

import pytest
import torch
from diffusers import HunyuanVideo15Transformer3DModel

from fvx.core import grad, random, role
from fvx.core.optim_config import AdamWConfig
from fvx_methods import finetune
from fvx_models import build, hunyuan_video15, lora, lora_files
from fvx_models.hunyuan_video15 import HunyuanVideo15Config

from family_cases import CASES, inputs, native_modules, raw_batch  # noqa: E402
from test_lora import trained_adapters  # noqa: E402

NATIVE = CASES["hunyuan_video15"].native


@pytest.fixture(scope="module")
def tiny():
    model = HunyuanVideo15Config(preset="tiny").build()
    return model, model.weights.init(random.key(0))


def masked_inputs(model, key):
    """Inputs with real 0/1 masks: padding in the last sample's Qwen text, one ByT5 token in the first sample and an
    empty ByT5 stream (a prompt that quotes no text) in the second."""
    x, t, cond = inputs(model, key)
    cond["text_mask_2"] = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0]])
    return x, t, cond


# ------------------------------------------------------------------------------------------------------- presets


def test_every_preset_gives_every_constructor_argument_and_the_released_t2v_configs():
    arguments = {name for name in inspect.signature(HunyuanVideo15Transformer3DModel.__init__).parameters} - {"self"}
    for name, preset in hunyuan_video15.PRESETS.items():
        assert set(preset.kwargs) == arguments, name
        assert not preset.kwargs["use_meanflow"] and preset.kwargs["task_type"] == "t2v"
        assert preset.kwargs["in_channels"] == 2 * preset.kwargs["out_channels"] + 1 == 2 * preset.latents.channels + 1
    p480, p720 = (hunyuan_video15.PRESETS[f"hunyuanvideo1.5-{r}-t2v"] for r in ("480p", "720p"))
    assert {**p480.kwargs, "target_size": 960} == p720.kwargs and p480.kwargs["target_size"] == 640
    assert (p480.options["flow_shift"], p720.options["flow_shift"]) == (5.0, 9.0)
    k = p480.kwargs
    assert (k["num_layers"], k["num_attention_heads"] * k["attention_head_dim"], k["text_embed_dim"],
            k["text_embed_2_dim"], k["image_embed_dim"], p480.text_len, p480.options["glyph_len"]) == (
        54, 2048, 3584, 1472, 1152, 1000, 256)
    assert p480.latents.channels == 32 and p480.latents.scale == 1.03682 and p480.latents.vae_stride == (4, 16, 16)
    spec = HunyuanVideo15Config(preset="hunyuanvideo1.5-480p-t2v").build().memory_spec()  # a meta skeleton
    assert abs(sum(math.prod(s) for s in spec.shapes.values()) / 1e9 - 8.33) < 0.01
    assert [(g.name, g.count, g.dim, g.ffn_dim, g.text_tokens) for g in spec.groups] == [
        ("transformer_blocks", 54, 2048, 8192, False), ("token_refiner", 2, 2048, 8192, True)]
    assert spec.patch == (1, 1, 1) and spec.text_len == 1000


# ---------------------------------------------------------------------------------------------------- the batch


def test_the_batch_holds_both_text_streams_and_without_glyph_text_only_the_qwen_one(tiny):
    model, _ = tiny
    raw = raw_batch(model, random.key(3))
    cond = model.batch(raw)["cond"]
    assert sorted(cond) == ["text", "text_2", "text_mask", "text_mask_2"]
    assert all(torch.equal(cond[name], raw[name]) for name in cond)
    assert not {"text", "text_mask", "text_2", "text_mask_2"} & set(model.batch(raw))  # all moved into the cond
    plain = HunyuanVideo15Config(preset="tiny", glyph_text=False).build()
    qwen_only = {k: v for k, v in raw.items() if k not in ("text_2", "text_mask_2")}
    assert sorted(plain.batch(qwen_only)["cond"]) == ["text", "text_mask"]
    assert plain.cond == {"text": ("L", 32), "text_mask": ("L",)}


def test_a_batch_without_the_glyph_stream_names_it_and_the_knob(tiny):
    model, _ = tiny
    raw = raw_batch(model, random.key(3))
    del raw["text_2"]
    with pytest.raises(ValueError, match=r"^hunyuan_video15 needs the batch tensor 'text_2' \(the ByT5 glyph-text "
                                         r"embedding and its mask; for data whose prompts quote no text set "
                                         r"glyph_text=false\)"):
        model.batch(raw)
    plain = HunyuanVideo15Config(preset="tiny", glyph_text=False).build()
    with pytest.raises(ValueError, match=r"^hunyuan_video15: the batch holds a ByT5 glyph embedding \(text_2\) but "
                                         r"glyph_text is false"):
        plain.batch(raw_batch(model, random.key(3)))
    with pytest.raises(ValueError, match="hunyuan_video15 needs the batch tensor 'text_mask'"):
        plain.batch({"latents": raw["latents"], "text": raw["text"]})


# --------------------------------------------------------------------------------------------------- the inputs


def test_inputs_are_the_t2v_pipelines_zero_condition_mask_and_image_placeholder_with_t_as_given(tiny):
    model, _ = tiny
    config = CASES["hunyuan_video15"].config
    x, t, cond = masked_inputs(model, random.key(1))
    kwargs, native = build.native_inputs(config, x, t, cond)
    hidden = kwargs["hidden_states"]
    assert hidden.shape == (2, 9, 2, 4, 4) and torch.equal(hidden[:, :4], x) and not hidden[:, 4:].any()
    assert kwargs["image_embeds"].shape == (2, 729, 16) and not kwargs["image_embeds"].any()
    assert kwargs["timestep"] is t  # 0..1000 as the pipeline passes its scheduler's timesteps
    assert kwargs["encoder_attention_mask_2"] is cond["text_mask_2"] and kwargs["encoder_hidden_states_2"] is cond[
        "text_2"]
    assert torch.equal(native, x) and "timestep_r" not in kwargs


def test_without_glyph_text_the_dit_gets_the_pipelines_empty_byt5_stream(tiny):
    model, params = tiny
    config = HunyuanVideo15Config(preset="tiny", glyph_text=False)
    plain = config.build()
    x, t, cond = masked_inputs(model, random.key(1))
    kwargs, _ = build.native_inputs(config, x, t, {"text": cond["text"], "text_mask": cond["text_mask"]})
    assert kwargs["encoder_hidden_states_2"].shape == (2, 4, 24) and not kwargs["encoder_hidden_states_2"].any()
    assert kwargs["encoder_attention_mask_2"].shape == (2, 4) and not kwargs["encoder_attention_mask_2"].any()
    got = plain.apply(params, x, t, {"text": cond["text"], "text_mask": cond["text_mask"]})
    empty = {**cond, "text_2": torch.zeros(2, 4, 24), "text_mask_2": torch.zeros(2, 4)}
    with torch.no_grad():
        want = NATIVE(native_modules(CASES["hunyuan_video15"], params), x, t, empty)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.apply(params, x, t, empty), got, rtol=0, atol=0)


def test_apply_with_real_masks_equals_the_pipeline_call_and_padded_tokens_do_not_matter(tiny):
    model, params = tiny
    x, t, cond = masked_inputs(model, random.key(1))
    got = model.apply(params, x, t, cond)
    with torch.no_grad():
        want = NATIVE(native_modules(CASES["hunyuan_video15"], params), x, t, cond)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    noisy = {**cond, "text": cond["text"] + 5 * (1 - cond["text_mask"])[..., None],
             "text_2": cond["text_2"] + 5 * (1 - cond["text_mask_2"])[..., None]}  # padded positions changed
    torch.testing.assert_close(model.apply(params, x, t, noisy), got, rtol=1e-5, atol=1e-5)


def test_bf16_compute_keeps_t_in_fp32():
    """diffusers' time embedding casts its features to t's dtype, so its bf16 pipeline rounds t to bf16 (999 and 1000
    are one bf16 number); fvx feeds fp32 t and the embedding casts the features to its weights' dtype."""
    model = HunyuanVideo15Config(preset="tiny", compute_dtype="bf16").build()
    params = model.weights.init(random.key(0))
    x, _, cond = masked_inputs(model, random.key(1))
    outs = [model.apply(params, x, torch.full((2,), value), cond) for value in (999.0, 1000.0)]
    assert all(torch.isfinite(o).all() for o in outs) and outs[0].dtype == torch.float32
    assert not torch.equal(outs[0], outs[1])
    assert torch.tensor(999.0).bfloat16() == torch.tensor(1000.0).bfloat16()


def test_the_zero_unconditional_keeps_one_qwen_token_and_an_empty_glyph_stream(tiny):
    model, params = tiny
    _, _, cond = masked_inputs(model, random.key(1))
    zero = model.uncond(cond, "zero")
    assert zero["text_mask"].tolist() == [[1, 0, 0, 0, 0]] * 2 and not zero["text_mask_2"].any()
    assert not any(zero[name].any() for name in ("text", "text_2"))
    x, t, _ = masked_inputs(model, random.key(2))
    assert torch.isfinite(model.apply(params, x, t, zero)).all()


# ----------------------------------------------------------------------------------------------- unused params


def test_the_unused_params_are_exactly_those_without_gradient():
    """A forward and backward of the tiny diffusers module as the pipeline calls it: the 6 params of the last block's
    text output get no gradient, its text query and the image embedder (text-to-video) an exactly zero one."""
    config = CASES["hunyuan_video15"].config
    model = config.build()
    params = model.weights.init(random.key(0))
    (module,) = native_modules(CASES["hunyuan_video15"], params).values()
    x, t, cond = masked_inputs(model, random.key(1))
    NATIVE({"transformer": module}, x, t, cond).square().mean().backward()
    none = {n for n, p in module.named_parameters() if p.grad is None}
    zero = {n for n, p in module.named_parameters() if p.grad is not None and not p.grad.any()}
    assert len(none) == 6 and len(params) == 119 and all(n.startswith("transformer_blocks.1.") for n in none)
    assert none | zero == hunyuan_video15.unused(config) and len(zero) == 11
    assert model.weights.trained_names == frozenset(params) - hunyuan_video15.unused(config)


def test_unused_params_are_held_frozen_unchanged_by_a_step_and_exported_as_loaded(tiny, tmp_path):
    _, params = tiny
    base = tmp_path / "base"
    CASES["hunyuan_video15"].config.build().export.folder(params, str(base))
    model = HunyuanVideo15Config(preset="tiny", path=str(base), frozen_dtype="fp32").build()
    unused = hunyuan_video15.unused(HunyuanVideo15Config(preset="tiny"))
    assert unused <= set(params) and not unused & model.weights.trained_names
    program = finetune.Finetune(optim=AdamWConfig(lr=1e-2, weight_decay=0.1)).build({"student": model}, total_steps=2)
    state, frozen = program.init(random.key(0)), program.frozen(random.key(0))
    assert set(frozen["student"]) == unused and set(state.roles["student"].params) == model.weights.trained_names
    states = _dicts(state.roles["student"].opt_state)
    assert states and all(set(s) == model.weights.trained_names for s in states)  # Adam's moments: none for the unused
    for i in range(2):
        state, metrics = program.step_(state, frozen, model.batch(raw_batch(model, random.key(10 + i))))
        assert math.isfinite(float(metrics["loss"]))
    trained = state.roles["student"].params
    assert all(torch.equal(frozen["student"][n], params[n]) for n in unused)
    assert sum(not torch.equal(trained[n], params[n]) for n in trained) == len(trained)  # decayed, if nothing else
    model.export.folder(role.with_trained(frozen["student"], trained), str(tmp_path / "out"))
    loaded = HunyuanVideo15Transformer3DModel.from_pretrained(tmp_path / "out" / "transformer").state_dict()
    assert all(torch.equal(loaded[n], params[n]) for n in unused)
    assert all(torch.equal(loaded[n], trained[n]) for n in trained)


def _dicts(tree_):
    if isinstance(tree_, dict):
        return [tree_]
    if isinstance(tree_, (tuple, list)):
        return [d for item in tree_ for d in _dicts(item)]
    return []


def test_remat_gives_the_trained_params_the_same_gradients(tiny):
    model, params = tiny
    remat = HunyuanVideo15Config(preset="tiny", remat=True).build()
    x, t, cond = masked_inputs(model, random.key(2))
    target = random.normal(random.key(3), tuple(x.shape))
    grads = [grad.value_and_grad(lambda p: ((m.apply(p, x, t, cond) - target) ** 2).mean())(params)[1]
             for m in (model, remat)]
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in params)


# ----------------------------------------------------------------------------------------------------- exports


@pytest.mark.parametrize("preset, shift", [("tiny", 5.0), ("hunyuanvideo1.5-720p-t2v", 9.0)])
def test_the_exported_pipeline_files_name_hunyuanvideo15s_pipeline_with_its_flow_shift_and_guidance(
        tmp_path, preset, shift):
    config = HunyuanVideo15Config(preset=preset)
    hunyuan_video15.pipeline_files(config, tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "HunyuanVideo15Pipeline"
    assert index["transformer"] == ["diffusers", "HunyuanVideo15Transformer3DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKLHunyuanVideo15"]
    assert index["guider"] == ["diffusers", "ClassifierFreeGuidance"]
    assert json.loads((tmp_path / "scheduler" / "scheduler_config.json").read_text())["shift"] == shift
    assert json.loads((tmp_path / "guider" / "guider_config.json").read_text())["guidance_scale"] == 6.0


def test_a_peft_lora_export_loads_into_diffusers_transformer_and_equals_fvxs_lora_model(tmp_path):
    """diffusers 0.42's HunyuanVideo15Pipeline has no load_lora_weights: its transformer's load_lora_adapter (what
    load_lora_weights calls for the pipelines that have it) reads the file, alpha / r from its metadata."""
    pytest.importorskip("peft")
    targets = ("to_q", "to_k", "to_v", "to_out", "ff", "proj")
    config = HunyuanVideo15Config(preset="tiny", frozen_dtype="fp32",
                                  lora=lora.LoRAConfig(rank=4, alpha=8.0, target_modules=targets))
    adapted = config.build()
    base = adapted.weights.base(random.key(0))
    adapters = trained_adapters(adapted, random.key(1))
    assert adapted.export.adapter_formats == ("peft",)  # no original layout in fvx
    adapted.export.adapters(adapters, str(tmp_path), "peft")
    (transformer,) = native_modules(CASES["hunyuan_video15"], base).values()
    transformer.load_lora_adapter(str(tmp_path), weight_name=lora_files.PEFT_FILE, prefix="transformer")
    x, t, cond = masked_inputs(adapted, random.key(2))
    with torch.no_grad():
        loaded = NATIVE({"transformer": transformer}, x, t, cond)
        plain = NATIVE(native_modules(CASES["hunyuan_video15"], base), x, t, cond)
    got = adapted.apply(role.with_trained(base, adapters), x, t, cond)
    torch.testing.assert_close(loaded, got, rtol=1e-5, atol=1e-5)
    assert (got - plain).abs().max() > 1e-3  # the adapters matter


# --------------------------------------------------------------------------------------------------- bad input


def test_bad_cond_tensors_are_one_line_errors_naming_them(tiny):
    model, params = tiny
    x, t, cond = masked_inputs(model, random.key(1))
    with pytest.raises(ValueError, match=r"cond\['text_2'\] must be \[B, 4, 24\], got \[2, 5, 24\]"):
        model.apply(params, x, t, {**cond, "text_2": torch.zeros(2, 5, 24)})
    with pytest.raises(ValueError, match=r"missing \['text_mask_2'\]"):
        model.apply(params, x, t, {k: v for k, v in cond.items() if k != "text_mask_2"})
    with pytest.raises(ValueError, match=r"x_t must be \[B, 4, T, H, W\]"):
        model.apply(params, torch.cat([x, x[:, :1]], dim=1), t, cond)
    with pytest.raises(ValueError, match=r"unknown hunyuan_video15 preset 'hunyuanvideo1.5-480p-i2v'; valid presets: "
                                         r"tiny, hunyuanvideo1.5-480p-t2v, hunyuanvideo1.5-720p-t2v"):
        HunyuanVideo15Config(preset="hunyuanvideo1.5-480p-i2v")


def test_compile_model_is_refused_in_one_line_naming_the_data_dependent_forward():
    with pytest.raises(ValueError, match=r"compile=model cannot compile the hunyuan_video15 family's forward as one "
                                         r"graph \(its forward reorders each sample's text tokens by their masks"):
        HunyuanVideo15Config(preset="tiny", compile="model").build()
