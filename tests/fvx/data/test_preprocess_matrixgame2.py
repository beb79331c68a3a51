"""preprocess of kind "matrixgame2": videos with FastVideo's per-frame action files -> Matrix-Game parquet. The toy
world's files come back as its own samples (actions included); with the tiny Wan I2V folder the rows are the VAE's
and image encoder's calls and the actions of the clip's own frames; a missing, short or wrong-width action file is
exit 2 before anything is written."""
import json
import pathlib

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import tiny_wan_pipeline
from fvx import config as fconfig, run
from fvx.core import random
from fvx.data import datasets, media, parquet, preprocess, toy_world
from fvx.data.toy_world import Codec, WorldConfig
from fvx.data.toy_world_actions import ActionWorldDataset
from fvx.training import preprocessing
from fvx_models import wan

ROOT = pathlib.Path(__file__).resolve().parents[3]
WORLD = WorldConfig(num_samples=5)
TOY = str(ROOT / "experiments" / "finetune_wan.py")
I2V = str(ROOT / "experiments" / "finetune_wan_i2v.py")


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("world_actions")
    assert toy_world.main(["write-videos", str(folder), "--samples", "5", "--kind", "matrixgame2"]) == 0
    return folder


def toy_overrides():
    return ["data.world.num_samples=5", "data.preprocess.samples_per_file=2", "data.kind=matrixgame2"]


def rows_of(folder):
    return [r for f in sorted((folder / preprocess.PARTS).glob("*.parquet")) for r in pq.read_table(f).to_pylist()]


def test_the_worlds_files_come_back_as_its_samples_with_their_actions(videos, tmp_path):
    config = fconfig.apply_overrides(fconfig.load_experiment(TOY), toy_overrides())
    done = preprocessing.run_preprocess(config, str(videos), str(tmp_path / "ds"), progress=False)
    assert done["rows"] == 5 and done["skipped"] == []
    part = tmp_path / "ds" / preprocess.PARTS / "part_00000.parquet"
    assert pq.read_schema(part).equals(parquet.parquet_schema("matrixgame2"))
    world = ActionWorldDataset(WORLD, random.key(0), kind="matrixgame2", collate=lambda samples, indices: samples)
    data = datasets.open_dataset(datasets.DataConfig(kind="matrixgame2", path=str(tmp_path / "ds" / preprocess.PARTS),
                                                     world=WORLD), random.key(1))
    for index in range(5):
        batch, sample = data.read([index]), world.sample(index)
        for key in ("latents", "first_frame_latents", "image_embeds", "keyboard", "mouse"):
            assert torch.equal(batch[key][0], torch.from_numpy(np.asarray(sample[key]))), (index, key)
    true = Codec(WORLD.factor).decode(data.read([0, 1, 2])["latents"])
    assert data.sample_quality(true, [0, 1, 2]) == {"action_following": 1.0, "continuation_mse": 0.0}
    assert data.sample_quality(true[:, :, :1].expand_as(true), [0, 1, 2])["action_following"] == 0.0


@pytest.mark.parametrize("damage, message", [
    ("missing", "video '{root}/world_00002.mp4' has no action file (kind 'matrixgame2' reads 'world_00002.npz' or "
                "'world_00002.npy'"),
    ("short", "action file '{root}/world_00002.npz': keyboard has 3 rows, but the clip of 'world_00002.mp4' takes "
              "video frames up to 3"),
    ("wide", "action file '{root}/world_00002.npz': keyboard is [4, 6], 6 keys wide, but the first action file's is "
             "4 wide"),
    ("mouse", "action file '{root}/world_00002.npz': 'mouse' must be [N, 2] (one row per video frame), got shape "
              "[4, 3]"),
    ("garbage", "action file '{root}/world_00002.npz' is not a readable .npy or .npz file"),
    ("pickled", "action file '{root}/world_00002.npy' holds a pickled object (FastVideo's dict form), which fvx does "
                "not unpickle; if you trust it, load it once with numpy's allow_pickle and save its 'keyboard' and "
                "'mouse' arrays with np.savez as '{root}/world_00002.npz'"),
])
def test_a_bad_action_file_is_exit_2_naming_it_before_anything_is_written(videos, tmp_path, capsys, damage, message):
    root = tmp_path / "in"
    root.mkdir()
    for path in videos.iterdir():
        (root / path.name).write_bytes(path.read_bytes())
    target = root / "world_00002.npz"
    actions = dict(np.load(target))
    if damage == "missing":
        target.unlink()
    elif damage == "garbage":
        target.write_bytes(b"not numpy")
    elif damage == "pickled":  # FastVideo's own form
        target.unlink()
        np.save(root / "world_00002.npy", actions, allow_pickle=True)
    else:
        changed = {"short": {"keyboard": actions["keyboard"][:3]}, "wide": {"keyboard": np.eye(6)[:4]},
                   "mouse": {"mouse": np.zeros((4, 3))}}[damage]
        np.savez(target, **{**actions, **changed})
    code = run.main(["preprocess", TOY, "--videos", str(root), "--out", str(tmp_path / "ds"), *toy_overrides()])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message.format(root=root) in err[0], err
    assert not (tmp_path / "ds").exists()


