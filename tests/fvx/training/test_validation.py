"""fvx.training.validation: cadence, fixed noise, prompts, sampling with a closed-form model and the tiny VAE,
logging."""
import io

import msgspec
import pytest
import torch
from PIL import Image

from fvx import config as fconfig
from fvx.core import random
from fvx.data import datasets as data
from fvx.training import callbacks, tracking, validation
from fvx.training.validation import ValidationConfig
from fvx_models import cond as fcond
from fvx_models.wan import WanConfig
from fvx_models.wan_vae import WanVAEConfig

SHAPE = (2, 16, 2, 4, 4)  # [N, C, T, H, W]


@pytest.fixture(scope="module")
def vae():
    return WanVAEConfig().build(random.key(0))


@pytest.fixture(scope="module")
def model():
    """The tiny Wan: its cond is text [N, L, 32] and text_mask [N, L]."""
    return WanConfig().build()


def linear_velocity(params, x_t, t, cond):
    """A closed-form model: v = w x_t (cond must arrive untouched)."""
    assert cond["marker"] == "cond"
    return params["w"] * x_t


def gif_frames(data_bytes: bytes) -> Image.Image:
    gif = Image.open(io.BytesIO(data_bytes))
    assert gif.format == "GIF"
    return gif


class BlankingDataset:
    """Texts i * ones; sample 1's text is blanked as CFG dropout blanks it (and flagged, as fvx.data.datasets flags
    it)."""

    def __init__(self, n=4):
        self.n = n

    def __len__(self):
        return self.n

    def read(self, indices):
        text = torch.stack([torch.full((3, 32), float(i + 1)) * (i != 1) for i in indices])
        return {"text": text, "text_mask": torch.ones(len(indices), 3), "caption": [f"c{i}" for i in indices],
                "cfg_dropped": torch.tensor([i == 1 for i in indices]),
                "latents": torch.zeros(len(indices), 16, 3, 4, 6)}


# ---------------------------------------------------------------------------------------------------------- cadence


def test_should_validate_cadence():
    steps = range(12)
    assert [s for s in steps if validation.should_validate(ValidationConfig(every=5), s)] == [0, 5, 10]
    assert [s for s in steps if validation.should_validate(ValidationConfig(every=5, at_start=False), s)] == [5, 10]
    assert not any(validation.should_validate(ValidationConfig(every=0), s) for s in steps)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        validation.should_validate(ValidationConfig(every=5), -1)


def test_config_is_checked_on_conversion():
    with pytest.raises(fconfig.ConfigError, match=r"every"):
        fconfig.validate(ValidationConfig(every=-1))
    assert msgspec.convert({"latent_shape": [16, 2, 4, 4]}, ValidationConfig).latent_shape == (16, 2, 4, 4)


# ------------------------------------------------------------------------------------------------------ noise, keys


def test_fixed_noise_is_per_prompt_and_independent_of_the_count(key):
    noise = validation.fixed_noise(key, SHAPE)
    assert noise.shape == SHAPE and noise.dtype == torch.float32
    for i in range(2):
        assert torch.equal(noise[i], random.normal(random.fold_in(key, i), SHAPE[1:]))
    assert torch.equal(validation.fixed_noise(key, (3, *SHAPE[1:]))[:2], noise)
    assert torch.equal(validation.prompt_keys(key, 3)[1], random.fold_in(key, 1))
    with pytest.raises(ValueError, match=r"shape must be \[N, C, T, H, W\]"):
        validation.fixed_noise(key, (2, 16, 4, 4))


def test_many_step_sigmas_by_hand():
    assert validation.many_step_sigmas(4, 1.0).tolist() == [1.0, 0.75, 0.5, 0.25]
    expected = [3 * s / (1 + 2 * s) for s in (1.0, 0.75, 0.5, 0.25)]
    torch.testing.assert_close(validation.many_step_sigmas(4, 3.0), torch.tensor(expected), rtol=0, atol=1e-7)


# --------------------------------------------------------------------------------------------------------- sampling


