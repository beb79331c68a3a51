"""The toy world's sound (kind "t2va"): a tone per prompt, an exact framing codec, and scores of decoded sound."""
import numpy as np
import pytest
import torch

from fvx.core import random
from fvx.data import datasets as data, toy_audio, toy_world as world


@pytest.fixture(scope="module")
def dataset():
    return data.open_dataset(data.DataConfig(kind="t2va", world=world.WorldConfig(), text_len=4), random.key(0))


def test_the_default_worlds_sound_is_a_quarter_second_at_4096_hz_in_32_audio_latents():
    config = world.WorldConfig()
    assert (config.frames, config.fps, config.audio_rate) == (4, 16, 4096)
    assert config.audio_samples == 4096 * 4 // 16 == 1024
    assert config.audio_latent_shape == (2, 32, 32)


def test_each_prompt_sounds_its_own_pitch_panned_by_its_direction(dataset):
    config = dataset.config
    tones = dataset.tones().numpy()  # [P, 2, S]
    prompts = config.prompts
    assert tones.shape == (len(prompts), 2, 1024) and np.abs(tones).max() <= 0.5
    duration = 4 / 16
    for p, (colour, direction) in enumerate(prompts):
        spectrum = np.abs(np.fft.rfft(tones[p].astype(np.float64), axis=-1)) ** 2  # bin k is k / duration Hz
        peak = spectrum.sum(0).argmax() / duration
        assert peak == round(440 * 2 ** (p / len(prompts)) * duration) / duration  # base * 2^(p/P), whole cycles
        assert spectrum.sum(0)[1:].sum() == pytest.approx(spectrum.sum(0).max(), rel=1e-9)  # a pure tone: one bin
        left, right = np.abs(tones[p]).max(-1)
        expected = {"left": (0.5, 0.25), "right": (0.25, 0.5)}.get(direction, (0.5, 0.5))
        assert (left, right) == pytest.approx(expected, abs=1e-4)
        assert tones[p, :, 0].tolist() == [0.0, 0.0]  # phase 0: one true waveform per prompt
    assert len(set(config.pitches)) == len(prompts) and config.pitches == sorted(config.pitches)
    assert config.pitches[:3] == [440.0, 480.0, 524.0]  # 440 * 2^(1/8) = 479.8 -> 120 cycles in 0.25 s


def test_the_codec_is_exact_and_its_layout_is_sample_frames():
    waveform = random.uniform(random.key(1), (3, 2, 96), minval=-1.0, maxval=1.0)
    codec = toy_audio.AudioFrames(sample_rate=8000).build(random.key(0))
    latents = codec.encode(waveform)
    assert latents.shape == (3, 2, 32, 3) and codec.sample_rate == 8000
    for c, k, a in ((0, 0, 0), (1, 5, 2), (1, 31, 1)):
        assert latents[2, c, k, a] == 2 * waveform[2, c, 32 * a + k]  # column a holds samples 32a .. 32a + 31
    assert torch.equal(codec.decode(latents), waveform)  # bit-exact both ways
    assert torch.equal(codec.encode(codec.decode(latents)), latents)
    assert codec.decode(torch.full((1, 2, 32, 1), 5.0)).max() == 1.0  # model output beyond the range is clipped
    with pytest.raises(ValueError, match="95 samples is not a whole number of 32-sample"):
        codec.encode(waveform[..., :95])


def test_world_batches_carry_each_prompts_tone_as_latents(dataset):
    prompts = len(dataset.prompts)
    batch = dataset.read([0, 3, 3 + prompts])
    assert batch["audio_latents"].shape == (3, 2, 32, 32) and batch["audio_sample_rate"].tolist() == [4096] * 3
    assert torch.equal(batch["audio_latents"][1], batch["audio_latents"][2])  # a function of the prompt alone
    waveforms = toy_audio.AudioFrames().build().decode(batch["audio_latents"])
    assert torch.equal(waveforms, dataset.tones()[[0, 3, 3]])
    assert batch["audio_latents"].abs().max() == 1.0  # the tones fill the latents' [-1, 1]


def test_audio_quality_is_perfect_on_the_true_tones_and_poor_on_noise(dataset):
    prompts = len(dataset.prompts)
    indices = list(range(prompts)) + [prompts + 2]
    true = dataset.tones()[[i % prompts for i in indices]]
    assert dataset.audio_quality(true, indices) == {"audio_mse": 0.0, "pitch_match": 1.0}
    noise = random.uniform(random.key(2), (16, 2, 1024), minval=-1.0, maxval=1.0)
    scores = dataset.audio_quality(noise, list(range(16)))
    assert scores["audio_mse"] > 0.4 and scores["pitch_match"] < 0.1  # 1/3 + the tones' mean power 0.10
    shifted = dataset.audio_quality(true.roll(1, dims=0), indices)  # every sound another prompt's tone
    assert shifted["pitch_match"] == 0.0 and shifted["audio_mse"] > 0.05
    quiet = dataset.audio_quality(true * 0.5, indices)  # the right pitch, too soft
    assert quiet["pitch_match"] == 1.0 and 0.0 < quiet["audio_mse"] < 0.05
    with pytest.raises(ValueError, match="are not 9 of the world's sounds"):
        dataset.audio_quality(true[..., :512], indices)


def test_bad_audio_knobs_are_named():
    with pytest.raises(ValueError, match="data.world.audio_rate 4000 Hz gives 1000 samples .* data.world.fps 16"):
        world.WorldConfig(audio_rate=4000)
    with pytest.raises(ValueError, match=r"data.world.audio_pitch 1500 Hz: .* below half data.world.audio_rate"):
        world.WorldConfig(audio_pitch=1500.0)
    with pytest.raises(ValueError, match="data.world.audio_pitch 20 Hz is too low for 8 prompts"):
        world.WorldConfig(audio_pitch=20.0)
    assert world.WorldConfig(fps=8, audio_rate=2048).audio_latent_shape == (2, 32, 32)  # 0.5 s at 2048 Hz


def test_a_sound_is_scored_by_its_caption_as_sample_scores_it(dataset):
    """``caption_audio_quality``: the prompt a caption names picks the true tone (``sample`` scores its sounds so)."""
    captions = [world.caption(dataset.config, *prompt) for prompt in dataset.prompts]
    assert dataset.caption_audio_quality(dataset.tones(), captions) == {"audio_mse": 0.0, "pitch_match": 1.0}
    assert dataset.caption_audio_quality(dataset.tones()[[1]], captions[:1])["pitch_match"] == 0.0
    with pytest.raises(ValueError, match="'a purple cat' is none of the toy world's prompts"):
        dataset.caption_audio_quality(dataset.tones()[:1], ["a purple cat"])
