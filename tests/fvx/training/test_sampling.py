"""``python -m fvx.run sample``: videos from prompts with a run's trained role or an export, on the toy world."""
import json
import pathlib
import shutil

import msgspec
import numpy
import pytest
import torch
from PIL import Image

from fvx import run
from fvx.core import random
from fvx.data import media, preprocess, toy_world_files
from fvx.data.toy_world import WorldDataset
from fvx.training import experiment, run_folder, sample_inputs, sampling, validation
from fvx.training.experiment import build_models

RED_RIGHT = "red bars moving right"
QUICK = ["run.progress=false", "validation.every=0", "data.batch_size=4", "run.checkpoint.final=true"]


def train(out: pathlib.Path, experiment_file: str, steps: int, *overrides: str) -> pathlib.Path:
    assert run.main([experiment_file, "--out", str(out), "--steps", str(steps), *QUICK, *overrides]) == 0
    return out


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    return train(tmp_path_factory.mktemp("finetuned") / "run", "experiments/finetune_wan.py", 3,
                 "method.optim.warmup_steps=1", "run.checkpoint.every=2")


@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    return train(tmp_path_factory.mktemp("causal") / "run", "experiments/dfsft_causal_t2v.py", 2)


def sample(source, out, *args) -> int:
    return run.main(["sample", str(source), "--out", str(out), *map(str, args)])


def frames_of(path: pathlib.Path) -> torch.Tensor:
    """Every frame of an mp4, ``[T, H, W, 3]`` uint8."""
    fps, duration = media.probe_video(path)
    return torch.from_numpy(media.read_frames(path, range(round(fps * duration))))


def test_a_run_samples_into_named_files_and_a_record(finetuned, tmp_path, capsys):
    out = tmp_path / "samples"
    assert sample(finetuned, out, "--prompt", RED_RIGHT, "--prompt", "blue bars moving left", "--num-per-prompt", 2,
                  "--gif", "--scale", 2) == 0
    record = json.loads((out / sampling.SAMPLES).read_text())
    assert [(v["prompt"], v["seed"]) for v in record["videos"]] == [
        (RED_RIGHT, 0), (RED_RIGHT, 1), ("blue bars moving left", 2), ("blue bars moving left", 3)]
    assert record["videos"][0]["files"] == ["red-bars-moving-right_0.mp4", "red-bars-moving-right_0.gif"]
    assert (record["step"], record["role"], record["sampler"], record["kind"]) == (3, "student", "model", "ode")
    assert record["steps"] == 20 and record["latent_shape"] == [192, 4, 2, 2]
    video = frames_of(out / "red-bars-moving-right_0.mp4")
    assert video.shape == (4, 32, 32, 3)  # the world's 4 frames of 16x16, twice as large
    assert set(record["videos"][0]["world_score"]) >= {"nearest_mse", "hit_rate", "prompt_match"}
    printed = capsys.readouterr().out
    assert "red-bars-moving-right_0.mp4: 'red bars moving right', seed 0, the toy world's score" in printed


def test_one_seed_makes_the_same_video_and_the_record_makes_it_again(finetuned, tmp_path):
    """Two runs with one seed write identical frames; the record's prompt and seed alone make video 3 again."""
    args = ("--prompt", RED_RIGHT, "--prompt", "blue bars moving up", "--num-per-prompt", 2, "--steps", 4)
    assert sample(finetuned, tmp_path / "a", *args) == 0 and sample(finetuned, tmp_path / "b", *args) == 0
    for name in ("red-bars-moving-right_1.mp4", "blue-bars-moving-up_3.mp4"):
        assert torch.equal(frames_of(tmp_path / "a" / name), frames_of(tmp_path / "b" / name))
    chosen = json.loads((tmp_path / "a" / sampling.SAMPLES).read_text())["videos"][3]
    assert sample(finetuned, tmp_path / "c", "--prompt", chosen["prompt"], "--seed", chosen["seed"], "--steps", 4) == 0
    again = tmp_path / "c" / f"blue-bars-moving-up_{chosen['seed']}.mp4"
    assert torch.equal(frames_of(again), frames_of(tmp_path / "a" / chosen["files"][0]))


def test_prompts_are_encoded_with_the_clip_they_make_and_a_negative_prompt_as_negative(finetuned, tmp_path,
                                                                                        monkeypatch):
    """What a family whose text states its clip (Cosmos 3) is told: the made video's frames at --fps and its pixel
    size, the negative prompt marked negative."""
    told = []
    encode = toy_world_files.WorldEncoders.encode_text
    monkeypatch.setattr(toy_world_files.WorldEncoders, "encode_text",
                        lambda self, prompts, clips=None: told.append(clips) or encode(self, prompts))
    assert sample(finetuned, tmp_path / "s", "--prompt", RED_RIGHT, "--steps", 2, "--guidance", 2, "--fps", 8,
                  "--negative-prompt", "blue bars moving left") == 0
    clip = preprocess.Clip(4, 8.0, 16, 16)  # the world's 4 frames of 16 x 16 (the codec: 1 frame a latent)
    assert told == [[clip], [clip._replace(negative=True)]]