def test_sample_videos_ode_matches_the_closed_form_and_decodes(key, vae):
    w = torch.tensor(0.5, requires_grad=True)
    params = {"w": w}
    noise = validation.fixed_noise(key, SHAPE)
    sigmas = [1.0, 0.5]
    latents, video = validation.sample_videos(linear_velocity, params, noise, sigmas, {"marker": "cond"},
                                              decode=vae.decode)
    # Euler on v = w x over levels 1 -> 0.5 -> 0: x <- x (1 + (s' - s) w), twice with s' - s = -0.5.
    torch.testing.assert_close(latents, noise * (1 - 0.5 * 0.5) ** 2, rtol=1e-6, atol=1e-6)
    assert video.shape == (2, 3, 5, 16, 16) and 0 <= video.min() and video.max() <= 1
    assert not latents.requires_grad and not video.requires_grad
    assert params["w"] is w and w.item() == 0.5 and w.grad is None  # the params are used as they are


def test_sample_videos_sde_is_deterministic_per_key(key, vae):
    noise = validation.fixed_noise(key, SHAPE)
    keys = validation.prompt_keys(random.fold_in(key, 7), SHAPE[0])
    run = lambda k: validation.sample_videos(linear_velocity, {"w": torch.tensor(0.3)}, noise, [1.0, 0.6, 0.2],
                                             {"marker": "cond"}, key=k, sampler="sde", decode=vae.decode)
    (latents, video), (again, video_again) = run(keys), run(keys)
    assert torch.equal(latents, again) and torch.equal(video, video_again)
    other, _ = run(validation.prompt_keys(random.fold_in(key, 8), SHAPE[0]))
    assert not torch.allclose(latents, other)
    alone, _ = validation.sample_videos(linear_velocity, {"w": torch.tensor(0.3)}, noise[1:], [1.0, 0.6, 0.2],
                                        {"marker": "cond"}, key=keys[1:], sampler="sde")
    torch.testing.assert_close(alone, latents[1:], rtol=0, atol=0)  # per-prompt keys: independent of the others


def test_sample_videos_denormalizes_before_decoding(key):
    seen = []
    decode = lambda z: seen.append(z) or torch.zeros(z.shape[0], 3, 1, 2, 2)
    latents, video = validation.sample_videos(linear_velocity, {"w": torch.tensor(0.0)}, torch.ones(SHAPE), [1.0],
                                              {"marker": "cond"}, denormalize=lambda x: 2 * x + 1, decode=decode)
    assert torch.equal(latents, torch.ones(SHAPE)) and torch.equal(seen[0], torch.full(SHAPE, 3.0))
    assert video.shape == (2, 3, 1, 2, 2)
    assert validation.sample_videos(linear_velocity, {"w": torch.tensor(0.0)}, torch.ones(SHAPE), [1.0],
                                    {"marker": "cond"})[1] is None


# ---------------------------------------------------------------------------------------------------------- logging


def test_log_validation_writes_gif_summaries_files_and_stats(tmp_path, key, vae):
    latents = validation.fixed_noise(key, SHAPE)
    video = vae.decode(latents)
    with tracking.open_tracker(tmp_path / "tb") as tracker:
        paths = validation.log_validation(tracker, 10, "student", latents, video, folder=tmp_path / "validation",
                                          fps=8, captions=["a cat", "a dog"])
    images = tracking.read_images(tmp_path / "tb")
    assert sorted(images) == ["validation/student/prompt_0", "validation/student/prompt_1"]
    (step, gif_bytes), = images["validation/student/prompt_1"]
    gif = gif_frames(gif_bytes)
    assert step == 10 and gif.is_animated and gif.n_frames == 5 and gif.size == (16, 16)
    folder = tmp_path / "validation" / "step_10"
    for i, animal in enumerate(("a-cat", "a-dog")):  # named by the prompt, as a person browsing the folder reads it
        assert folder / f"validation_student_prompt_{i}_{animal}_10.gif" in paths
        assert folder / f"validation_student_prompt_{i}_{animal}_10.png" in paths
    assert all(path.is_file() for path in paths)
    assert (folder / "validation_student_prompt_1_a-dog_10.gif").read_bytes() == gif_bytes
    scalars = tracking.read_scalars(tmp_path / "tb")
    assert scalars["validation/student/latent_mean"][0][1] == pytest.approx(latents.mean().item(), abs=1e-6)
    assert scalars["validation/student/latent_std"][0][1] == pytest.approx(latents.std(correction=0).item(), abs=1e-6)
    assert tracking.read_texts(tmp_path / "tb")["validation/student/captions"] == [
        (10, "- prompt_0: a cat\n- prompt_1: a dog")]


