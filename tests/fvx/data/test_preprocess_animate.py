"""preprocess of kind "animate": videos with their pose and face videos (and character images) -> Wan-Animate
parquet. The toy world's files come back as its own animation samples (the face pixels stored as uint8); a character
image replaces the first frame as the reference; a face video of another size is resized whole; a video without its
pose video, or a face size the model does not read, is exit 2 before anything is written."""
import pathlib

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from fvx import config as fconfig, run
from fvx.core import random
from fvx.data import datasets, media, preprocess, toy_world
from fvx.data.toy_world import Codec, WorldConfig
from fvx.data.toy_world_actions import world_dataset
from fvx.training import preprocessing
from media_files import copy_of, world_files

ROOT = pathlib.Path(__file__).resolve().parents[3]
WORLD = WorldConfig(num_samples=4)
ANIMATE = str(ROOT / "experiments" / "finetune_wan_animate.py")
OVERRIDES = ["data.world.num_samples=4", "data.preprocess.samples_per_file=2", "data.preprocess.num_frames=4",
             "data.preprocess.max_height=16", "data.preprocess.max_width=16"]  # the world's clips


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    return world_files(tmp_path_factory.mktemp("world_animate"), "animate")


def dataset(folder: pathlib.Path):
    return datasets.open_dataset(datasets.DataConfig(kind="animate", path=str(folder / preprocess.PARTS), world=WORLD),
                                 random.key(1))


def test_the_worlds_files_come_back_as_its_animation_samples(videos, tmp_path):
    assert len(preprocess.find_inputs(videos, "animate")) == 4  # the pose and face videos are not inputs of their own
    config = fconfig.apply_overrides(fconfig.load_experiment(ANIMATE), OVERRIDES)
    done = preprocessing.run_preprocess(config, str(videos), str(tmp_path / "ds"), progress=False)
    assert done["rows"] == 4 and done["skipped"] == []
    table = pq.read_table(next((tmp_path / "ds" / preprocess.PARTS).glob("*.parquet")))
    assert table.column("face_pixels_dtype")[0].as_py() == "uint8"
    world = world_dataset(WORLD, random.key(0), kind="animate", collate=lambda samples, indices: samples)
    data = dataset(tmp_path / "ds")
    for index in range(4):
        batch, sample = data.read([index]), world.sample(index)
        for name in ("latents", "reference_latents", "pose_latents", "image_embeds", "face_pixels"):
            assert torch.equal(batch[name][0], torch.from_numpy(np.asarray(sample[name]))), name
    true = Codec(WORLD.factor).decode(data.read([0, 1])["latents"][:, :, 1:])  # the clips, the reference's slot dropped
    assert data.sample_quality(true, [0, 1])["continuation_mse"] == 0.0


def test_a_character_image_is_the_reference_and_a_face_video_is_resized_whole(videos, tmp_path):
    root = copy_of(videos, tmp_path / "in")
    image = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    Image.fromarray(image).save(root / "world_00001.ref.png")
    face = np.random.default_rng(1).integers(0, 256, (4, 32, 48, 3), dtype=np.uint8)
    media.write_video(root / "world_00002.face.mp4", face, WORLD.fps)
    config = fconfig.apply_overrides(fconfig.load_experiment(ANIMATE), OVERRIDES)
    preprocessing.run_preprocess(config, str(root), str(tmp_path / "ds"), progress=False)
    data = dataset(tmp_path / "ds")
    with_ref = data.read([1])
    front = toy_world.space_to_depth(media.resize_crop(image[None], 16, 16), WORLD.factor)
    assert torch.equal(with_ref["latents"][0, :, :1], front)
    assert torch.equal(with_ref["reference_latents"][0, 4:, :1], front)
    resized = data.read([2])["face_pixels"][0]
    assert resized.shape == (3, 13, 16, 16)
    decoded = media.read_frames(root / "world_00002.face.mp4", range(4))
    want = preprocess.face_pixels(decoded, 16).float() / 127.5 - 1
    torch.testing.assert_close(resized[:, 1:5], want[:, 1:2].expand(-1, 4, -1, -1))  # frame 1 held for 4