def validations_sample(run_dir: pathlib.Path, *, seed: int):
    """(the latents validation samples for its first prompt with ``validation.seed = seed`` from the run's newest
    checkpoint, the validator, the run's setup)."""
    config = run_folder.load_run(run_dir)
    built = experiment.setup(config)
    state = experiment.initial_state(built, experiment.batch_fn(config, built)(0))
    saved = sampling.fexport.role_checkpoint(run_dir, role="student")
    state = state._replace(roles={"student": state.roles["student"]._replace(params=saved.read())})
    vcfg = msgspec.structs.replace(config.validation, seed=seed, num_prompts=1, every=1)
    validator = validation.make_validator(vcfg, built.dataset, built.program.model)
    entry = built.program.validate(state, experiment.frozen_params(built), vcfg)[0]
    latents, _ = validation.sample_videos(entry.apply, entry.params, validator.noise, entry.sigmas,
                                          validator.prompts.cond, key=validator.keys, sampler=entry.sampler,
                                          draw=entry.draw)
    return latents, validator, built


def test_a_video_is_validations_sample_of_its_seed(causal, tmp_path):
    """The streaming student's clip from ``sample`` (seed s) is the clip validation streams for its first prompt with
    validation.seed = s: one code path."""
    want, validator, _ = validations_sample(causal, seed=7)
    done = sampling.run_sample(sampling.Request(str(causal), (validator.prompts.captions[0],), out=str(tmp_path),
                                                seed=7), progress=False, say=lambda line: None)
    torch.testing.assert_close(done["latents"], want, rtol=0, atol=0)


def test_a_stream_three_times_longer_keeps_its_window(causal, tmp_path):
    """With a window, a 3x longer stream samples on a cache of the same size (the ring of its window and sink)."""
    window = ("models.student.local_attn_size=4",)
    done = sampling.run_sample(sampling.Request(str(causal), (RED_RIGHT,), window, out=str(tmp_path), frames=12),
                               progress=False, say=lambda line: None)
    assert done["latents"].shape[2] == 12
    model = build_models(sampling.open_source(sampling.Request(str(causal), (), window)).config)["student"]
    assert len(model.causal.empty_cache(12).slots) == len(model.causal.empty_cache(4).slots) == 4 - 2
    record = json.loads((tmp_path / sampling.SAMPLES).read_text())
    assert record["overrides"] == list(window) and "window_1/prompt_match" in record["videos"][0]["world_score"]


def test_an_earlier_checkpoint_samples_its_own_params(finetuned, tmp_path):
    newest = sampling.run_sample(sampling.Request(str(finetuned), (RED_RIGHT,), out=str(tmp_path / "a"), steps=2),
                                 progress=False)
    earlier = sampling.run_sample(sampling.Request(str(finetuned), (RED_RIGHT,), out=str(tmp_path / "b"), steps=2,
                                                   step=2), progress=False)
    steps = [json.loads((tmp_path / name / sampling.SAMPLES).read_text())["step"] for name in "ab"]
    assert steps == [3, 2] and not torch.equal(newest["latents"], earlier["latents"])


def test_ranks_share_the_videos_and_the_last_writes_the_record(finetuned, tmp_path):
    request = sampling.Request(str(finetuned), (RED_RIGHT, "blue bars moving left", "blue bars moving up"),
                               out=str(tmp_path), steps=2)
    first = sampling.run_sample(request, rank=1, world=2, progress=False)
    assert [v["index"] for v in first["videos"]] == [1] and not (tmp_path / sampling.SAMPLES).exists()
    second = sampling.run_sample(request, rank=0, world=2, progress=False)
    assert [v["index"] for v in second["videos"]] == [0, 2]
    record = json.loads((tmp_path / sampling.SAMPLES).read_text())
    assert [v["seed"] for v in record["videos"]] == [0, 1, 2]


def test_an_export_samples_as_its_run(finetuned, tmp_path):
    assert run.main(["export", str(finetuned), "--out", str(tmp_path / "export")]) == 0
    args = ("--prompt", RED_RIGHT, "--steps", 3)
    assert sample(finetuned, tmp_path / "a", *args) == 0 and sample(tmp_path / "export", tmp_path / "b", *args) == 0
    name = "red-bars-moving-right_0.mp4"
    assert torch.equal(frames_of(tmp_path / "a" / name), frames_of(tmp_path / "b" / name))
    assert json.loads((tmp_path / "b" / sampling.SAMPLES).read_text())["where"].startswith("export ")


