"""preprocess of kind "framepack": each of the toy world's videos becomes its sections (fvx.data.sections), read back
as the world's own clips cut, with the start frame's features; a cut too short for one section is refused before
anything is written."""
import pathlib

import pytest
import torch

from fvx import config as fconfig
from fvx.core import random
from fvx.data import datasets, preprocess, sections, toy_world
from fvx.data.toy_world import Codec, WorldDataset, tokens_of_first_frame
from fvx.training import preprocessing

ROOT = pathlib.Path(__file__).resolve().parents[3]
FRAMEPACK = str(ROOT / "experiments" / "finetune_framepack.py")
OVERRIDES = ["data.world.num_samples=3", "data.preprocess.samples_per_file=2", "data.preprocess.num_frames=5",
             "data.preprocess.max_height=16", "data.preprocess.max_width=16"]  # the experiment's world clips


@pytest.fixture(scope="module")
def config():
    return fconfig.apply_overrides(fconfig.load_experiment(FRAMEPACK), OVERRIDES)


def test_the_worlds_videos_come_back_as_their_sections(config, tmp_path):
    world_config = config.data.world
    assert toy_world.main(["write-videos", str(tmp_path / "in"), "--samples", "3", "--frames", "5"]) == 0
    done = preprocessing.run_preprocess(config, str(tmp_path / "in"), str(tmp_path / "ds"), progress=False)
    assert done["rows"] == 6 and done["skipped"] == []  # 5 frames: two sections of 2 after the first
    data = datasets.open_dataset(datasets.DataConfig(kind="framepack", path=str(tmp_path / "ds" / preprocess.PARTS),
                                                     text_len=4, world=world_config, sections=config.data.sections),
                                 random.key(1))
    world = WorldDataset(world_config, random.key(0), kind="t2v", collate=lambda samples, indices: samples)
    for clip in range(3):
        latents = world.sample(clip)["latents"]
        for n, part in enumerate(sections.cut(torch.from_numpy(latents), config.data.sections)):
            batch = data.read([2 * clip + n])
            assert torch.equal(batch["latents"][0], part["latents"])
            assert torch.equal(batch["framepack_history"][0], part["history"])
            assert torch.equal(batch["frame_indices"][0], part["frame_indices"])
            assert torch.equal(batch["image_embeds"][0], torch.from_numpy(tokens_of_first_frame(latents)))
    true = Codec(world_config.factor).decode(data.read([0, 1])["latents"])
    assert data.sample_quality(true, [0, 1]) == {"section_mse": 0.0, "hit_rate": 1.0}


def test_a_cut_without_a_whole_section_is_refused_before_anything_is_written(config, tmp_path):
    short = fconfig.apply_overrides(config, ["data.world.frames=2", "data.preprocess.num_frames=2"])
    with pytest.raises(ValueError, match=r"^data.preprocess.num_frames=2 makes 2 latent frames, no section of "
                                         r"data.sections.window=2 after the first \(it needs 3 frames\)$"):
        preprocessing.run_preprocess(short, str(tmp_path / "in"), str(tmp_path / "ds"), progress=False)
    assert not (tmp_path / "ds").exists()
