"""fvx_models.wan_fastvideo_names: a tiny Wan exported by fvx, its transformer weights re-saved under FastVideo's
internal Wan names (renamed here by this file's own rules, written from FastVideo's module names, not from the
module's table), loads as the params it was exported from; a folder that mixes namings or holds an unknown key is
refused in one line naming the key."""
import re

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from fvx.core import random
from fvx_models import build, diffusers_folder as dfolder, wan_fastvideo_names
from fvx_models.attention.config import SLAConfig
from fvx_models.wan import WAN, WanConfig

TO_INTERNAL = (  # diffusers name -> FastVideo's internal one, as FastVideo's Wan DiT names its modules
    (r"^condition_embedder\.text_embedder\.linear_(1|2)\.", lambda m: f"condition_embedder.text_embedder."
                                                                      f"{'fc_in' if m[1] == '1' else 'fc_out'}."),
    (r"^condition_embedder\.time_embedder\.linear_(1|2)\.", lambda m: f"condition_embedder.time_embedder.mlp."
                                                                      f"{'fc_in' if m[1] == '1' else 'fc_out'}."),
    (r"^condition_embedder\.time_proj\.", "condition_embedder.time_modulation.linear."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.0\.proj\.", "condition_embedder.image_embedder.ff.fc_in."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.2\.", "condition_embedder.image_embedder.ff.fc_out."),
    (r"^blocks\.(\d+)\.attn1\.(to_q|to_k|to_v|norm_q|norm_k)\.(weight|bias)$", r"blocks.\1.\2.\3"),
    (r"^blocks\.(\d+)\.attn1\.to_out\.0\.", r"blocks.\1.to_out."),
    (r"^blocks\.(\d+)\.attn2\.to_out\.0\.", r"blocks.\1.attn2.to_out."),
    (r"^blocks\.(\d+)\.ffn\.net\.0\.proj\.", r"blocks.\1.ffn.fc_in."),
    (r"^blocks\.(\d+)\.ffn\.net\.2\.", r"blocks.\1.ffn.fc_out."),
    (r"^blocks\.(\d+)\.norm2\.", r"blocks.\1.self_attn_residual_norm.norm."),
)
PATCH_PROJ = (r"^patch_embedding\.", "patch_embedding.proj.")  # FastVideo's own; TurboWan's converter keeps diffusers'


def internal(name: str, proj: bool = False) -> str:
    for pattern, replacement in TO_INTERNAL + ((PATCH_PROJ,) if proj else ()):
        if re.search(pattern, name):
            return re.sub(pattern, replacement, name)
    return name


def export(config: WanConfig, folder, edit=lambda params: params):
    """``config``'s model, its init params (through ``edit``) and the transformer folder it exported them to."""
    model = config.build()
    params = edit(model.weights.init(random.key(0)))
    model.export.folder(params, str(folder))
    return model, params, folder / "transformer"


def resave(transformer, rename, extra=None) -> None:
    """Re-save the transformer's weights under ``rename(name)`` (and ``extra``)."""
    path = transformer / dfolder.WEIGHTS_NAME
    weights = {rename(name): tensor for name, tensor in load_file(path).items()}
    save_file({**weights, **(extra or {})}, path)


def assert_same(loaded, params):
    assert loaded.keys() == params.keys()
    for name in params:
        assert torch.equal(loaded[name], params[name]), name


@pytest.fixture(scope="module")
def t2v(tmp_path_factory):
    return export(WanConfig(preset="tiny"), tmp_path_factory.mktemp("t2v") / "pipeline")


@pytest.mark.parametrize("proj", [False, True], ids=["turbowan-patch-embedding", "fastvideo-patch-embedding"])
def test_a_fastvideo_named_t2v_folder_loads_as_exported(t2v, tmp_path, proj):
    model, params, transformer = t2v
    copy = tmp_path / "transformer"
    copy.mkdir()
    (copy / "config.json").write_text((transformer / "config.json").read_text())
    save_file(load_file(transformer / dfolder.WEIGHTS_NAME), copy / dfolder.WEIGHTS_NAME)
    resave(copy, lambda name: internal(name, proj))
    keys = set(load_file(copy / dfolder.WEIGHTS_NAME))
    assert {"blocks.0.to_q.weight", "blocks.1.ffn.fc_in.bias", "condition_embedder.text_embedder.fc_in.weight",
            "blocks.0.self_attn_residual_norm.norm.weight", "blocks.0.attn2.to_out.weight",
            "condition_embedder.time_modulation.linear.weight"} <= keys
    assert ("patch_embedding.proj.weight" in keys) == proj and "blocks.0.attn1.to_q.weight" not in keys
    assert_same(model.weights.load(str(copy)), params)


def test_a_fastvideo_named_i2v_folder_loads_as_exported(tmp_path):
    model, params, transformer = export(WanConfig(preset="tiny-i2v"), tmp_path / "pipeline")
    resave(transformer, internal)
    assert "condition_embedder.image_embedder.ff.fc_in.weight" in load_file(transformer / dfolder.WEIGHTS_NAME)
    assert_same(model.weights.load(str(tmp_path / "pipeline")), params)


