"""Cosmos Predict 2.5's encoders (fvx_models.encoders, the record in fvx_models.cosmos): a tiny random
Cosmos2_5_PredictBasePipeline folder (a Qwen2.5-VL model with a byte-level tokenizer and chat template built here, the
Wan VAE, no safety checker) saved locally, opened as preprocessing opens it, against the pipeline's own calls."""
import pytest
import torch
import transformers
from diffusers import AutoencoderKLWan, Cosmos2_5_PredictBasePipeline, UniPCMultistepScheduler

import encoder_checks
from fvx_models import cosmos, encoders as fencoders

PROMPTS = ["red bars moving left", "a cat"]


def tiny_reason1(tokenizer) -> transformers.Qwen2_5_VLForConditionalGeneration:
    text = dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024, bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                  fullatt_block_indexes=[0], patch_size=2, window_size=4)
    return transformers.Qwen2_5_VLForConditionalGeneration(
        transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    tokenizer = encoder_checks.byte_qwen_tokenizer()  # the pipeline passes typed-text contents
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                           latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0])
    pipe = Cosmos2_5_PredictBasePipeline(text_encoder=tiny_reason1(tokenizer), tokenizer=tokenizer, transformer=None,
                                         vae=vae, scheduler=UniPCMultistepScheduler(),
                                         safety_checker=fencoders.NoSafetyChecker())
    path = tmp_path_factory.mktemp("cosmos25")
    pipe.save_pretrained(path)  # the safety checker is not saved: model_index.json holds it as [None, None]
    return path


def test_text_is_the_pipelines_whole_reason1_embedding(folder):
    opened = cosmos.ENCODERS.open(folder, ["text"])
    rows = opened.encode_text(PROMPTS)
    with torch.no_grad():
        full, negative = opened.pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False,
                                                   device=torch.device("cpu"))
    assert negative is None and [r.shape for r in rows] == [(512, 3 * 16)] * 2  # 3 layers concatenated
    assert all(torch.equal(row, padded) for row, padded in zip(rows, full))
    assert rows[1][-1].abs().sum() > 0  # the padding rows the DiT reads are not zero, so they are stored


def test_video_latents_are_the_vaes_posterior_mean_unnormalised(folder):
    encoder_checks.assert_video_latents_are_the_posterior_mean(cosmos.ENCODERS, folder, (3, 5, 32, 32), (4, 3, 16, 16))
    assert cosmos.ENCODERS.frame_step == 4 and cosmos.ENCODERS.pixel_multiple == 16
    assert cosmos.CosmosConfig.family.encoders is cosmos.ENCODERS


def test_the_folder_opens_without_the_guardrail_and_refuses_a_missing_text_encoder(folder, tmp_path):
    assert isinstance(cosmos.ENCODERS.open(folder, ["video"]).pipe.safety_checker, fencoders.NoSafetyChecker)
    encoder_checks.assert_refused_without(cosmos.ENCODERS, folder, tmp_path, "text_encoder", ("tokenizer",),
                                          r"has no 'text_encoder' component [^\n]*, which text encoding needs$")
