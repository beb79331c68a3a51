"""Kandinsky 6, trained video-only: its forward against the diffusers module as Kandinsky6TI2VAPipeline calls it
without audio is the family test's (tests/fvx_models/test_families.py, case "kandinsky6"); here: the params it holds
frozen are exactly those a video-only forward sends no gradient, the released preset, the exported folder, and its
encoders: the pipeline's prompt encoding (its template cropped, the real tokens after the pooled CLIP row) and the
HunyuanVideo VAE's mean."""
import inspect
import json

import torch
import transformers
from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky6TI2VAPipeline, Kandinsky6Transformer3DModel
from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_ti2va import _PROMPT_TEMPLATE, _QWEN_CROP_START

import encoder_checks
from fvx.core import grad, random
from fvx_models import hunyuan_video, kandinsky6
from fvx_models.kandinsky6 import Kandinsky6Config
from test_encoders_kandinsky5 import SPECIALS, qwen_tokenizer, tiny_qwen

from family_cases import inputs  # noqa: E402

PROMPTS = ["red bars moving left", "a cat"]


def test_the_frozen_audio_branch_is_exactly_what_a_video_only_forward_leaves_without_gradient():
    config = Kandinsky6Config(preset="tiny")
    model = config.build()
    params = model.weights.init(random.key(0))
    x, t, cond = inputs(model, random.key(1))
    grads = grad.grad(lambda p: model.apply(p, x, t, cond).square().mean())(params)
    without = {name for name, g in grads.items() if g is None or not g.abs().max() > 0}
    frozen = kandinsky6.unused(config)
    assert without == frozen and all(n.startswith(("audio_", "visual_transformer_blocks.")) for n in frozen)
    assert "audio_out_layer.out_layer.weight" in frozen and "out_layer.out_layer.weight" not in frozen


def test_the_released_preset_is_diffusers_layout():
    signature = inspect.signature(Kandinsky6Transformer3DModel.__init__).parameters
    preset = Kandinsky6Config(preset="kandinsky6").spec
    assert preset.kwargs == {name: p.default for name, p in signature.items() if name != "self"}
    assert preset.latents == hunyuan_video.LATENTS and preset.text_len == 1 + kandinsky6.TEXT_LEN


def test_an_export_is_a_kandinsky6_pipeline_folder_with_the_audio_branch_as_loaded(tmp_path):
    model = Kandinsky6Config(preset="tiny").build()
    params = model.weights.init(random.key(0))
    written = model.export.folder(params, str(tmp_path))
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "Kandinsky6TI2VAPipeline"
    loaded = Kandinsky6Transformer3DModel.from_pretrained(written.files["transformer"])
    assert all(torch.equal(p, params[name]) for name, p in loaded.state_dict().items() if name in params)


def test_text_is_the_pooled_row_then_the_pipelines_real_tokens_and_video_the_vaes_mean(tmp_path):
    torch.manual_seed(0)
    template = _PROMPT_TEMPLATE
    tokenizer = encoder_checks.template_cropping_tokenizer(
        qwen_tokenizer, {SPECIALS[0]: 0}, SPECIALS[1:], [template.format(p) for p in PROMPTS],
        template.split("{}")[0], _QWEN_CROP_START)
    clip_tokenizer = encoder_checks.tiny_clip_tokenizer(PROMPTS)
    Kandinsky6TI2VAPipeline(
        transformer=None, vae=encoder_checks.tiny_hunyuan_vae(), text_encoder=tiny_qwen(len(tokenizer)),
        tokenizer=tokenizer, text_encoder_2=encoder_checks.tiny_clip_text(len(clip_tokenizer)),
        tokenizer_2=clip_tokenizer, scheduler=FlowMatchEulerDiscreteScheduler()).save_pretrained(tmp_path)
    opened = kandinsky6.ENCODERS.open(tmp_path, ["text", "video"])
    assert type(opened.pipe.tokenizer) is transformers.Qwen2Tokenizer
    rows = opened.encode_text(PROMPTS)
    embeds, pooled, mask, *_ = opened.pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False,
                                                         max_sequence_length=kandinsky6.TEXT_LEN)
    assert embeds.shape[1] == kandinsky6.TEXT_LEN and mask.sum(1).tolist() == [5, 3]  # the words and <|im_end|>
    encoder_checks.assert_pooled_row_then_tokens(rows, pooled, [e[m] for e, m in zip(embeds, mask)])
    encoder_checks.assert_video_latents_are_the_posterior_mean(kandinsky6.ENCODERS, tmp_path, (3, 5, 32, 32),
                                                               (4, 2, 4, 4))
