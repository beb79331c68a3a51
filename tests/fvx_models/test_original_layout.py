"""fvx_models.original_layout: whole weights in Wan's original layout (what ComfyUI and musubi-tuner load) convert back
through diffusers' own single-file converter to the exported params bit for bit, for every Wan-family layout and every
preset (Wan 2.1 I2V's image embedder included), plain and with LoRA adapters merged; the files are named after what
is exported (the two experts ``_high_noise`` / ``_low_noise``) and the printed hint names them; a param without an
original name, or a family without the layout, is one clear error that writes nothing."""
import pytest
import torch
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from safetensors.torch import load_file

from fvx.core import random, role
from fvx_models import lora, original_layout
from fvx_models.hunyuan_video import HunyuanVideoConfig
from fvx_models.skyreels_v2 import SkyReelsV2Config
from fvx_models.wan import WanConfig, original_name
from fvx_models.wan_causal import WanCausalConfig
from fvx_models.wan_moe import Wan22MoEConfig

WAN_LAYOUTS = [WanConfig(preset="tiny"), WanConfig(preset="tiny-ti2v"), WanConfig(preset="tiny-i2v"),
               SkyReelsV2Config(preset="tiny"), Wan22MoEConfig(preset="tiny"), Wan22MoEConfig(preset="tiny-i2v"),
               WanCausalConfig(preset="tiny")]
EVERY_PRESET = [(config, preset) for config in (WanConfig, SkyReelsV2Config, Wan22MoEConfig, WanCausalConfig)
                for preset in config.family.presets]
WITHOUT_ORIGINAL_NAMES = {"tiny-fps", "skyreels-v2-df-1.3b"}  # SkyReels-V2's frame-rate embedding: refused below


def converted_back(written, params: dict, components: dict) -> dict[str, tuple[dict, dict]]:
    """component -> (diffusers' conversion of its file, the params it should give back)."""
    out = {}
    for component, prefix in components.items():
        back = convert_wan_transformer_to_diffusers(load_file(written.files[component]))
        out[component] = back, {name[len(prefix):]: p for name, p in params.items() if name.startswith(prefix)}
    return out


def assert_bitwise(back: dict, want: dict) -> None:
    assert back.keys() == want.keys()
    for name in want:
        assert back[name].dtype == want[name].dtype and torch.equal(back[name], want[name]), name


@pytest.mark.parametrize("config", WAN_LAYOUTS, ids=lambda c: f"{c.family.name}-{c.preset}")
def test_the_original_layout_converts_back_through_diffusers_bitwise(config, tmp_path):
    model = config.build()
    params = model.weights.init(random.key(0))
    written = model.export.folder(params, str(tmp_path / "out"), form="comfyui")
    assert list(written.files) == list(config.family.checkpoints.components)
    for component, (back, want) in converted_back(written, params, config.family.checkpoints.components).items():
        stored = load_file(written.files[component])
        assert "blocks.0.self_attn.q.weight" in stored and "head.modulation" in stored
        if config.spec.kwargs.get("image_dim"):  # Wan 2.1 I2V: the CLIP image embedding's projection
            assert {f"img_emb.proj.{i}.weight" for i in (0, 1, 3, 4)} <= stored.keys()
        assert_bitwise(back, want)
    assert written.how_to_load[0].startswith(f"ComfyUI: put {written.files['transformer'].name} in "
                                             "models/diffusion_models/")


@pytest.mark.parametrize("config, preset", EVERY_PRESET, ids=lambda v: getattr(v, "__name__", v))
def test_every_param_of_every_preset_has_an_original_name_that_diffusers_maps_back(config, preset):
    """On the meta skeleton (no weights): the 14B presets too, Wan 2.1 I2V's image embedder included."""
    family = config.family
    names = [name for name, _ in family.architecture.skeleton(config(preset=preset)).named_parameters()]
    for prefix in family.checkpoints.components.values():
        part = [name[len(prefix):] for name in names if name.startswith(prefix)]
        originals = {name: family.checkpoints.original_name(name) for name in part}
        unnamed = sorted(name for name, original in originals.items() if original is None)
        if preset in WITHOUT_ORIGINAL_NAMES:
            assert unnamed and all(name.startswith(("fps_embedding", "fps_projection")) for name in unnamed)
            continue
        assert unnamed == []
        back = convert_wan_transformer_to_diffusers({original: torch.empty(0) for original in originals.values()})
        assert sorted(back) == sorted(part)


def test_the_image_embedder_has_the_names_of_diffusers_wan_conversion_script():
    """diffusers' scripts/convert_wan_to_diffusers.py, TRANSFORMER_KEYS_RENAME_DICT ("For the I2V model", "for the
    FLF2V model"): the original -> diffusers names, read back the other way."""
    script = {"img_emb.proj.0": "condition_embedder.image_embedder.norm1",
              "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
              "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
              "img_emb.proj.4": "condition_embedder.image_embedder.norm2",
              "img_emb.emb_pos": "condition_embedder.image_embedder.pos_embed"}
    for original, diffusers_name in script.items():
        assert original_name(diffusers_name) == original
        assert original_name(diffusers_name + ".weight") == original + ".weight"