def test_turbowan_sla_folder_keeps_its_proj_l(tmp_path):
    """TurboWan's folder: FastVideo's names and SLA's ``blocks.N.attn1.attn_impl.proj_l`` (non-zero), which loads
    as it is, not as the zeros a dense folder's lacking proj_l would be."""
    config = msgspec.structs.replace(WanConfig(preset="tiny"), attention="sla",
                                     sla=SLAConfig(implementation="reference"))

    def nonzero_proj_l(params):
        return {name: random.normal(random.key(7), p.shape) if ".attn_impl.proj_l." in name else p
                for name, p in params.items()}

    model, params, transformer = export(config, tmp_path / "pipeline", nonzero_proj_l)
    resave(transformer, internal)
    keys = set(load_file(transformer / dfolder.WEIGHTS_NAME))
    assert "blocks.0.attn1.attn_impl.proj_l.weight" in keys and "blocks.0.to_q.weight" in keys
    loaded = model.weights.load(str(tmp_path / "pipeline"))
    assert loaded["blocks.1.attn1.attn_impl.proj_l.weight"].abs().max() > 0
    assert_same(loaded, params)


def test_a_lazy_read_and_the_stored_dtypes_use_diffusers_names(t2v, tmp_path):
    model, params, transformer = t2v
    copy = tmp_path / "transformer"
    copy.mkdir()
    (copy / "config.json").write_text((transformer / "config.json").read_text())
    save_file({internal(name): tensor.to(torch.bfloat16) for name, tensor in
               load_file(transformer / dfolder.WEIGHTS_NAME).items()}, copy / dfolder.WEIGHTS_NAME)
    skeleton = build.skeleton(WanConfig(preset="tiny"))
    lazy = dfolder.read_params(copy, skeleton, WAN.checkpoints.components, "wan load", lazy=True,
                               stored_names=WAN.checkpoints.stored_names)
    handle = lazy["blocks.0.attn1.to_q.weight"]
    assert handle.name == "blocks.0.to_q.weight"
    assert torch.equal(handle.narrow(0, 2, 3), params["blocks.0.attn1.to_q.weight"][2:5].bfloat16().float())
    dtypes = dfolder.stored_dtypes(copy, skeleton, WAN.checkpoints.components, "wan export",
                                   WAN.checkpoints.stored_names)
    assert dtypes.keys() == params.keys() and set(dtypes.values()) == {torch.bfloat16}


def test_a_diffusers_folder_is_not_renamed(t2v):
    _, params, transformer = t2v
    assert wan_fastvideo_names.diffusers_names(load_file(transformer / dfolder.WEIGHTS_NAME)) is None
    assert wan_fastvideo_names.diffusers_names({"patch_embedding.weight", "proj_out.weight"}) is None


def one_line_refusal(model, folder) -> str:
    with pytest.raises(ValueError) as error:
        model.weights.load(str(folder))
    assert "\n" not in str(error.value)
    return str(error.value)


def copied(t2v, tmp_path, rename, extra=None):
    model, _, transformer = t2v
    copy = tmp_path / "transformer"
    copy.mkdir()
    (copy / "config.json").write_text((transformer / "config.json").read_text())
    save_file(load_file(transformer / dfolder.WEIGHTS_NAME), copy / dfolder.WEIGHTS_NAME)
    resave(copy, rename, extra)
    return model, copy


def test_a_folder_mixing_namings_is_refused_naming_keys_of_both(t2v, tmp_path):
    model, copy = copied(t2v, tmp_path, lambda name: name if name.startswith("blocks.1.") else internal(name))
    message = one_line_refusal(model, copy)
    assert message.startswith("wan load: ") and "mix" in message
    assert "'blocks.0.attn2.to_out.bias'" in message and "'blocks.1.attn1.norm_k.weight'" in message


def test_an_unknown_key_is_refused_by_its_stored_name(t2v, tmp_path):
    model, copy = copied(t2v, tmp_path, internal, {"blocks.0.attn1.bogus.weight": torch.zeros(2)})
    message = one_line_refusal(model, copy)
    assert "unexpected keys (1): blocks.0.attn1.bogus.weight" in message


def test_a_misshapen_renamed_key_is_shown_as_stored(t2v, tmp_path):
    model, copy = copied(t2v, tmp_path, internal)
    resave(copy, lambda name: name, {"blocks.0.ffn.fc_in.weight": torch.zeros(3, 3)})
    message = one_line_refusal(model, copy)
    assert "blocks.0.ffn.fc_in.weight (read as blocks.0.ffn.net.0.proj.weight): [3, 3] vs expected" in message


def test_two_keys_read_as_one_name_are_refused(t2v, tmp_path):
    model, copy = copied(t2v, tmp_path, internal)
    resave(copy, lambda name: name, {"patch_embedding.proj.weight": load_file(
        copy / dfolder.WEIGHTS_NAME)["patch_embedding.weight"]})
    message = one_line_refusal(model, copy)
    assert "'patch_embedding.proj.weight' and 'patch_embedding.weight'" in message
