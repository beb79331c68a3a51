"""fvx_models.wan_two_time: the r input of Wan starts as the base Wan, loads plain folders, round-trips its export,
and equals diffusers' AnyFlow transformer."""
import pytest
import torch
from diffusers import AnyFlowTransformer3DModel

from fvx.core import random
from fvx_models.wan import TINY, WanConfig
from fvx_models.wan_two_time import DELTA, REmbedder

X = random.normal(random.key(1), (2, 16, 2, 8, 8))
T, R = torch.tensor([300.0, 700.0]), torch.tensor([100.0, 0.0])
COND = {"text": random.normal(random.key(2), (2, 8, 32)), "text_mask": torch.ones(2, 8)}


@pytest.fixture(scope="module")
def base():
    model = WanConfig(preset="tiny").build()
    params = model.weights.init(random.key(0))
    return model, params, model.apply(params, X, T, COND)


def test_gated_copy_is_the_base_wan_on_the_diagonal(base):
    _, _, v = base
    model = WanConfig(preset="tiny", r_embedder=REmbedder()).build()
    params = model.weights.init(random.key(0))
    assert model.rules.two_time and sorted(n for n in params if n.startswith(DELTA)) == [
        DELTA + "linear_1.bias", DELTA + "linear_1.weight", DELTA + "linear_2.bias", DELTA + "linear_2.weight"]
    assert torch.equal(model.apply(params, X, T, COND, r=T), v)
    assert torch.equal(model.apply(params, X, T, COND), v)  # r left out is t
    assert not torch.allclose(model.apply(params, X, T, COND, r=R), v)


def test_additive_zero_is_the_base_wan_for_every_r(base):
    _, _, v = base
    model = WanConfig(preset="tiny", r_embedder=REmbedder(fusion="additive", init="zero")).build()
    params = model.weights.init(random.key(0))
    assert torch.equal(model.apply(params, X, T, COND, r=R), v)
    assert torch.equal(params[DELTA + "linear_2.weight"], torch.zeros_like(params[DELTA + "linear_2.weight"]))


def test_a_plain_wan_folder_loads_with_the_delta_made_and_an_export_keeps_it(base, tmp_path):
    plain, params, v = base
    plain.export.folder(params, str(tmp_path / "plain"))
    model = WanConfig(preset="tiny", r_embedder=REmbedder()).build()
    loaded = model.weights.load(str(tmp_path / "plain"))
    assert torch.equal(loaded[DELTA + "linear_2.weight"], params["condition_embedder.time_embedder.linear_2.weight"])
    assert torch.equal(model.apply(loaded, X, T, COND, r=T), v)
    trained = {**loaded, DELTA + "linear_2.bias": loaded[DELTA + "linear_2.bias"] + 0.5}
    model.export.folder(trained, str(tmp_path / "two_time"))
    again = model.weights.load(str(tmp_path / "two_time"))
    assert all(torch.equal(again[name], trained[name]) for name in trained)


def test_equals_diffusers_anyflow_transformer():
    model = WanConfig(preset="tiny", r_embedder=REmbedder()).build()
    params = model.weights.init(random.key(0))
    params[DELTA + "linear_2.weight"] = params[DELTA + "linear_2.weight"] + 0.1  # a trained delta path
    kwargs = {k: v for k, v in TINY.items() if k not in ("qk_norm", "added_kv_proj_dim", "pos_embed_seq_len")}
    anyflow = AnyFlowTransformer3DModel(**kwargs, gate_value=0.25, deltatime_type="r").eval()
    anyflow.load_state_dict(params, strict=True)
    frames = X.shape[2]
    with torch.no_grad():
        expected = anyflow(X.permute(0, 2, 1, 3, 4), T[:, None].expand(2, frames), R[:, None].expand(2, frames),
                           COND["text"], return_dict=False)[0].permute(0, 2, 1, 3, 4)
    assert torch.allclose(model.apply(params, X, T, COND, r=R), expected, atol=1e-5)


def test_r_on_a_one_time_model_and_a_bad_r_are_refused(base):
    model, params, _ = base
    with pytest.raises(ValueError, match="r given to a model without a second time input"):
        model.apply(params, X, T, COND, r=R)
    two = WanConfig(preset="tiny", r_embedder=REmbedder()).build()
    with pytest.raises(ValueError, match=r"r must have t's shape \(2,\), got \(1,\)"):
        two.apply(two.weights.init(random.key(0)), X, T, COND, r=R[:1])
