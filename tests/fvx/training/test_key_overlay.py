"""Validation and ``sample`` draw each frame's keys on videos whose prompt's cond has a ``keyboard`` (action data),
after display scaling, and leave other videos as they were."""
import io

import torch
from PIL import Image

from fvx.data import actions
from fvx.training import sampling, validation
from fvx.training.validation import ValidationConfig


class Recorder:
    def __init__(self):
        self.videos = {}

    def video(self, step, name, frames, fps=16.0, folder=None, label=None):
        self.videos[name] = frames.clone()
        return []

    def scalars(self, step, values):
        pass

    def text(self, step, name, value):
        pass


def validated(cond, scale):
    video = torch.rand(2, 3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    config = ValidationConfig(every=1, num_prompts=2, num_steps=1, display_scale=scale)
    validator = validation.Validator(config, validation.Prompts(cond), torch.zeros(2, 4, 3, 1, 1),
                                     torch.zeros(2, 2, dtype=torch.int64), None, lambda latents: video, None)
    tracker = Recorder()
    validation.validate(validator, tracker, 1, [validation.Sampler("model", lambda p, x, t, c: torch.zeros_like(x),
                                                                   None, [1.0])])
    return video, tracker.videos


def test_validation_draws_the_keys_after_scaling():
    keyboard = torch.eye(4)[torch.tensor([[0, 0, 3], [2, 1, 1]])]  # [2 prompts, 3 frames, 4 keys]
    video, logged = validated({"keyboard": keyboard, "other": torch.zeros(2, 1)}, scale=8)
    for i in range(2):
        scaled = video[i].repeat_interleave(8, dim=-1).repeat_interleave(8, dim=-2)
        expected = actions.overlay_keys(scaled, keyboard[i])
        assert torch.equal(logged[f"validation/model/prompt_{i}"], expected.permute(1, 0, 2, 3))
        assert not torch.equal(expected, scaled)


def test_validation_without_keys_logs_the_videos_unchanged():
    video, logged = validated({"other": torch.zeros(2, 1)}, scale=1)
    assert torch.equal(logged["validation/model/prompt_0"], video[0].permute(1, 0, 2, 3))


def test_sample_writes_the_keys_on_its_gif(tmp_path):
    video = torch.zeros(3, 2, 8, 8)
    keyboard = torch.tensor([[0.0, 0, 0, 1], [0, 0, 0, 1]])  # D on both frames
    paths = sampling.write_video(tmp_path, "clip", video, 8.0, gif=True, scale=8, keyboard=keyboard)
    gif = Image.open(io.BytesIO(next(p for p in paths if p.suffix == ".gif").read_bytes())).convert("RGB")
    top, left, side = actions.cells(64, 64)["D"]
    green = gif.getpixel((left + side // 2, top + side // 2))
    assert green[1] > 150 and green[0] < 60 and green[2] < 60  # lit D: green
    grey = gif.getpixel(tuple(v + side // 2 for v in actions.cells(64, 64)["W"][1::-1]))
    assert abs(grey[0] - grey[1]) < 20 and grey[0] > 60  # unlit W: grey
    plain = sampling.write_video(tmp_path, "plain", video, 8.0, gif=True, scale=8)
    assert Image.open(io.BytesIO(plain[-1].read_bytes())).convert("RGB").getpixel((left + 1, top + 1)) == (0, 0, 0)
