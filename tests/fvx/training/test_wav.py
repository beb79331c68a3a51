"""WAV files (fvx.training.wav) and sound in a run's log (Tracker.audio, read_audio)."""
import wave

import numpy as np
import pytest
import torch

from fvx.core import random
from fvx.training import tracking, wav


def stereo(samples=300, seed=0):
    """[2, samples] float32 in [-1, 1], the ends included."""
    waveform = random.uniform(random.key(seed), (2, samples), minval=-1.0, maxval=1.0)
    waveform[0, 0], waveform[1, 0] = 1.0, -1.0
    return waveform


def test_write_then_read_round_trip_to_one_pcm_step(tmp_path):
    waveform = stereo()
    path = wav.write_wav(tmp_path / "sub" / "a.wav", waveform, 8000)
    assert path == tmp_path / "sub" / "a.wav" and not list(path.parent.glob(".*tmp"))
    back, rate = wav.read_wav(path)
    assert rate == 8000 and back.shape == (2, 300) and back.dtype == torch.float32
    assert (back - waveform).abs().max() <= 0.5 / 32767 + 1e-7
    assert back[0, 0] == 1.0 and back[1, 0] == -1.0
    with wave.open(str(path), "rb") as source:  # the stdlib's own reading of the header
        assert (source.getnchannels(), source.getsampwidth(), source.getframerate()) == (2, 2, 8000)
        assert source.getnframes() / source.getframerate() == 300 / 8000  # duration = samples / rate
        first = np.frombuffer(source.readframes(2), dtype="<i2")
    expected = np.round(waveform[:, :2].numpy().T.reshape(-1).astype(np.float64) * 32767)  # interleaved L R L R
    assert first.tolist() == expected.tolist()


def test_loud_samples_are_clipped_and_mono_and_numpy_work(tmp_path):
    loud = np.array([[2.0, -3.0, 0.25]], dtype=np.float64)
    back, rate = wav.read_wav(wav.write_wav(tmp_path / "m.wav", loud, 1))
    assert rate == 1 and back.shape == (1, 3)
    assert back[0].tolist() == [1.0, -1.0, pytest.approx(0.25, abs=0.5 / 32767)]


@pytest.mark.parametrize("waveform, rate, match", [
    (torch.zeros(3), 8000, r"2-D \[C, S\] with C >= 1 channels, got shape \[3\]"),
    (torch.zeros(1, 2, 3), 8000, r"got shape \[1, 2, 3\]"),
    (torch.zeros(0, 5), 8000, r"C >= 1 channels, got shape \[0, 5\]"),
    (torch.tensor([[0.0, float("nan")]]), 8000, "must be finite, got 1 NaN or Inf"),
    (torch.zeros(1, 4, dtype=torch.int16), 8000, "float tensor"),
    (torch.zeros(1, 4), 0, "sample_rate must be a positive int .Hz., got 0"),
    (torch.zeros(1, 4), -5, "got -5"),
    (torch.zeros(1, 4), 8000.0, "got 8000.0"),
])
def test_bad_input_is_one_line_value_error(tmp_path, waveform, rate, match):
    with pytest.raises(ValueError, match=match) as error:
        wav.write_wav(tmp_path / "bad.wav", waveform, rate)
    assert "\n" not in str(error.value) and not (tmp_path / "bad.wav").exists()


def test_tracker_audio_logs_a_summary_and_a_wav_beside_the_videos_files(tmp_path):
    waveform = stereo(512)
    with tracking.open_tracker(tmp_path / "run") as tracker:
        paths = tracker.audio(7, "validation/p0", waveform, 4096, folder=tmp_path / "media", label="Red bars, left!")
        video = tracker.video(7, "validation/p0", torch.zeros(2, 3, 4, 4), folder=tmp_path / "media",
                              label="Red bars, left!")
        assert tracker.audio(9, "validation/p0", waveform[:, :256], 4096) == []  # no folder: the summary alone
        tracker.audio(9, "other", waveform[:1], 8000)
    assert paths == [tmp_path / "media" / "validation_p0_red-bars-left_7.wav"]
    assert paths[0].with_suffix(".gif") == video[0]  # the sound sits beside the GIF, named alike
    back, rate = wav.read_wav(paths[0])
    assert rate == 4096 and (back - waveform).abs().max() <= 0.5 / 32767 + 1e-7  # both channels kept
    assert tracking.read_audio(tmp_path / "run", "validation/p0") == [(7, 4096, 512), (9, 4096, 256)]
    assert tracking.read_audio(tmp_path / "run", "other") == [(9, 8000, 512)]
    assert tracking.read_audio(tmp_path / "run", "missing") == []


def test_tracker_audio_events_hold_the_wav(tmp_path):
    """The event's encoded sound is the same WAV the file holds (stereo; NaN logged as silence, loud clipped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    waveform = stereo(64)
    waveform[1, 3], waveform[0, 5] = float("nan"), 4.0
    with tracking.open_tracker(tmp_path / "run") as tracker:
        (path,) = tracker.audio(0, "s", waveform, 2000, folder=tmp_path)
    (event,) = EventAccumulator(str(tmp_path / "run")).Reload().Audio("s")
    assert event.encoded_audio_string == path.read_bytes() and event.content_type == "audio/wav"
    back, _ = wav.read_wav(path)
    assert back[1, 3] == 0.0 and back[0, 5] == 1.0


def test_other_ranks_check_the_arguments_and_write_nothing(tmp_path):
    tracker = tracking.open_tracker(tmp_path / "run", rank=1)
    assert tracker.audio(0, "s", stereo(32), 4096, folder=tmp_path / "media") == []
    assert not (tmp_path / "run").exists() and not (tmp_path / "media").exists()
    with pytest.raises(ValueError, match=r"waveform must be a float \[C, S\].*got shape \(32,\)"):
        tracker.audio(0, "s", torch.zeros(32), 4096)
    with pytest.raises(ValueError, match="sample_rate must be a positive int"):
        tracker.audio(0, "s", stereo(32), 0)
