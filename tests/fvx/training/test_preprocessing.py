"""preprocess with a real (tiny) Wan I2V pipeline folder: image-to-video rows equal the pipeline's own calls on the
decoded, cropped frames; clips of two aspect ratios go to their buckets; a folder lacking a component is refused first."""
import json
import pathlib

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import tiny_wan_pipeline
from media_files import write_with_sound
from fvx import config as fconfig, run
from fvx.data import media, preprocess
from fvx.data.sections import SectionsConfig
from fvx.training import preprocessing
from fvx_models import wan

ROOT = pathlib.Path(__file__).resolve().parents[3]
EXPERIMENT = str(ROOT / "experiments" / "finetune_wan_i2v.py")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_wan_pipeline.save(tmp_path_factory.mktemp("wan_i2v"))


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    root, rng = tmp_path_factory.mktemp("clips"), np.random.default_rng(0)
    for name, (h, w) in (("wide", (24, 40)), ("tall", (40, 24)), ("wide2", (32, 48))):
        frames = rng.integers(0, 256, (7, h, w, 3), dtype=np.uint8)
        media.write_video(root / f"{name}.mp4", frames, 16)
        (root / f"{name}.txt").write_text(f"red bars moving {'left' if 'wide' in name else 'up'}\n")
    return root


def config_of(folder, **overrides):
    items = {"models.student.path": str(folder), "models.student.preset": "tiny-i2v", "data.world": "null",
             "data.preprocess.num_frames": 5, "data.preprocess.max_height": 16, "data.preprocess.max_width": 32,
             "data.preprocess.samples_per_file": 2, **overrides}
    return fconfig.apply_overrides(fconfig.load_experiment(EXPERIMENT), [f"{k}={v}" for k, v in items.items()])


