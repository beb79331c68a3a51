"""Wan 2.2 VACE-Fun A14B (fvx_models.wan_vace_moe): its forward against two diffusers WanVACETransformer3DModel experts
routed as WanVACEPipeline routes them is the family test's (tests/fvx_models/test_families.py, case "wan_vace_moe");
here: the released preset as diffusers' converter writes it, what trains (experts and parts), one expert's range a
step, the context scale reaching both experts, the pipeline folder and the ComfyUI names of each expert's file."""
import json

import pytest
import torch
from safetensors.torch import load_file

from fvx.core import flow, random
from fvx_models import lora, wan, wan_moe, wan_vace, wan_vace_moe
from fvx_models.model import StepRange
from fvx_models.wan_vace_moe import WanVACEMoEConfig

from family_cases import inputs  # noqa: E402


def test_the_released_preset_is_the_converters_vace_fun_a14b():
    """diffusers' scripts/convert_wan_to_diffusers.py, model type "Wan2.2-VACE-Fun-14B": each expert Wan 14B with
    context blocks at 0, 5, ..., 35 on a 96-channel context; its pipeline routes at boundary_ratio 0.875 and ships
    UniPC at flow shift 3."""
    preset = WanVACEMoEConfig(preset="wan2.2-vace-fun-a14b").spec
    converter = dict(added_kv_proj_dim=None, attention_head_dim=128, cross_attn_norm=True, eps=1e-06, ffn_dim=13824,
                     freq_dim=256, in_channels=16, num_attention_heads=40, num_layers=40, out_channels=16,
                     patch_size=(1, 2, 2), qk_norm="rms_norm_across_heads", text_dim=4096,
                     vace_layers=[0, 5, 10, 15, 20, 25, 30, 35], vace_in_channels=96)
    assert {name: preset.kwargs[name] for name in converter} == converter
    assert preset.latents == wan.WAN21_VAE and preset.options == {"flow_shift": 3.0, "boundary_ratio": 0.875}


def test_trainable_names_the_experts_and_parts_what_of_them():
    def trained(**knobs):
        return WanVACEMoEConfig(**knobs).build().weights.trained_names

    every = trained()
    high_context = trained(trainable=("transformer",), parts=("context",))
    assert high_context == {name for name in every if name.startswith(("transformer.vace_blocks.",
                                                                        "transformer.vace_patch_embedding."))}
    assert trained(trainable=("transformer_2",)) == {name for name in every if name.startswith("transformer_2.")}
    adapted = WanVACEMoEConfig(parts=("base",), lora=lora.LoRAConfig(rank=2)).build().weights.trained_names
    assert adapted and not any(".vace_" in name for name in adapted)
    for knobs, message in (({"parts": ()}, "parts must name each part to train once"),
                           ({"trainable": ("transformer", "transformer")}, "trainable must name each expert"),
                           ({"context_scale": (1.0, 1.0, 1.0)}, "context_scale must be one finite number or 2")):
        with pytest.raises(ValueError, match=message):
            WanVACEMoEConfig(**knobs)


def test_a_step_trains_one_expert_in_its_range():
    """Wan 2.2 A14B's rule (fvx_models.wan_moe.step_ranges): the low-noise expert with probability 0.875 below
    t = 875, else the high-noise one; an expert left frozen is never drawn."""
    both = WanVACEMoEConfig().build().rules.step_ranges
    assert both == (StepRange(0.875, 0.0, 875.0), StepRange(0.125, 875.0, float("inf")))
    assert WanVACEMoEConfig(trainable=("transformer",)).build().rules.step_ranges == (
        StepRange(1.0, 875.0, float("inf")),)


def test_a_recipe_may_split_the_experts_training_timesteps_away_from_the_router():
    """DiffSynth-Studio's VACE-Fun scripts train the high-noise expert on timestep ids [0, 358) of its shift-5 grid
    ("boundary corresponds to timesteps [900, 1000]"): exactly the grid's levels from t = 900 up, while the router
    still sends t >= 875 to it."""
    config = WanVACEMoEConfig(train_boundary_ratio=0.9)
    ranges = config.build().rules.step_ranges
    assert [(r.t_min, r.t_max) for r in ranges] == [(0.0, 900.0), (900.0, float("inf"))]
    assert [r.probability for r in ranges] == pytest.approx([0.9, 0.1])
    assert config.boundary == 0.875 and wan_moe.boundary_timestep(config) == 875.0
    t = flow.to_timestep(flow.training_sigmas(5.0), 1000)
    assert torch.equal(torch.nonzero(t >= 900.0).flatten(), torch.arange(358))


def test_the_context_scale_reaches_both_experts():
    """At context scale 0 each expert's hints vanish: the velocity is the two experts' without a context branch,
    whatever the context."""
    model = WanVACEMoEConfig(context_scale=0.0).build()
    params = model.weights.init(random.key(0))
    x, t, cond = inputs(model, random.key(1))  # t = (30, 910.5): one sample to each expert
    other = {**cond, "vace_context": cond["vace_context"] + 1.0}
    torch.testing.assert_close(model.apply(params, x, t, cond), model.apply(params, x, t, other), rtol=0, atol=0)
    scaled = WanVACEMoEConfig().build()
    assert not torch.allclose(scaled.apply(params, x, t, cond), scaled.apply(params, x, t, other), atol=1e-4)


def test_an_export_is_a_two_expert_vace_pipeline_and_comfyui_files_per_expert(tmp_path):
    model = WanVACEMoEConfig().build()
    params = model.weights.init(random.key(0))
    model.export.folder(params, str(tmp_path / "folder"))
    index = json.loads((tmp_path / "folder" / "model_index.json").read_text())
    assert index["_class_name"] == "WanVACEPipeline" and index["boundary_ratio"] == 0.875
    assert index["transformer"] == index["transformer_2"] == ["diffusers", "WanVACETransformer3DModel"]
    adapted = WanVACEMoEConfig(lora=lora.LoRAConfig(rank=2, target_modules=("proj_in", "to_q"))).build()
    written = adapted.export.adapters(adapted.weights.initial(random.key(1)), str(tmp_path / "lora"), "comfyui")
    assert set(written.files) == {"transformer", "transformer_2"}
    for path in written.files.values():
        keys = set(load_file(path))
        assert "diffusion_model.vace_blocks.0.before_proj.lora_down.weight" in keys
        assert "diffusion_model.blocks.1.self_attn.q.lora_up.weight" in keys
    assert wan_vace_moe.WAN_VACE_MOE.checkpoints.original_name is wan_vace.original_name
