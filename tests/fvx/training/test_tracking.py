import importlib.machinery
import importlib.util
import io
import math
import pathlib
import types

import numpy as np
import pytest
import torch
from PIL import Image

from fvx.training import tracking
from fvx.training.tracking import open_tracker, read_hparams, read_images, read_scalars, read_texts

HAS_FFMPEG = importlib.util.find_spec("imageio_ffmpeg") is not None


def uint8_frames(t: int, h: int, w: int, c: int = 3, seed: int = 0) -> torch.Tensor:
    """[T,H,W,C] uint8 with distinct random frames (H*W <= 256 colours a frame, so a GIF holds them exactly)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (t, h, w, c), generator=g, dtype=torch.uint8)


def gif_frames(data: bytes) -> tuple[Image.Image, list[np.ndarray]]:
    gif = Image.open(io.BytesIO(data))
    frames = []
    for i in range(gif.n_frames):
        gif.seek(i)
        frames.append(np.array(gif.convert("RGB")))
    gif.seek(0)
    return gif, frames


def png_array(data: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG"
    return np.array(image)


def test_scalars_read_back_as_float32(tmp_path):
    logged = [
        (0, {"loss": 0.1, "lr": 1 / 3, "grad_norm": torch.tensor(math.pi * 1e-3, dtype=torch.float64)}),
        (5, {"loss": float("nan"), "count": torch.tensor(7), "x": np.float32(2.5)}),
        (7, {"loss": torch.tensor(float("inf")), "lr": -1e-30}),
    ]
    with open_tracker(tmp_path) as tracker:
        for step, metrics in logged:
            tracker.scalars(step, metrics)
    expected = {}
    for step, metrics in logged:
        for name, value in metrics.items():
            value = value.item() if isinstance(value, torch.Tensor) else value
            expected.setdefault(name, []).append((step, float(np.float32(value))))
    got = read_scalars(tmp_path)
    assert got.keys() == expected.keys()
    assert got["loss"][1][0] == 5 and math.isnan(got["loss"][1][1])
    got["loss"][1] = expected["loss"][1] = None  # NaN != NaN
    assert got == expected


def test_other_ranks_write_nothing_but_check_arguments(tmp_path):
    logdir, folder = tmp_path / "run", tmp_path / "videos"
    tracker = open_tracker(logdir, rank=1)
    assert not tracker.active and tracker.logdir is None
    tracker.scalars(0, {"loss": torch.tensor(1.0)})
    tracker.text(0, "notes", "hi")
    tracker.hparams({"a": {"b": 1}})
    tracker.image(0, "image", torch.rand(3, 4, 5))
    assert tracker.video(0, "video", uint8_frames(2, 4, 5), folder=folder) == []
    tracker.flush()
    with pytest.raises(ValueError, match="frames"):
        tracker.video(0, "video", torch.zeros(4, 5, 3))
    tracker.close()
    tracker.close()
    assert list(tmp_path.iterdir()) == []


def test_video_is_an_animated_gif_image_summary_and_files(tmp_path):
    frames = uint8_frames(5, 6, 10)
    folder = tmp_path / "samples"
    with open_tracker(tmp_path / "run") as tracker:
        paths = tracker.video(3, "sample/video", frames.permute(0, 3, 1, 2).float() / 255, fps=16, folder=folder)
    [(step, data)] = read_images(tmp_path / "run")["sample/video"]
    gif, decoded = gif_frames(data)
    assert step == 3 and gif.format == "GIF" and gif.is_animated
    assert gif.n_frames == 5 and gif.size == (10, 6)
    assert gif.info["duration"] == 60 and gif.info["loop"] == 0  # 1000 / 16 ms, rounded to GIF's 1/100 s
    np.testing.assert_array_equal(np.stack(decoded), frames.numpy())

    stem = folder / "sample_video_3"
    assert paths[:2] == [stem.with_suffix(".gif"), stem.with_suffix(".png")]
    assert paths[0].read_bytes() == data
    np.testing.assert_array_equal(png_array(paths[1].read_bytes()), frames[0].numpy())
    assert (stem.with_suffix(".mp4") in paths) == HAS_FFMPEG


def test_video_layouts_and_dtypes_agree(tmp_path):
    frames = uint8_frames(4, 5, 7)
    gray = uint8_frames(3, 5, 7, c=1, seed=1)
    with open_tracker(tmp_path) as tracker:
        tracker.video(0, "hwc_uint8", frames)
        tracker.video(0, "chw_float", frames.permute(0, 3, 1, 2).double() / 255)
        tracker.video(0, "gray", gray.permute(0, 3, 1, 2))
    images = read_images(tmp_path)
    assert images["hwc_uint8"] == images["chw_float"]
    gif, decoded = gif_frames(images["gray"][0][1])
    assert gif.n_frames == 3
    np.testing.assert_array_equal(np.stack(decoded)[..., 0], gray[..., 0].numpy())


def test_images_round_trip_through_png(tmp_path):
    rgb = uint8_frames(1, 5, 6)[0]  # H = 5: [H,W,C] is read channels-first when H could be C
    rgba = uint8_frames(1, 5, 6, c=4)[0]
    out_of_range = torch.tensor([[[-0.5, 1.5, float("nan"), 0.2]]])  # [C=1, H=1, W=4]
    before = out_of_range.clone()
    with open_tracker(tmp_path) as tracker:
        tracker.image(1, "chw_float", rgb.permute(2, 0, 1).float() / 255)
        tracker.image(2, "hwc_uint8", rgb.numpy())
        tracker.image(3, "rgba", rgba)
        tracker.image(4, "clamped", out_of_range)
        tracker.image(5, "ambiguous", rgb[:3].permute(2, 0, 1))  # [3,3,6]: both ends could be C -> channels-first
    images = read_images(tmp_path)
    assert [step for step, _ in images["chw_float"]] == [1]
    for tag in ("chw_float", "hwc_uint8"):
        np.testing.assert_array_equal(png_array(images[tag][0][1]), rgb.numpy())
    np.testing.assert_array_equal(png_array(images["rgba"][0][1]), rgba.numpy())
    np.testing.assert_array_equal(png_array(images["clamped"][0][1]), [[0, 255, 0, 51]])
    np.testing.assert_array_equal(png_array(images["ambiguous"][0][1]), rgb[:3].numpy())
    assert torch.equal(out_of_range.nan_to_num(), before.nan_to_num()) and out_of_range.isnan().equal(before.isnan())


def test_hparams_flatten_and_text_read_back(tmp_path):
    config = {
        "model": {"dim": 8, "act": "gelu", "blocks": {"depth": np.int64(2)}},
        "optim": {"lr": 1e-4, "betas": [0.9, 0.99], "schedule": None},
        "ema": True,
        "seed": torch.tensor(3),
        "extra": {},
    }
    with open_tracker(tmp_path) as tracker:
        tracker.hparams(config)
        tracker.text(9, "notes", "# Run\nsome *markdown*")
    assert read_hparams(tmp_path) == {
        "model.dim": 8.0, "model.act": "gelu", "model.blocks.depth": 2.0, "optim.lr": 1e-4,
        "optim.betas": "[0.9, 0.99]", "optim.schedule": "None", "ema": True, "seed": 3.0, "extra": "{}",
    }
    texts = read_texts(tmp_path)
    assert texts["notes"] == [(9, "# Run\nsome *markdown*")]
    [(step, text)] = texts["config"]
    assert step == 0
    assert text.splitlines() == [
        '    model.dim=8', '    model.act="gelu"', '    model.blocks.depth=2', '    optim.lr=0.0001',
        '    optim.betas=[0.9, 0.99]', '    optim.schedule=null', '    ema=true', '    seed=3', '    extra={}',
    ]


def test_close_is_idempotent_and_later_calls_raise(tmp_path):
    with open_tracker(tmp_path) as tracker:
        assert tracker.active and tracker.logdir == tmp_path
        tracker.scalars(0, {"a": 1.0})
    tracker.close()
    assert read_scalars(tmp_path) == {"a": [(0, 1.0)]}
    with pytest.raises(RuntimeError, match="closed"):
        tracker.scalars(1, {"a": 2.0})
    assert len(list(tmp_path.iterdir())) == 1  # no new event file was opened


@pytest.mark.parametrize("frames, error, match", [
    (torch.zeros(5, 3, 4), ValueError, r"frames must be \[T,C,H,W\] or \[T,H,W,C\].*\(5, 3, 4\)"),
    (torch.zeros(1, 2, 5, 3, 4), ValueError, "frames must be"),
    (torch.zeros(0, 3, 4, 5), ValueError, "T >= 1"),
    (torch.zeros(2, 2, 4, 5), ValueError, r"C in \(1, 3, 4\).*\(2, 2, 4, 5\)"),
    (torch.zeros(2, 3, 4, 5, dtype=torch.int32), TypeError, "frames must be uint8 or floating point"),
    ([[0.0]], TypeError, "frames must be a torch.Tensor"),
])
def test_bad_frames_fail_clearly(tmp_path, frames, error, match):
    with open_tracker(tmp_path) as tracker:
        with pytest.raises(error, match=match):
            tracker.video(0, "video", frames)
    assert read_images(tmp_path) == {}


def test_bad_arguments_fail_clearly(tmp_path):
    with open_tracker(tmp_path) as tracker:
        with pytest.raises(ValueError, match=r"metric 'loss' must be a 0-dim tensor, got shape \(2,\)"):
            tracker.scalars(0, {"ok": 1.0, "loss": torch.zeros(2)})
        with pytest.raises(TypeError, match="metric 'loss' must be a real number"):
            tracker.scalars(0, {"loss": "1.0"})
        with pytest.raises(TypeError, match="step must be an int"):
            tracker.scalars(1.0, {"loss": 1.0})
        with pytest.raises(ValueError, match=r"image must be \[C,H,W\] or \[H,W,C\]"):
            tracker.image(0, "image", torch.zeros(1, 3, 4, 4))
        with pytest.raises(ValueError, match="fps must be a positive number"):
            tracker.video(0, "video", uint8_frames(2, 4, 4), fps=0)
        with pytest.raises(TypeError, match="config must be a Mapping"):
            tracker.hparams([("lr", 1.0)])
        with pytest.raises(TypeError, match="tag must be a non-empty str"):
            tracker.text(0, "", "x")
    assert read_scalars(tmp_path) == {}  # the half-valid metrics call logged nothing
    with pytest.raises(ValueError, match="rank must be an int >= 0"):
        open_tracker(tmp_path, rank=-1)
    with pytest.raises(FileNotFoundError, match="no TensorBoard run"):
        read_scalars(tmp_path / "missing")


@pytest.mark.skipif(not HAS_FFMPEG, reason="imageio-ffmpeg not installed")
def test_mp4_written_when_ffmpeg_available(tmp_path):
    import imageio_ffmpeg

    with open_tracker(tmp_path / "run") as tracker:
        paths = tracker.video(0, "video", uint8_frames(5, 7, 9), fps=8, folder=tmp_path)  # odd sizes get padded
    mp4 = tmp_path / "video_0.mp4"
    assert paths[-1] == mp4
    reader = imageio_ffmpeg.read_frames(str(mp4))
    meta = next(reader)
    assert meta["size"] == (10, 8) and meta["fps"] == 8 and sum(1 for _ in reader) == 5


class FakeWandb(types.ModuleType):
    """A stand-in for the ``wandb`` module: records what a run logs."""

    def __init__(self):
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.inits, self.logs, self.config, self.finished = [], [], {}, 0
        fake = self

        class Run:
            class config:
                @staticmethod
                def update(values, allow_val_change=False):
                    fake.config.update(values)

            @staticmethod
            def log(values, step):
                fake.logs.append((step, values))

            @staticmethod
            def finish():
                fake.finished += 1

        self.Run = Run

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self.Run

    class Video:
        def __init__(self, frames, fps, format):
            self.shape, self.fps, self.format = frames.shape, fps, format


def test_wandb_mirrors_the_scalars_videos_and_config_of_a_run(tmp_path, monkeypatch):
    import sys

    from fvx import run

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "run"
    experiment = str(pathlib.Path(__file__).resolve().parents[3] / "experiments" / "finetune_wan.py")
    assert run.main([experiment, "--out", str(out), "--steps", "2", "run.progress=false", "data.batch_size=2",
                     "validation.every=2", "validation.num_prompts=1", "validation.num_steps=2",
                     "run.wandb.project=toy"]) == 0
    (init,) = fake.inits
    assert init["project"] == "toy" and init["mode"] == "offline" and init["dir"] == str(out) and init["name"] == "run"
    logged = {name for _, values in fake.logs for name in values}
    assert set(tracking.read_scalars(out / "tb")) <= logged
    videos = [v for _, values in fake.logs for name, v in values.items() if name == "validation/model/prompt_0"]
    assert len(videos) == 2 and videos[0].format == "gif" and videos[0].shape[1] == 3  # steps 0 and 2, [T, C, H, W]
    assert fake.config["method.optim.lr"] == 3e-3 and fake.finished == 1
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: one clear error before anything is written
    assert run.main([experiment, "--out", str(tmp_path / "other"), "run.wandb.project=toy"]) == 2
    assert not (tmp_path / "other").exists()


def test_slug_makes_a_readable_file_name_part():
    assert tracking.slug("A Red square, moving LEFT!") == "a-red-square-moving-left"
    assert tracking.slug("word " * 20, limit=12) == "word-word"
    assert tracking.slug("¿?") == ""
