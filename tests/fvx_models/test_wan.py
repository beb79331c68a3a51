"""fvx_models.wan against diffusers' own WanTransformer3DModel (tiny preset): what is Wan's own (the text mask, the
fp32-kept modules, init rules, presets, load errors); tests/fvx_models/test_families.py holds what every family
shares."""
import inspect
import json
import os

import msgspec
import pytest
import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from safetensors.torch import load_file, save_file

from fvx.core import grad as fgrad, random
from fvx_models import build, diffusers_folder as dfolder, wan

TINY = wan.PRESETS["tiny"].kwargs


@pytest.fixture(scope="module")
def model():
    return wan.WanConfig(preset="tiny").build()


@pytest.fixture(scope="module")
def module():
    return build.skeleton(wan.WanConfig(preset="tiny"))


@pytest.fixture(scope="module")
def params(model):
    return model.weights.init(random.key(0))


@pytest.fixture(scope="module")
def batch():
    k = random.split(random.key(1), 4)
    return dict(x=random.normal(k[0], (2, 16, 2, 4, 6)), t=torch.tensor([30.0, 910.5]),
                cond={"text": random.normal(k[1], (2, 5, TINY["text_dim"])), "text_mask": torch.ones(2, 5)},
                target=random.normal(k[2], (2, 16, 2, 4, 6)))


@pytest.fixture(scope="module")
def exported(model, params, tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan") / "pipeline"
    model.export.folder(params, str(folder))
    return folder / "transformer"


def reference(params) -> WanTransformer3DModel:
    """A real diffusers module holding ``params`` (built from the tiny kwargs, RNG state restored)."""
    state = torch.get_rng_state()
    module = WanTransformer3DModel(**TINY)
    torch.set_rng_state(state)
    module.load_state_dict(params)
    return module


def mse(model, b):
    def loss(p):
        return ((model.apply(p, b["x"], b["t"], b["cond"]) - b["target"]) ** 2).mean()

    return loss


def assert_same_params(a, b):
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.float32, name
        assert torch.equal(a[name], b[name]), name


# ------------------------------------------------------------------------------------------------------------- apply


def test_text_mask_zeroes_padded_tokens(model, params, batch):
    """Wan attends to every text token: the mask zeroes the padded ones, as the pipeline's zero padding does."""
    text = batch["cond"]["text"]
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0], [1.0] * 5])
    masked = model.apply(params, batch["x"], batch["t"], {"text": text, "text_mask": mask})
    zeroed = model.apply(params, batch["x"], batch["t"], {"text": text * mask[..., None], "text_mask": torch.ones(2, 5)})
    assert torch.equal(masked, zeroed)
    with torch.no_grad():
        want = reference(params)(batch["x"], batch["t"], text * mask[..., None], return_dict=False)[0]
    torch.testing.assert_close(masked, want, rtol=1e-5, atol=1e-5)


def test_bf16_compute_is_close_and_gradients_stay_fp32(model, params, batch):
    half = wan.WanConfig(preset="tiny", compute_dtype="bf16").build()
    full_out = model.apply(params, batch["x"], batch["t"], batch["cond"])
    half_out = half.apply(params, batch["x"], batch["t"], batch["cond"])
    assert half_out.dtype == torch.float32
    assert (half_out - full_out).abs().max() < 0.05 * full_out.abs().max() and not torch.equal(half_out, full_out)
    _, grads = fgrad.value_and_grad(mse(half, batch))(params)
    assert all(g.dtype == torch.float32 for g in grads.values())
    _, full_grads = fgrad.value_and_grad(mse(model, batch))(params)
    g, fg = grads["proj_out.weight"], full_grads["proj_out.weight"]
    assert torch.nn.functional.cosine_similarity(g.flatten(), fg.flatten(), dim=0) > 0.99


KEPT_FP32 = {"time_embedder", "scale_shift_table", "norm1", "norm2", "norm3"}  # diffusers' Wan list, by hand


def test_bf16_keeps_diffusers_fp32_modules(module):
    keep = build.fp32_kept(module)
    assert keep == {name for name, _ in module.named_parameters() if KEPT_FP32 & set(name.split("."))}
    assert "scale_shift_table" in keep and "blocks.1.scale_shift_table" in keep and "blocks.0.norm2.weight" in keep
    assert "condition_embedder.time_embedder.linear_1.weight" in keep
    assert "blocks.0.attn1.norm_q.weight" not in keep and "proj_out.weight" not in keep


