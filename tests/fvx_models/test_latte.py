"""Latte: an epsilon-prediction DDPM family run as a flow. Its forward against the diffusers module as LattePipeline
calls it (one prompt at a time, the embedding cut to its tokens) is the family test's
(tests/fvx_models/test_families.py, case "latte"), its LoRA loads with peft (tests/fvx_models/test_lora.py); here: its
training loss is the epsilon loss of a DDPM trainer, Euler on its levels is its DDIM scheduler's sampling, the released
preset, the exported folder, its encoders, its clip-length rule."""
import inspect
import json

import pytest
import torch
import transformers
from diffusers import AutoencoderKL, DDIMScheduler, DDPMScheduler, LattePipeline, LatteTransformer3DModel

import encoder_checks
from fvx.core import flow, random
from fvx_models import latte, vp_flow
from fvx_models.latte import LatteConfig
from tiny_wan_pipeline import WORDS, tiny_t5_tokenizer

from family_cases import CASES, inputs, native_modules, vp_finetune_draws  # noqa: E402


def epsilon(transformer, latents, taus, cond):
    """The DiT's noise prediction as LattePipeline calls it, one prompt at a time (its real tokens, no mask)."""
    return torch.cat([transformer(hidden_states=latents[i:i + 1], timestep=taus[i:i + 1],
                                  encoder_hidden_states=cond["text"][i:i + 1, cond["text_mask"][i].bool()],
                                  return_dict=False)[0][:, :latents.shape[1]] for i in range(latents.shape[0])])


def test_the_finetuning_loss_is_the_epsilon_loss_on_ddpm_noising():
    """fvx's fine-tuning loss (its own timesteps and weight) equals a DDPM trainer's (Latte's and Allegro's
    ``train.py``): ``DDPMScheduler.add_noise`` at the integer timesteps, ``mse(eps_pred, noise)``."""
    loss, params, batch, x0, noise, taus = vp_finetune_draws(LatteConfig(preset="tiny"), latte.schedule_abar())
    ddpm = DDPMScheduler(beta_start=0.0001, beta_end=0.02, beta_schedule="linear")
    noisy = ddpm.add_noise(x0, noise, taus)
    (transformer,) = native_modules(CASES["latte"], params).values()
    script = torch.mean((epsilon(transformer, noisy, taus, batch["cond"]) - noise) ** 2)
    assert len(set(taus.tolist())) == 3
    torch.testing.assert_close(loss, script, rtol=2e-4, atol=0)


def test_euler_on_its_levels_is_the_ddim_schedulers_sampling():
    """The validation sampler on ``validation.schedule=model`` lands where LattePipeline's loop with its
    DDIMScheduler lands, from the VP point of the same noise (``s`` times it at the first level)."""
    model = LatteConfig(preset="tiny").build()
    params = model.weights.init(random.key(0))
    noise, _, cond = inputs(model, random.key(3), batch=1)
    sigmas = model.rules.sampling_sigmas(5)
    ours = flow.euler_sample(model.apply, params, noise, sigmas, cond=cond)

    (transformer,) = native_modules(CASES["latte"], params).values()
    sched = latte.scheduler()
    sched.set_timesteps(5)
    a, b = vp_flow.coefficients(sigmas[:1])
    latents = noise * (a + b)
    for tau in sched.timesteps:
        latents = sched.step(epsilon(transformer, latents, tau.expand(1), cond), tau, latents, return_dict=False)[0]
    assert sched.timesteps.tolist() == [800, 600, 400, 200, 0]
    torch.testing.assert_close(ours, latents, rtol=0, atol=2e-4)


def test_the_released_preset_is_latte_1():
    signature = [name for name in inspect.signature(LatteTransformer3DModel.__init__).parameters if name != "self"]
    preset = LatteConfig(preset="latte-1").spec
    k = preset.kwargs
    assert sorted(k) == sorted(signature)
    assert (k["num_layers"], k["num_attention_heads"] * k["attention_head_dim"], k["caption_channels"]) == (
        28, 1152, 4096)
    assert (k["in_channels"], k["out_channels"], k["video_length"]) == (4, 8, 16)
    assert preset.latents.scale == 0.18215 and preset.text_len == 120


def test_a_clip_of_another_length_than_its_temporal_table_is_refused_in_one_line():
    model = LatteConfig(preset="tiny").build()
    with pytest.raises(ValueError, match="video_length=2 latent frames: a clip has 2 \\(or 1\\), got 3"):
        model.check_latents((1, 16, 3, 4, 4))
    model.check_latents((1, 16, 1, 4, 4))


def test_an_export_is_a_latte_pipeline_folder_with_its_ddim_scheduler(tmp_path):
    model = LatteConfig(preset="tiny").build()
    params = model.weights.init(random.key(0))
    written = model.export.folder(params, str(tmp_path))
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "LattePipeline" and index["scheduler"] == ["diffusers", "DDIMScheduler"]
    saved = DDIMScheduler.from_pretrained(tmp_path / "scheduler").config
    assert (saved.beta_start, saved.beta_end, saved.beta_schedule, saved.prediction_type) == (
        0.0001, 0.02, "linear", "epsilon")
    loaded = LatteTransformer3DModel.from_pretrained(written.files["transformer"])
    assert all(torch.equal(p, params[name]) for name, p in loaded.state_dict().items() if name in params)


def test_a_folder_encodes_its_t5_tokens_and_each_frames_vae_mean(tmp_path):
    """LattePipeline's own prompt encoding of one prompt (T5 at 120 tokens cut to its real tokens), and the image
    VAE's posterior mean frame by frame."""
    torch.manual_seed(0)
    text = transformers.T5EncoderModel(transformers.T5Config(vocab_size=len(WORDS), d_model=16, d_kv=4, d_ff=32,
                                                             num_layers=2, num_heads=4))
    vae = AutoencoderKL(block_out_channels=(8, 8), latent_channels=4, layers_per_block=1, norm_num_groups=2,
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
    LattePipeline(tokenizer=tiny_t5_tokenizer(), text_encoder=text, vae=vae, transformer=None,
                  scheduler=DDIMScheduler()).save_pretrained(tmp_path)
    opened = latte.ENCODERS.open(tmp_path, ["text", "video"])
    prompts = ["Red bars moving left ", "a cat"]
    rows = opened.encode_text(prompts)
    for prompt, row in zip(prompts, rows):
        one, _ = opened.pipe.encode_prompt(prompt, do_classifier_free_guidance=False, clean_caption=True)
        assert row.shape[0] < 120 and torch.equal(row, one[0])
    video = encoder_checks.random_clip((3, 3, 16, 16))
    latents = opened.encode_video(video)
    assert latents.shape == (4, 3, 8, 8)
    frames = opened.pipe.vae.encode(video.transpose(0, 1)).latent_dist.mode()  # the frames as a batch of images
    assert torch.equal(latents, frames.transpose(0, 1))