def test_a_distilled_student_samples_its_few_steps(world_teacher, tmp_path):
    out = train(tmp_path / "dmd2", "experiments/dmd2.py", 1, f"models.student.path={world_teacher}",
                f"models.teacher.path={world_teacher}", "method.generator_update_interval=1")
    done = sampling.run_sample(sampling.Request(str(out), (RED_RIGHT,), out=str(tmp_path / "s")), progress=False)
    record = json.loads((tmp_path / "s" / sampling.SAMPLES).read_text())
    assert done["sampler"] == "student" and record["kind"] == "sde" and record["guidance"] is None
    said = []
    ema = sampling.run_sample(sampling.Request(str(out), (RED_RIGHT,), out=str(tmp_path / "e"), ema=True, steps=9,
                                               guidance=3.0), progress=False, say=said.append)
    assert said == ["warning: --steps does not apply: the 'student' sampler keeps the schedule it was trained for",
                    "warning: --guidance and --negative-prompt do not apply: the 'student' sampler is unguided"]
    assert ema["where"].endswith("(EMA)") and json.loads((tmp_path / "e" / sampling.SAMPLES).read_text())["ema"]


def test_a_flow_map_samples_in_the_jumps_asked(world_teacher, tmp_path):
    out = train(tmp_path / "meanflow", "experiments/meanflow.py", 1, f"models.student.path={world_teacher}")
    one = sampling.run_sample(sampling.Request(str(out), (RED_RIGHT,), out=str(tmp_path / "one"), jumps=1),
                              progress=False)
    three = sampling.run_sample(sampling.Request(str(out), (RED_RIGHT,), out=str(tmp_path / "three"), jumps=3),
                                progress=False)
    assert (one["sampler"], three["sampler"]) == ("student_1step", "student_3step")
    assert not torch.equal(one["latents"], three["latents"])


