"""CogVideoX: a v-prediction DDPM family run as a flow. Its forward against the diffusers module as CogVideoXPipeline
calls it is the family test's (tests/fvx_models/test_families.py, cases "cogvideox" and "cogvideox-2b"); here: its
training loss is diffusers' train_cogvideox_lora.py's, Euler on its levels is its DDIM scheduler's sampling, its own
noise levels, the released presets, the exported folder and its encoders."""
import inspect
import json

import pytest
import torch
import transformers
from diffusers import (AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline,
                       CogVideoXTransformer3DModel)

import encoder_checks
from fvx.core import flow, random
from fvx_models import cogvideox, vp_flow
from fvx_models.cogvideox import CogVideoXConfig
from tiny_wan_pipeline import WORDS, tiny_t5_tokenizer

from family_cases import CASES, inputs, native_modules, vp_finetune_draws  # noqa: E402


def pipeline_rope(transformer, latents):
    pipe = CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer,
                             scheduler=CogVideoXDDIMScheduler())
    return pipe._prepare_rotary_positional_embeddings(latents.shape[3] * 8, latents.shape[4] * 8, latents.shape[1],
                                                      "cpu")


@pytest.mark.parametrize("case", ["cogvideox", "cogvideox-2b"])
def test_the_finetuning_loss_is_train_cogvideox_loras(case):
    """fvx's fine-tuning loss (its own timesteps and weight) equals diffusers' examples/cogvideo/train_cogvideox_lora.py
    at the same noise and timesteps: ``add_noise``, the DiT at the integer timestep, ``get_velocity`` as the x0
    prediction, ``mean(1 / (1 - abar) (x0_pred - x0)^2)``."""
    config = CASES[case].config
    loss, params, batch, x0, noise, taus = vp_finetune_draws(config, cogvideox.schedule_abar(config))
    (transformer,) = native_modules(CASES[case], params).values()
    sched = cogvideox.scheduler(config)
    frames_first = (lambda x: x.permute(0, 2, 1, 3, 4))
    target = frames_first(x0)
    noisy = sched.add_noise(target, frames_first(noise), taus)
    rope = pipeline_rope(transformer, noisy) if transformer.config.use_rotary_positional_embeddings else None
    output = transformer(hidden_states=noisy, encoder_hidden_states=batch["cond"]["text"], timestep=taus,
                         image_rotary_emb=rope, return_dict=False)[0]
    pred = sched.get_velocity(output, noisy, taus)
    weights = (1 / (1 - sched.alphas_cumprod[taus])).float().view(-1, 1, 1, 1, 1)
    script = torch.mean((weights * (pred - target) ** 2).reshape(3, -1), dim=1).mean()
    assert len(set(taus.tolist())) == 3
    torch.testing.assert_close(loss, script, rtol=2e-4, atol=0)


def test_euler_on_its_levels_is_the_ddim_schedulers_sampling():
    """The validation sampler on ``validation.schedule=model`` (Euler on the family's levels) lands where
    CogVideoXPipeline's loop with CogVideoXDDIMScheduler.step lands, from the same noise (5 steps: a step count
    dividing 1000, as its default 50, so each DDIM step ends on the next step's timestep and the last on ``abar``
    1)."""
    case = CASES["cogvideox"]
    model = case.config.build()
    params = model.weights.init(random.key(0))
    noise, _, cond = inputs(model, random.key(3), batch=1)
    sigmas = model.rules.sampling_sigmas(5)
    ours = flow.euler_sample(model.apply, params, noise, sigmas, cond=cond)

    (transformer,) = native_modules(case, params).values()
    sched = cogvideox.scheduler(case.config)
    sched.set_timesteps(5)
    latents = noise.permute(0, 2, 1, 3, 4)  # at tau = 999 (zero SNR) the VP point is the noise itself
    rope = pipeline_rope(transformer, latents)
    for tau in sched.timesteps:
        v = transformer(hidden_states=latents, encoder_hidden_states=cond["text"], timestep=tau.expand(1),
                        image_rotary_emb=rope, return_dict=False)[0]
        latents = sched.step(v, tau, latents, return_dict=False)[0]
    torch.testing.assert_close(ours, latents.permute(0, 2, 1, 3, 4), rtol=0, atol=2e-4)


