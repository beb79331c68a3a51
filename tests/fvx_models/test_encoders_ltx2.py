"""LTX-2's encoders (the record in fvx_models.ltx2): a tiny random LTX2Pipeline folder (Gemma-3 with a tiny vision
tower, the LTX-2.0 text connectors, the LTX-2 video VAE and audio VAE, with drawn latent statistics) saved locally,
opened as preprocessing opens it, against diffusers' own calls; the log-mel front end against an independent NumPy
reference."""
import math

import numpy as np
import pytest
import torch
import transformers
from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler, LTX2Pipeline
from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

import encoder_checks
from fvx_models import ltx2
from fvx_models.ltx2 import LTX2Config

CHARS = list("abcdefghijklmnopqrstuvwxyz") + ["▁"]


def tiny_gemma_tokenizer() -> transformers.GemmaTokenizer:
    """One token a character (no merges), Gemma's special tokens."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    return transformers.GemmaTokenizer(vocab={w: i for i, w in enumerate(specials + CHARS)})


def tiny_gemma() -> transformers.Gemma3ForConditionalGeneration:
    """Gemma-3 with 2 text layers of width 16 (3 hidden states: 48 stacked features) and a 1-layer vision tower."""
    text = transformers.Gemma3TextConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=16,
                                         max_position_embeddings=1024)
    vision = transformers.SiglipVisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                             num_attention_heads=1, image_size=14, patch_size=7)
    return transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4))


def tiny_connectors(version: str = "2.0") -> LTX2TextConnectors:
    """The connectors over 16-wide Gemma features x 3 hidden states, 8 learnable registers; LTX-2.3's project per
    modality (video 24 wide, audio 16)."""
    heads = {"2.0": 2, "2.3": 3}[version]
    return LTX2TextConnectors(caption_channels=16, text_proj_in_factor=3, video_connector_num_attention_heads=heads,
                              video_connector_attention_head_dim=8, video_connector_num_layers=1,
                              video_connector_num_learnable_registers=8, audio_connector_num_attention_heads=2,
                              audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
                              audio_connector_num_learnable_registers=8, per_modality_projections=version == "2.3",
                              video_hidden_dim=24, audio_hidden_dim=16)


def tiny_video_vae() -> AutoencoderKLLTX2Video:
    """4x compression in time and space, 8 channels, drawn statistics and a scaling factor not 1."""
    vae = AutoencoderKLLTX2Video(
        latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, False, False), decoder_spatio_temporal_scaling=(True, True, False),
        decoder_inject_noise=(False,) * 4, upsample_residual=(False,) * 3, upsample_factor=(1, 1, 1), patch_size=1,
        downsample_type=("spatiotemporal", "spatiotemporal", "spatial", "spatial"), scaling_factor=0.8)
    return encoder_checks.draw_latent_statistics(vae)


def tiny_audio_vae() -> AutoencoderKLLTX2Audio:
    """2 latent channels over 16 mel bins / 4: statistics over the 2 x 4 = 8 packed features (the real VAE's 8 x 16 =
    128), drawn."""
    vae = AutoencoderKLLTX2Audio(base_channels=8, ch_mult=(1, 2, 4), num_res_blocks=1, latent_channels=2, mel_bins=16,
                                 resolution=16)
    vae.latents_mean.copy_(torch.linspace(-1.0, 1.0, 8))
    vae.latents_std.copy_(torch.linspace(0.25, 3.0, 8))
    return vae


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    pipe = LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=tiny_video_vae(), audio_vae=tiny_audio_vae(),
                        text_encoder=tiny_gemma(), tokenizer=tiny_gemma_tokenizer(), connectors=tiny_connectors(),
                        transformer=None, vocoder=None)
    path = tmp_path_factory.mktemp("ltx2")
    pipe.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def opened(folder):
    return ltx2.ENCODERS.open(folder, ["text", "video", "audio"])


def test_the_record_is_the_configs_with_ltx2s_compression():
    assert LTX2Config.family.encoders is ltx2.ENCODERS
    assert (ltx2.ENCODERS.frame_step, ltx2.ENCODERS.pixel_multiple) == (8, 32)
    assert ltx2.ENCODERS.components(["text", "audio"]) == ("tokenizer", "text_encoder", "connectors", "audio_vae")
    assert ltx2.ENCODERS.refusal(["video", "audio"]) is None


def connector_reference(pipe, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``LTX2Pipeline.__call__`` hands the DiT for ``prompts`` (no CFG): the connectors' video embedding, mask."""
    embeds, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=1024)
    video, _, video_mask = pipe.connectors(embeds, mask, padding_side="left")
    return video, video_mask


def test_text_is_the_connectors_video_embedding_every_row_a_register_or_a_token(opened):
    prompts = ["red bars moving left", "a cat"]
    rows = opened.encode_text(prompts)
    video, mask = connector_reference(opened.pipe, prompts)
    assert opened.pipe.tokenizer.padding_side == "left" and mask.all()  # registers replace the padding
    assert [r.shape for r in rows] == [(1024, 16), (1024, 16)]
    assert all(torch.equal(row, v) for row, v in zip(rows, video))
    alone = opened.encode_text(["a cat"])[0]  # each prompt's rows do not depend on its batch
    assert torch.allclose(alone, rows[1], atol=1e-6, rtol=0)


