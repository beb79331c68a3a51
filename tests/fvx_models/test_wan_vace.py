"""Wan 2.1 VACE: Wan's spec on diffusers' WanVACETransformer3DModel with its control context. Its forward against the
diffusers module as WanVACEPipeline calls it is the family test's (tests/fvx_models/test_families.py, case
"wan_vace"); its LoRA files load with WanVACEPipeline (tests/fvx_models/test_lora.py). Here: the context as the
pipeline encodes it, what ``trainable`` trains, the original names, the released presets, the exported folder and
the one-line refusals of a missing or misshapen context."""
import inspect
import json
import types

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanVACEPipeline, WanVACETransformer3DModel
from safetensors.torch import load_file

import encoder_checks
from fvx.core import random
from fvx_models import lora, wan_vace
from fvx_models.wan_vace import WanVACEConfig
from test_encoders_wan_variants import tiny_umt5, tiny_wan_vae
from tiny_wan_pipeline import tiny_t5_tokenizer

from family_cases import (CASES, _masked as masked, inputs, native_modules,  # noqa: E402
                          raw_batch)


def test_the_context_is_the_pipelines_prepare_video_latents_and_prepare_masks(tmp_path):
    """A VACE folder opens with WanVACEPipeline; a control video, a mask and a reference image encode to exactly
    ``[prepare_video_latents | prepare_masks]`` of that pipeline (the tiny VAE: 2x in time and space, DiT patch 2),
    and the reference's latent frame is the one the pipeline puts in front."""
    WanVACEPipeline(tokenizer=tiny_t5_tokenizer(), text_encoder=tiny_umt5(), vae=tiny_wan_vae(),
                    scheduler=FlowMatchEulerDiscreteScheduler(), transformer=None).save_pretrained(tmp_path)
    opened = wan_vace.ENCODERS.open(tmp_path, ["text", "video", "context"])
    assert type(opened.pipe) is WanVACEPipeline
    encoder_checks.assert_text_is_the_pipelines_encode_prompt_cut_to_its_tokens(opened)
    video = encoder_checks.random_clip((3, 5, 16, 16), seed=3)
    mask = (torch.rand(1, 5, 16, 16, generator=torch.Generator().manual_seed(4)) > 0.5).float()
    reference = encoder_checks.random_clip((3, 1, 16, 16), seed=5)[:, 0]
    context = opened.encode_context(video, mask, [reference])

    pipe = opened.pipe
    pipe.transformer = types.SimpleNamespace(config=types.SimpleNamespace(patch_size=(1, 2, 2)))  # its masks read it
    expected = torch.cat([pipe.prepare_video_latents(video[None], mask[None], [[reference]], device="cpu"),
                          pipe.prepare_masks(mask[None], [[reference]])], dim=1)[0]
    assert context.shape == (2 * 4 + 4, 1 + 3, 8, 8) and torch.equal(context, expected)
    without = opened.encode_context(video, None, [])  # no mask: all of it to be made
    ones = torch.ones(1, 1, 5, 16, 16)
    assert torch.equal(without, torch.cat([pipe.prepare_video_latents(video[None], ones, [[]], device="cpu"),
                                           pipe.prepare_masks(ones, [[]])], dim=1)[0])
    front = opened.encode_references([reference])  # in the VAE's own scale, as vae_latent is stored
    mean = torch.tensor(pipe.vae.config.latents_mean).view(-1, 1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std).view(-1, 1, 1, 1)
    torch.testing.assert_close((front - mean) / std, context[:4, :1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("scale", [0.5, (0.25, 1.5)])
def test_the_context_scale_is_the_pipelines_conditioning_scale(scale):
    """``context_scale`` (one value, or one per context block) is ``WanVACEPipeline``'s ``conditioning_scale``: the
    DiT's ``control_hidden_states_scale``; it changes the velocity."""
    model = WanVACEConfig(preset="tiny", context_scale=scale).build()
    params = model.weights.init(random.key(0))
    x, t, cond = inputs(model, random.key(1))
    per_block = torch.tensor(scale if isinstance(scale, tuple) else (scale, scale))
    (module,) = native_modules(CASES["wan_vace"], params).values()
    with torch.no_grad():
        expected = module(hidden_states=x, timestep=t, encoder_hidden_states=masked(cond),
                          control_hidden_states=cond["vace_context"], control_hidden_states_scale=per_block,
                          return_dict=False)[0]
    got = model.apply(params, x, t, cond)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, WanVACEConfig(preset="tiny").build().apply(params, x, t, cond), atol=1e-4)


def test_a_context_scale_of_the_wrong_length_is_one_line():
    with pytest.raises(ValueError, match=r"context_scale must be one finite number or 2 \(one per context block\)"):
        WanVACEConfig(preset="tiny", context_scale=(1.0, 1.0, 1.0))


def test_trainable_picks_the_base_the_context_branch_or_both():
    names = {part: WanVACEConfig(trainable=part).build().weights.trained_names
             for part in (("base",), ("context",), ("base", "context"))}
    context = {name for name in names[("base", "context")] if name.startswith(("vace_blocks.", "vace_patch_"))}
    assert names[("context",)] == context and context and names[("base",)] == names[("base", "context")] - context
    with pytest.raises(ValueError, match="trainable must name each part to train once"):
        WanVACEConfig(trainable=())


def test_the_context_branch_has_vaces_original_names_in_a_comfyui_file(tmp_path):
    assert wan_vace.original_name("vace_blocks.3.proj_in.weight") == "vace_blocks.3.before_proj.weight"
    assert wan_vace.original_name("vace_blocks.3.proj_out.bias") == "vace_blocks.3.after_proj.bias"
    assert wan_vace.original_name("vace_blocks.0.norm2.weight") == "vace_blocks.0.norm3.weight"  # as a main block's
    assert wan_vace.original_name("vace_patch_embedding.weight") == "vace_patch_embedding.weight"
    assert wan_vace.original_name("blocks.1.attn1.to_q.weight") == "blocks.1.self_attn.q.weight"
    model = WanVACEConfig().build()
    assert all(wan_vace.original_name(name) for name in model.weights.init(random.key(0)))
    adapted = WanVACEConfig(lora=lora.LoRAConfig(rank=2, target_modules=("proj_in", "to_q"))).build()
    adapters = adapted.weights.initial(random.key(1))
    written = adapted.export.adapters(adapters, str(tmp_path), "comfyui", stem="control")
    keys = set(load_file(written.files["transformer"]))
    assert "diffusion_model.vace_blocks.0.before_proj.lora_down.weight" in keys
    assert "diffusion_model.vace_blocks.1.self_attn.q.lora_up.weight" in keys


def test_the_released_presets_are_diffusers_vace_configs():
    """Wan2.1-VACE-1.3B and -14B as diffusers' convert_wan_to_diffusers.py writes them: Wan 2.1 T2V's architecture
    with context blocks every 2nd (1.3B) or 5th (14B) layer on a 96-channel context."""
    signature = [name for name in inspect.signature(WanVACETransformer3DModel.__init__).parameters if name != "self"]
    small, large = (WanVACEConfig(preset=p).spec.kwargs for p in ("wan2.1-vace-1.3b", "wan2.1-vace-14b"))
    assert sorted(small) == sorted(signature) == sorted(large)
    assert (small["num_layers"], small["num_attention_heads"], small["ffn_dim"]) == (30, 12, 8960)
    assert small["vace_layers"] == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28]
    assert large["vace_layers"] == [0, 5, 10, 15, 20, 25, 30, 35] and large["num_layers"] == 40
    assert small["vace_in_channels"] == large["vace_in_channels"] == 96
    assert WanVACEConfig(preset="world").spec.kwargs["vace_in_channels"] == 2 * 192 + 64


