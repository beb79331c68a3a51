"""ChronoEdit: Wan 2.1 I2V's spec on diffusers' ChronoEditTransformer3DModel. Its forward against the diffusers module
as ChronoEditPipeline calls it is the family test's (tests/fvx_models/test_families.py, case "chronoedit"); here: the
RoPE difference from Wan at two latent frames, the released preset and the pipeline folder an export writes (its LoRA
files load with ChronoEditPipeline: tests/fvx_models/test_lora.py)."""
import inspect
import json

import torch
from diffusers import ChronoEditTransformer3DModel, FlowMatchEulerDiscreteScheduler

from fvx.core import random
from fvx_models.chronoedit import ChronoEditConfig
from fvx_models.wan import WanConfig

from family_cases import inputs  # noqa: E402


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