def bad(capsys, *argv) -> str:
    assert run.main(["sample", *map(str, argv)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_bad_input_is_one_line_before_anything_is_written(finetuned, causal, world_teacher, tmp_path, capsys):
    out = tmp_path / "out"
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00\x01")
    (tmp_path / "fresh").mkdir()
    shutil.copytree(finetuned, tmp_path / "unsaved", ignore=shutil.ignore_patterns("checkpoints"))
    for argv, message in [
        ((finetuned, "--prompts", tmp_path / "empty.txt"), "holds no prompts"),
        ((finetuned, "--prompts", tmp_path / "binary.txt"), "is not UTF-8 text"),
        ((finetuned,), "give --prompt TEXT or --prompts FILE"),
        ((tmp_path / "nowhere", "--prompt", RED_RIGHT), "no such folder"),
        ((tmp_path / "fresh", "--prompt", RED_RIGHT), "neither a run folder"),
        ((tmp_path / "unsaved", "--prompt", RED_RIGHT), "has no checkpoint"),
        ((finetuned, "--prompt", "a purple cat"), "knows only its prompts"),
        ((finetuned, "--prompt", RED_RIGHT, "--jumps", 2), "has no second time input"),
        ((finetuned, "--prompt", RED_RIGHT, "--step", 9), "9"),
        ((finetuned, "--prompt", RED_RIGHT, "--ema"), "keeps no EMA params"),
        ((finetuned, "--prompt", RED_RIGHT, "--image", tmp_path / "x.png"), "from text only"),
        ((finetuned, "--prompt", RED_RIGHT, "--control", tmp_path / "x.mp4"), "takes no control video"),
        ((finetuned, "--prompt", RED_RIGHT, "--pose", tmp_path / "x.mp4"), "animates no character"),
        ((finetuned, "--prompt", RED_RIGHT, "--schedule", "model"), "has no sampling schedule of its own"),
        ((causal, "--prompt", RED_RIGHT, "--frames", 5), "not whole blocks (e.g. --frames 6)"),
        ((causal, "--prompt", RED_RIGHT, "--solver", "unipc"), "streams block by block"),
        ((causal, "--prompt", RED_RIGHT, "--frames", 40), "position table holds (32: --frames 32 at most)"),
        ((finetuned, "--prompt", RED_RIGHT, "--karras", "0.01,200"), "set validation.solver=unipc"),
        ((finetuned, "--prompt", RED_RIGHT, "--karras", "low"), "--karras takes SIGMA_MIN,SIGMA_MAX"),
        ((finetuned, "--prompt", RED_RIGHT, "--base", tmp_path / "fresh"), "model_index.json"),
        ((finetuned, "--prompt", RED_RIGHT, "--base", world_teacher), "component"),
    ]:
        assert message in bad(capsys, *argv, "--out", out), argv
        assert not out.exists()


@pytest.fixture(scope="module")
def image_to_video(tmp_path_factory):
    return train(tmp_path_factory.mktemp("i2v") / "run", "experiments/finetune_wan_i2v.py", 2)


def test_an_image_to_video_model_starts_from_the_image(image_to_video, tmp_path):
    """The first frame of world clip 0, written as a PNG and given as --image, conditions the sample exactly as the
    dataset's own first-frame latents condition validation's sample of that clip (the world's codec is exact)."""
    want, validator, built = validations_sample(image_to_video, seed=3)
    config = run_folder.load_run(image_to_video)
    clip = built.dataset.read([validator.prompts.indices[0]])["latents"]  # the world's codec: pixels by depth
    pixels = torch.nn.functional.pixel_shuffle(clip[0, :, 0][None], config.data.world.factor)[0]
    image = tmp_path / "first.png"
    Image.fromarray(((pixels + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()).save(image)
    done = sampling.run_sample(sampling.Request(str(image_to_video), (validator.prompts.captions[0],),
                                                out=str(tmp_path / "s"), seed=3, image=str(image)), progress=False)
    torch.testing.assert_close(done["latents"], want, rtol=0, atol=0)


def test_image_to_video_needs_a_decodable_image(image_to_video, tmp_path, capsys):
    (tmp_path / "broken.png").write_bytes(b"not a png")
    out = tmp_path / "out"
    assert "give --image" in bad(capsys, image_to_video, "--prompt", RED_RIGHT, "--out", out)
    assert "does not decode as an image" in bad(capsys, image_to_video, "--prompt", RED_RIGHT, "--image",
                                                tmp_path / "broken.png", "--out", out)
    assert "does not exist" in bad(capsys, image_to_video, "--prompt", RED_RIGHT, "--image", tmp_path / "no.png",
                                   "--out", out)
    assert not out.exists()


@pytest.fixture(scope="module")
def video_to_video(tmp_path_factory):
    return train(tmp_path_factory.mktemp("v2v") / "run", "experiments/finetune_cosmos3.py", 1,
                 "models.student.given_frames=2")


def test_a_video_to_video_model_continues_the_videos_first_frames(video_to_video, tmp_path, capsys):
    """Cosmos 3's video call: world clip 0 written as a lossless mp4 and given as --video conditions the sample
    exactly as the dataset's own latents condition validation's sample of that clip (the world's codec is exact), and
    the made video's first 2 frames are the given video's."""
    want, validator, built = validations_sample(video_to_video, seed=3)
    config = run_folder.load_run(video_to_video)
    clip = built.dataset.read([validator.prompts.indices[0]])["latents"][0]  # [C, T, h, w]: pixels by depth
    pixels = torch.nn.functional.pixel_shuffle(clip.transpose(0, 1), config.data.world.factor)  # [T, 3, H, W]
    frames = ((pixels + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    media.write_video(tmp_path / "clip.mp4", frames, 16)
    done = sampling.run_sample(sampling.Request(str(video_to_video), (validator.prompts.captions[0],),
                                                out=str(tmp_path / "s"), seed=3, video=str(tmp_path / "clip.mp4")),
                               progress=False)
    torch.testing.assert_close(done["latents"], want, rtol=0, atol=0)
    made = done["frames"][0, :, :2].mul(255).round().to(torch.uint8).permute(1, 2, 3, 0)  # [2, H, W, 3]
    assert torch.equal(made, torch.from_numpy(frames[:2]))
    assert "continues a video's first frames: give --video" in bad(capsys, video_to_video, "--prompt", RED_RIGHT,
                                                                  "--out", tmp_path / "none")


@pytest.fixture(scope="module")
def world_model(tmp_path_factory):
    return train(tmp_path_factory.mktemp("mg2") / "run", "experiments/worldmodel_matrixgame2.py", 2)


def test_a_world_model_samples_from_an_image_and_an_action_file(world_model, tmp_path, capsys):
    """Matrix-Game: the first frame of world clip 0 as --image and its keys as an --actions file make exactly the
    video validation samples for that clip; the video is named after the file; without either, one line."""
    want, validator, built = validations_sample(world_model, seed=3)
    config = run_folder.load_run(world_model)
    sample0 = built.dataset.read([validator.prompts.indices[0]])
    pixels = torch.nn.functional.pixel_shuffle(sample0["latents"][0, :, 0][None], config.data.world.factor)[0]
    image = tmp_path / "first.png"
    Image.fromarray(((pixels + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()).save(image)
    keys = tmp_path / "keys.npz"
    numpy.savez(keys, keyboard=sample0["keyboard"][0].numpy(), mouse=sample0["mouse"][0].numpy())
    done = sampling.run_sample(sampling.Request(str(world_model), (), out=str(tmp_path / "s"), seed=3, image=str(image),
                                                actions=str(keys)), progress=False, say=lambda line: None)
    torch.testing.assert_close(done["latents"], want, rtol=0, atol=0)
    assert done["videos"][0]["files"] == ["keys_3.mp4"]
    out = tmp_path / "out"
    numpy.save(tmp_path / "short.npy", sample0["keyboard"][0, :2].numpy())
    for args, message in [(("--image", image), "give --actions FILE"), (("--actions", keys), "give --image"),
                          (("--image", image, "--actions", tmp_path / "short.npy"), "keyboard has 2 rows, but the "
                                                                                    "video has 4 frames"),
                          (("--image", image, "--actions", keys, "--negative-prompt", "x"), "reads no text")]:
        assert message in bad(capsys, world_model, *args, "--out", out), args
    assert not out.exists()


def test_a_model_with_sound_writes_it_beside_and_into_its_video(tmp_path):
    out = train(tmp_path / "run", "experiments/finetune_minimax_h3.py", 1)
    done = sampling.run_sample(sampling.Request(str(out), (RED_RIGHT,), out=str(tmp_path / "s"), steps=2),
                               progress=False)
    assert done["videos"][0]["files"] == ["red-bars-moving-right_0.mp4", "red-bars-moving-right_0.wav"]
    assert set(done["latents"]) == {"video", "audio"}
    assert {"audio_mse", "pitch_match", "nearest_mse"} <= set(done["videos"][0]["world_score"])  # the sound scored
    import av
    with av.open(str(tmp_path / "s" / "red-bars-moving-right_0.mp4")) as container:
        assert sorted(stream.type for stream in container.streams) == ["audio", "video"]


def test_a_longer_clip_than_a_bidirectional_model_saw_is_warned(finetuned, tmp_path, capsys):
    assert sample(finetuned, tmp_path, "--prompt", RED_RIGHT, "--frames", 5, "--steps", 2) == 0
    assert "was trained on 4 latent frames; 5 attend beyond what it saw" in capsys.readouterr().err
    record = json.loads((tmp_path / sampling.SAMPLES).read_text())
    assert "world_score" not in record["videos"][0]  # the world has no true clips of 5 frames to compare with


@pytest.mark.slow  # the toy teacher trained for 300 steps (about 25 s, shared with tests/fvx/data/test_world.py)
def test_the_toy_teacher_draws_the_typed_prompt(toy_teacher_300, tmp_path):
    """The README's teacher, briefly trained, sampled from the typed prompt: the world's own score finds its clips
    nearest the prompt's true ones more often than any other prompt's."""
    done = sampling.run_sample(sampling.Request(str(toy_teacher_300), (RED_RIGHT,), out=str(tmp_path / "s"),
                                                num_per_prompt=8), progress=False)
    match = sum(v["world_score"]["prompt_match"] for v in done["videos"]) / 8
    assert match >= 0.25, [v["world_score"] for v in done["videos"]]  # chance: 1 in 8; 6 in 8 measured


@pytest.fixture(scope="module")
def control_model(tmp_path_factory):
    return train(tmp_path_factory.mktemp("vace") / "run", "experiments/finetune_wan_vace.py", 2)


def test_a_control_model_samples_from_a_control_video_its_mask_and_a_reference(control_model, tmp_path, capsys):
    """Wan VACE: the control video and mask of a world clip (its first frame then grey, as ``write-videos --kind
    vace`` writes them) encode to the context the dataset gives that clip (up to the 8-bit grey of the frames to be
    made); a reference image adds a latent frame in front, dropped from the video; without --control, or with a short
    one, one line."""
    from fvx.data import toy_world

    config = run_folder.load_run(control_model)
    built = experiment.setup(config)
    sample0 = built.dataset.read([0])
    pixels = toy_world.depth_to_space(sample0["latents"], config.data.world.factor)[0]  # [3, T, H, W] in [-1, 1]
    clip = ((pixels + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 3, 0).numpy()
    control, mask = numpy.full_like(clip, 128), numpy.full_like(clip, 255)
    control[0], mask[0] = clip[0], 0
    media.write_video(tmp_path / "control.mp4", control, 16)
    media.write_video(tmp_path / "mask.mp4", mask, 16)
    request = sampling.Request(str(control_model), (RED_RIGHT,), out=str(tmp_path / "s"),
                               control=str(tmp_path / "control.mp4"), mask=str(tmp_path / "mask.mp4"))
    model = built.program.model
    read = sample_inputs.read_control(request, "vace", model, 4)
    encoder = sampling.preprocessing.prompt_encoder(config, "student", None, "vace")()
    got = torch.from_numpy(sample_inputs.control_condition(encoder, read, (192, 4, 2, 2), model)["vace_context"])
    want = sample0["vace_context"][0].clone()
    want[192:384, 1:] += 128 / 127.5 - 1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    done = sampling.run_sample(request, progress=False)
    assert done["latents"].shape[2] == 4 and frames_of(tmp_path / "s" / "red-bars-moving-right_0.mp4").shape[0] == 4
    weaker = sampling.run_sample(request._replace(out=str(tmp_path / "w"),
                                                  overrides=("models.student.context_scale=0.5",)), progress=False)
    assert not torch.equal(weaker["latents"], done["latents"])  # the pipeline's conditioning_scale, as an override
    reference = tmp_path / "ref.png"
    Image.fromarray(numpy.full((16, 16, 3), 200, numpy.uint8)).save(reference)
    done = sampling.run_sample(request._replace(out=str(tmp_path / "r"), reference=str(reference)), progress=False)
    assert done["latents"].shape[2] == 4  # the reference's frame dropped
    assert json.loads((tmp_path / "r" / sampling.SAMPLES).read_text())["latent_shape"][1] == 5
    out = tmp_path / "out"
    media.write_video(tmp_path / "short.mp4", numpy.zeros((2, 16, 16, 3), numpy.uint8), 16)
    for args, message in [((), "give --control VIDEO"),
                          (("--control", tmp_path / "short.mp4"), "(the video takes its first 4 frames)"),
                          (("--control", tmp_path / "control.mp4", "--mask", tmp_path / "no.mp4"),
                           "--mask '" + str(tmp_path / "no.mp4") + "' does not exist")]:
        assert message in bad(capsys, control_model, "--prompt", RED_RIGHT, *args, "--out", out), args
    assert not out.exists()


@pytest.fixture(scope="module")
def animation_model(tmp_path_factory):
    return train(tmp_path_factory.mktemp("animate") / "run", "experiments/finetune_wan_animate.py", 2)


def test_an_animation_model_animates_the_character_by_the_pose_and_face_videos(animation_model, tmp_path, capsys):
    """Wan-Animate: a world clip's first frame as --image, its white bars as --pose and the clip as --face (as
    ``write-videos --kind animate`` writes them) make exactly the sample validation makes of that clip from its
    dataset inputs (the world's codec is exact); the video drops the reference's slot; a longer video is made segment
    by segment, its first the one-segment video; a background and its mask replace; a missing --face or --mask, or
    --pose given to another model, is one line."""
    from fvx.data import toy_world, toy_world_animate

    want, validator, built = validations_sample(animation_model, seed=3)
    index = validator.prompts.indices[0]
    clip = built.dataset.clip(index)  # [3, T, H, W] in [-1, 1]
    def as_uint8(video):  # [3, T, H, W] in [-1, 1] -> [T, H, W, 3] uint8
        return ((video + 1) * 127.5).round().clip(0, 255).astype(numpy.uint8).transpose(1, 2, 3, 0)

    media.write_video(tmp_path / "pose.mp4", as_uint8(toy_world_animate.pose_video(clip)), 16)
    media.write_video(tmp_path / "face.mp4", as_uint8(clip), 16)
    Image.fromarray(as_uint8(clip)[0]).save(tmp_path / "character.png")
    request = sampling.Request(str(animation_model), (validator.prompts.captions[0],), out=str(tmp_path / "s"), seed=3,
                               image=str(tmp_path / "character.png"), pose=str(tmp_path / "pose.mp4"),
                               face=str(tmp_path / "face.mp4"))
    done = sampling.run_sample(request, progress=False)
    torch.testing.assert_close(done["latents"], want, rtol=0, atol=0)
    assert done["latents"].shape[2] == 5 and done["frames"].shape[2] == 4  # the reference's slot is not the video's
    assert toy_world.WorldConfig().frames == frames_of(tmp_path / "s" / done["videos"][0]["files"][0]).shape[0]
    # --frames 7: two segments of the trained 4 frames, the second starting on the first's last frame made
    longer = toy_world.WorldDataset(toy_world.WorldConfig(frames=7), built.dataset.key, kind="animate",
                                    collate=lambda samples, indices: samples).clip(index)
    assert numpy.array_equal(longer[:, :4], clip)
    media.write_video(tmp_path / "pose7.mp4", as_uint8(toy_world_animate.pose_video(longer)), 16)
    media.write_video(tmp_path / "face7.mp4", as_uint8(longer), 16)
    long = sampling.run_sample(request._replace(out=str(tmp_path / "l"), frames=7, pose=str(tmp_path / "pose7.mp4"),
                                                face=str(tmp_path / "face7.mp4")), progress=False)
    assert long["frames"].shape[2] == 7 and torch.equal(long["frames"][:, :, :4], done["frames"])
    record = json.loads((tmp_path / "l" / sampling.SAMPLES).read_text())
    assert record["segments"] == [0, 3] and record["frames"] == 7 and record["latent_shape"][1] == 5
    # the replace mode: the character put into a background where the mask is white (its condition is the data's
    # replace-mode encoding, tests/fvx/data/test_preprocess_animate.py)
    media.write_video(tmp_path / "background.mp4", numpy.full((4, 16, 16, 3), 40, numpy.uint8), 16)
    mask = numpy.zeros((4, 16, 16, 3), numpy.uint8)
    mask[:, 8:] = 255
    media.write_video(tmp_path / "mask.mp4", mask, 16)
    replaced = sampling.run_sample(request._replace(out=str(tmp_path / "b"), mask=str(tmp_path / "mask.mp4"),
                                                    background=str(tmp_path / "background.mp4")), progress=False)
    assert replaced["frames"].shape == done["frames"].shape and not torch.equal(replaced["latents"], done["latents"])
    out = tmp_path / "out"
    assert "--background and --mask go together" in bad(
        capsys, animation_model, "--prompt", RED_RIGHT, "--image", tmp_path / "character.png", "--pose",
        tmp_path / "pose.mp4", "--face", tmp_path / "face.mp4", "--background", tmp_path / "background.mp4",
        "--out", out)
    assert "give --face VIDEO" in bad(capsys, animation_model, "--prompt", RED_RIGHT, "--image",
                                      tmp_path / "character.png", "--pose", tmp_path / "pose.mp4", "--out", out)
    assert "the character to animate" in bad(capsys, animation_model, "--prompt", RED_RIGHT, "--out", out)
    assert not out.exists()


@pytest.fixture(scope="module")
def section_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sections")
    return (train(root / "framepack", "experiments/finetune_framepack.py", 2, "method.grad_accum=4"),
            train(root / "helios", "experiments/finetune_helios.py", 2))


def start_image(run_dir: pathlib.Path, path: pathlib.Path) -> tuple[numpy.ndarray, pathlib.Path]:
    """The first frame of the run's world clip 0, ``[3, H, W]`` in [-1, 1], written as a PNG at ``path``."""
    world = run_folder.load_run(run_dir).data.world
    first = WorldDataset(world, random.key(0), kind="t2v", collate=None).clip(0)[:, 0]
    Image.fromarray(((first + 1) * 127.5).round().clip(0, 255).astype(numpy.uint8).transpose(1, 2, 0)).save(path)
    return first, path


def test_a_section_model_makes_its_video_a_section_at_a_time(section_models, tmp_path, capsys):
    """FramePack from a start image: 5 frames, the image first (the world's codec is exact), its two sections made
    last first beside what is made; the same seed makes the same video. Helios from text: two chunks of 2, the second
    beside the first."""
    framepack, helios = section_models
    first, image = start_image(framepack, tmp_path / "start.png")
    made = [sampling.run_sample(sampling.Request(str(framepack), (RED_RIGHT,), out=str(tmp_path / f"s{i}"), seed=2,
                                                 image=str(image)), progress=False) for i in range(2)]
    assert made[0]["latents"].shape == (1, 48, 5, 4, 4) and torch.equal(made[0]["latents"], made[1]["latents"])
    frames = made[0]["frames"][0]  # [3, 5, 16, 16] in [0, 1]
    torch.testing.assert_close(frames[:, 0], torch.from_numpy(first) / 2 + 0.5, rtol=0, atol=1 / 255)
    assert frames[:, 1:].std() > 0.05 and "attend beyond" not in capsys.readouterr().out
    ended = sampling.run_sample(sampling.Request(str(framepack), (RED_RIGHT,), out=str(tmp_path / "e"), seed=2,
                                                 image=str(image), last_image=str(image)), progress=False)
    assert ended["latents"].shape == (1, 48, 5, 4, 4) and not torch.equal(ended["latents"], made[0]["latents"])
    record = json.loads((tmp_path / "e" / sampling.SAMPLES).read_text())
    assert record["last_image"] == str(image.absolute())
    chunks = sampling.run_sample(sampling.Request(str(helios), (RED_RIGHT,), out=str(tmp_path / "h")), progress=False)
    assert chunks["latents"].shape == (1, 48, 4, 4, 4) and frames_of(tmp_path / "h" / "red-bars-moving-right_0.mp4"
                                                                     ).shape[0] == 4
    # Helios from the image: two chunks after it (its noised latents in every chunk's history), as many frames
    started = [sampling.run_sample(sampling.Request(str(helios), (RED_RIGHT,), out=str(tmp_path / f"hi{i}"), seed=2,
                                                    image=str(image)), progress=False) for i in range(2)]
    assert started[0]["latents"].shape == (1, 48, 4, 4, 4)
    assert torch.equal(started[0]["latents"], started[1]["latents"])
    from_text = sampling.run_sample(sampling.Request(str(helios), (RED_RIGHT,), out=str(tmp_path / "ht"), seed=2),
                                    progress=False)
    assert not torch.equal(started[0]["latents"], from_text["latents"])
    # Helios after a video: a world clip of 4 frames is two whole chunks of 2; two new chunks follow them
    clip = WorldDataset(run_folder.load_run(helios).data.world, random.key(0), kind="t2v", collate=None).clip(0)
    media.write_video(tmp_path / "clip.mp4", ((clip + 1) * 127.5).round().clip(0, 255).astype(numpy.uint8)
                      .transpose(1, 2, 3, 0), 16)
    continued = sampling.run_sample(sampling.Request(str(helios), (RED_RIGHT,), out=str(tmp_path / "hv"),
                                                     video=str(tmp_path / "clip.mp4")), progress=False)
    assert continued["latents"].shape == (1, 48, 8, 4, 4)
    torch.testing.assert_close(continued["frames"][0][:, :4], torch.from_numpy(clip) / 2 + 0.5, rtol=0, atol=3 / 255)
    assert json.loads((tmp_path / "hv" / sampling.SAMPLES).read_text())["video"] == str(tmp_path / "clip.mp4")


def test_a_one_frame_model_makes_one_frame_from_the_image(tmp_path, capsys):
    """FramePack trained as musubi-tuner's --one_frame: --image is the control, the one frame made is the output
    (decoded alone); the same seed makes the same frame; --frames is refused in one line."""
    run_dir = train(tmp_path / "run", "experiments/finetune_framepack.py", 1, "method.optim.warmup_steps=0",
                    "data.sections.order=one_frame", "data.sections.window=4")
    _, image = start_image(run_dir, tmp_path / "start.png")
    made = [sampling.run_sample(sampling.Request(str(run_dir), (RED_RIGHT,), out=str(tmp_path / f"s{i}"), seed=2,
                                                 image=str(image)), progress=False) for i in range(2)]
    assert made[0]["latents"].shape == (1, 48, 1, 4, 4) and made[0]["frames"].shape == (1, 3, 1, 16, 16)
    assert torch.equal(made[0]["latents"], made[1]["latents"])
    assert "makes one frame from --image (data.sections.order=one_frame); drop --frames" in bad(
        capsys, run_dir, "--prompt", RED_RIGHT, "--image", image, "--frames", 5, "--out", tmp_path / "out")


def test_section_models_refuse_a_missing_image_and_a_length_of_no_whole_sections(section_models, tmp_path, capsys):
    framepack, helios = section_models
    out = tmp_path / "out"
    assert "makes videos from an image" in bad(capsys, framepack, "--prompt", RED_RIGHT, "--out", out)
    image = tmp_path / "x.png"
    Image.fromarray(numpy.zeros((16, 16, 3), numpy.uint8)).save(image)
    assert "whole sections of data.sections.window=2 latent frames (inverted_anti_drifting): e.g. 3, 5, 7" in bad(
        capsys, framepack, "--prompt", RED_RIGHT, "--image", image, "--frames", 4, "--out", out)
    assert "does not make its video last section first from a start image" in bad(
        capsys, helios, "--prompt", RED_RIGHT, "--image", image, "--last-image", image, "--out", out)
    assert "--last-image 'nowhere.png' does not exist" in bad(
        capsys, framepack, "--prompt", RED_RIGHT, "--image", image, "--last-image", "nowhere.png", "--out", out)
    assert "does not continue a video (Helios's chunks" in bad(capsys, framepack, "--prompt", RED_RIGHT, "--image",
                                                               image, "--video", image, "--out", out)
    assert "give --image or --video, not both" in bad(capsys, helios, "--prompt", RED_RIGHT, "--image", image,
                                                        "--video", image, "--out", out)
    media.write_video(tmp_path / "one.mp4", numpy.zeros((1, 16, 16, 3), numpy.uint8), 16)
    assert "continues whole chunks of 2 frames (data.sections.window=2 latent frames); the video has 1" in bad(
        capsys, helios, "--prompt", RED_RIGHT, "--video", tmp_path / "one.mp4", "--out", out)
    for start in ((), ("--image", image)):  # from an image as from text: the chunks' frames
        assert "whole sections of data.sections.window=2 latent frames (chunks): e.g. 2, 4, 6" in bad(
            capsys, helios, "--prompt", RED_RIGHT, *start, "--frames", 5, "--out", out)
    assert not out.exists()