def test_a_keyboard_array_file_is_an_action_file_without_mouse(videos, tmp_path):
    root = tmp_path / "in"
    root.mkdir()
    for path in sorted(videos.glob("world_0000[01].*")):
        (root / path.name).write_bytes(path.read_bytes())
    for name in ("world_00000", "world_00001"):
        np.save(root / f"{name}.npy", np.load(root / f"{name}.npz")["keyboard"])
        (root / f"{name}.npz").unlink()
    config = fconfig.apply_overrides(fconfig.load_experiment(TOY), toy_overrides())
    preprocessing.run_preprocess(config, str(root), str(tmp_path / "ds"), progress=False)
    rows = rows_of(tmp_path / "ds")
    assert [r["mouse_cond_shape"] for r in rows] == [[], []] and rows[1]["keyboard_cond_shape"] == [4, 4]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_wan_pipeline.save(tmp_path_factory.mktemp("wan_i2v"))


def test_with_the_tiny_wan_folder_rows_are_its_calls_and_the_clips_own_actions(folder, tmp_path):
    """A 32 fps video cut at 16 fps takes source frames 0, 2, ..., 8: its actions are those rows (FastVideo takes the
    first num_frames rows, the same when the video is at train_fps)."""
    root, rng = tmp_path / "in", np.random.default_rng(0)
    root.mkdir()
    media.write_video(root / "game.mp4", rng.integers(0, 256, (12, 16, 32, 3), dtype=np.uint8), 32)
    keyboard, mouse = np.eye(4, dtype=np.float32)[rng.integers(0, 4, 12)], rng.normal(size=(12, 2)).astype(np.float32)
    json.dump([{"path": "game.mp4", "cap": ["a game"], "action_path": "game_actions.npz"}],
              open(root / "videos2caption.json", "w"))
    (root / "videos").mkdir()
    (root / "game.mp4").rename(root / "videos" / "game.mp4")
    np.savez(root / "videos" / "game_actions.npz", keyboard=keyboard, mouse=mouse)
    items = {"models.student.path": str(folder), "models.student.preset": "tiny-i2v", "data.world": "null",
             "data.kind": "matrixgame2", "data.preprocess.num_frames": 5, "data.preprocess.max_height": 16,
             "data.preprocess.max_width": 32, "data.preprocess.train_fps": 16}
    config = fconfig.apply_overrides(fconfig.load_experiment(I2V), [f"{k}={v}" for k, v in items.items()])
    done = preprocessing.run_preprocess(config, str(root), str(tmp_path / "ds"), progress=False)
    assert done["rows"] == 1 and done["skipped"] == []
    row = rows_of(tmp_path / "ds")[0]
    assert "text_embedding_bytes" not in row

    def tensor(name):
        return torch.from_numpy(np.frombuffer(row[f"{name}_bytes"], np.float32).reshape(row[f"{name}_shape"]).copy())

    frames = [0, 2, 4, 6, 8]
    assert torch.equal(tensor("keyboard_cond"), torch.from_numpy(keyboard[frames]))
    assert torch.equal(tensor("mouse_cond"), torch.from_numpy(mouse[frames]))
    opened = wan.ENCODERS.open(folder, ["video", "first_frame", "image"])
    clip = media.resize_crop(media.read_frames(root / "videos" / "game.mp4", frames), 16, 32)
    assert torch.equal(tensor("vae_latent"), opened.pipe.vae.encode(clip[None]).latent_dist.mean[0])
    assert torch.allclose(tensor("first_frame_latent"), wan.encode_first_frame(opened.pipe, clip[None])[0], atol=1e-6)
    assert torch.equal(tensor("clip_feature"), opened.encode_image((clip[:, 0] + 1) / 2))
    assert row["caption"] == "a game" and row["num_frames"] == row["vae_latent_shape"][1]  # latent frames, as FastVideo
