"""Kandinsky 5.0 (fvx_models.kandinsky5): FastVideo's packed text unpacked, the DiT's inputs as FastVideo's plugin and
diffusers' pipeline make them (channels last, the zero image condition, the text cut to the batch's longest prompt,
the RoPE positions and scale), the zero unconditional, the 480p rule, every param trained, the activation figures,
the exported pipeline files, LoRA files that diffusers' pipeline loads, and bad input as one clear error."""
import inspect
import json

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5T2VPipeline, Kandinsky5Transformer3DModel

from fvx.core import grad, random
from fvx_models import build, kandinsky5, lora, lora_files
from fvx_models.kandinsky5 import Kandinsky5Config

from family_cases import CASES, inputs, native_modules, raw_batch  # noqa: E402
from test_lora import assert_loaded_lora_matches, trained_adapters  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    model = Kandinsky5Config().build()
    return model, model.weights.init(random.key(0))


@pytest.fixture(scope="module")
def lite():
    return Kandinsky5Config(preset="kandinsky5-t2v-lite").build()  # a meta skeleton: no weights drawn


def test_every_preset_gives_every_constructor_argument_and_the_real_ones_are_dense_at_480p():
    arguments = {name for name in inspect.signature(Kandinsky5Transformer3DModel.__init__).parameters} - {"self"}
    for name, preset in kandinsky5.PRESETS.items():
        assert set(preset.kwargs) == arguments, name
        assert preset.latents == kandinsky5.LATENTS
    assert kandinsky5.LATENTS.scale == 0.476986 and kandinsky5.LATENTS.vae_stride == (4, 8, 8)
    lite = kandinsky5.PRESETS["kandinsky5-t2v-lite"].kwargs
    assert (lite["model_dim"], lite["ff_dim"], lite["num_visual_blocks"], lite["visual_cond"]) == (1792, 7168, 32, True)
    assert kandinsky5.PRESETS["kandinsky5-t2v-lite"].text_len == 513  # FastVideo's Qwen text_len 512 + the pooled row


def test_the_batch_unpacks_fastvideos_packed_pooled_row(tiny):
    model, _ = tiny
    raw = raw_batch(model, random.key(3))
    cond = model.batch(raw)["cond"]
    assert torch.equal(cond["text"], raw["text"][:, 1:]) and torch.equal(cond["text_mask"], raw["text_mask"][:, 1:])
    assert torch.equal(cond["pooled"], raw["text"][:, 0, :16])  # in_text_dim2 of the tiny preset
    dropped = {**raw, "text": torch.zeros_like(raw["text"])}  # a CFG-dropped sample: its pooled row is zero too
    assert not model.batch(dropped)["cond"]["pooled"].any()


