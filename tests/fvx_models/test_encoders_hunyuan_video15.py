"""HunyuanVideo 1.5's encoders (fvx_models.encoders, the records in fvx_models.hunyuan_video15): a tiny random
HunyuanVideo15Pipeline folder (a Qwen2.5-VL text model with a byte-level tokenizer and chat template built here, ByT5,
the HunyuanVideo 1.5 VAE) saved locally, opened as preprocessing opens it, against the pipeline's own calls."""
import pytest
import torch
import transformers
from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler,
                       HunyuanVideo15Pipeline)

import encoder_checks
from fvx_models import hunyuan_video15

PROMPTS = ["red bars moving left", 'a sign reads "OPEN" and \u201cshop\u201d']


def tiny_qwen(tokenizer) -> transformers.Qwen2_5_VLTextModel:
    return transformers.Qwen2_5_VLTextModel(transformers.Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=2048, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    tokenizer = encoder_checks.byte_qwen_tokenizer()
    byt5 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=384, d_model=24, d_kv=4, d_ff=32, num_layers=2, num_heads=4, relative_attention_num_buckets=8))
    vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1)
    pipe = HunyuanVideo15Pipeline(text_encoder=tiny_qwen(tokenizer), tokenizer=tokenizer, transformer=None, vae=vae,
                                  scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder_2=byt5,
                                  tokenizer_2=transformers.ByT5Tokenizer(), guider=ClassifierFreeGuidance())
    path = tmp_path_factory.mktemp("hunyuan_video15")
    pipe.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(folder):
    """The whole pipeline's ``encode_prompt`` of PROMPTS, called as its ``__call__`` calls it."""
    pipe = HunyuanVideo15Pipeline.from_pretrained(folder, transformer=None)
    with torch.no_grad():
        return pipe, pipe.encode_prompt(PROMPTS, device=torch.device("cpu"), batch_size=len(PROMPTS))


def test_text_is_the_qwen_stream_cut_to_its_tokens(folder, reference):
    pipe, (embeds, mask, _, _) = reference
    rows = hunyuan_video15.ENCODERS.open(folder, ["text"]).encode_text(PROMPTS)
    templated = pipe.tokenizer.apply_chat_template(
        [[{"role": "system", "content": pipe.system_message}, {"role": "user", "content": p}] for p in PROMPTS],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert [r.shape for r in rows] == [(len(ids) - 108, 16) for ids in templated]  # the template's 108 tokens cropped
    for row, padded, valid in zip(rows, embeds, mask):
        assert valid[:len(row)].all() and not valid[len(row):].any()
        assert torch.equal(row, padded[:len(row)])


def test_the_glyph_stream_is_the_byt5_rows_of_the_quoted_text(folder, reference):
    pipe, (_, _, embeds_2, mask_2) = reference
    rows = hunyuan_video15.ENCODERS.open(folder, ["text"]).encode_text_2(PROMPTS)
    quoted = pipe.tokenizer_2('Text "OPEN". Text "shop". ').input_ids  # the pipeline's glyph text, its </s> included
    assert [r.shape for r in rows] == [(0, 24), (len(quoted), 24)]  # the first prompt quotes nothing
    assert not mask_2[0].any() and torch.equal(rows[1], embeds_2[1, :len(quoted)])
    assert mask_2[1, :len(quoted)].all() and not mask_2[1, len(quoted):].any()


def test_video_latents_are_the_vaes_posterior_mean_unscaled(folder):
    encoder_checks.assert_video_latents_are_the_posterior_mean(hunyuan_video15.ENCODERS, folder, (3, 5, 32, 32),
                                                               (4, 2, 2, 2))
    assert hunyuan_video15.ENCODERS.frame_step == 4 and hunyuan_video15.ENCODERS.pixel_multiple == 16
    assert hunyuan_video15.HunyuanVideo15Config.family.encoders is hunyuan_video15.ENCODERS


def test_a_folder_without_the_text_encoder_is_refused_in_one_line(folder, tmp_path):
    encoder_checks.assert_refused_without(hunyuan_video15.ENCODERS, folder, tmp_path, "text_encoder", ("tokenizer",),
                                          r"has no 'text_encoder' component [^\n]*, which text encoding needs$")
    with pytest.raises(ValueError, match="cannot encode image|no image-to-video"):
        hunyuan_video15.ENCODERS.open(folder, ["first_frame"])
