"""fvx_models.wan against diffusers' own WanTransformer3DModel (tiny preset): forward, remat, bf16, load/export."""
import inspect
import json
import os

import msgspec
import pytest
import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from safetensors.torch import load_file, save_file

from fvx import grad as fgrad
from fvx import random
from fvx_models import wan

TINY = wan.PRESETS["tiny"]


@pytest.fixture(scope="module")
def module():
    return wan.skeleton("tiny")


@pytest.fixture(scope="module")
def params(module):
    return wan.init(module, random.key(0))


@pytest.fixture(scope="module")
def batch():
    k = random.split(random.key(1), 4)
    return dict(
        x=random.normal(k[0], (2, 16, 2, 4, 6)),
        t=torch.tensor([30.0, 910.5]),
        text=random.normal(k[1], (2, 5, TINY["text_dim"])),
        target=random.normal(k[2], (2, 16, 2, 4, 6)),
    )


@pytest.fixture(scope="module")
def exported(module, params, tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan") / "transformer"
    wan.export(module, params, folder)
    return folder


def reference(params) -> WanTransformer3DModel:
    """A real diffusers module holding ``params`` (built from the tiny kwargs, RNG state restored)."""
    state = torch.get_rng_state()
    model = WanTransformer3DModel(**TINY)
    torch.set_rng_state(state)
    model.load_state_dict(params)
    return model


def mse(module, **kwargs):
    def loss(p, b):
        return ((wan.apply(module, p, b["x"], b["t"], {"text": b["text"]}, **kwargs) - b["target"]) ** 2).mean()

    return loss


def assert_same_params(a, b):
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.float32, name
        assert torch.equal(a[name], b[name]), name


# ------------------------------------------------------------------------------------------------------------- apply


def test_apply_equals_the_modules_own_forward(module, params, batch):
    with torch.no_grad():
        expected = reference(params)(batch["x"], batch["t"], batch["text"], return_dict=False)[0]
    out = wan.apply(module, params, batch["x"], batch["t"], {"text": batch["text"]})
    assert out.dtype == torch.float32 and out.shape == batch["x"].shape
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_text_mask_zeroes_padded_tokens(module, params, batch):
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    masked = wan.apply(module, params, batch["x"], batch["t"], {"text": batch["text"], "text_mask": mask})
    zero_padded = batch["text"] * mask[..., None]
    assert torch.equal(masked, wan.apply(module, params, batch["x"], batch["t"], {"text": zero_padded}))
    assert not torch.equal(masked, wan.apply(module, params, batch["x"], batch["t"], {"text": batch["text"]}))


def test_remat_gives_the_same_values_and_gradients(module, params, batch):
    remat_module = wan.skeleton("tiny", remat=True)
    assert module.gradient_checkpointing is False
    assert remat_module.gradient_checkpointing and remat_module._gradient_checkpointing_func is fgrad.remat
    loss, grads = fgrad.value_and_grad(mse(module))(params, batch)
    remat_loss, remat_grads = fgrad.value_and_grad(mse(remat_module))(params, batch)
    assert torch.equal(remat_loss, loss)  # the same kernels run in the same order: bitwise
    assert all(torch.equal(remat_grads[name], grads[name]) for name in grads)
    assert all(g.abs().sum() > 0 for name, g in grads.items() if name.startswith("blocks.0."))


def test_bf16_compute_is_close_and_gradients_stay_fp32(module, params, batch):
    full = wan.apply(module, params, batch["x"], batch["t"], {"text": batch["text"]})
    half = wan.apply(module, params, batch["x"], batch["t"], {"text": batch["text"]}, compute_dtype=torch.bfloat16)
    assert half.dtype == torch.float32
    assert (half - full).abs().max() < 0.05 * full.abs().max()
    assert not torch.equal(half, full)
    loss, grads = fgrad.value_and_grad(mse(module, compute_dtype=torch.bfloat16))(params, batch)
    assert all(g.dtype == torch.float32 for g in grads.values())
    _, full_grads = fgrad.value_and_grad(mse(module))(params, batch)
    g, fg = grads["proj_out.weight"], full_grads["proj_out.weight"]
    assert torch.nn.functional.cosine_similarity(g.flatten(), fg.flatten(), dim=0) > 0.99


def test_bf16_keeps_diffusers_fp32_modules(module):
    keep = [name for name, _ in module.named_parameters() if wan._keeps_fp32(module, name)]
    assert "scale_shift_table" in keep and "blocks.1.scale_shift_table" in keep and "blocks.0.norm2.weight" in keep
    assert "condition_embedder.time_embedder.linear_1.weight" in keep
    assert "blocks.0.attn1.norm_q.weight" not in keep and "proj_out.weight" not in keep


KEPT_FP32 = {"time_embedder", "scale_shift_table", "norm1", "norm2", "norm3"}  # diffusers' Wan list, by hand


def test_model_names_its_param_dtypes_and_apply_takes_bf16_stored_params(params, batch):
    """``param_dtypes(bf16)``: bf16 but diffusers' fp32-kept modules. Params stored that way compute in the compute
    dtype: under fp32 exactly as their bf16-rounded fp32 values, under bf16 exactly as the fp32 masters."""
    model = wan.WanConfig(preset="tiny").build()
    dtypes = model.param_dtypes(torch.bfloat16)
    assert dtypes.keys() == params.keys()
    kept = {name for name in params if KEPT_FP32 & set(name.split("."))}
    assert kept and len(kept) < len(params)
    assert all(dtype == (torch.float32 if name in kept else torch.bfloat16) for name, dtype in dtypes.items())
    stored = {name: p.to(dtypes[name]) for name, p in params.items()}
    rounded = {name: p.float() for name, p in stored.items()}
    x, t, cond = batch["x"], batch["t"], {"text": batch["text"]}
    out = model.apply(stored, x, t, cond)
    assert out.dtype == torch.float32 and torch.equal(out, model.apply(rounded, x, t, cond))
    assert not torch.equal(out, model.apply(params, x, t, cond))
    half = wan.WanConfig(preset="tiny", compute_dtype="bf16").build()
    assert torch.equal(half.apply(stored, x, t, cond), half.apply(params, x, t, cond))


def test_apply_rejects_inputs_that_do_not_fit(module, params, batch):
    x, t, text = batch["x"], batch["t"], batch["text"]
    with pytest.raises(ValueError, match=r"x_t must be \[B, 16, T, H, W\].*\(2, 16, 2, 3, 6\)"):
        wan.apply(module, params, x[..., :3, :], t, {"text": text})
    with pytest.raises(ValueError, match=r"t must be a tensor of shape \[2\]"):
        wan.apply(module, params, x, t[:1], {"text": text})
    with pytest.raises(ValueError, match=r"cond\['text'\] must be \[2, L, 32\], got \(2, 5, 31\)"):
        wan.apply(module, params, x, t, {"text": text[..., :31]})
    with pytest.raises(ValueError, match="text_mask"):
        wan.apply(module, params, x, t, {"text": text, "text_mask": torch.ones(2, 4)})


# ------------------------------------------------------------------------------------------------------ skeleton, init


def test_skeleton_params_are_meta_and_buffers_real(module, batch):
    assert all(p.is_meta for p in module.parameters())
    buffers = dict(module.named_buffers())
    assert set(buffers) == {"rope.freqs_cos", "rope.freqs_sin"}
    state = torch.get_rng_state()
    expected = WanTransformer3DModel(**TINY).rope
    torch.set_rng_state(state)
    for name, buffer in buffers.items():
        assert buffer.device.type == "cpu" and torch.equal(buffer, getattr(expected, name.split(".")[1]))
    with pytest.raises(RuntimeError, match="meta"):  # the skeleton's own params can never compute
        module(batch["x"], batch["t"], batch["text"], return_dict=False)


def test_init_is_deterministic_distinct_and_leaves_global_rng_alone(module, params):
    state = torch.get_rng_state()
    again = wan.init(module, random.key(0))
    other = wan.init(module, random.key(1))
    wan.skeleton("tiny")
    assert torch.equal(state, torch.get_rng_state())
    assert_same_params(again, params)
    assert list(params) == [name for name, _ in module.named_parameters()]
    random_names = [n for n in params if not ("norm" in n and n.rsplit(".", 1)[-1] in ("weight", "bias"))]
    assert all(not torch.equal(params[n], other[n]) for n in random_names)
    # per-param keys depend on the name, not the position: two same-shaped params differ
    assert not torch.equal(params["blocks.0.attn1.to_q.weight"], params["blocks.1.attn1.to_q.weight"])


def test_init_follows_pytorch_default_rules(params):
    dim = TINY["num_attention_heads"] * TINY["attention_head_dim"]
    for name, fan_in in [("blocks.0.ffn.net.0.proj.weight", dim), ("blocks.0.ffn.net.0.proj.bias", dim),
                         ("patch_embedding.weight", 16 * 4), ("patch_embedding.bias", 16 * 4),
                         ("condition_embedder.text_embedder.linear_1.weight", TINY["text_dim"])]:
        bound = fan_in**-0.5
        assert params[name].abs().max() <= bound and params[name].abs().max() > 0.8 * bound, name
    assert torch.equal(params["blocks.0.norm2.weight"], torch.ones(dim))
    assert torch.equal(params["blocks.0.norm2.bias"], torch.zeros(dim))
    assert torch.equal(params["blocks.0.attn1.norm_q.weight"], torch.ones(dim))
    table = params["blocks.0.scale_shift_table"]
    assert table.shape == (1, 6, dim) and 0.5 < table.std() * dim**0.5 < 1.5


# -------------------------------------------------------------------------------------------------------- load/export


def test_export_loads_in_diffusers_and_back_bit_for_bit(module, params, exported):
    assert sorted(os.listdir(exported)) == ["config.json", wan.WEIGHTS_NAME]
    config = json.loads((exported / "config.json").read_text())
    assert config["_class_name"] == "WanTransformer3DModel" and config["num_layers"] == TINY["num_layers"]
    state = torch.get_rng_state()
    theirs = WanTransformer3DModel.from_pretrained(exported).state_dict()
    torch.set_rng_state(state)
    assert_same_params(dict(theirs), params)
    assert_same_params(wan.load(module, exported), params)


def test_sharded_export_and_pipeline_root_load(module, params, tmp_path):
    root = tmp_path / "pipeline"
    wan.export(module, params, root / "transformer", max_shard_bytes=40_000)
    files = sorted(os.listdir(root / "transformer"))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and wan.WEIGHTS_INDEX_NAME in files and wan.WEIGHTS_NAME not in files
    assert shards[0] == f"diffusion_pytorch_model-00001-of-{len(shards):05d}.safetensors"
    assert not [f for f in os.listdir(root) if f != "transformer"]  # no staging folder left behind
    assert_same_params(wan.load(module, root), params)
    state = torch.get_rng_state()
    theirs = WanTransformer3DModel.from_pretrained(root, subfolder="transformer").state_dict()
    torch.set_rng_state(state)
    assert_same_params(dict(theirs), params)


def test_export_in_bf16_keeps_fp32_modules(module, params, tmp_path):
    wan.export(module, params, tmp_path / "bf16", dtype=torch.bfloat16)
    stored = load_file(tmp_path / "bf16" / wan.WEIGHTS_NAME)
    assert stored["proj_out.weight"].dtype == torch.bfloat16
    assert stored["blocks.0.scale_shift_table"].dtype == torch.float32
    loaded = wan.load(module, tmp_path / "bf16")
    assert torch.equal(loaded["proj_out.weight"], params["proj_out.weight"].bfloat16().float())
    assert torch.equal(loaded["blocks.0.scale_shift_table"], params["blocks.0.scale_shift_table"])


def test_export_refuses_a_full_folder_and_leaves_nothing_on_error(module, params, exported, tmp_path):
    with pytest.raises(ValueError, match="already exists"):
        wan.export(module, params, exported)
    bad = {**params, "proj_out.weight": params["proj_out.weight"][:3]}
    with pytest.raises(ValueError, match=r"proj_out.weight: \[3, 96\] vs expected \[64, 96\]"):
        wan.export(module, bad, tmp_path / "out")
    assert os.listdir(tmp_path) == []


def _corrupt(exported, tmp_path, edit):
    """A copy of the exported folder whose weights went through ``edit(dict) -> dict``."""
    folder = tmp_path / "edited"
    folder.mkdir()
    (folder / "config.json").write_text((exported / "config.json").read_text())
    save_file(edit(load_file(exported / wan.WEIGHTS_NAME)), folder / wan.WEIGHTS_NAME)
    return folder


def test_load_names_missing_and_unexpected_keys(module, exported, tmp_path):
    def edit(weights):
        del weights["blocks.1.ffn.net.2.bias"]
        weights["blocks.9.extra.weight"] = torch.zeros(2)
        return weights

    with pytest.raises(ValueError, match=r"missing keys \(1\): blocks.1.ffn.net.2.bias; "
                                         r"unexpected keys \(1\): blocks.9.extra.weight"):
        wan.load(module, _corrupt(exported, tmp_path, edit))


def test_load_names_shape_mismatches_with_both_shapes(module, exported, tmp_path):
    def edit(weights):
        weights["proj_out.bias"] = torch.zeros(7)
        return weights

    with pytest.raises(ValueError, match=r"shape mismatches \(1\): proj_out.bias: \[7\] vs expected \[64\]"):
        wan.load(module, _corrupt(exported, tmp_path, edit))


def test_load_truncates_long_lists(module, exported, tmp_path):
    def edit(weights):
        return {"only.one": torch.zeros(1)}

    with pytest.raises(ValueError, match=rf"missing keys \({len(list(module.parameters()))}\): .*\.\.\. and \d+ more"):
        wan.load(module, _corrupt(exported, tmp_path, edit))


def test_load_checks_the_folder_and_its_config(module, exported, tmp_path):
    with pytest.raises(ValueError, match=f"no config.json in {str(tmp_path)!r}"):
        wan.load(module, tmp_path)
    (tmp_path / "config.json").write_text((exported / "config.json").read_text())
    with pytest.raises(ValueError, match="no diffusion_pytorch_model.safetensors nor .*index.json"):
        wan.load(module, tmp_path)
    config = json.loads((exported / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_layers": 3, "ffn_dim": 8}))
    with pytest.raises(ValueError, match=r"ffn_dim: folder has 8, expected 192; num_layers: folder has 3, expected 2"):
        wan.load(module, tmp_path)


# ------------------------------------------------------------------------------------------------- presets, config


def test_real_presets_match_diffusers_and_the_wan_vae():
    defaults = {n: p.default for n, p in inspect.signature(WanTransformer3DModel.__init__).parameters.items()}
    assert wan.PRESETS["wan2.1-t2v-14b"] == {name: defaults[name] for name in wan.PRESETS["wan2.1-t2v-14b"]}
    small = wan.PRESETS["wan2.1-t2v-1.3b"]
    assert (small["num_attention_heads"], small["attention_head_dim"], small["ffn_dim"], small["num_layers"]) == (
        12, 128, 8960, 30)
    assert set(wan.PRESETS) == set(wan.METADATA)
    vae = inspect.signature(AutoencoderKLWan.__init__).parameters
    for preset in ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b"):
        assert list(wan.METADATA[preset].latents_mean) == vae["latents_mean"].default
        assert list(wan.METADATA[preset].latents_std) == vae["latents_std"].default


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown Wan preset 'wan9'; valid presets: tiny, wan2.1-t2v-1.3b"):
        wan.WanConfig(preset="wan9")
    with pytest.raises(msgspec.ValidationError, match="unknown Wan preset 'wan9'"):
        msgspec.convert({"preset": "wan9"}, wan.WanConfig)
    with pytest.raises(ValueError, match="valid presets"):
        wan.skeleton("wan9")


def test_built_model_binds_the_config(params, batch, exported, key):
    model = wan.WanConfig(preset="tiny").build()
    assert (model.name, model.latent_channels, model.text_dim, model.patch_size) == ("wan:tiny", 16, 32, (1, 2, 2))
    assert_same_params(model.initial_params(random.key(0)), params)
    assert_same_params(model.init(random.key(0)), params)
    out = model.apply(params, batch["x"], batch["t"], {"text": batch["text"]})
    module = wan.skeleton("tiny")
    assert torch.equal(out, wan.apply(module, params, batch["x"], batch["t"], {"text": batch["text"]}))
    from_folder = msgspec.convert({"path": str(exported), "compute_dtype": "bf16"}, wan.WanConfig).build()
    assert_same_params(from_folder.initial_params(key), params)
    half = from_folder.apply(params, batch["x"], batch["t"], {"text": batch["text"]})
    assert torch.equal(half, wan.apply(module, params, batch["x"], batch["t"], {"text": batch["text"]},
                                       compute_dtype=torch.bfloat16))


def test_check_latents_and_normalisation(batch):
    model = wan.WanConfig(preset="wan2.1-t2v-1.3b").build()
    model.check_latents((1, 16, 3, 4, 6))
    with pytest.raises(ValueError, match=r"\(1, 16, 3, 5, 6\) do not fit model wan:wan2.1-t2v-1.3b"):
        model.check_latents((1, 16, 3, 5, 6))
    with pytest.raises(ValueError, match="C = 16"):
        model.check_latents((1, 4, 3, 4, 6))
    x = batch["x"]
    normalised = model.normalize(x)
    assert torch.allclose(normalised[:, 2], (x[:, 2] + 0.9113) / 2.3275)
    assert torch.allclose(model.denormalize(normalised), x, atol=1e-6)
    tiny = wan.WanConfig().build()
    assert torch.equal(tiny.normalize(x), x) and torch.equal(tiny.denormalize(x), x)