def test_inputs_are_channels_last_with_the_zero_image_condition_and_the_text_cut_to_the_longest_prompt(tiny):
    model, _ = tiny
    config = CASES["kandinsky5"].config
    x, t, cond = inputs(model, random.key(1), text_len=6)
    cond["text_mask"] = torch.tensor([[1.0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    kwargs, native = build.native_inputs(config, x, t, cond)
    assert native.shape == (2, 2, 4, 4, 16)
    hidden = kwargs["hidden_states"]
    assert hidden.shape == (2, 2, 4, 4, 33) and torch.equal(hidden[..., :16], x.permute(0, 2, 3, 4, 1))
    assert not hidden[..., 16:].any()  # [x | zero image latents | zero mask]
    assert torch.equal(kwargs["encoder_hidden_states"], cond["text"][:, :4])  # the longest valid length
    assert torch.equal(kwargs["text_rope_pos"], torch.arange(4))
    assert [p.tolist() for p in kwargs["visual_rope_pos"]] == [[0, 1], [0, 1], [0, 1]]  # the patched grid
    assert kwargs["timestep"] is t and kwargs["pooled_projections"] is cond["pooled"]  # t as given, 0..1000
    assert kwargs["sparse_params"] is None and kwargs["scale_factor"] == (1.0, 3.16, 3.16)  # 32 px: not 480p
    empty = build.native_inputs(config, x, t, {**cond, "text_mask": torch.zeros(2, 6)})[0]
    assert empty["encoder_hidden_states"].shape[1] == 1  # at least one token, as FastVideo
    lite = Kandinsky5Config(preset="kandinsky5-t2v-lite")
    x480 = torch.zeros(1, 16, 1, 64, 96)  # 512 x 768 px
    cond480 = {"text": torch.zeros(1, 3, 3584), "text_mask": torch.ones(1, 3), "pooled": torch.zeros(1, 768)}
    kwargs = build.native_inputs(lite, x480, torch.tensor([500.0]), cond480)[0]
    assert kwargs["scale_factor"] == (1.0, 2.0, 2.0)
    assert [len(p) for p in kwargs["visual_rope_pos"]] == [1, 32, 48]


def test_padding_after_the_longest_prompt_changes_nothing_and_inside_it_is_attended(tiny):
    model, params = tiny
    x, t, cond = inputs(model, random.key(1), text_len=5)
    cond["text_mask"] = torch.tensor([[1.0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    longer = {**cond, "text": torch.cat([cond["text"], random.normal(random.key(5), (2, 3, 32))], dim=1),
              "text_mask": torch.cat([cond["text_mask"], torch.zeros(2, 3)], dim=1)}
    assert torch.equal(model.apply(params, x, t, longer), model.apply(params, x, t, cond))
    changed = {**cond, "text": cond["text"].clone()}
    changed["text"][1, 4] += 1.0  # sample 1's padding, within the batch's longest prompt: the DiT has no text mask
    out, out_changed = model.apply(params, x, t, cond), model.apply(params, x, t, changed)
    assert torch.equal(out[0], out_changed[0]) and not torch.equal(out[1], out_changed[1])


def test_the_zero_unconditional_zeroes_the_text_and_the_pooled_vector_at_the_conds_length(tiny):
    model, _ = tiny
    _, _, cond = inputs(model, random.key(1))
    zero = model.uncond(cond, "zero")
    assert not zero["text"].any() and not zero["pooled"].any()
    assert torch.equal(zero["text_mask"], cond["text_mask"])


def test_the_real_presets_train_480p_only_and_the_tiny_one_any_size(lite, tiny):
    lite.check_latents((1, 16, 31, 64, 96))  # 512 x 768 px, FastVideo's recipe
    lite.check_latents((1, 16, 21, 60, 106))  # 480 x 848 px
    with pytest.raises(ValueError, match=r"trains at 480p only, as FastVideo: height and width 448 x 832 px \(latents "
                                         r"x 8\) must each be within 480\.\.854 px \(latent 60\.\.106\)"):
        lite.check_latents((1, 16, 20, 56, 104))
    with pytest.raises(ValueError, match="within 480..854 px"):
        lite.check_latents((1, 16, 20, 64, 108))  # 864 px
    Kandinsky5Config(preset="kandinsky5-t2v-lite", only_480p=False).build().check_latents((1, 16, 20, 90, 160))
    model, _ = tiny
    model.check_latents((2, 16, 2, 4, 4))
    with pytest.raises(ValueError, match="visual RoPE holds 128 positions per axis; these latents make a grid of "
                                         r"2 x 2 x 129 patches"):
        model.check_latents((1, 16, 2, 4, 258))


def test_every_param_trains_text_to_video():
    """Measured: a forward and backward of the tiny model reaches every param (the image-condition columns of the
    visual embedding get zero gradients, as in FastVideo, but they are columns of a trained weight)."""
    config = CASES["kandinsky5"].config
    assert config.family.training.held_frozen(config) == frozenset()
    model = config.build()
    params = model.weights.init(random.key(0))
    assert model.weights.trained_names == frozenset(params)
    x, t, cond = inputs(model, random.key(1))
    grads = grad.grad(lambda p: model.apply(p, x, t, cond).square().mean())(params)
    assert sorted(grads) == sorted(params)
    assert all(bool(g.abs().sum()) for name, g in grads.items()), [n for n, g in grads.items() if not g.abs().sum()]


def test_the_export_is_a_kandinsky5_pipeline_with_flow_shift_5(tiny, tmp_path):
    model, params = tiny
    model.export.folder(params, str(tmp_path))
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "Kandinsky5T2VPipeline"
    assert index["vae"] == ["diffusers", "AutoencoderKLHunyuanVideo"]
    assert json.loads((tmp_path / "scheduler" / "scheduler_config.json").read_text())["shift"] == 5.0


def test_bad_input_is_one_line_naming_the_tensor(tiny):
    model, params = tiny
    raw = raw_batch(model, random.key(0))
    with pytest.raises(ValueError, match="kandinsky5 needs the batch tensor 'text_mask'"):
        model.batch({k: v for k, v in raw.items() if k != "text_mask"})
    with pytest.raises(ValueError, match=r"kandinsky5: the batch's text embedding \[2, 1, 32\] is not the packed "
                                         r"\[B, 1 \+ L, D\] form \(row 0 the pooled CLIP vector of width 16\)"):
        model.batch({**raw, "text": torch.zeros(2, 1, 32), "text_mask": torch.ones(2, 1)})
    x, t, cond = inputs(model, random.key(1))
    with pytest.raises(ValueError, match=r"kandinsky5: cond\['pooled'\] must be \[B, 16\], got \[2, 768\]"):
        model.apply(params, x, t, {**cond, "pooled": torch.zeros(2, 768)})
    with pytest.raises(ValueError, match=r"x_t must be \[B, 16, T, H, W\] with T, H, W divisible by \(1, 2, 2\)"):
        model.apply(params, torch.zeros(2, 33, 2, 4, 4), t, cond)
    long = {"text": torch.zeros(1, 1025, 32), "text_mask": torch.ones(1, 1025), "pooled": torch.zeros(1, 16)}
    with pytest.raises(ValueError, match="kandinsky5: the text has 1025 valid tokens; the DiT's text RoPE holds 1024"):
        model.apply(params, x[:1], t[:1], long)
    with pytest.raises(ValueError, match="kandinsky5 only_480p must be true or false, got 'yes'"):
        Kandinsky5Config(only_480p="yes")
    with pytest.raises(ValueError, match="unknown kandinsky5 preset 'lite'; valid presets: tiny, kandinsky5-t2v-lite"):
        Kandinsky5Config(preset="lite")


# --------------------------------------------------------------------------------------------------------- LoRA


def test_fastvideos_default_lora_targets_are_the_query_key_value_projections():
    """FastVideo's default targets (to_q, to_k, to_v, to_out, ...) match Kandinsky's to_query, to_key, to_value as
    substrings; its out_layer is no to_out: every attention's q, k, v and nothing else."""
    adapted = Kandinsky5Config(lora=lora.LoRAConfig(rank=4)).build()
    modules = adapted.export.adapters.args[0].modules
    expected = [f"{block}.{attention}.{proj}" for block, attentions in
                [("visual_transformer_blocks.0", ("self_attention", "cross_attention")),
                 ("visual_transformer_blocks.1", ("self_attention", "cross_attention")),
                 ("text_transformer_blocks.0", ("self_attention",))]
                for attention in attentions for proj in ("to_query", "to_key", "to_value")]
    assert sorted(modules) == sorted(expected)


@pytest.mark.parametrize("targets", [lora.DEFAULT_TARGETS, ("to_", "out_layer", "in_layer")],
                         ids=["fastvideo-defaults", "every-linear"])
def test_exported_peft_adapters_load_with_the_kandinsky5_pipeline(tmp_path, targets):
    pytest.importorskip("peft")
    config = lora.LoRAConfig(rank=4, alpha=8.0, target_modules=targets)
    adapted = Kandinsky5Config(frozen_dtype="fp32", lora=config).build()
    base = adapted.weights.base(random.key(0))
    adapters = trained_adapters(adapted, random.key(1))
    written = adapted.export.adapters(adapters, str(tmp_path), "peft")
    assert [p.name for p in written.files.values()] == [lora_files.PEFT_FILE]
    (transformer,) = native_modules(CASES["kandinsky5"], base).values()
    pipe = Kandinsky5T2VPipeline(transformer=transformer, vae=None, text_encoder=None, tokenizer=None,
                                 text_encoder_2=None, tokenizer_2=None, scheduler=FlowMatchEulerDiscreteScheduler())
    assert_loaded_lora_matches(pipe, "kandinsky5", tmp_path, lora_files.PEFT_FILE, adapted, base, adapters)