def test_log_validation_without_a_vae_writes_latent_previews_and_stats(tmp_path, key):
    latents = validation.fixed_noise(key, SHAPE) * 2 + 1
    with tracking.open_tracker(tmp_path / "tb") as tracker:
        paths = validation.log_validation(tracker, 3, "teacher", latents, None, folder=tmp_path / "v")
    images = tracking.read_images(tmp_path / "tb")
    assert sorted(images) == ["validation/teacher/latents_0", "validation/teacher/latents_1"]
    gif = gif_frames(images["validation/teacher/latents_0"][0][1])
    assert gif.n_frames == 2 and gif.size == (64, 64)  # 4x4 latents upscaled 16x
    assert len(paths) == 4 and all(p.parent == tmp_path / "v" / "step_3" for p in paths)
    scalars = tracking.read_scalars(tmp_path / "tb")
    assert scalars["validation/teacher/latent_mean"] == [(3, pytest.approx(latents.mean().item(), abs=1e-5))]
    assert scalars["validation/teacher/latent_mean_abs"] == [(3, pytest.approx(latents.abs().mean().item(), abs=1e-5))]


def test_log_validation_checks_shapes(tmp_path):
    with tracking.open_tracker(tmp_path) as tracker:
        with pytest.raises(ValueError, match=r"video must be \[N, 3, T, H, W\] with N = 2"):
            validation.log_validation(tracker, 0, "s", torch.zeros(SHAPE), torch.zeros(1, 3, 5, 8, 8))


def test_latent_preview_by_hand():
    latents = torch.zeros(4, 2, 1, 2)
    latents[0] = torch.tensor([[[0.0, 2.0]], [[4.0, 8.0]]])  # min 0, max 8
    latents[1] = 5.0  # constant -> 0.5
    latents[2] = torch.tensor([[[-1.0, 1.0]], [[1.0, 1.0]]])
    latents[3] = 100.0  # not shown
    frames = validation.latent_preview(latents, min_size=4)
    assert frames.shape == (2, 3, 4, 8)  # [T, 3, H, W], short side 1 -> 4 (factor 4)
    assert frames[0, 0, 0, ::4].tolist() == [0.0, 0.25] and frames[1, 0, 0, ::4].tolist() == [0.5, 1.0]
    assert torch.all(frames[:, 1] == 0.5)
    assert frames[0, 2, 0, ::4].tolist() == [0.0, 1.0]
    assert validation.latent_preview(latents[:2], min_size=1).shape == (2, 1, 1, 2)  # C < 3: the first as grey


# ---------------------------------------------------------------------------------------------------------- prompts


def test_prompts_from_the_dataset_skip_cfg_blanked_samples(model):
    prompts = validation.read_prompts(ValidationConfig(num_prompts=3), BlankingDataset(), model)
    assert [row[0, 0].item() for row in prompts.cond["text"]] == [1.0, 3.0, 4.0]
    assert prompts.captions == ("c0", "c2", "c3") and prompts.cond["text_mask"].shape == (3, 3) and prompts.count == 3
    with pytest.raises(ValueError, match="only 3 samples"):
        validation.read_prompts(ValidationConfig(num_prompts=4), BlankingDataset(), model)