def test_a_frozen_role_is_stored_in_bf16_but_the_fp32_kept_modules(params, batch):
    """``base_params(whole_model=True)``: bf16 but diffusers' fp32-kept modules, detached. Stored that way, params
    compute in the compute dtype: under fp32 as their bf16-rounded fp32 values, under bf16 as the fp32 masters."""
    model = wan.WanConfig(preset="tiny").build()
    stored = model.weights.base(random.key(0), whole_model=True)
    kept = {name for name in params if KEPT_FP32 & set(name.split("."))}
    assert all(p.dtype == (torch.float32 if name in kept else torch.bfloat16) for name, p in stored.items())
    assert all(not p.requires_grad for p in stored.values())
    rounded = {name: p.float() for name, p in stored.items()}
    x, t, cond = batch["x"], batch["t"], batch["cond"]
    out = model.apply(stored, x, t, cond)
    assert out.dtype == torch.float32 and torch.equal(out, model.apply(rounded, x, t, cond))
    assert not torch.equal(out, model.apply(params, x, t, cond))
    half = wan.WanConfig(preset="tiny", compute_dtype="bf16").build()
    assert torch.equal(half.apply(stored, x, t, cond), half.apply(params, x, t, cond))
    fp32 = wan.WanConfig(preset="tiny", frozen_dtype="fp32").build().weights.base(random.key(0), whole_model=True)
    assert_same_params(fp32, params)


def test_apply_rejects_inputs_that_do_not_fit(model, params, batch):
    x, t, cond = batch["x"], batch["t"], batch["cond"]
    with pytest.raises(ValueError, match=r"x_t must be \[B, 16, T, H, W\].*\(2, 16, 2, 3, 6\)"):
        model.apply(params, x[..., :3, :], t, cond)
    with pytest.raises(ValueError, match=r"t must be a tensor of shape \[2\]"):
        model.apply(params, x, t[:1], cond)
    with pytest.raises(ValueError, match=r"cond\['text'\] must be \[B, L, 32\], got \[2, 5, 31\]"):
        model.apply(params, x, t, {**cond, "text": cond["text"][..., :31]})
    with pytest.raises(ValueError, match="disagree on the text length"):
        model.apply(params, x, t, {**cond, "text_mask": torch.ones(2, 4)})
    with pytest.raises(ValueError, match=r"missing \['text_mask'\]"):
        model.apply(params, x, t, {"text": cond["text"]})


def test_ti2v_takes_one_timestep_per_token_and_the_wan22_latents():
    model = wan.WanConfig(preset="tiny-ti2v").build()
    params = model.weights.init(random.key(0))
    x = random.normal(random.key(1), (2, 48, 2, 4, 4))
    cond = {"text": random.normal(random.key(2), (2, 5, 32)), "text_mask": torch.ones(2, 5)}
    t = torch.tensor([30.0, 910.5])
    module = reference_of("tiny-ti2v", params)
    with torch.no_grad():
        per_token = module(x, t[:, None].expand(2, 2 * 2 * 2), cond["text"], return_dict=False)[0]
        per_sample = module(x, t, cond["text"], return_dict=False)[0]
    got = model.apply(params, x, t, cond)
    torch.testing.assert_close(got, per_token, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, per_sample, rtol=1e-6, atol=1e-7)  # the per-token path is the pipeline's
    assert model.latents.channels == 48 and model.latents.vae_stride == (4, 16, 16)
    assert model.latents.mean[0] == -0.2289 and model.latents.std[47] == 0.7744


def reference_of(preset: str, params: dict) -> WanTransformer3DModel:
    state = torch.get_rng_state()
    module = WanTransformer3DModel(**wan.PRESETS[preset].kwargs)
    torch.set_rng_state(state)
    module.load_state_dict(params)
    return module


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
        module(batch["x"], batch["t"], batch["cond"]["text"], return_dict=False)


