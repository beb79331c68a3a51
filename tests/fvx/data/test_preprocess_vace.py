"""preprocess of kind "vace": videos with their control videos, masks and reference images -> Wan VACE parquet. The
toy world's files (its extension task) come back as its own samples; a reference image is prepared as
WanVACEPipeline prepares it and adds a latent frame in front of the latents and the context; a video without its
control video is exit 2 before anything is written."""
import pathlib

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanVACEPipeline
from PIL import Image

from fvx import config as fconfig, run
from fvx.core import random
from fvx.data import datasets, media, preprocess, toy_world
from fvx.data.toy_world import Codec, WorldConfig, WorldDataset
from fvx.training import preprocessing
from media_files import copy_of, world_files

ROOT = pathlib.Path(__file__).resolve().parents[3]
WORLD = WorldConfig(num_samples=4)
VACE = str(ROOT / "experiments" / "finetune_wan_vace.py")
OVERRIDES = ["data.world.num_samples=4", "data.preprocess.samples_per_file=2", "data.preprocess.num_frames=4",
             "data.preprocess.max_height=16", "data.preprocess.max_width=16"]  # the world's clips
GREY = 128 / 127.5 - 1  # the 8-bit grey of the control videos' frames to be made


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    return world_files(tmp_path_factory.mktemp("world_vace"), "vace")


def test_the_worlds_files_come_back_as_its_extension_samples(videos, tmp_path):
    assert len(preprocess.find_inputs(videos, "vace")) == 4  # the control files are not inputs of their own
    config = fconfig.apply_overrides(fconfig.load_experiment(VACE), OVERRIDES)
    done = preprocessing.run_preprocess(config, str(videos), str(tmp_path / "ds"), progress=False)
    assert done["rows"] == 4 and done["skipped"] == []
    world = WorldDataset(WORLD, random.key(0), kind="vace", collate=lambda samples, indices: samples)
    data = datasets.open_dataset(datasets.DataConfig(kind="vace", path=str(tmp_path / "ds" / preprocess.PARTS),
                                                     world=WORLD), random.key(1))
    for index in range(4):
        batch, sample = data.read([index]), world.sample(index)
        assert torch.equal(batch["latents"][0], torch.from_numpy(sample["latents"]))
        context, want = batch["vace_context"][0], torch.from_numpy(sample["vace_context"])
        channels = sample["latents"].shape[0]
        reactive = want[channels:2 * channels].clone()
        reactive[:, 1:] += GREY  # the frames to be made hold the grey the 8-bit files store for zero
        torch.testing.assert_close(context[channels:2 * channels], reactive, rtol=0, atol=1e-6)
        assert torch.equal(context[:channels], want[:channels]) and torch.equal(context[2 * channels:],
                                                                                want[2 * channels:])
    true = Codec(WORLD.factor).decode(data.read([0, 1])["latents"])
    assert data.sample_quality(true, [0, 1])["continuation_mse"] == 0.0


def test_a_reference_image_is_fit_on_white_and_adds_a_latent_frame_in_front(videos, tmp_path):
    root = copy_of(videos, tmp_path / "in")
    image = np.random.default_rng(0).integers(0, 256, (8, 16, 3), dtype=np.uint8)  # wider than the 16 x 16 clips
    Image.fromarray(image).save(root / "world_00001.ref.png")
    config = fconfig.apply_overrides(fconfig.load_experiment(VACE), OVERRIDES)
    preprocessing.run_preprocess(config, str(root), str(tmp_path / "ds"), progress=False)
    data = datasets.open_dataset(datasets.DataConfig(kind="vace", path=str(tmp_path / "ds" / preprocess.PARTS),
                                                     world=WORLD, batch_by_shape=True), random.key(1))
    plain, with_ref = data.read([0])["vace_context"][0], data.read([1])
    assert with_ref["latents"].shape[2] == with_ref["vace_context"].shape[2] == plain.shape[1] + 1
    canvas = media.fit_on_white(image[None], 16, 16)
    pipe = WanVACEPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(),
                           transformer=None)
    pipe.vae_scale_factor_spatial = 8  # preprocess_conditions' image handling, at the toy codec's stride
    (prepared,), = pipe.preprocess_conditions(None, None, Image.fromarray(image), 1, 16, 16, 1, torch.float32,
                                              "cpu")[2]
    torch.testing.assert_close(canvas, prepared, rtol=0, atol=1e-6)
    front = toy_world.space_to_depth(canvas[:, None], WORLD.factor)
    assert torch.equal(with_ref["latents"][0, :, :1], front)
    channels = front.shape[0]
    assert torch.equal(with_ref["vace_context"][0, :channels, :1], front)
    assert not with_ref["vace_context"][0, channels:, :1].any()  # its reactive latents and mask are zero


def test_a_video_without_its_control_video_is_exit_2_before_anything_is_written(videos, tmp_path, capsys):
    root = copy_of(videos, tmp_path / "in")
    (root / "world_00002.control.mp4").unlink()
    code = run.main(["preprocess", VACE, "--videos", str(root), "--out", str(tmp_path / "ds"), *OVERRIDES])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert (f"video '{root}/world_00002.mp4' has no control video (kind 'vace' reads 'world_00002.control.mp4' "
            "beside it, with an optional 'world_00002.mask.mp4' and 'world_00002.ref.png')") in err[0]
    assert not (tmp_path / "ds").exists()