def test_prompts_and_latent_shape_from_a_synthetic_dataset(key, model):
    config = data.DataConfig(text_len=6, synthetic=data.SyntheticConfig(num_samples=5, latent_shape=(16, 2, 4, 6),
                                                                        text_len=4, text_dim=32))
    dataset = data.open_dataset(config, key)
    prompts = validation.read_prompts(ValidationConfig(num_prompts=2), dataset, model)
    expected = dataset.read([0, 1])
    assert torch.equal(prompts.cond["text"], expected["text"])
    assert torch.equal(prompts.cond["text_mask"], expected["text_mask"])
    assert validation.latent_shape(ValidationConfig(), dataset) == (16, 2, 4, 6)
    assert validation.latent_shape(ValidationConfig(latent_shape=(16, 1, 2, 2)), dataset) == (16, 1, 2, 2)
    text_only = data.open_dataset(msgspec.structs.replace(config, kind="text_only"), key)
    with pytest.raises(ValueError, match="latent_shape must be set for data without latents"):
        validation.latent_shape(ValidationConfig(), text_only)
    narrow = data.open_dataset(msgspec.structs.replace(config, synthetic=msgspec.structs.replace(
        config.synthetic, text_dim=8)), key)
    with pytest.raises(ValueError, match=r"wan: the batch's cond\['text'\] must be \[B, L, 32\], got \[2, 6, 8\]"):
        validation.read_prompts(ValidationConfig(num_prompts=2), narrow, model)


