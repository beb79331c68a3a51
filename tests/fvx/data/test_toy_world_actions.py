"""The toy world with actions: squares move as each frame's key says, keys turn mid-clip about half the time, the
score tells following the keys from not (per window too), and the key overlay lights the pressed cell."""
import numpy as np
import pytest
import torch

from fvx.core import random
from fvx.data import actions, datasets
from fvx.data.toy_world import COLOURS, Codec, WorldConfig
from fvx.data import toy_world_actions as twa

WORLD = WorldConfig(frames=8)
STEP = {0: (-1, 0), 1: (1, 0), 2: (0, -1), 3: (0, 1)}  # W S A D: up down left right, (rows, columns)


def world(config=WORLD):
    return datasets.open_dataset(datasets.DataConfig(kind="matrixgame2", world=config), random.key(0))


def by_hand(config, colour, start, keys):
    """The clip pixel by pixel: frame t's squares at start + speed x (sum of the moves of keys 0..t-1: a key held at a
    frame moves the squares into the next)."""
    video = -np.ones((3, len(keys), config.size, config.size), np.float32)
    row, column = start
    for t in range(len(keys)):
        if t:
            row, column = row + config.speed * STEP[keys[t - 1]][0], column + config.speed * STEP[keys[t - 1]][1]
        for y in range(config.size):
            for x in range(config.size):
                if (y - row) % (2 * config.width) < config.width and (x - column) % (2 * config.width) < config.width:
                    video[:, t, y, x] = COLOURS[colour]
    return video


def test_a_clip_is_its_lattice_moved_by_its_keys():
    keys = np.array([3, 3, 0, 0, 2, 1, 1, 3])
    assert np.array_equal(twa.render(WORLD, "blue", (2, 6), keys), by_hand(WORLD, "blue", (2, 6), keys))


def test_a_sample_holds_latents_first_frame_tokens_and_one_key_per_frame():
    data = world()
    batch = data.read([0, 5])
    assert batch["latents"].shape == (2, 192, 8, 2, 2) and batch["keyboard"].shape == (2, 8, 4)
    assert torch.equal(batch["keyboard"].sum(-1), torch.ones(2, 8)) and not batch["mouse"].any()
    assert torch.equal(batch["first_frame_latents"][:, :, 0], batch["latents"][:, :, 0])
    assert not batch["first_frame_latents"][:, :, 1:].any()
    # image embedding: token (y, x) of the first frame = its latent channels at (y, x)
    assert torch.equal(batch["image_embeds"][1, 2], batch["latents"][1, :, 0, 1, 0])
    video = (Codec(8).decode(batch["latents"]) * 2 - 1).numpy()
    for row, index in enumerate((0, 5)):
        keys = data.keys(index)
        colour = data.prompts[index % len(data.prompts)][0]
        starts = [s for s in twa.phases(WORLD) if np.array_equal(by_hand(WORLD, colour, s, keys), video[row])]
        assert len(starts) == 1  # the clip is the by-hand clip of one start


def test_keys_turn_mid_clip_about_half_the_time_from_any_direction():
    data = world(WorldConfig(frames=8, num_samples=400))
    keys = np.stack([data.keys(i) for i in range(400)])
    turned = (keys != keys[:, :1]).any(axis=1)
    assert 0.4 < turned.mean() < 0.6 and set(keys[:, 0]) == {0, 1, 2, 3}
    for row in keys[turned]:  # one change, at a frame in [1, 7) (the last frame's key moves nothing), to another key
        change = np.flatnonzero(row != row[0])
        assert 1 <= change[0] < 7 and (row[change[0]:] == row[change[0]]).all()
    assert np.array_equal(data.keys(7), world(WorldConfig(frames=8, num_samples=400)).keys(7))  # fixed by the key


def test_true_clips_follow_their_keys_and_wrong_ones_do_not():
    data = world()
    indices = list(range(8))
    true = Codec(8).decode(data.read(indices)["latents"])
    assert data.sample_quality(true, indices) == {"action_following": 1.0, "continuation_mse": 0.0}
    still = true[:, :, :1].expand_as(true)
    assert data.sample_quality(still, indices)["action_following"] == 0.0
    keys = data.keys(0)
    start = next(s for s in twa.phases(WORLD) if np.array_equal(twa.render(WORLD, "red", s, keys), data.clip(0)))
    backwards = torch.from_numpy(twa.render(WORLD, "red", start, keys ^ 1))[None] / 2 + 0.5  # W<->S, A<->D
    score = twa.action_quality(backwards, torch.from_numpy(twa.keyboard_of(keys))[None],
                               torch.from_numpy(data.clip(0))[None] / 2 + 0.5, WORLD.speed)
    assert score["action_following"] == 0.0 and score["continuation_mse"] > 0.1


def test_a_long_clip_is_scored_per_window():
    config = WorldConfig(frames=8, score_window=4)
    data = world(config)
    keys = data.keys(0)
    true = torch.from_numpy(data.clip(0))[None] / 2 + 0.5
    half = true.clone()
    half[:, :, 4:] = half[:, :, 3:4]  # the second window stands still
    score = data.sample_quality(half, [0])
    assert score["window_0/action_following"] == 1.0 and score["window_1/action_following"] == 0.0
    assert score["window_0/continuation_mse"] == 0.0 and score["action_following"] == pytest.approx(3 / 7)
    assert twa.keys_of(torch.from_numpy(twa.keyboard_of(keys))).tolist() == keys.tolist()


def test_a_speed_the_lattice_cannot_show_is_refused():
    with pytest.raises(ValueError, match="data.world.speed 4: on a lattice of period 8"):
        world(WorldConfig(speed=4))


def test_the_overlay_lights_the_pressed_key_and_leaves_the_rest_of_the_frame():
    video = torch.zeros(3, 2, 40, 40)
    keyboard = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 1.0]])  # W, then D
    out = actions.overlay_keys(video, keyboard)
    cells = actions.cells(40, 40)
    for t, lit in ((0, "W"), (1, "D")):
        for name, (top, left, side) in cells.items():
            pixel = out[:, t, top + side // 2, left + side // 2]
            expected = (torch.tensor(actions.PRESSED) * actions.PRESSED_ALPHA if name == lit
                        else torch.tensor(actions.RELEASED) * actions.RELEASED_ALPHA)
            assert torch.allclose(pixel, expected), (t, name)
    assert not out[:, :, 20:].any() and not out[:, :, :, 20:].any()  # the corner only
    assert actions.pressed(torch.eye(7)[[1, 2, 5, 6]]).tolist() == torch.eye(4, dtype=torch.bool).tolist()  # 7 keys
    assert actions.pressed(torch.eye(2)).tolist() == [[True, False, False, False], [False, True, False, False]]
    with pytest.raises(ValueError, match="overlay_keys: video must be"):
        actions.overlay_keys(torch.zeros(2, 40, 40), keyboard)