@pytest.mark.parametrize("config", [WanConfig(preset="tiny-i2v"), Wan22MoEConfig(preset="tiny-i2v")],
                         ids=lambda c: f"{c.family.name}-{c.preset}")
def test_a_merged_lora_exports_in_the_original_layout_bitwise(config, tmp_path):
    """A LoRA role's whole weights (adapters on the attentions, the image cross-attention's k_img/v_img and, for Wan
    2.1 I2V, the image embedder's linears, merged as W + (alpha / r) B A) convert back to fvx's merged params."""
    adapted = lora.LoRAConfig(rank=2, alpha=4.0, target_modules=("to_q", "add_k_proj", "add_v_proj", "image_embedder"))
    model = type(config)(preset=config.preset, frozen_dtype="fp32", lora=adapted).build()
    base = model.weights.base(random.key(0))
    adapters = {name: random.normal(random.fold_in(random.key(1), i), tuple(p.shape)) * 0.1
                for i, (name, p) in enumerate(model.weights.initial(random.key(1)).items())}
    modules = model.export.adapters.args[0].modules
    assert (any("image_embedder" in m for m in modules) == bool(config.spec.kwargs.get("image_dim"))
            and any("add_k_proj" in m for m in modules) == bool(config.spec.kwargs.get("added_kv_proj_dim")))
    written = model.export.folder(role.with_trained(base, adapters), str(tmp_path / "out"), form="comfyui", stem="run")
    scale = adapted.scale
    merged = lora.merged(base, adapters, modules, scale)
    for component, (back, want) in converted_back(written, merged, config.family.checkpoints.components).items():
        assert_bitwise(back, want)
        prefix = config.family.checkpoints.components[component]
        for module in (m[len(prefix):] for m in modules if m.startswith(prefix)):  # base + (alpha / r) B A
            a, b = (adapters[f"{prefix}{module}.{part}"] for part in (lora.A, lora.B))
            torch.testing.assert_close(back[f"{module}.weight"], base[f"{prefix}{module}.weight"] + scale * b @ a,
                                       rtol=0, atol=1e-6)


def test_files_are_named_after_the_export_and_the_hint_names_them(tmp_path):
    model = WanConfig(preset="tiny").build()
    params = model.weights.init(random.key(0))
    written = model.export.folder(params, str(tmp_path / "out"), form="comfyui", stem="my_run")
    path = tmp_path / "out" / "my_run.safetensors"
    assert written.files == {"transformer": path} and path.is_file()
    assert written.how_to_load == (f"ComfyUI: put my_run.safetensors in models/diffusion_models/ and load it with a "
                                   f"Load Diffusion Model node; musubi-tuner: wan_generate_video.py --dit {path}",)


def test_two_experts_write_high_and_low_noise_files_with_musubi_tuners_flags(tmp_path):
    model = Wan22MoEConfig(preset="tiny").build()
    written = model.export.folder(model.weights.init(random.key(0)), str(tmp_path / "out"), form="comfyui",
                                  dtype="bf16", stem="a14b")
    high, low = tmp_path / "out" / "a14b_high_noise.safetensors", tmp_path / "out" / "a14b_low_noise.safetensors"
    assert written.files == {"transformer": high, "transformer_2": low}
    assert written.how_to_load == (
        "ComfyUI: put a14b_high_noise.safetensors in models/diffusion_models/ and load it with a Load Diffusion Model "
        f"node (transformer: the high-noise expert); musubi-tuner: wan_generate_video.py --dit_high_noise {high}",
        "ComfyUI: put a14b_low_noise.safetensors in models/diffusion_models/ and load it with a Load Diffusion Model "
        f"node (transformer_2: the low-noise expert); musubi-tuner: wan_generate_video.py --dit {low}")
    stored = load_file(low)
    assert stored["blocks.0.self_attn.q.weight"].dtype == torch.bfloat16
    assert stored["blocks.0.modulation"].dtype == torch.float32  # diffusers keeps the modulation tables in fp32
    unnamed = model.export.folder(model.weights.init(random.key(0)), str(tmp_path / "default"), form="comfyui")
    assert [p.name for p in unnamed.files.values()] == ["diffusion_model_high_noise.safetensors",
                                                        "diffusion_model_low_noise.safetensors"]


def test_a_param_without_an_original_name_is_named_and_nothing_is_written(tmp_path):
    model = SkyReelsV2Config(preset="tiny-fps").build()
    with pytest.raises(ValueError, match=r"skyreels_v2 export: the original skyreels_v2 layout has no name for "
                                         r"fps_embedding.weight"):
        model.export.folder(model.weights.init(random.key(0)), str(tmp_path / "out"), form="comfyui")
    assert list(tmp_path.iterdir()) == []


def test_a_family_without_an_original_layout_says_so():
    model = HunyuanVideoConfig(preset="tiny").build()
    assert model.export.formats == ("diffusers",)
    with pytest.raises(ValueError, match="family hunyuan_video has no original layout in fvx"):
        original_layout.write({}, "unused", HunyuanVideoConfig.family, "hunyuan_video export", dtype_of=lambda n: None)