def test_prompts_file_is_a_cond_file_of_the_models_family(tmp_path, key, model):
    path = tmp_path / "prompts.safetensors"
    text, mask = random.normal(key, (3, 4, 32)), torch.tensor([[1.0, 1, 0, 0]] * 3)
    fcond.save(path, {"text": text, "text_mask": mask}, captions=["a", "b", "c"])
    prompts = validation.read_prompts(ValidationConfig(num_prompts=2, prompts_file=str(path)), None, model)
    assert torch.equal(prompts.cond["text"], text[:2]) and torch.equal(prompts.cond["text_mask"], mask[:2])
    assert prompts.captions == ("a", "b")
    fcond.save(tmp_path / "bare.safetensors", {"text": text})  # no mask: all ones, as the family's default
    bare, captions = model.load_cond(str(tmp_path / "bare.safetensors"))
    assert torch.equal(bare["text_mask"], torch.ones(3, 4)) and captions is None
    with pytest.raises(ValueError, match="holds only 3 prompts"):
        validation.read_prompts(ValidationConfig(num_prompts=4, prompts_file=str(path)), None, model)
    with pytest.raises(ValueError, match="does not exist"):
        validation.read_prompts(ValidationConfig(prompts_file=str(tmp_path / "nope.safetensors")), None, model)
    with pytest.raises(ValueError, match="set validation.prompts_file or pass the dataset"):
        validation.read_prompts(ValidationConfig(), None, model)
    from safetensors.torch import save_file
    save_file({"embeddings": text}, tmp_path / "wrong.safetensors")
    with pytest.raises(ValueError, match=r"it takes text \[B, L, 32\], text_mask \[B, L\].*holds \['embeddings'\]"):
        model.load_cond(str(tmp_path / "wrong.safetensors"))
    save_file({"text": text[..., :8].contiguous()}, tmp_path / "narrow.safetensors")
    with pytest.raises(ValueError, match=r"must be \[B, L, 32\], got \[3, 4, 8\]"):
        model.load_cond(str(tmp_path / "narrow.safetensors"))
    (tmp_path / "garbage.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        model.load_cond(str(tmp_path / "garbage.safetensors"))


# ---------------------------------------------------------------------------------------------------------- guidance


def test_a_guided_sampler_steps_with_uncond_plus_g_times_the_difference(tmp_path, key, model):
    """Fine-tuning validates with CFG: every Euler step's velocity is uncond + g (cond - uncond), the unconditional
    call on the family's zero cond (or the negative prompt's)."""
    config = data.DataConfig(text_len=6, synthetic=data.SyntheticConfig(num_samples=4, latent_shape=(16, 1, 4, 4),
                                                                        text_len=4, text_dim=32))
    dataset = data.open_dataset(config, key)
    params = model.weights.init(random.key(1))
    negative = tmp_path / "negative.safetensors"
    fcond.save(negative, {"text": random.normal(random.key(2), (1, 6, 32)), "text_mask": torch.ones(1, 6)})
    for uncond_mode, path in (("zero", None), ("negative_prompt", str(negative))):
        vconfig = ValidationConfig(every=1, num_prompts=2, num_steps=3, guidance_scale=3.0, cfg_uncond=uncond_mode,
                                   negative_prompt_path=path)
        validator = validation.make_validator(vconfig, dataset, model)
        seen = []

        def apply(p, x, t, cond):
            seen.append(cond)
            return model.apply(p, x, t, cond)

        with tracking.open_tracker(tmp_path / uncond_mode) as tracker:
            validation.validate(validator, tracker, 1, [validation.Sampler("model", apply, params,
                                                                           validation.many_step_sigmas(3, 3.0),
                                                                           guided=True)])
        assert len(seen) == 6 and all(seen[i] is validator.prompts.cond for i in range(0, 6, 2))
        uncond = validator.uncond(validator.prompts.cond)
        if uncond_mode == "zero":
            assert not uncond["text"].any()
        else:
            assert torch.equal(uncond["text"][1], model.load_cond(str(negative))[0]["text"][0])
        # the latents by hand: Euler with the guided velocity
        sigmas = torch.cat([validation.many_step_sigmas(3, 3.0), torch.zeros(1)])
        x = validator.noise.clone()
        with torch.no_grad():
            for i in range(3):
                t = torch.full((2,), float(sigmas[i] * 1000))
                vc = model.apply(params, x, t, validator.prompts.cond)
                vu = model.apply(params, x, t, uncond)
                x = x + (sigmas[i + 1] - sigmas[i]) * (vu + 3.0 * (vc - vu))
        latents, _ = validation.sample_videos(validation.guided(model.apply, validator.uncond, 3.0), params,
                                              validator.noise, validation.many_step_sigmas(3, 3.0),
                                              validator.prompts.cond)
        torch.testing.assert_close(latents, x, rtol=1e-5, atol=1e-5)
    assert validation.guided(model.apply, validator.uncond, 1.0) is model.apply  # g = 1: no unconditional call
    with pytest.raises(msgspec.ValidationError, match="negative_prompt_path"):
        msgspec.convert({"guidance_scale": 2.0, "cfg_uncond": "negative_prompt"}, ValidationConfig)


def test_scores_go_into_the_captions_and_their_means_into_the_scalars():
    """A sampler's ``score`` (an RL method's rewards): each video's values before its prompt, their means logged."""
    videos = torch.zeros(2, 3, 1, 4, 4)

    def score(video, captions):
        assert captions == ["red bars", "blue bars"]
        return {"world": torch.tensor([0.5, 0.25]), "avg": torch.tensor([1.0, 0.5])}

    captions, scalars = validation.scored_captions(score, videos, ["red bars", "blue bars"])
    assert captions == ["world: 0.5 | avg: 1 | red bars", "world: 0.25 | avg: 0.5 | blue bars"]
    assert scalars == {"reward/world": 0.375, "reward/avg": 0.75}


def test_a_fixed_sampler_is_sampled_at_the_first_validation_only_and_the_others_at_every_one(tmp_path, key, model):
    """A frozen teacher's samples cannot change: the validation callback samples it once per launch."""
    config = data.DataConfig(text_len=6, synthetic=data.SyntheticConfig(num_samples=4, latent_shape=(16, 1, 4, 4),
                                                                        text_len=4, text_dim=32))
    validator = validation.make_validator(ValidationConfig(every=2, num_prompts=1, num_steps=1),
                                          data.open_dataset(config, key), model)
    params, calls = model.weights.init(random.key(1)), []

    def counted(tag):
        def apply(p, x, t, cond):
            calls.append(tag)
            return model.apply(p, x, t, cond)
        return apply

    def samplers_of(state, frozen, vconfig):
        return [validation.Sampler(tag, counted(tag), params, validation.many_step_sigmas(1, 3.0), fixed=fixed)
                for tag, fixed in (("student", False), ("teacher", True))]

    hook = validation.callback(validator, samplers_of)
    with tracking.open_tracker(tmp_path) as tracker:
        for step in range(5):
            hook.on_step_end(callbacks.Context(step, None, {}, {}, tracker, tmp_path))
    assert calls == ["student", "teacher", "student", "student"]  # steps 0, 2, 4: validated; the teacher once
