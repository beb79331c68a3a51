"""fvx.data.toy_world: the toy video world renders what its prompts say, its codec is exact, its quality figures score
true clips perfectly and noise badly, and a short fine-tuning run on it learns what a person can see."""

import numpy as np
import pytest
import torch
from PIL import Image

from fvx.core import random
from fvx.data import datasets as data, toy_world as world
from fvx.training import tracking



@pytest.fixture(scope="module")
def dataset():
    return data.open_dataset(data.DataConfig(text_len=4, world=world.WorldConfig()), random.key(0))


def test_bars_drift_the_way_the_prompt_says():
    config = world.WorldConfig()
    for direction, (dr, dc) in world.DIRECTIONS.items():
        clip = world.render(config, "red", direction, world.starts(config, direction)[1])
        on = clip[0] > 0  # [T, H, W]: the red channel
        assert not (clip[2] > -1).any()  # red bars on black: no blue
        if dc:  # vertical bars, constant down each column, shifted by speed * dc per frame
            assert (on == on[:, :1, :]).all()
            assert all((np.roll(on[t], config.speed * dc, axis=1) == on[t + 1]).all() for t in range(config.frames - 1))
        else:
            assert (on == on[:, :, :1]).all()
            assert all((np.roll(on[t], config.speed * dr, axis=0) == on[t + 1]).all() for t in range(config.frames - 1))
        assert on[0].mean() == 0.5  # bars as wide as the gaps between them
    assert len(world.starts(config, "up")) == 2 * config.width // config.grid


def test_a_square_stays_in_frame_and_moves():
    config = world.WorldConfig(shape="square", size=16, width=4, speed=2, grid=2)
    for direction in world.DIRECTIONS:
        for start in world.starts(config, direction):
            clip = world.render(config, "blue", direction, start)
            assert all((clip[2, t] > 0).sum() == 16 for t in range(config.frames))  # all of it, every frame
    with pytest.raises(ValueError, match="leaves a 16 px frame"):
        world.WorldConfig(shape="square", size=16, width=12, speed=2)


def test_the_codec_is_exact_and_its_layout_is_pixel_blocks():
    video = torch.randn(2, 3, 4, 16, 16)
    latents = world.space_to_depth(video, 8)
    assert latents.shape == (2, 192, 4, 2, 2)
    assert torch.equal(world.depth_to_space(latents, 8), video)
    c, i, j = 1, 2, 5  # channel c f^2 + i f + j of latent pixel (y, x) is pixel (f y + i, f x + j) of colour c
    assert torch.equal(latents[0, c * 64 + i * 8 + j, 3, 1, 0], video[0, c, 3, 8 + i, j])
    assert np.array_equal(world.space_to_depth(video.numpy(), 8), latents.numpy())
    codec = world.SpaceToDepth().build()
    clip = video.clamp(-1, 1) / 2 + 0.5  # a decoded video, in [0, 1]
    assert torch.equal(codec.decode(codec.encode(clip)), clip)
    torch.testing.assert_close(codec.encode(codec.decode(latents.clamp(-1, 1))), latents.clamp(-1, 1), rtol=0,
                               atol=1e-7)  # x / 2 + 0.5 then 2 v - 1: one rounding each way


def test_samples_are_functions_of_key_and_index_and_prompts_cycle(dataset):
    batch = dataset.read([0, 9, 17])
    config = dataset.config
    assert batch["latents"].shape == (3, *config.latent_shape) and batch["text"].shape == (3, 4, 32)
    assert batch["caption"] == ["red bars moving right", "red bars moving left", "red bars moving left"]
    assert torch.equal(batch["text"][1], batch["text"][2])  # one embedding per prompt
    again = data.open_dataset(data.DataConfig(text_len=4, world=world.WorldConfig()), random.key(0)).read([9])
    assert torch.equal(again["latents"][0], batch["latents"][1])
    video = world.Codec(config.factor).decode(batch["latents"])
    assert min(float(((video[i] - dataset.references()[i % 8]) ** 2).flatten(1).mean(1).min()) for i in range(3)) == 0


