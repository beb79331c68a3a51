"""``sample`` of a Wan run whose model folder is a whole (tiny) diffusers pipeline: the family's own text encoder and
VAE, and the video the diffusers pipeline makes from the same prompt, noise, steps, scheduler and guidance."""
import json

import pytest
import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

import tiny_wan_pipeline
from fvx import run
from fvx.training import sampling

PROMPT = "a red cat moving left"
TEXT_LEN = 16  # the pipeline's max_sequence_length: both pad the prompt's tokens with zeros to this length


@pytest.fixture(scope="module")
def wan_run(tmp_path_factory):
    """One fine-tuning step of the tiny Wan from the pipeline folder, and the run exported with that folder linked."""
    root = tmp_path_factory.mktemp("wan_sample")
    folder = tiny_wan_pipeline.save_t2v(root / "pipeline")
    out = root / "run"
    assert run.main(["experiments/finetune_wan.py", "--out", str(out), "--steps", "1", "run.progress=false",
                     "validation.every=0", "data.world=null", "vae=null", "models.student.preset=tiny",
                     f"models.student.path={folder}", f"data.text_len={TEXT_LEN}", "data.batch_size=2",
                     "validation.latent_shape=[16,2,4,4]", "run.checkpoint.final=true"]) == 0
    assert run.main(["export", str(out), "--out", str(root / "export"), "--base", str(folder)]) == 0
    return out, root / "export", folder


def test_sample_is_the_diffusers_pipelines_video(wan_run, tmp_path):
    """``--schedule diffusers --negative-prompt ""`` is WanPipeline with FlowMatchEulerDiscreteScheduler(shift):
    the same latents from the same noise, and the same decoded frames."""
    source, export, _ = wan_run
    request = sampling.Request(str(source), (PROMPT,), out=str(tmp_path / "s"), steps=3, guidance=4.0, shift=3.0,
                               schedule="diffusers", negative_prompt="", seed=5)
    done = sampling.run_sample(request, progress=False)
    noise, _ = sampling.noise_and_keys([5], (16, 2, 4, 4))
    pipe = DiffusionPipeline.from_pretrained(export)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    call = dict(prompt=PROMPT, negative_prompt="", latents=noise, num_inference_steps=3, guidance_scale=4.0,
                height=16, width=16, num_frames=5, max_sequence_length=TEXT_LEN)
    latents = pipe(**call, output_type="latent").frames
    torch.testing.assert_close(done["latents"], latents, rtol=1e-4, atol=1e-4)
    video = torch.from_numpy(pipe(**call, output_type="np").frames).permute(0, 4, 1, 2, 3)  # [B, 3, T, H, W]
    torch.testing.assert_close(done["frames"], video, rtol=1e-4, atol=1e-4)


def test_unipc_is_the_released_wan_pipelines_sampler(wan_run, tmp_path):
    """``--solver unipc`` is WanPipeline with the scheduler Wan's released folders ship (UniPC, flow prediction,
    flow_shift 3)."""
    source, export, _ = wan_run
    request = sampling.Request(str(source), (PROMPT,), out=str(tmp_path), steps=4, guidance=5.0, shift=3.0,
                               solver="unipc", negative_prompt="", seed=2)
    done = sampling.run_sample(request, progress=False)
    noise, _ = sampling.noise_and_keys([2], (16, 2, 4, 4))
    pipe = DiffusionPipeline.from_pretrained(export)
    pipe.scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    latents = pipe(prompt=PROMPT, negative_prompt="", latents=noise, num_inference_steps=4, guidance_scale=5.0,
                   height=16, width=16, num_frames=5, max_sequence_length=TEXT_LEN, output_type="latent").frames
    torch.testing.assert_close(done["latents"], latents, rtol=1e-4, atol=1e-4)
    assert json.loads((tmp_path / sampling.SAMPLES).read_text())["solver"] == "unipc"


def test_the_family_vae_decodes_into_a_watchable_file(wan_run, tmp_path):
    source, _, _ = wan_run
    assert run.main(["sample", str(source), "--prompt", PROMPT, "--out", str(tmp_path), "--frames", "9",
                     "--height", "32", "--width", "16", "--steps", "2"]) == 0
    record = json.loads((tmp_path / sampling.SAMPLES).read_text())
    assert record["latent_shape"] == [16, 3, 8, 4] and record["model"].startswith("wan:")
    assert (tmp_path / "a-red-cat-moving-left_0.mp4").stat().st_size > 0


def test_frames_the_vae_cannot_make_are_refused(wan_run, tmp_path, capsys):
    source, _, _ = wan_run
    assert run.main(["sample", str(source), "--prompt", PROMPT, "--out", str(tmp_path / "x"), "--frames", "8"]) == 2
    assert "makes 1 + 4 k frames" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_wan22_a14b_samples_with_both_experts_from_a_base_folders_encoders(wan_run, tmp_path):
    """A run without a model folder (random tiny A14B on synthetic data) takes its text encoder and VAE from --base;
    its apply routes each step to the expert of its timestep."""
    _, _, folder = wan_run
    out = tmp_path / "a14b"
    assert run.main(["experiments/finetune_wan22_a14b.py", "--out", str(out), "--steps", "1", "run.progress=false",
                     "validation.every=0", "run.checkpoint.final=true"]) == 0
    assert run.main(["sample", str(out), "--prompt", PROMPT, "--out", str(tmp_path / "s"), "--steps", "3",
                     "--base", str(folder)]) == 0
    record = json.loads((tmp_path / "s" / sampling.SAMPLES).read_text())
    assert record["base"] == str(folder) and (tmp_path / "s" / "a-red-cat-moving-left_0.mp4").is_file()