def test_init_is_deterministic_distinct_and_leaves_global_rng_alone(model, module, params):
    state = torch.get_rng_state()
    again = model.weights.init(random.key(0))
    other = model.weights.init(random.key(1))
    wan.WanConfig(preset="tiny").build()
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


def test_export_writes_wan_pipeline_files(exported):
    root = exported.parent
    assert sorted(os.listdir(exported)) == ["config.json", dfolder.WEIGHTS_NAME]
    config = json.loads((exported / "config.json").read_text())
    assert config["_class_name"] == "WanTransformer3DModel" and config["num_layers"] == TINY["num_layers"]
    index = json.loads((root / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline" and index["vae"] == ["diffusers", "AutoencoderKLWan"]
    assert index["expand_timesteps"] is False and index["boundary_ratio"] is None
    assert json.loads((root / "scheduler" / "scheduler_config.json").read_text())["shift"] == 3.0
    assert all(oct(p.stat().st_mode)[-3:] == "644" for p in root.rglob("*") if p.is_file())


def test_sharded_weights_and_a_component_folder_load(module, params, tmp_path):
    folder = tmp_path / "transformer"
    folder.mkdir()
    module.save_config(folder)
    dfolder.write_weights(dict(params), folder, max_shard_bytes=40_000)
    files = sorted(os.listdir(folder))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and dfolder.WEIGHTS_INDEX_NAME in files and dfolder.WEIGHTS_NAME not in files
    assert shards[0] == f"diffusion_pytorch_model-00001-of-{len(shards):05d}.safetensors"
    model = wan.WanConfig(preset="tiny").build()
    assert_same_params(model.weights.load(str(folder)), params)  # the component folder itself
    assert_same_params(model.weights.load(str(tmp_path)), params)  # its pipeline root
    state = torch.get_rng_state()
    theirs = WanTransformer3DModel.from_pretrained(folder).state_dict()
    torch.set_rng_state(state)
    assert_same_params(dict(theirs), params)


def test_export_in_bf16_keeps_fp32_modules(model, params, tmp_path):
    model.export.folder(params, str(tmp_path / "bf16"), dtype="bf16")
    stored = load_file(tmp_path / "bf16" / "transformer" / dfolder.WEIGHTS_NAME)
    assert stored["proj_out.weight"].dtype == torch.bfloat16
    assert stored["blocks.0.scale_shift_table"].dtype == torch.float32
    loaded = model.weights.load(str(tmp_path / "bf16"))
    assert torch.equal(loaded["proj_out.weight"], params["proj_out.weight"].bfloat16().float())
    assert torch.equal(loaded["blocks.0.scale_shift_table"], params["blocks.0.scale_shift_table"])


def test_export_refuses_a_full_folder_and_leaves_nothing_on_error(model, params, exported, tmp_path):
    with pytest.raises(ValueError, match="already exists"):
        model.export.folder(params, str(exported.parent))
    bad = {**params, "proj_out.weight": params["proj_out.weight"][:3]}
    with pytest.raises(ValueError, match=r"proj_out.weight: \[3, 96\] vs expected \[64, 96\]"):
        model.export.folder(bad, str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []


def _corrupt(exported, tmp_path, edit):
    """A copy of the exported component folder whose weights went through ``edit(dict) -> dict``."""
    folder = tmp_path / "edited"
    folder.mkdir()
    (folder / "config.json").write_text((exported / "config.json").read_text())
    save_file(edit(load_file(exported / dfolder.WEIGHTS_NAME)), folder / dfolder.WEIGHTS_NAME)
    return str(folder)


def test_load_names_missing_and_unexpected_keys(model, exported, tmp_path):
    def edit(weights):
        del weights["blocks.1.ffn.net.2.bias"]
        weights["blocks.9.extra.weight"] = torch.zeros(2)
        return weights

    with pytest.raises(ValueError, match=r"missing keys \(1\): blocks.1.ffn.net.2.bias; "
                                         r"unexpected keys \(1\): blocks.9.extra.weight"):
        model.weights.load(_corrupt(exported, tmp_path, edit))


def test_load_names_shape_mismatches_with_both_shapes(model, exported, tmp_path):
    def edit(weights):
        weights["proj_out.bias"] = torch.zeros(7)
        return weights

    with pytest.raises(ValueError, match=r"shape mismatches \(1\): proj_out.bias: \[7\] vs expected \[64\]"):
        model.weights.load(_corrupt(exported, tmp_path, edit))


def test_load_truncates_long_lists(model, module, exported, tmp_path):
    with pytest.raises(ValueError, match=rf"missing keys \({len(list(module.parameters()))}\): .*\.\.\. and \d+ more"):
        model.weights.load(_corrupt(exported, tmp_path, lambda weights: {"only.one": torch.zeros(1)}))


def test_load_names_a_truncated_weights_file(model, exported, tmp_path):
    folder = tmp_path / "cut"
    folder.mkdir()
    (folder / "config.json").write_text((exported / "config.json").read_text())
    data = (exported / dfolder.WEIGHTS_NAME).read_bytes()
    (folder / dfolder.WEIGHTS_NAME).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"diffusion_pytorch_model.safetensors"):
        model.weights.load(str(folder))


def test_load_checks_the_folder_and_its_config(model, exported, tmp_path):
    with pytest.raises(ValueError, match=f"no config.json in {str(tmp_path)!r}"):
        model.weights.load(str(tmp_path))
    (tmp_path / "config.json").write_text((exported / "config.json").read_text())
    with pytest.raises(ValueError, match="no diffusion_pytorch_model.safetensors nor .*index.json"):
        model.weights.load(str(tmp_path))
    config = json.loads((exported / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_layers": 3, "ffn_dim": 8}))
    with pytest.raises(ValueError, match=r"ffn_dim: folder has 8, expected 192; num_layers: folder has 3, expected 2"):
        model.weights.load(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**config, "_class_name": "HunyuanVideoTransformer3DModel"}))
    with pytest.raises(ValueError, match="describes a HunyuanVideoTransformer3DModel, not a WanTransformer3DModel"):
        model.weights.load(str(tmp_path))


# ------------------------------------------------------------------------------------------------- presets, config


def test_real_presets_match_diffusers_and_the_wan_vaes():
    defaults = {n: p.default for n, p in inspect.signature(WanTransformer3DModel.__init__).parameters.items()}
    big = wan.PRESETS["wan2.1-t2v-14b"].kwargs
    assert big == {name: defaults[name] for name in big}
    small = wan.PRESETS["wan2.1-t2v-1.3b"].kwargs
    assert (small["num_attention_heads"], small["attention_head_dim"], small["ffn_dim"], small["num_layers"]) == (
        12, 128, 8960, 30)
    five = wan.PRESETS["wan2.2-ti2v-5b"].kwargs
    assert (five["num_attention_heads"] * 128, five["ffn_dim"], five["num_layers"], five["in_channels"]) == (
        3072, 14336, 30, 48)
    vae = inspect.signature(AutoencoderKLWan.__init__).parameters
    for preset in ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b"):
        assert list(wan.PRESETS[preset].latents.mean) == vae["latents_mean"].default
        assert list(wan.PRESETS[preset].latents.std) == vae["latents_std"].default
    assert len(wan.WAN22_LATENTS_MEAN) == len(wan.WAN22_LATENTS_STD) == 48


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown wan preset 'wan9'; valid presets: tiny, tiny-deep"):
        wan.WanConfig(preset="wan9")
    with pytest.raises(msgspec.ValidationError, match="unknown wan preset 'wan9'"):
        msgspec.convert({"preset": "wan9"}, wan.WanConfig)


def test_a_config_with_a_path_starts_from_the_folder(params, batch, exported, key):
    from_folder = msgspec.convert({"path": str(exported), "compute_dtype": "bf16"}, wan.WanConfig).build()
    assert_same_params(from_folder.weights.initial(key), params)
    half = wan.WanConfig(preset="tiny", compute_dtype="bf16").build()
    assert torch.equal(from_folder.apply(params, batch["x"], batch["t"], batch["cond"]),
                       half.apply(params, batch["x"], batch["t"], batch["cond"]))


def test_check_latents_and_normalisation(batch):
    model = wan.WanConfig(preset="wan2.1-t2v-1.3b").build()
    assert (model.name, model.latent_channels, model.patch_size) == ("wan:wan2.1-t2v-1.3b", 16, (1, 2, 2))
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
