"""Frame choice, cropping and resizing (fvx.data.media) against hand-computed indices and pixels."""
import numpy as np
import pytest
import torch

from fvx.data import media
from media_files import write_with_sound


def test_frames_are_every_fps_over_train_fps_th_from_the_start():
    # 30 fps for 2 s -> 60 frames; at 16 fps the step is 1.875: floor(k * 1.875) for k = 0..
    assert media.frame_indices(30.0, 2.0, num_frames=5, train_fps=16, tolerance=10.0).tolist() == [0, 1, 3, 5, 7]
    # the same rate: consecutive frames; a lower source rate repeats frames (step 0.5)
    assert media.frame_indices(16.0, 1.0, num_frames=4, train_fps=16, tolerance=5.0).tolist() == [0, 1, 2, 3]
    assert media.frame_indices(8.0, 1.0, num_frames=5, train_fps=16, tolerance=5.0).tolist() == [0, 0, 1, 1, 2]


def test_too_long_and_too_short_videos_are_refused_with_their_reason():
    # 81 frames at 16 fps = 5.06 s; tolerance 2 allows 10.1 s
    with pytest.raises(media.MediaError, match="lasts 11.00 s, longer than video_length_tolerance_range=2"):
        media.frame_indices(24.0, 11.0, num_frames=81, train_fps=16, tolerance=2.0)
    with pytest.raises(media.MediaError, match="yields 48 frames at train_fps=16 .* fewer than num_frames=81"):
        media.frame_indices(24.0, 3.0, num_frames=81, train_fps=16, tolerance=5.0)


def test_usable_frames_follow_the_vaes_temporal_rule():
    assert [media.usable_frames(n, 4) for n in (1, 4, 5, 80, 81, 84)] == [1, 1, 5, 77, 81, 81]
    assert media.usable_frames(121, 8) == 121 and media.usable_frames(4, 1) == 4


def test_crop_box_keeps_the_targets_aspect_centred():
    # by hand: ratio 480/832 = 0.5769..; 720/1280 = 0.5625 < ratio -> keep height, width int(720 / 0.5769..) = 1248
    top, left, h, w = media.crop_box(720, 1280, 480, 832)
    assert (h, w) == (720, 1248) and (top, left) == (0, 16)


def test_resize_crop_maps_pixels_to_minus_one_one_and_keeps_an_exact_size_as_is():
    frames = np.random.default_rng(0).integers(0, 256, (2, 8, 12, 3), dtype=np.uint8)
    clip = media.resize_crop(frames, 8, 8)  # crop 8x12 -> 8x8 at left 2: no resize
    assert clip.shape == (3, 2, 8, 8)
    expected = torch.from_numpy(frames[:, :, 2:10]).permute(3, 0, 1, 2).float() / 255 * 2 - 1
    assert torch.equal(clip, expected)
    assert media.resize_crop(frames, 4, 6).shape == (3, 2, 4, 6)


def test_nearest_bucket_by_aspect_ratio():
    buckets = [(480, 832), (832, 480), (512, 512)]
    assert media.nearest_bucket(1080, 1920, buckets) == (480, 832)
    assert media.nearest_bucket(1920, 1080, buckets) == (832, 480)
    assert media.nearest_bucket(500, 520, buckets) == (512, 512)


def test_sizes_the_family_cannot_take_are_refused():
    with pytest.raises(ValueError, match="480x830 is not a multiple of 16"):
        media.check_size(480, 830, 16, "data.preprocess.max_height x max_width")


def test_the_audio_track_is_read_as_stereo_at_the_asked_rate(tmp_path):
    write_with_sound(tmp_path / "a.mp4")
    sound = media.read_audio(tmp_path / "a.mp4", 16000, 0.0, 0.5)
    assert sound.shape == (2, 8000) and sound.dtype == torch.float32
    spectrum = torch.fft.rfft(sound[0, 2000:6000]).abs()
    assert abs(int(spectrum.argmax()) * 16000 / 4000 - 440.0) <= 4.0  # the tone survives AAC and resampling
    with pytest.raises(media.MediaError, match="its audio track is 1.0. s from 0.00 s, shorter than the clip's 2.00 s"):
        media.read_audio(tmp_path / "a.mp4", 16000, 0.0, 2.0)
    write_with_sound(tmp_path / "mute.mp4", sound=False)
    with pytest.raises(media.MediaError, match="it has no audio track"):
        media.read_audio(tmp_path / "mute.mp4", 16000, 0.0, 0.5)