def test_ltx_2_3_text_is_its_video_projection_4096_wide_in_the_real_model(opened):
    pipe = opened.pipe
    saved = pipe.connectors
    try:
        torch.manual_seed(1)
        pipe.connectors = tiny_connectors("2.3").eval()
        rows = ltx2.encode_text(pipe, ["blue cat"])
        video, _ = connector_reference(pipe, ["blue cat"])
    finally:
        pipe.connectors = saved
    assert rows[0].shape == (1024, 24) and torch.equal(rows[0], video[0])


def test_video_latents_are_the_posterior_mean_normalised_as_the_pipeline_normalises(opened):
    video = encoder_checks.random_clip((3, 9, 32, 32))
    latents = opened.encode_video(video)
    expected = encoder_checks.ltx_normalised_mean(opened.pipe.vae, video, 0.8)
    assert latents.shape == (8, 3, 8, 8) and torch.allclose(latents, expected, atol=1e-6, rtol=0)
    assert torch.equal(LTX2Config(preset="tiny").spec.latents.normalize(latents[None])[0], latents)  # identity


# -------------------------------------------------------------------------------------------------------- audio


def numpy_log_mel(wave: np.ndarray, rate: int, n_fft: int, hop: int, bins: int) -> np.ndarray:
    """An independent float64 log-mel ``[ch, frames, bins]`` of ``wave [ch, S]``: framed rFFT of the reflect-padded
    signal under a periodic Hann window; Slaney mel triangles (linear to 1 kHz, then log) scaled to unit area."""
    padded = np.pad(wave, ((0, 0), (n_fft // 2, n_fft // 2)), mode="reflect")
    frames = 1 + (padded.shape[1] - n_fft) // hop
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    stack = np.stack([padded[:, i * hop:i * hop + n_fft] * window for i in range(frames)], axis=1)
    magnitude = np.abs(np.fft.rfft(stack, axis=-1))  # [ch, frames, n_fft / 2 + 1]

    def hz_to_mel(f):
        return f / (200 / 3) if f < 1000 else 15 + math.log(f / 1000) * 27 / math.log(6.4)

    def mel_to_hz(m):
        return m * 200 / 3 if m < 15 else 1000 * math.exp((m - 15) * math.log(6.4) / 27)

    edges = [mel_to_hz(m) for m in np.linspace(0, hz_to_mel(rate / 2), bins + 2)]
    freqs = np.linspace(0, rate // 2, n_fft // 2 + 1)
    filters = np.zeros((freqs.size, bins))
    for b in range(bins):
        lo, mid, hi = edges[b:b + 3]
        rise, fall = (freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)
        filters[:, b] = np.maximum(0, np.minimum(rise, fall)) * 2 / (hi - lo)
    return np.log(np.maximum(magnitude @ filters, 1e-5))


def test_log_mel_is_the_stft_magnitude_through_slaney_mel_filters():
    wave = torch.rand(1, 2, 4000, generator=torch.Generator().manual_seed(3)) - 0.5
    mel = ltx2.log_mel(wave, 16000, 160, 64)
    reference = numpy_log_mel(wave[0].double().numpy(), 16000, 1024, 160, 64)
    assert mel.shape == (1, 2, 26, 64) and np.allclose(mel[0].numpy(), reference, atol=1e-4, rtol=0)


def test_resampling_keeps_a_tone_and_the_duration():
    t = torch.arange(4800) / 48000
    tone = torch.sin(2 * math.pi * 440 * t).expand(1, 2, -1)
    down = ltx2.resample(tone, 48000, 16000)
    expected = torch.sin(2 * math.pi * 440 * torch.arange(1600) / 16000)
    assert down.shape == (1, 2, 1600) and (down[..., 100:-100] - expected[100:-100]).abs().max() < 1e-3
    up = ltx2.resample(torch.randn(2, 441), 44100, 16000)
    assert up.shape == (2, 160)  # ceil(441 x 16000 / 44100)
    assert ltx2.resample(tone, 16000, 16000) is tone


def test_audio_latents_are_the_audio_vaes_mean_of_the_log_mel_normalised_per_packed_channel(opened):
    wave = (torch.rand(2, 48000 // 5, generator=torch.Generator().manual_seed(4)) - 0.5) * 0.5  # 0.2 s at 48 kHz
    latents = opened.encode_audio(wave, 48000)
    vae = opened.pipe.audio_vae
    mel = ltx2.log_mel(ltx2.resample(wave[None], 48000, 16000), 16000, 160, 16)  # [1, 2, 21, 16]
    mean = vae.encode(mel).latent_dist.mean[0]  # [2 channels, 6 frames, 4 bins]
    packed = mean.permute(1, 0, 2).reshape(6, 8)  # a frame's features channel-major, as the DiT packs them
    expected = ((packed - vae.latents_mean) / vae.latents_std).reshape(6, 2, 4).permute(1, 0, 2)
    assert mel.shape == (1, 2, 21, 16) and latents.shape == (2, 6, 4)
    assert torch.allclose(latents, expected, atol=1e-6, rtol=0)


def test_a_folder_without_the_text_encoder_is_named_before_any_weight_loads(folder, tmp_path):
    encoder_checks.assert_refused_without(ltx2.ENCODERS, folder, tmp_path, "text_encoder", ("tokenizer", "connectors"),
                                          "has no 'text_encoder' component")