def test_i2v_rows_are_the_pipelines_calls_on_the_cut_frames(folder, clips, tmp_path):
    done = preprocessing.run_preprocess(config_of(folder), str(clips), str(tmp_path / "ds"), progress=False)
    assert done["rows"] == 3 and done["skipped"] == []
    rows = [r for f in sorted((tmp_path / "ds" / preprocess.PARTS).glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert [r["id"] for r in rows] == ["tall.mp4", "wide.mp4", "wide2.mp4"]
    opened = wan.ENCODERS.open(folder, ["text", "video", "first_frame", "image"])
    clip = media.resize_crop(media.read_frames(clips / "tall.mp4", range(5)), 16, 32)  # 16 fps at 16 fps: frames 0-4
    row = rows[0]

    def tensor(name):
        return torch.from_numpy(np.frombuffer(row[f"{name}_bytes"], np.dtype(row[f"{name}_dtype"])).reshape(
            row[f"{name}_shape"]).copy())

    assert torch.equal(tensor("vae_latent"), opened.pipe.vae.encode(clip[None]).latent_dist.mean[0])
    assert torch.allclose(tensor("first_frame_latent"), wan.encode_first_frame(opened.pipe, clip[None])[0], atol=1e-6)
    image = opened.pipe.encode_image(media_image(clip), device=torch.device("cpu"))[0]
    assert torch.equal(tensor("clip_feature"), image)
    assert torch.equal(tensor("pil_image"), ((clip[:, 0] + 1) * 127.5).round().to(torch.uint8))
    full, _ = opened.pipe.encode_prompt(["red bars moving up"], do_classifier_free_guidance=False,
                                        max_sequence_length=512)
    assert torch.equal(tensor("text_embedding"), full[0, :5])
    assert (row["width"], row["height"], row["num_frames"], row["fps"]) == (32, 16, 3, 16.0)
    assert json.loads((tmp_path / "ds" / "metadata.json").read_text())["model"] == str(folder.resolve())


def media_image(clip):
    from PIL import Image
    return Image.fromarray(((clip[:, 0] + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy())


def test_clips_go_to_the_bucket_nearest_their_aspect_ratio(folder, clips, tmp_path):
    config = config_of(folder, **{"data.kind": "t2v", "data.preprocess.buckets": "[[16,32],[32,16]]"})
    preprocessing.run_preprocess(config, str(clips), str(tmp_path / "ds"), progress=False)
    rows = [r for f in sorted((tmp_path / "ds" / preprocess.PARTS).glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert {r["id"]: (r["height"], r["width"]) for r in rows} == {"tall.mp4": (32, 16), "wide.mp4": (16, 32),
                                                                   "wide2.mp4": (16, 32)}
    assert {r["id"]: r["vae_latent_shape"] for r in rows}["tall.mp4"] == [4, 3, 16, 8]


def test_an_image_is_a_one_frame_clip(folder, tmp_path):
    from PIL import Image
    (tmp_path / "in").mkdir()
    pixels = np.random.default_rng(1).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "in" / "still.png")
    (tmp_path / "in" / "still.txt").write_text("a cat\n")
    config = config_of(folder, **{"data.kind": "t2v"})
    assert preprocessing.run_preprocess(config, str(tmp_path / "in"), str(tmp_path / "ds"), progress=False)["rows"] == 1
    row = pq.read_table(tmp_path / "ds" / preprocess.PARTS / "part_00000.parquet").to_pylist()[0]
    opened = wan.ENCODERS.open(folder, ["video"])
    clip = media.resize_crop(pixels[None], 16, 32)
    expected = opened.pipe.vae.encode(clip[None]).latent_dist.mean[0]
    assert row["media_type"] == "image" and row["vae_latent_shape"] == list(expected.shape) == [4, 1, 8, 16]
    assert np.array_equal(np.frombuffer(row["vae_latent_bytes"], np.float32).reshape(expected.shape), expected.numpy())


def test_a_folder_without_the_image_encoder_its_model_reads_is_refused_before_anything_is_written(folder, clips, tmp_path, capsys):
    import shutil
    broken = tmp_path / "model"
    shutil.copytree(folder, broken)
    shutil.rmtree(broken / "image_encoder")
    code = run.main(["preprocess", EXPERIMENT, "--videos", str(clips), "--out", str(tmp_path / "ds"),
                     f"models.student.path={broken}", "models.student.preset=tiny-i2v", "data.world=null"])
    assert code == 2 and "has no 'image_encoder' component" in capsys.readouterr().err
    assert not (tmp_path / "ds").exists()
    code = run.main(["preprocess", EXPERIMENT, "--videos", str(clips), "--out", str(tmp_path / "ds"),
                     f"models.student.path={folder}", "models.student.preset=tiny-i2v", "data.world=null",
                     "data.preprocess.max_width=30"])
    assert code == 2 and "480x30 is not a multiple of 16" in capsys.readouterr().err
    # a model that reads no image features (Wan 2.2's I2V) needs no image encoder: its clip_feature is left empty
    config = config_of(broken, **{"models.student.preset": "tiny"})
    assert preprocessing.run_preprocess(config, str(clips), str(tmp_path / "ds2"), progress=False)["rows"] == 3
    row = pq.read_table(tmp_path / "ds2" / preprocess.PARTS / "part_00000.parquet").to_pylist()[0]
    assert (row["clip_feature_bytes"], row["clip_feature_shape"]) == (b"", []) and row["first_frame_latent_shape"]


class Recorder:
    """An encoder (fvx.data.preprocess.Encoder) that returns marks of what it was given."""

    def __init__(self):
        self.sounds = []

    def encode_text(self, prompts, clips=None):
        self.clips = clips
        return [torch.full((2, 3), float(len(p))) for p in prompts]

    def encode_text_2(self, prompts):
        return None

    def encode_video(self, video):
        return video[:1, :, :2, :2].clone()

    def encode_audio(self, waveform, rate):
        self.sounds.append((waveform, rate))
        return torch.zeros(2, 32, 1)

    def encode_first_frame(self, video):
        return video[:1, :1, :2, :2] + 5

    def encode_image(self, image):
        return None


def test_t2va_takes_the_clips_own_sound_from_its_start_for_its_length(tmp_path):
    write_with_sound(tmp_path / "a.mp4", seconds=1.0, fps=16, rate=8000)
    (tmp_path / "a.txt").write_text("a tone")
    write_with_sound(tmp_path / "b.mp4", sound=False)
    (tmp_path / "b.txt").write_text("silence")
    cut = preprocess.PreprocessConfig(num_frames=8, train_fps=16, max_height=16, max_width=16)
    job = preprocess.Job({}, "t2va", cut, 1, 16, audio_rate=16000)
    encoder = Recorder()
    rows, skipped = preprocess.encode_part(job, encoder, preprocess.find_inputs(tmp_path))
    assert [r["id"] for r in rows] == ["a.mp4"] and rows[0]["audio_sample_rate"] == 16000
    assert skipped == [{"file": "b.mp4", "reason": "it has no audio track"}]
    (sound, rate), = encoder.sounds
    assert rate == 16000 and torch.equal(sound, media.read_audio(tmp_path / "a.mp4", 16000, 0.0, 0.5))


def test_each_caption_is_encoded_with_the_clip_it_describes(tmp_path):
    """The encoder gets each caption's clip (a family whose text states it, Cosmos 3, writes it into the prompt): a
    video's cut frames at the cut's rate and size, an image's one frame; text-only data the clip the cut makes."""
    write_with_sound(tmp_path / "a.mp4", seconds=1.0, fps=16, rate=8000)
    (tmp_path / "a.txt").write_text("a tone")
    from PIL import Image
    Image.fromarray(np.zeros((20, 20, 3), np.uint8)).save(tmp_path / "b.png")
    (tmp_path / "b.txt").write_text("a still")
    cut = preprocess.PreprocessConfig(num_frames=7, train_fps=8, max_height=16, max_width=16)
    encoder = Recorder()
    rows, _ = preprocess.encode_part(preprocess.Job({}, "t2v", cut, 2, 16), encoder, preprocess.find_inputs(tmp_path))
    assert [r["id"] for r in rows] == ["a.mp4", "b.png"]
    assert encoder.clips == [preprocess.Clip(7, 8.0, 16, 16), preprocess.Clip(1, 8.0, 16, 16)]
    preprocess.encode_part(preprocess.Job({}, "text_only", cut, 2, 16), encoder, preprocess.find_inputs(tmp_path))
    assert encoder.clips == [preprocess.Clip(7, 8.0, 16, 16)] * 2  # 1 + 2 k frames of the cut's 7


def test_i2va_rows_hold_the_first_frame_beside_the_clips_sound(tmp_path):
    write_with_sound(tmp_path / "a.mp4", seconds=1.0, fps=16, rate=8000)
    (tmp_path / "a.txt").write_text("a tone")
    cut = preprocess.PreprocessConfig(num_frames=8, train_fps=16, max_height=16, max_width=16)
    job = preprocess.Job({}, "i2va", cut, 1, 16, audio_rate=16000)
    encoder = Recorder()
    (row,), skipped = preprocess.encode_part(job, encoder, preprocess.find_inputs(tmp_path))
    clip, _ = preprocess.cut(job, preprocess.find_inputs(tmp_path)[0])
    assert skipped == [] and row["audio_sample_rate"] == 16000 and "image_embeds" not in row
    assert torch.equal(row["first_frame_latents"], clip[:1, :1, :2, :2] + 5)
    assert torch.equal(row["pil_image"], ((clip[:, 0] + 1) * 127.5).round().to(torch.uint8))
    (sound, _), = encoder.sounds
    assert torch.equal(sound, media.read_audio(tmp_path / "a.mp4", 16000, 0.0, 0.5))


def test_one_frame_rows_encode_the_first_and_last_frames_each_alone(tmp_path):
    """data.sections.order=one_frame: the clip's first frame (the control) and last (the frame made), each encoded
    alone as musubi-tuner encodes its control and target images; one row, the last frame made from the first."""
    write_with_sound(tmp_path / "a.mp4", seconds=1.0, fps=16, rate=8000)
    (tmp_path / "a.txt").write_text("a change")
    cut = preprocess.PreprocessConfig(num_frames=5, train_fps=16, max_height=16, max_width=16)
    job = preprocess.Job({}, "framepack", cut, 4, 16, sections=SectionsConfig(window=9, order="one_frame"))
    encoder = Recorder()
    (row,), _ = preprocess.encode_part(job, encoder, preprocess.find_inputs(tmp_path))
    clip, _ = preprocess.cut(job, preprocess.find_inputs(tmp_path)[0])
    assert row["id"] == "a.mp4#0" and torch.equal(row["latents"], clip[:1, -1:, :2, :2])
    assert torch.equal(row["framepack_history"][:, :1], clip[:1, :1, :2, :2])
    assert row["frame_indices"][:3].tolist() == [9, 0, 10]