def test_its_noise_levels_are_uniform_integer_timesteps_drawn_per_sample():
    config = CogVideoXConfig(preset="tiny-2b")
    keys = torch.stack([random.fold_in(random.key(0), i) for i in range(4000)])
    sigma, t = cogvideox.sigma_sampler(config, keys, torch.zeros(1))
    taus = vp_flow.timestep_of(cogvideox.schedule_abar(config), sigma)
    assert torch.allclose(taus, taus.round(), atol=1e-3) and torch.equal(t, 1000 * sigma)
    counts = torch.bincount(taus.round().long() // 100, minlength=10)
    assert counts.min() > 300 and counts.max() < 500  # 400 each expected
    again, _ = cogvideox.sigma_sampler(config, keys[:3], torch.zeros(1))
    assert torch.equal(again, sigma[:3])


def test_the_released_presets_are_the_2b_and_5b_configs():
    signature = [name for name in inspect.signature(CogVideoXTransformer3DModel.__init__).parameters if name != "self"]
    small, large = (CogVideoXConfig(preset=p).spec for p in ("cogvideox-2b", "cogvideox-5b"))
    assert sorted(small.kwargs) == sorted(signature) == sorted(large.kwargs)
    assert (small.kwargs["num_layers"], small.kwargs["num_attention_heads"]) == (30, 30)
    assert (large.kwargs["num_layers"], large.kwargs["num_attention_heads"]) == (42, 48)
    assert not small.kwargs["use_rotary_positional_embeddings"] and large.kwargs["use_rotary_positional_embeddings"]
    assert (small.options["snr_shift_scale"], large.options["snr_shift_scale"]) == (3.0, 1.0)
    assert (small.latents.scale, large.latents.scale) == (1.15258426, 0.7)


def test_the_released_1_5_image_to_video_preset_has_its_ofs_embedding_and_the_pipeline_gives_it_2():
    """THUDM/CogVideoX1.5-5B-I2V (its config.json): 1.5's layout, 32 input channels, a 512-wide ofs embedding and no
    position table; the DiT's ofs is the pipeline's 2.0, none for a DiT without the embedding (the family test's case
    "cogvideox-1.5-i2v" checks the forward against the pipeline's call)."""
    k = CogVideoXConfig(preset="cogvideox1.5-5b-i2v").spec.kwargs
    assert (k["in_channels"], k["ofs_embed_dim"], k["patch_size_t"], k["use_learned_positional_embeddings"]) == (
        32, 512, 2, False)
    config = CogVideoXConfig(preset="tiny-1.5-i2v")
    x, t, cond = inputs(config.build(), random.key(0))
    frames_first = x.transpose(1, 2)  # the DiT's layout
    assert torch.equal(cogvideox.inputs(config, frames_first, t, cond, False)["ofs"], torch.full((2,), 2.0))
    assert cogvideox.inputs(CogVideoXConfig(preset="tiny-1.5"), frames_first, t, cond, False)["ofs"] is None


def test_an_export_is_a_cogvideox_pipeline_folder_with_its_ddim_scheduler(tmp_path):
    model = CogVideoXConfig(preset="tiny-2b").build()
    params = model.weights.init(random.key(0))
    written = model.export.folder(params, str(tmp_path))
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "CogVideoXPipeline"
    assert index["scheduler"] == ["diffusers", "CogVideoXDDIMScheduler"]
    saved = CogVideoXDDIMScheduler.from_pretrained(tmp_path / "scheduler").config
    assert (saved.snr_shift_scale, saved.prediction_type, saved.timestep_spacing) == (3.0, "v_prediction", "trailing")
    loaded = CogVideoXTransformer3DModel.from_pretrained(written.files["transformer"])
    assert all(torch.equal(p, params[name]) for name, p in loaded.state_dict().items() if name in params)


def test_a_2b_layout_takes_exactly_its_text_length():
    model = CogVideoXConfig(preset="tiny-2b").build()
    x, t, cond = inputs(model, random.key(0), text_len=7)
    with pytest.raises(ValueError, match=r"cogvideox:tiny-2b: its position table holds exactly 5 text tokens, got 7 "
                                         r"\(data.text_len=5\)"):
        model.apply(model.weights.init(random.key(0)), x, t, cond)


def test_a_folder_encodes_every_t5_token_and_the_vaes_mean(tmp_path):
    """CogVideoXPipeline's own T5 call at 226 tokens, every one kept (the pipeline encodes the padding without a
    mask), and the VAE's posterior mean in its own scale."""
    torch.manual_seed(0)
    text = transformers.T5EncoderModel(transformers.T5Config(vocab_size=len(WORDS), d_model=16, d_kv=4, d_ff=32,
                                                             num_layers=2, num_heads=4))
    vae = AutoencoderKLCogVideoX(block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1,
                                 norm_num_groups=2, temporal_compression_ratio=4)
    CogVideoXPipeline(tokenizer=tiny_t5_tokenizer(), text_encoder=text, vae=vae, transformer=None,
                      scheduler=CogVideoXDDIMScheduler()).save_pretrained(tmp_path)
    opened = cogvideox.ENCODERS.open(tmp_path, ["text", "video"])
    rows = opened.encode_text(["red bars moving left", "a cat"])
    reference = opened.pipe._get_t5_prompt_embeds(["red bars moving left", "a cat"], max_sequence_length=226)
    assert [tuple(r.shape) for r in rows] == [(226, 16)] * 2 and torch.equal(torch.stack(rows), reference)
    video = encoder_checks.random_clip((3, 5, 16, 16))
    assert torch.equal(opened.encode_video(video), opened.pipe.vae.encode(video[None]).latent_dist.mode()[0])


def test_image_to_video_holds_its_learned_position_table_frozen_drawn_as_diffusers_draws_it(tmp_path):
    """CogVideoX-5b-I2V's position table is a persistent buffer in diffusers (its trainers never train it): fvx
    carries it as a param held frozen, drawn as diffusers initialises it, exported under its name into a
    CogVideoXImageToVideoPipeline folder that diffusers loads strictly."""
    config = CogVideoXConfig(preset="tiny-i2v")
    model = config.build()
    assert cogvideox.POSITIONS not in model.weights.trained_names
    params = model.weights.init(random.key(0))
    torch.manual_seed(0)
    reference = CogVideoXTransformer3DModel(**config.spec.kwargs).patch_embed.pos_embedding
    assert params[cogvideox.POSITIONS].dtype == torch.float32
    assert torch.equal(params[cogvideox.POSITIONS], reference.float())
    shifted = params[cogvideox.POSITIONS] + 1  # as a checkpoint's learned table differs from the initial one
    written = model.export.folder({**params, cogvideox.POSITIONS: shifted}, str(tmp_path))
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "CogVideoXImageToVideoPipeline"
    loaded = CogVideoXTransformer3DModel.from_pretrained(written.files["transformer"])
    assert torch.equal(loaded.patch_embed.pos_embedding, shifted)
    assert torch.equal(model.weights.load(str(tmp_path))[cogvideox.POSITIONS], shifted)


def test_image_to_video_latents_of_another_size_than_its_table_are_refused_in_one_line():
    model = CogVideoXConfig(preset="tiny-i2v").build()
    model.check_latents((1, 16, 2, 4, 4))
    with pytest.raises(ValueError, match=r"covers latents of exactly 4 x 4 and 5 video frames \(2 latent frames\), "
                                         r"got 8 x 8 and 2 latent frames"):
        model.check_latents((1, 16, 2, 8, 8))


def test_the_first_frame_is_encoded_alone_and_scaled_as_the_image_to_video_pipeline_does(tmp_path):
    torch.manual_seed(0)
    vae = AutoencoderKLCogVideoX(block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1,
                                 norm_num_groups=2, temporal_compression_ratio=4, scaling_factor=0.7)
    CogVideoXPipeline(tokenizer=tiny_t5_tokenizer(), text_encoder=None, vae=vae, transformer=None,
                      scheduler=CogVideoXDDIMScheduler()).save_pretrained(tmp_path)
    opened = cogvideox.ENCODERS.open(tmp_path, ["first_frame"])
    video = encoder_checks.random_clip((3, 9, 16, 16))
    given = opened.encode_first_frame(video)
    first = opened.pipe.vae.encode(video[None, :, :1]).latent_dist.mode()[0] * 0.7
    assert given.shape == (4, 3, 2, 2) and torch.equal(given[:, :1], first) and not given[:, 1:].any()
