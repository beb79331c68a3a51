"""ChronoEdit: Wan 2.1 I2V's spec on diffusers' ChronoEditTransformer3DModel. Its forward against the diffusers module
as ChronoEditPipeline calls it is the family test's (tests/fvx_models/test_families.py, case "chronoedit"); here: the
RoPE difference from Wan at two latent frames, the released preset, the pipeline folder an export writes, and LoRA
files diffusers' ChronoEditPipeline loads."""
import inspect
import json

import pytest
import torch
from diffusers import (AutoencoderKLWan, ChronoEditPipeline, ChronoEditTransformer3DModel,
                       FlowMatchEulerDiscreteScheduler)

from fvx.core import random, role
from fvx_models import lora, lora_files, wan_vae
from fvx_models.chronoedit import ChronoEditConfig
from fvx_models.wan import WanConfig

from family_cases import CASES, inputs, native_modules, wan_i2v_native  # noqa: E402


def test_two_latent_frames_put_the_edit_at_the_end_of_the_reasoning_window():
    """With the same params ChronoEdit is Wan 2.1 I2V at three latent frames; at two (the input and the edit) its
    edit frame sits at temporal position ``rope_temporal_skip_len - 1``, so the outputs differ."""
    chrono, wan_i2v = ChronoEditConfig(preset="tiny").build(), WanConfig(preset="tiny-i2v").build()
    params = chrono.weights.init(random.key(0))
    assert set(params) == set(wan_i2v.weights.init(random.key(0)))
    for frames, same in ((3, True), (2, False)):
        x, t, cond = inputs(chrono, random.key(frames), frames=frames)
        ours, theirs = chrono.apply(params, x, t, cond), wan_i2v.apply(params, x, t, cond)
        assert torch.allclose(ours, theirs, atol=1e-6, rtol=0) is same, frames


def test_the_released_preset_is_wan21_i2v_14b_with_the_skip():
    kwargs = ChronoEditConfig(preset="chronoedit-14b").spec.kwargs
    signature = inspect.signature(ChronoEditTransformer3DModel.__init__).parameters
    assert sorted(kwargs) == sorted(name for name in signature if name != "self")
    assert kwargs == {**WanConfig(preset="wan2.1-i2v-14b-720p").spec.kwargs, "rope_temporal_skip_len": 8}


def test_an_export_is_a_chronoedit_pipeline_folder(tmp_path):
    model = ChronoEditConfig(preset="tiny").build()
    params = model.weights.init(random.key(0))
    written = model.export.folder(params, str(tmp_path))
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "ChronoEditPipeline"
    assert index["transformer"] == ["diffusers", "ChronoEditTransformer3DModel"]
    assert index["image_encoder"] == ["transformers", "CLIPVisionModel"]
    assert FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path / "scheduler").config.shift == 3.0
    loaded = ChronoEditTransformer3DModel.from_pretrained(written.files["transformer"])
    assert loaded.config.rope_temporal_skip_len == 8
    assert all(torch.equal(p, params[name]) for name, p in loaded.state_dict().items())


def test_a_peft_lora_file_loads_with_the_chronoedit_pipeline_and_equals_fvx_lora(tmp_path):
    pytest.importorskip("peft")
    adapted = ChronoEditConfig(frozen_dtype="fp32", lora=lora.LoRAConfig(rank=4, alpha=8.0)).build()
    base, fresh = adapted.weights.base(random.key(0)), adapted.weights.initial(random.key(1))
    adapters = {name: random.normal(random.fold_in(random.key(1), i), tuple(p.shape)) * 0.1
                if name.endswith(lora.B) else p for i, (name, p) in enumerate(fresh.items())}
    written = adapted.export.adapters(adapters, str(tmp_path), "peft")
    (transformer,) = native_modules(CASES["chronoedit"], base).values()
    pipe = ChronoEditPipeline(tokenizer=None, text_encoder=None, image_encoder=None, image_processor=None,
                              transformer=transformer, vae=AutoencoderKLWan(**wan_vae.PRESETS["tiny"]),
                              scheduler=FlowMatchEulerDiscreteScheduler())
    assert [p.name for p in written.files.values()] == [lora_files.PEFT_FILE]
    pipe.load_lora_weights(str(tmp_path), weight_name=lora_files.PEFT_FILE)
    x, t, cond = inputs(adapted, random.key(2))
    with torch.no_grad():
        loaded = wan_i2v_native({"transformer": pipe.transformer}, x, t, cond)
    ours = adapted.apply(role.with_trained(base, adapters), x, t, cond)
    plain = ChronoEditConfig(frozen_dtype="fp32").build().apply(base, x, t, cond)
    assert (ours - plain).abs().max() > 1e-3  # the adapters change the output
    torch.testing.assert_close(loaded.float(), ours, rtol=1e-5, atol=1e-5)
