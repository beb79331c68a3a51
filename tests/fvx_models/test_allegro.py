"""Allegro: an epsilon-prediction DDPM family run as a flow. Its forward against the diffusers module as
AllegroPipeline calls it is the family test's (tests/fvx_models/test_families.py, case "allegro"), its LoRA loads
with peft (tests/fvx_models/test_lora.py); here: its training loss is rhymes-ai/Allegro's train.py's, Euler on its
levels is its Euler scheduler's deterministic sampling, the released preset, the exported folder, its encoders."""
import inspect
import json

import torch
import transformers
from diffusers import (AllegroPipeline, AllegroTransformer3DModel, AutoencoderKLAllegro, DDPMScheduler,
                       EulerAncestralDiscreteScheduler, EulerDiscreteScheduler)

import encoder_checks
from fvx.core import flow, random
from fvx_models import allegro
from fvx_models.allegro import AllegroConfig
from tiny_wan_pipeline import WORDS, tiny_t5_tokenizer

from family_cases import CASES, inputs, native_modules, vp_finetune_draws  # noqa: E402


def pipeline_call(transformer, latents, taus, cond):
    """The DiT's noise prediction as AllegroPipeline calls it (its RoPE for the latent grid, the text mask)."""
    pipe = AllegroPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer,
                           scheduler=DDPMScheduler())
    b, _, f, h, w = latents.shape
    rope = pipe._prepare_rotary_positional_embeddings(b, h * 8, w * 8, f, "cpu")
    return transformer(hidden_states=latents, encoder_hidden_states=cond["text"], timestep=taus,
                       encoder_attention_mask=cond["text_mask"], image_rotary_emb=rope, return_dict=False)[0]


def test_the_finetuning_loss_is_train_pys_epsilon_loss():
    """fvx's fine-tuning loss (its own timesteps and weight) equals Allegro's ``train.py`` (``snr_gamma`` unset):
    ``DDPMScheduler().add_noise`` at integer timesteps, ``mse(eps_pred, noise)``."""
    loss, params, batch, x0, noise, taus = vp_finetune_draws(AllegroConfig(preset="tiny"), allegro.schedule_abar())
    noisy = DDPMScheduler().add_noise(x0, noise, taus)
    (transformer,) = native_modules(CASES["allegro"], params).values()
    script = torch.mean((pipeline_call(transformer, noisy, taus, batch["cond"]) - noise) ** 2)
    assert len(set(taus.tolist())) == 3
    torch.testing.assert_close(loss, script, rtol=2e-4, atol=0)


def test_euler_on_its_levels_is_the_euler_schedulers_deterministic_sampling():
    """The validation sampler on ``validation.schedule=model`` lands where AllegroPipeline's loop lands with the
    Euler scheduler without the ancestral noise (``EulerDiscreteScheduler()``, the same sigmas), from the same point:
    its latents ``x_K = (1 + k) x_t``. The pipeline's timesteps are linear in ``k`` between integer ones, fvx's in
    ``abar``: a fraction of a step apart."""
    model = AllegroConfig(preset="tiny").build()
    params = model.weights.init(random.key(0))
    noise, _, cond = inputs(model, random.key(3), batch=1)
    sigmas = model.rules.sampling_sigmas(6)
    ours = flow.euler_sample(model.apply, params, noise, sigmas, cond=cond)

    (transformer,) = native_modules(CASES["allegro"], params).values()
    sched, ancestral = EulerDiscreteScheduler(), allegro.scheduler()
    sched.set_timesteps(6)
    ancestral.set_timesteps(6)
    assert torch.equal(sched.sigmas, ancestral.sigmas)
    latents = noise * (1 + sched.sigmas[0])
    for tau in sched.timesteps:
        eps = pipeline_call(transformer, sched.scale_model_input(latents, tau), tau.expand(1), cond)
        latents = sched.step(eps, tau, latents, return_dict=False)[0]
    torch.testing.assert_close(ours, latents, rtol=0, atol=1e-4 * float(latents.abs().max()))


def test_the_released_preset_is_rhymes_ais_allegro():
    signature = inspect.signature(AllegroTransformer3DModel.__init__).parameters
    preset = AllegroConfig(preset="allegro").spec
    assert preset.kwargs == {name: p.default for name, p in signature.items() if name != "self"}
    assert preset.latents.scale == 0.13235 and preset.latents.vae_stride == (4, 8, 8) and preset.text_len == 512


def test_an_export_is_an_allegro_pipeline_folder_with_its_euler_scheduler(tmp_path):
    model = AllegroConfig(preset="tiny").build()
    params = model.weights.init(random.key(0))
    written = model.export.folder(params, str(tmp_path))
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "AllegroPipeline"
    assert index["scheduler"] == ["diffusers", "EulerAncestralDiscreteScheduler"]
    saved = EulerAncestralDiscreteScheduler.from_pretrained(tmp_path / "scheduler").config
    assert (saved.beta_start, saved.beta_end, saved.prediction_type) == (0.0001, 0.02, "epsilon")
    loaded = AllegroTransformer3DModel.from_pretrained(written.files["transformer"])
    assert all(torch.equal(p, params[name]) for name, p in loaded.state_dict().items() if name in params)


def test_a_folder_encodes_its_t5_tokens_and_the_tiled_vaes_mean(tmp_path):
    """AllegroPipeline's own prompt encoding (T5 at 512 tokens, cut to its mask) and its VAE's posterior mean, in the
    tiles the Allegro VAE only encodes in."""
    torch.manual_seed(0)
    text = transformers.T5EncoderModel(transformers.T5Config(vocab_size=len(WORDS), d_model=16, d_kv=4, d_ff=32,
                                                             num_layers=2, num_heads=4))
    vae = AutoencoderKLAllegro(block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1,
                               norm_num_groups=2, sample_size=32)
    AllegroPipeline(tokenizer=tiny_t5_tokenizer(), text_encoder=text, vae=vae, transformer=None,
                    scheduler=EulerAncestralDiscreteScheduler()).save_pretrained(tmp_path)
    opened = allegro.ENCODERS.open(tmp_path, ["text", "video"])
    prompts = ["red bars moving left", "a cat"]
    rows = opened.encode_text(prompts)
    embeds, mask, _, _ = opened.pipe.encode_prompt(prompts, do_classifier_free_guidance=False, clean_caption=True)
    assert embeds.shape[1] == 512 and [len(r) for r in rows] == mask.sum(1).tolist()
    assert all(torch.equal(row, full[keep.bool()]) for row, full, keep in zip(rows, embeds, mask))
    video = encoder_checks.random_clip((3, 24, 32, 32))
    opened.pipe.vae.enable_tiling()
    assert torch.equal(opened.encode_video(video), opened.pipe.vae.encode(video[None]).latent_dist.mode()[0])