def test_quality_scores_true_clips_perfectly_and_noise_badly(dataset):
    codec = world.Codec(dataset.config.factor)
    indices = list(range(8))
    true = codec.decode(dataset.read(indices)["latents"])
    assert dataset.sample_quality(true, indices) == {"nearest_mse": pytest.approx(0.0, abs=1e-6), "hit_rate": 1.0,
                                                     "prompt_match": 1.0}
    noise = codec.decode(random.normal(random.key(1), (8, *dataset.config.latent_shape)))
    bad = dataset.sample_quality(noise, indices)
    assert bad["nearest_mse"] > 0.3 and bad["hit_rate"] == 0.0
    reversed_motion = true.flip(2)  # the right bars moving the wrong way
    assert dataset.sample_quality(reversed_motion, indices)["hit_rate"] == 0.0
    with pytest.raises(ValueError, match="are not the world's clips"):
        dataset.sample_quality(true[:, :, :2], indices)


def test_a_long_clip_is_scored_per_window_of_the_worlds_length(dataset):
    """A true clip three times the world's length scores perfectly in every window; one whose last window is noise
    says so in that window only (a streamed sample that drifts along the clip)."""
    indices = list(range(8))
    long_world = world.WorldConfig(frames=3 * dataset.config.frames)
    clips = [world.render(long_world, *dataset.prompts[i % 8], dataset.starts[dataset.prompts[i % 8][1]][i % 3])
             for i in indices]
    true = torch.from_numpy(np.stack(clips)) / 2 + 0.5
    figures = dataset.sample_quality(true, indices)
    assert set(figures) == {f"{w}{name}" for w in ("", "window_0/", "window_1/", "window_2/")
                            for name in ("nearest_mse", "hit_rate", "prompt_match")}
    assert all(figures[f"window_{w}/hit_rate"] == 1.0 for w in range(3)) and figures["hit_rate"] == 1.0
    drifted = true.clone()
    drifted[:, :, 8:] = torch.rand(drifted[:, :, 8:].shape, generator=torch.Generator().manual_seed(0))
    figures = dataset.sample_quality(drifted, indices)
    assert [figures[f"window_{w}/hit_rate"] for w in range(3)] == [1.0, 1.0, 0.0]
    assert figures["hit_rate"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="are not the world's clips"):
        dataset.sample_quality(true[:, :, :6], indices)


def test_bad_world_configs_are_named():
    with pytest.raises(ValueError, match="unknown colour 'purple'; known: red, green, blue, white"):
        world.WorldConfig(colours=("purple",))
    with pytest.raises(ValueError, match="unknown direction 'sideways'"):
        world.WorldConfig(directions=("sideways",))
    with pytest.raises(ValueError, match="size 20 must be a multiple of data.world.factor 8"):
        world.WorldConfig(size=20)


@pytest.mark.slow
def test_a_short_finetuning_run_learns_the_prompted_bars(toy_teacher_300):
    """300 steps of the default experiment: the logged distance to the nearest true clip falls far below step 0's,
    and the decoded validation videos have the prompted colour and bar orientation."""
    out = toy_teacher_300
    scalars = tracking.read_scalars(out / "tb")
    (_, start), (_, end) = scalars["validation/model/nearest_mse"]
    assert start > 0.3 and end < 0.5 * start
    config = world.WorldConfig()
    for i, (colour, direction) in enumerate(config.prompts):
        named = f"validation_model_prompt_{i}_{colour}-bars-moving-{direction}_300.png"  # the first frame
        first = out / "validation" / "step_300" / named
        lit = np.asarray(Image.open(first).convert("RGB"), dtype=np.float32) / 255.0
        channel = {"red": 0, "blue": 2}[colour]
        assert lit[..., channel].mean() > lit[..., 2 - channel].mean() + 0.1, (i, colour)  # the prompted colour
        across_rows, across_columns = lit[..., channel].std(axis=0).mean(), lit[..., channel].std(axis=1).mean()
        vertical_bars = direction in ("left", "right")  # bars vary along a row
        assert (across_columns > across_rows) == vertical_bars, (i, direction)