def test_an_export_is_a_vace_pipeline_folder(tmp_path):
    model = WanVACEConfig().build()
    params = model.weights.init(random.key(0))
    written = model.export.folder(params, str(tmp_path))
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "WanVACEPipeline" and index["transformer_2"] == [None, None]
    assert index["transformer"] == ["diffusers", "WanVACETransformer3DModel"]
    assert FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path / "scheduler").config.shift == 3.0
    loaded = WanVACETransformer3DModel.from_pretrained(written.files["transformer"])
    assert loaded.config.vace_layers == [0, 1]
    assert all(torch.equal(p, params[name]) for name, p in loaded.state_dict().items())


def test_a_missing_or_misshapen_context_is_one_line_naming_the_column_and_its_shape():
    model = WanVACEConfig().build()
    batch = raw_batch(model, random.key(0))
    assert model.batch(batch)["cond"]["vace_context"].shape == (2, 48, 2, 4, 4)
    with pytest.raises(ValueError, match=r"needs the batch tensor 'vace_context' \(the control context: parquet column "
                                         r"vace_context of data.kind='vace' data\)"):
        model.batch({k: v for k, v in batch.items() if k != "vace_context"})
    for bad in (batch["vace_context"][:, :40], batch["vace_context"][:, :, :1]):
        with pytest.raises(ValueError, match=r"wan_vace:tiny: column vace_context is \[2, \d+, \d, 4, 4\], but it must "
                                             r"be \[B, 48, 2, 4, 4\]"):
            model.batch({**batch, "vace_context": bad})