def test_a_video_without_its_pose_video_is_exit_2_before_anything_is_written(videos, tmp_path, capsys):
    root = copy_of(videos, tmp_path / "in")
    (root / "world_00002.pose.mp4").unlink()
    code = run.main(["preprocess", ANIMATE, "--videos", str(root), "--out", str(tmp_path / "ds"), *OVERRIDES])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert (f"video '{root}/world_00002.mp4' has no pose video (kind 'animate' reads 'world_00002.pose.mp4' and "
            "'world_00002.face.mp4' beside it, with an optional character image 'world_00002.ref.png' (none: the "
            "clip's first frame))") in err[0]
    assert not (tmp_path / "ds").exists()
    code = run.main(["preprocess", ANIMATE, "--videos", str(videos), "--out", str(tmp_path / "ds"), *OVERRIDES,
                     "data.preprocess.animate.face_size=32"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["fvx.run: error: data.preprocess.animate.face_size=32, but models.student "
                                 "(wan_animate:world) reads 16 x 16 face videos; set "
                                 "data.preprocess.animate.face_size=16"]
    assert not (tmp_path / "ds").exists()


def test_a_longer_clip_is_cut_into_segments_each_after_the_first_given_the_previous_ones_last_frame(tmp_path, capsys):
    """``data.preprocess.animate.segment_frames=4``: clips of 7 frames become two rows, frames 0..3 and 3..6; the
    second's reference latents give frame 3 (its first, the first segment's last) with mask one after the
    character's slot, its latents, pose and face are its own frames'; a segment longer than the clip is exit 2."""
    folder = tmp_path / "long"
    assert toy_world.main(["write-videos", str(folder), "--samples", "2", "--frames", "7", "--kind", "animate"]) == 0
    long = [*OVERRIDES[:2], "data.world.frames=7", "data.preprocess.num_frames=7", *OVERRIDES[3:]]
    config = fconfig.apply_overrides(fconfig.load_experiment(ANIMATE),
                                     [*long, "data.preprocess.animate.segment_frames=4"])
    done = preprocessing.run_preprocess(config, str(folder), str(tmp_path / "ds"), progress=False)
    assert done["rows"] == 4 and done["skipped"] == []
    table = pq.read_table(next((tmp_path / "ds" / preprocess.PARTS).glob("*.parquet")))
    assert table.column("id").to_pylist()[:2] == ["world_00000.mp4#0", "world_00000.mp4#1"]
    data = datasets.open_dataset(datasets.DataConfig(kind="animate", path=str(tmp_path / "ds" / preprocess.PARTS)),
                                 random.key(1))
    first, second = data.read([0]), data.read([1])
    clip = toy_world.space_to_depth(media.resize_crop(media.read_frames(folder / "world_00000.mp4", range(7)), 16, 16),
                                    WORLD.factor)
    assert torch.equal(first["latents"][0, :, 1:], clip[:, :4])
    assert torch.equal(second["latents"][0, :, 1:], clip[:, 3:])
    assert torch.equal(second["latents"][0, :, :1], clip[:, :1])  # the character: the clip's first frame
    reference = second["reference_latents"][0]
    assert reference[:4, :2].eq(1).all() and not reference[:4, 2:].any()
    assert torch.equal(reference[4:, 1], clip[:, 3]) and not reference[4:, 2:].any()
    assert not first["reference_latents"][0, :4, 1:].any()  # a first segment: no previous frame given
    code = run.main(["preprocess", ANIMATE, "--videos", str(folder), "--out", str(tmp_path / "bad"), *long,
                     "data.preprocess.animate.segment_frames=9"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "data.preprocess.animate.segment_frames=9 must be 1 + 1 k video frames" in err[0]


def test_a_background_and_its_mask_make_the_replace_modes_reference_latents(videos, tmp_path, capsys):
    """``clip.background.mp4`` and ``clip.mask.mp4`` (white: the character's place, to be made): the segment's
    condition is the background's latents, its mask one on the cells kept (the pipeline's replace mode, at the codec's
    grid, nearest); a background without its mask is exit 2 before anything is written."""
    root = copy_of(videos, tmp_path / "in")
    background = np.random.default_rng(2).integers(0, 256, (4, 16, 16, 3), dtype=np.uint8)
    mask = np.zeros((4, 16, 16, 3), np.uint8)
    mask[:, :8] = 255  # the top half to be made
    media.write_video(root / "world_00001.background.mp4", background, WORLD.fps)
    media.write_video(root / "world_00001.mask.mp4", mask, WORLD.fps)
    config = fconfig.apply_overrides(fconfig.load_experiment(ANIMATE), OVERRIDES)
    preprocessing.run_preprocess(config, str(root), str(tmp_path / "ds"), progress=False)
    reference = dataset(tmp_path / "ds").read([1])["reference_latents"][0]
    decoded = media.read_frames(root / "world_00001.background.mp4", range(4))
    assert torch.equal(reference[4:, 1:], toy_world.space_to_depth(media.resize_crop(decoded, 16, 16), WORLD.factor))
    assert not reference[:4, 1:, 0].any() and reference[:4, 1:, 1].eq(1).all()  # kept: the bottom row of cells
    assert not dataset(tmp_path / "ds").read([0])["reference_latents"][0, 4:, 1:].any()  # the animate mode's zeros
    (root / "world_00001.mask.mp4").unlink()
    code = run.main(["preprocess", ANIMATE, "--videos", str(root), "--out", str(tmp_path / "bad"), *OVERRIDES])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "has a background video but no mask video: the replace mode reads both" in err[0]
    assert not (tmp_path / "bad").exists()
