"""fvx_models.original_layout: whole weights in Wan's original layout (what ComfyUI loads) convert back through
diffusers' own single-file converter to the exported params bit for bit, for every Wan-family layout; a param
without an original name, or a family without the layout, is one clear error that writes nothing."""
import pytest
import torch
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from safetensors.torch import load_file

from fvx.core import random
from fvx_models import original_layout
from fvx_models.hunyuan_video import HunyuanVideoConfig
from fvx_models.skyreels_v2 import SkyReelsV2Config
from fvx_models.wan import WanConfig
from fvx_models.wan_causal import WanCausalConfig
from fvx_models.wan_moe import Wan22MoEConfig

WAN_LAYOUTS = [WanConfig(preset="tiny"), WanConfig(preset="tiny-ti2v"), SkyReelsV2Config(preset="tiny"),
               Wan22MoEConfig(preset="tiny"), WanCausalConfig(preset="tiny")]


@pytest.mark.parametrize("config", WAN_LAYOUTS, ids=lambda c: f"{c.family.name}-{c.preset}")
def test_the_original_layout_converts_back_through_diffusers_bitwise(config, tmp_path):
    model = config.build()
    params = model.init(random.key(0))
    written = model.export(params, str(tmp_path / "out"), form="comfyui")
    assert list(written.files) == list(config.family.components)
    for component, prefix in config.family.components.items():
        stored = load_file(written.files[component])
        assert "blocks.0.self_attn.q.weight" in stored and "head.modulation" in stored
        back = convert_wan_transformer_to_diffusers(stored)
        want = {name[len(prefix):]: p for name, p in params.items() if name.startswith(prefix)}
        assert back.keys() == want.keys()
        assert all(back[n].dtype == want[n].dtype and torch.equal(back[n], want[n]) for n in want)
    assert written.how_to_load[0].startswith("ComfyUI: put diffusion_model.safetensors in models/diffusion_models/")


def test_two_experts_write_one_file_each_and_say_which_is_which(tmp_path):
    model = Wan22MoEConfig(preset="tiny").build()
    written = model.export(model.init(random.key(0)), str(tmp_path / "out"), form="comfyui", dtype="bf16")
    assert [p.name for p in written.files.values()] == ["diffusion_model.safetensors",
                                                        "diffusion_model_transformer_2.safetensors"]
    assert written.how_to_load[1].endswith("(transformer_2: the low-noise expert)")
    stored = load_file(written.files["transformer_2"])
    assert stored["blocks.0.self_attn.q.weight"].dtype == torch.bfloat16
    assert stored["blocks.0.modulation"].dtype == torch.float32  # diffusers keeps the modulation tables in fp32


def test_a_param_without_an_original_name_is_named_and_nothing_is_written(tmp_path):
    model = SkyReelsV2Config(preset="tiny-fps").build()
    with pytest.raises(ValueError, match=r"skyreels_v2 export: the original skyreels_v2 layout has no name for "
                                         r"fps_embedding.weight"):
        model.export(model.init(random.key(0)), str(tmp_path / "out"), form="comfyui")
    assert list(tmp_path.iterdir()) == []


def test_a_family_without_an_original_layout_says_so():
    model = HunyuanVideoConfig(preset="tiny").build()
    assert model.export_formats == ("diffusers",)
    with pytest.raises(ValueError, match="family hunyuan_video has no original layout in fvx"):
        original_layout.write({}, "unused", HunyuanVideoConfig.family, "hunyuan_video export", dtype_of=lambda n: None)
