"""preprocess end to end on the toy world's files (fvx.data.preprocess, fvx.training.preprocessing, the CLI): exact
round trip, FastVideo's metadata, bad inputs skipped and listed, resumption to identical bytes, refusals."""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from fvx import config as fconfig, run
from fvx.core import random
from fvx.data import datasets, parquet, preprocess
from fvx.data.toy_world import WorldConfig, WorldDataset, caption, space_to_depth
from fvx.data.toy_world_files import write_videos
from fvx.training import preprocessing

ROOT = pathlib.Path(__file__).resolve().parents[3]
EXPERIMENT = str(ROOT / "experiments" / "finetune_wan.py")
WORLD = WorldConfig(num_samples=10)


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("world_videos")
    write_videos(WORLD, str(folder))
    return folder


def config_of(**overrides):
    items = [f"data.world.num_samples={WORLD.num_samples}", "data.preprocess.samples_per_file=4"]
    return fconfig.apply_overrides(fconfig.load_experiment(EXPERIMENT), items + [f"{k}={v}" for k, v in overrides.items()])


def tree_bytes(folder: pathlib.Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_worlds_files_come_back_as_its_exact_latents_and_texts(videos, tmp_path):
    done = preprocessing.run_preprocess(config_of(), str(videos), str(tmp_path / "ds"), progress=False)
    assert done["complete"] and done["rows"] == 10 and done["skipped"] == []
    world = WorldDataset(WORLD, random.key(0), kind="t2v", collate=lambda samples, indices: samples)
    data = datasets.open_dataset(datasets.DataConfig(path=str(tmp_path / "ds" / preprocess.PARTS), text_len=4),
                                 random.key(1))
    assert len(data) == 10
    for index in range(10):
        batch = data.read([index])
        assert torch.equal(batch["latents"][0], torch.from_numpy(space_to_depth(world.clip(index), WORLD.factor)))
        assert torch.equal(batch["text"][0], torch.from_numpy(world.texts[index % 8]))
        assert batch["caption"] == [caption(WORLD, *world.prompts[index % 8])]
    row = parquet.pq.read_table(tmp_path / "ds" / preprocess.PARTS / "part_00000.parquet").slice(1, 1).to_pylist()[0]
    assert {k: row[k] for k in ("id", "file_name", "media_type", "width", "height", "num_frames", "duration_sec",
                                "fps")} == {"id": "world_00001.mp4", "file_name": "world_00001.mp4",
                                            "media_type": "video", "width": 16, "height": 16, "num_frames": 4,
                                            "duration_sec": 0.25, "fps": 16.0}
    metadata = json.loads((tmp_path / "ds" / "metadata.json").read_text())
    assert metadata["count"] == 10 and metadata["family"] == "wan" and metadata["kind"] == "t2v"
    assert (tmp_path / "ds" / "COMPLETE").is_file()


def broken_inputs(videos: pathlib.Path, folder: pathlib.Path) -> pathlib.Path:
    shutil.copytree(videos, folder)
    (folder / "world_00002.mp4").write_bytes(b"not a video at all")
    (folder / "world_00003.txt").unlink()
    (folder / "world_00004.txt").write_text("  \n")
    short = WorldConfig(num_samples=1, frames=2)
    write_videos(short, str(folder / "short"))
    return folder


def test_bad_inputs_are_skipped_named_and_listed(videos, tmp_path, capsys):
    inputs = broken_inputs(videos, tmp_path / "in")
    done = preprocessing.run_preprocess(config_of(), str(inputs), str(tmp_path / "ds"), progress=False)
    reasons = {entry["file"]: entry["reason"] for entry in done["skipped"]}
    assert set(reasons) == {"world_00002.mp4", "world_00003.mp4", "world_00004.mp4", "short/world_00000.mp4"}
    assert reasons["world_00002.mp4"].startswith("it does not decode as video")
    assert reasons["world_00003.mp4"] == "its caption is missing"
    assert reasons["world_00004.mp4"] == "its caption is empty"
    assert "yields 2 frames at train_fps=16" in reasons["short/world_00000.mp4"]
    assert done["rows"] == 7 and json.loads((tmp_path / "ds" / "skipped.json").read_text()) == done["skipped"]
    assert "skipped world_00003.mp4: its caption is missing" in capsys.readouterr().out


def test_an_image_where_a_video_is_required_is_skipped(tmp_path):
    from PIL import Image
    Image.new("RGB", (32, 32)).save(tmp_path / "x.png")
    job = preprocess.Job({}, "i2v", preprocess.PreprocessConfig(), 4, 16)
    item = preprocess.Input(tmp_path / "x.png", "a caption", "x.png")
    with pytest.raises(preprocess.media.MediaError, match="it is an image; kind 'i2v' needs videos"):
        preprocess.cut(job, item)


class Crash(Exception):
    pass


def test_a_killed_run_resumes_to_the_bytes_of_an_uninterrupted_one(videos, tmp_path):
    config = config_of()
    preprocessing.run_preprocess(config, str(videos), str(tmp_path / "whole"), progress=False)
    job, factory = preprocessing.job_of(config)
    job = preprocessing.dataclasses.replace(job, identity={**job.identity, "inputs": str(videos.resolve()),
                                                           "fvx_version": "0"})
    inputs = preprocess.find_inputs(videos)
    encoder, calls = factory(), []

    def crashing():
        class Crashing:
            def __getattr__(self, name):
                def call(*args):
                    calls.append(name)
                    if name == "encode_video" and len(calls) > 6:  # in rank 0's second part (part 2)
                        raise Crash()
                    return getattr(encoder, name)(*args)
                return call
        return Crashing()

    out = tmp_path / "killed"
    preprocess.check_folder(out, job.identity)
    with pytest.raises(Crash):
        preprocess.run(job, crashing, inputs, out, rank=0, world=2)
    assert not (out / preprocess.COMPLETE).exists()
    first = (out / preprocess.PARTS / "part_00000.parquet").read_bytes()
    preprocess.run(job, factory, inputs, out, rank=1, world=2)  # the other rank finishes its parts
    preprocess.run(job, factory, inputs, out, rank=0, world=2)  # rank 0 again: its remaining parts, then completes
    assert (out / preprocess.PARTS / "part_00000.parquet").read_bytes() == first  # done parts are not rewritten
    whole, killed = tree_bytes(tmp_path / "whole"), tree_bytes(out)
    assert sorted(whole) == sorted(killed)
    assert all(whole[name] == killed[name] for name in whole if name != "metadata.json")


def test_two_processes_under_torchruns_env_write_the_one_process_files(videos, tmp_path):
    env = {**os.environ, "WORLD_SIZE": "2"}
    command = [sys.executable, "-m", "fvx.run", "preprocess", EXPERIMENT, "--videos", str(videos), "--out",
               str(tmp_path / "two"), f"data.world.num_samples={WORLD.num_samples}", "data.preprocess.samples_per_file=4"]
    procs = [subprocess.Popen(command, env={**env, "RANK": str(r)}, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert any("wrote 10 clips" in out for out, _ in outs)
    preprocessing.run_preprocess(config_of(), str(videos), str(tmp_path / "one"), progress=False)
    one, two = tree_bytes(tmp_path / "one"), tree_bytes(tmp_path / "two")
    assert sorted(one) == sorted(two) and all(one[n] == two[n] for n in one if n.endswith(".parquet"))


def test_a_folder_made_for_another_model_or_geometry_is_refused_and_left_as_it_was(videos, tmp_path, capsys):
    out = tmp_path / "ds"
    preprocessing.run_preprocess(config_of(), str(videos), str(out), progress=False)
    before = tree_bytes(out)
    with pytest.raises(ValueError, match=r"was made with world=\{.*\(differing: world\); use another folder"):
        preprocessing.run_preprocess(config_of(**{"data.world.seed": 1}), str(videos), str(out), progress=False)
    assert tree_bytes(out) == before
    code = run.main(["preprocess", EXPERIMENT, "--videos", str(videos), "--out", str(out),
                     f"data.world.num_samples={WORLD.num_samples}", "data.preprocess.samples_per_file=5"])
    assert code == 2 and tree_bytes(out) == before
    assert "was made with preprocess=" in capsys.readouterr().err
    again = run.main(["preprocess", EXPERIMENT, "--videos", str(videos), "--out", str(out),
                      f"data.world.num_samples={WORLD.num_samples}", "data.preprocess.samples_per_file=4"])
    assert again == 0 and "is already complete: 10 clips" in capsys.readouterr().out and tree_bytes(out) == before


def test_nothing_encodable_is_exit_2_and_the_toy_geometry_is_checked(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.mp4").write_bytes(b"junk")
    (tmp_path / "in" / "a.txt").write_text("red bars moving left")
    code = run.main(["preprocess", EXPERIMENT, "--videos", str(tmp_path / "in"), "--out", str(tmp_path / "ds")])
    err = capsys.readouterr().err
    assert code == 2 and "no input could be encoded (1 skipped, listed in" in err
    assert not (tmp_path / "ds" / preprocess.COMPLETE).exists()
    code = run.main(["preprocess", EXPERIMENT, "--videos", str(tmp_path / "in"), "--out", str(tmp_path / "ds2"),
                     "data.preprocess.num_frames=8"])
    assert code == 2 and "set data.preprocess.num_frames=4 train_fps=16" in capsys.readouterr().err
    assert not (tmp_path / "ds2").exists()


def test_encode_prompts_writes_a_cond_file_validation_reads(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("red bars moving left\n\nblue bars moving up\n")
    code = run.main(["encode-prompts", EXPERIMENT, str(prompts), "--out", str(tmp_path / "p.safetensors")])
    assert code == 0
    model = config_of().models["student"].build()
    cond, captions = model.load_cond(str(tmp_path / "p.safetensors"))
    world = WorldDataset(WORLD, random.key(0), kind="t2v", collate=lambda samples, indices: samples)
    assert captions == ("red bars moving left", "blue bars moving up")
    assert torch.equal(cond["text"][0], torch.from_numpy(world.texts[1]))
    assert torch.equal(cond["text"][1], torch.from_numpy(world.texts[7]))
    assert np.array_equal(cond["text_mask"].numpy(), np.ones((2, 4), np.float32))


def test_text_only_data_from_a_prompts_file(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("red bars moving left\n\nblue bars moving up\nred bars moving down\n")
    config = config_of(**{"data.kind": "text_only"})
    done = preprocessing.run_preprocess(config, str(prompts), str(tmp_path / "ds"), progress=False)
    assert done["rows"] == 3
    data = datasets.open_dataset(datasets.DataConfig(path=str(tmp_path / "ds" / preprocess.PARTS), kind="text_only",
                                                     text_len=4), random.key(0))
    world = WorldDataset(WORLD, random.key(0), kind="t2v", collate=lambda samples, indices: samples)
    batch = data.read([0, 1, 2])
    assert batch["caption"] == ["red bars moving left", "blue bars moving up", "red bars moving down"]
    assert torch.equal(batch["text"], torch.from_numpy(np.stack([world.texts[i] for i in (1, 7, 2)])))


def test_a_negative_prompt_file_from_encode_prompts_is_what_validation_loads(tmp_path):
    (tmp_path / "negative.txt").write_text("blue bars moving right\n")
    out = tmp_path / "made" / "negative.safetensors"  # its folder is made
    assert run.main(["encode-prompts", EXPERIMENT, str(tmp_path / "negative.txt"), "--out", str(out)]) == 0
    model = config_of().models["student"].build()
    negative = model.load_negative(str(out), "validation.negative_prompt_path")
    world = WorldDataset(WORLD, random.key(0), kind="t2v", collate=lambda samples, indices: samples)
    assert torch.equal(negative["text"][0], torch.from_numpy(world.texts[4]))



def test_fastvideos_merged_layout_is_read_with_its_first_caption(videos, tmp_path):
    root = tmp_path / "merged"
    (root / "videos").mkdir(parents=True)
    for name in ("world_00001.mp4", "world_00006.mp4"):
        shutil.copy(videos / name, root / "videos" / name)
    listing = [{"path": "world_00006.mp4", "cap": ["blue bars moving down", "ignored"]},
               {"path": "world_00001.mp4", "cap": "red bars moving left"}, {"path": "gone.mp4", "cap": "x"}]
    (root / "videos2caption.json").write_text(json.dumps(listing))
    inputs = preprocess.find_inputs(root)
    assert [(i.name, i.caption) for i in inputs] == [("gone.mp4", "x"), ("world_00001.mp4", "red bars moving left"),
                                                     ("world_00006.mp4", "blue bars moving down")]
    done = preprocessing.run_preprocess(config_of(), str(root), str(tmp_path / "ds"), progress=False)
    assert done["rows"] == 2 and done["skipped"] == [{"file": "gone.mp4", "reason": "the file does not exist"}]
    (root / "videos2caption.json").write_text('{"path": "a.mp4"}')
    with pytest.raises(ValueError, match="must be a JSON list of"):
        preprocess.find_inputs(root)


# ----------------------------------------------------------------------------------- prompts files: text or JSON

FASTVIDEO_JSON = {"data": [{"caption": "red bars moving left"}, {"caption": "  blue bars moving up ", "video": "x"}]}


def test_the_prompt_reader_takes_a_text_file_and_fastvideos_validation_json(tmp_path):
    (tmp_path / "p.txt").write_text("red bars moving left\n\n  blue bars moving up  \n")
    (tmp_path / "p.json").write_text(json.dumps(FASTVIDEO_JSON))
    expected = ["red bars moving left", "blue bars moving up"]
    assert preprocess.read_prompts(tmp_path / "p.txt") == expected
    assert preprocess.read_prompts(str(tmp_path / "p.json")) == expected
    assert [(i.caption, i.name) for i in preprocess.find_prompts(tmp_path / "p.json")] == [
        ("red bars moving left", "text_prompt_0"), ("blue bars moving up", "text_prompt_1")]


@pytest.mark.parametrize("name, content, message", [
    ("gone.txt", None, "does not exist"),
    ("empty.txt", "\n \n", "holds no prompts"),
    ("binary.txt", b"\xff\xfe\x00\x01", "is not UTF-8 text"),
    ("nul.txt", "a\x00b\n", "is not text"),
    ("empty.json", '{"data": []}', "holds no prompts"),
    ("broken.json", '{"data": [', "is not valid JSON"),
    ("list.json", '[{"caption": "a"}]', 'a list "data" of {"caption": ...} entries'),
    ("nodata.json", '{"prompts": ["a"]}', 'a list "data"'),
    ("blank.json", '{"data": [{"caption": "a"}, {"caption": "  "}]}', 'entry data[1] needs a non-empty string'),
    ("nocap.json", '{"data": [{"caption": "a"}, {"prompt": "b"}]}', 'data[1] needs a non-empty string "caption", '
                                                                   'got {"prompt": "b"}'),
    ("notstr.json", '{"data": ["a"]}', 'data[0] needs a non-empty string "caption", got "a"'),
])
def test_a_bad_prompts_file_is_one_line_naming_the_file_and_entry(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError) as error:
        preprocess.read_prompts(path, "--prompts")
    text = str(error.value)
    assert message in text and text.startswith(f"--prompts {str(path)!r}") and "\n" not in text


def test_encode_prompts_from_fastvideos_json_writes_the_captions_cond_file(tmp_path):
    (tmp_path / "validation.json").write_text(json.dumps(FASTVIDEO_JSON))
    out = tmp_path / "validation.safetensors"
    assert run.main(["encode-prompts", EXPERIMENT, str(tmp_path / "validation.json"), "--out", str(out)]) == 0
    cond, captions = config_of().models["student"].build().load_cond(str(out))
    world = WorldDataset(WORLD, random.key(0), kind="t2v", collate=lambda samples, indices: samples)
    assert captions == ("red bars moving left", "blue bars moving up")
    assert torch.equal(cond["text"], torch.from_numpy(np.stack([world.texts[1], world.texts[7]])))


def test_every_prompt_reader_is_the_one_reader(tmp_path, capsys):
    from fvx.training import sampling
    (tmp_path / "p.json").write_text(json.dumps(FASTVIDEO_JSON))
    assert sampling.read_prompts_file(str(tmp_path / "p.json")) == ("red bars moving left", "blue bars moving up")
    (tmp_path / "bad.json").write_text('{"data": [{"caption": 3}]}')
    out = tmp_path / "x.safetensors"
    code = run.main(["encode-prompts", EXPERIMENT, str(tmp_path / "bad.json"), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "entry data[0] needs a non-empty string" in err[0]
    assert not out.exists()
    done = preprocessing.run_preprocess(config_of(**{"data.kind": "text_only"}), str(tmp_path / "p.json"),
                                        str(tmp_path / "ds"), progress=False)
    assert done["rows"] == 2
