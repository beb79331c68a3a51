"""LTX-Video's encoders (the record in fvx_models.ltx_video): a tiny random LTXPipeline folder (T5, the LTX VAE with
drawn latent statistics) saved locally, opened as preprocessing opens it, against diffusers' own calls."""
import pytest
import torch
import transformers
from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline

import encoder_checks
from fvx_models import ltx_video
from fvx_models.ltx_video import LTXVideoConfig
from tiny_wan_pipeline import WORDS, tiny_t5_tokenizer


def tiny_ltx_vae() -> AutoencoderKLLTXVideo:
    """diffusers' own test sizes (4x compression in time and space, 8 channels), statistics and scale not 0/1/1."""
    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo(latent_channels=8, block_out_channels=(8, 8, 8, 8),
                                decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
                                decoder_layers_per_block=(1, 1, 1, 1, 1),
                                spatio_temporal_scaling=(True, True, False, False),
                                decoder_spatio_temporal_scaling=(True, True, False, False), patch_size=1,
                                scaling_factor=0.7)
    return encoder_checks.draw_latent_statistics(vae)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    text = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=len(WORDS), d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8))
    pipe = LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=tiny_ltx_vae(), text_encoder=text,
                       tokenizer=tiny_t5_tokenizer(), transformer=None)
    path = tmp_path_factory.mktemp("ltx_video")
    pipe.save_pretrained(path)
    return path


def test_the_record_is_the_configs_with_ltx_videos_compression():
    assert LTXVideoConfig.family.encoders is ltx_video.ENCODERS
    assert (ltx_video.ENCODERS.frame_step, ltx_video.ENCODERS.pixel_multiple) == (8, 32)
    assert ltx_video.ENCODERS.refusal(["audio"]) == "LTX-Video makes no sound"
    assert "no image-to-video" in ltx_video.ENCODERS.refusal(["first_frame"])


def test_text_is_the_pipelines_encode_prompt_cut_to_its_tokens(folder):
    opened = ltx_video.ENCODERS.open(folder, ["text"])
    prompts = ["red bars moving left", "a cat"]
    rows = opened.encode_text(prompts)
    full, mask, _, _ = opened.pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=128)
    assert full.shape == (2, 128, 16) and mask.sum(1).tolist() == [5, 3]  # the words and </s>
    assert [r.shape for r in rows] == [(5, 16), (3, 16)]
    for row, padded in zip(rows, full):
        assert torch.equal(row, padded[:len(row)])
    assert full[0, 5:].abs().sum() > 0  # T5 runs unmasked: the padded rows are not zero, hence the cut


def test_video_latents_are_the_posterior_mean_normalised_as_the_pipeline_normalises(folder):
    opened = ltx_video.ENCODERS.open(folder, ["video"])
    video = encoder_checks.random_clip((3, 9, 32, 32))
    latents = opened.encode_video(video)
    expected = encoder_checks.ltx_normalised_mean(opened.pipe.vae, video, 0.7)
    assert latents.shape == (8, 3, 8, 8) and torch.allclose(latents, expected, atol=1e-6, rtol=0)
    # what the default config (latents_stats None: identity statistics) trains on as it is
    space = LTXVideoConfig(preset="tiny").spec.latents
    assert torch.equal(space.normalize(latents[None])[0], latents)


def test_a_folder_without_the_text_encoder_is_named_before_any_weight_loads(folder, tmp_path):
    encoder_checks.assert_refused_without(ltx_video.ENCODERS, folder, tmp_path, "text_encoder", ("tokenizer",),
                                          "has no 'text_encoder' component")
