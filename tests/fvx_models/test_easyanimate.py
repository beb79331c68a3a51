"""EasyAnimate V5.1: an MMDiT flow model. Its forward against the diffusers module as EasyAnimatePipeline calls it is
the family test's (tests/fvx_models/test_families.py, case "easyanimate"), its LoRA loads with peft
(tests/fvx_models/test_lora.py); here: its encoders are the pipeline's prompt encoding (every one of the 256 rows) and
the Magvit VAE's mean, the released preset, the exported folder."""
import inspect
import json

import torch
import transformers
from diffusers import (AutoencoderKLMagvit, EasyAnimatePipeline, EasyAnimateTransformer3DModel,
                       FlowMatchEulerDiscreteScheduler)

import encoder_checks
from fvx.core import random
from fvx_models import easyanimate
from fvx_models.easyanimate import EasyAnimateConfig


def tiny_qwen2_vl(tokenizer) -> transformers.Qwen2VLForConditionalGeneration:
    """Qwen2-VL of width 16 (its vision tower tiny too: the pipeline loads the whole model)."""
    text = dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    vision = dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, in_channels=3, patch_size=2,
                  spatial_merge_size=1, temporal_patch_size=1)
    return transformers.Qwen2VLForConditionalGeneration(transformers.Qwen2VLConfig(
        text_config=text, vision_config=vision, pad_token_id=tokenizer.pad_token_id))


def test_text_is_the_pipelines_prompt_encoding_every_row_and_video_the_vaes_mean(tmp_path):
    torch.manual_seed(0)
    tokenizer = encoder_checks.byte_qwen_tokenizer()
    vae = AutoencoderKLMagvit(latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                              norm_num_groups=2)
    EasyAnimatePipeline(text_encoder=tiny_qwen2_vl(tokenizer), tokenizer=tokenizer, vae=vae, transformer=None,
                        scheduler=FlowMatchEulerDiscreteScheduler()).save_pretrained(tmp_path)
    opened = easyanimate.ENCODERS.open(tmp_path, ["text", "video"])
    prompts = ["red bars moving left", "a cat"]
    rows = opened.encode_text(prompts)
    embeds, _, mask, _ = opened.pipe.encode_prompt(prompts, do_classifier_free_guidance=False)
    assert embeds.shape[1] == 256 and int(mask.sum()) < 2 * 256
    assert [tuple(r.shape) for r in rows] == [(256, 16)] * 2 and torch.equal(torch.stack(rows), embeds)
    video = encoder_checks.random_clip((3, 5, 16, 16))
    assert torch.equal(opened.encode_video(video), opened.pipe.vae.encode(video[None]).latent_dist.mode()[0])


def test_the_released_preset_is_the_v51_12b_text_to_video_layout():
    signature = [name for name in inspect.signature(EasyAnimateTransformer3DModel.__init__).parameters
                 if name != "self"]
    preset = EasyAnimateConfig(preset="easyanimate-v5.1-12b").spec
    k = preset.kwargs
    assert sorted(k) == sorted(signature)
    assert (k["num_layers"], k["num_attention_heads"] * k["attention_head_dim"], k["text_embed_dim"]) == (
        48, 3072, 3584)
    assert k["add_norm_text_encoder"] and (k["in_channels"], k["out_channels"]) == (16, 16)
    assert preset.latents.scale == 0.7125 and preset.text_len == 256


def test_an_export_is_an_easyanimate_pipeline_folder(tmp_path):
    model = EasyAnimateConfig(preset="tiny").build()
    params = model.weights.init(random.key(0))
    written = model.export.folder(params, str(tmp_path))
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "EasyAnimatePipeline"
    assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    loaded = EasyAnimateTransformer3DModel.from_pretrained(written.files["transformer"])
    assert all(torch.equal(p, params[name]) for name, p in loaded.state_dict().items() if name in params)
