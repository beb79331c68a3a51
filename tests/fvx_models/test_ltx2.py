"""fvx_models.ltx2 against diffusers' LTX2VideoTransformer3DModel and LTX2Pipeline (tiny presets of both versions):
the video-only forward as the pipeline calls the DiT, the frozen audio branch, the LTX-2 trainer's noise levels, the
text width of each version, the frame rate, the export, the presets and the activation figures."""
import json
import math
import sys

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline, LTX2VideoTransformer3DModel

from fvx.core import flow, grad, random
from fvx.distributed import memory
from fvx_methods import finetune
from fvx_models import build, diffusers_folder as dfolder, ltx2
from fvx_models.ltx2 import LTX2Config

from family_cases import inputs, raw_batch  # noqa: E402

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[2] / "bench"))
from activations import saved_per_group  # noqa: E402

FASTVIDEO_PATTERNS = ("audio", "a2v", "v2a", "av_ca")  # fastvideo/train/models/ltx2/ltx2.py's _AUDIO_PARAM_PATTERNS


@pytest.fixture(scope="module", params=["tiny", "tiny-2.3"])
def built(request):
    config = LTX2Config(preset=request.param)
    model = config.build()
    return config, model, model.weights.init(random.key(0))


def fresh(config, params):
    """A real diffusers module holding ``params`` (torch's RNG state restored after its own init)."""
    state = torch.get_rng_state()
    module = LTX2VideoTransformer3DModel(**config.spec.kwargs)
    torch.set_rng_state(state)
    module.load_state_dict(params)
    return module


def native(config, params, x, t, cond, fps=24.0, module=None):
    """The DiT called as LTX2Pipeline's modality-isolated pass calls it (video only): latents packed by its own
    _pack_latents, one zero audio latent frame and one zero audio text token, timestep = sigma = t, the connector's
    embedding and mask, the latent grid and frame rate; the video tokens unpacked by its _unpack_latents."""
    module = fresh(config, params) if module is None else module
    k = config.spec.kwargs
    b, _, f, h, w = x.shape
    audio_text = k["caption_channels"] if k["use_prompt_embeddings"] else k["audio_cross_attention_dim"]
    with torch.no_grad():
        video, _ = module(hidden_states=LTX2Pipeline._pack_latents(x), audio_hidden_states=torch.zeros(b, 1, 8),
                          encoder_hidden_states=cond["text"], audio_encoder_hidden_states=torch.zeros(b, 1, audio_text),
                          timestep=t, sigma=t, encoder_attention_mask=cond["text_mask"], num_frames=f, height=h,
                          width=w, fps=fps, audio_num_frames=1, isolate_modalities=True,
                          use_cross_timestep=config.preset == "tiny-2.3", return_dict=False)
    return LTX2Pipeline._unpack_latents(video, f, h, w)


# ------------------------------------------------------------------------------------------------ the DiT's inputs


def test_apply_equals_the_diffusers_module_called_as_the_pipeline_calls_it(built):
    config, model, params = built
    x, t, cond = inputs(model, random.key(1), frames=3, size=4)
    torch.testing.assert_close(model.apply(params, x, t, cond), native(config, params, x, t, cond),
                               rtol=1e-5, atol=1e-5)


def test_the_dit_gets_tokens_a_minimal_audio_input_and_the_pipelines_timestep_and_sigma(built):
    config, model, _ = built
    x, t, cond = inputs(model, random.key(1), frames=3, size=4)
    kwargs, native_x = build.native_inputs(config, x, t, cond)
    assert native_x.shape == (2, 3, 4, 4, 8)  # BTHWC
    assert torch.equal(kwargs["hidden_states"], LTX2Pipeline._pack_latents(x))  # [B, T H W, C], the pipeline's order
    assert kwargs["timestep"] is t and kwargs["sigma"] is t  # 0..1000 per sample; sigma=timestep as the pipeline
    assert kwargs["encoder_hidden_states"] is cond["text"] and kwargs["encoder_attention_mask"] is cond["text_mask"]
    assert (kwargs["num_frames"], kwargs["height"], kwargs["width"], kwargs["fps"]) == (3, 4, 4, 24.0)
    assert kwargs["isolate_modalities"] is True and kwargs["audio_num_frames"] == 1
    assert kwargs["use_cross_timestep"] is (config.preset == "tiny-2.3")  # LTX-2.0's legacy False, 2.3's True
    width = 24 if config.preset == "tiny" else 16  # the caption width projected (2.0), else the audio cross width
    assert kwargs["audio_hidden_states"].shape == (2, 1, 8) and not kwargs["audio_hidden_states"].any()
    assert kwargs["audio_encoder_hidden_states"].shape == (2, 1, width)
    assert not kwargs["audio_encoder_hidden_states"].any() and kwargs["return_dict"] is False


def test_the_video_output_does_not_depend_on_the_audio_branch(built):
    """Every audio-owned param redrawn: the video velocity is bitwise the same; a video param redrawn changes it."""
    config, model, params = built
    x, t, cond = inputs(model, random.key(1))
    other = model.weights.init(random.key(7))
    audio = {n: other[n] if ltx2.owns_audio(n) else p for n, p in params.items()}
    assert sum(not torch.equal(audio[n], params[n]) for n in params) > 50
    torch.testing.assert_close(model.apply(audio, x, t, cond), model.apply(params, x, t, cond), rtol=0, atol=0)
    video = {**params, "transformer_blocks.1.ff.net.2.weight": other["transformer_blocks.1.ff.net.2.weight"]}
    assert not torch.allclose(model.apply(video, x, t, cond), model.apply(params, x, t, cond))


def test_the_frame_rate_moves_the_temporal_rope_positions():
    config = LTX2Config(preset="tiny", fps=30.0)
    model = config.build()
    params = model.weights.init(random.key(0))
    x, t, cond = inputs(model, random.key(1), frames=3)
    got = model.apply(params, x, t, cond)
    torch.testing.assert_close(got, native(config, params, x, t, cond, fps=30.0), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, native(config, params, x, t, cond, fps=24.0), atol=1e-4)


# ----------------------------------------------------------------------------------------- the frozen audio branch


def test_only_the_video_branch_trains_and_it_is_exactly_what_gets_gradients(built):
    """trained_names: every param but the audio branch's and the a2v/v2a machinery's; a video-only forward and
    backward gives every trained param a gradient and no audio-owned one."""
    config, model, params = built
    assert model.weights.trained_names == frozenset(n for n in params if not ltx2.owns_audio(n))
    assert not model.joint and model.modalities == {}
    for name in params:
        if any(fragment in name for fragment in ("audio", "a2v", "v2a", "av_ca", "av_cross_attn")):
            assert name not in model.weights.trained_names, name
    for name in ("proj_in.weight", "proj_out.bias", "time_embed.linear.weight", "scale_shift_table",
                 "transformer_blocks.0.attn1.to_q.weight", "transformer_blocks.1.attn2.to_k.weight",
                 "transformer_blocks.0.ff.net.0.proj.weight", "transformer_blocks.1.scale_shift_table"):
        assert name in model.weights.trained_names, name
    x, t, cond = inputs(model, random.key(1))
    _, grads = grad.value_and_grad(lambda p: model.apply(p, x, t, cond).square().mean())(params)
    reached = {n for n, g in grads.items() if g is not None and bool(g.abs().sum())}
    assert reached == model.weights.trained_names
    # FastVideo's patterns alone, on diffusers' names, leave out the video stream's a2v/v2a modulation embedder
    missed = {n for n in params if ltx2.owns_audio(n) and not any(f in n for f in FASTVIDEO_PATTERNS)}
    assert {n.split(".")[0] for n in missed} == {"av_cross_attn_video_scale_shift"}


def test_train_audio_is_refused_in_one_line():
    with pytest.raises(ValueError, match="ltx2 train_audio=True is not supported") as error:
        LTX2Config(preset="tiny", train_audio=True)
    assert "\n" not in str(error.value) and "audio latents in the batch" in str(error.value)


def test_bad_knobs_are_one_line_errors():
    for kwargs, message in [({"timestep_uniform_prob": -0.1}, "timestep_uniform_prob must lie in [0, 1], got -0.1"),
                            ({"timestep_uniform_prob": 1.5}, "timestep_uniform_prob must lie in [0, 1], got 1.5"),
                            ({"fps": math.inf}, "fps must be a positive finite frame rate")]:
        with pytest.raises(ValueError) as error:
            LTX2Config(preset="tiny", **kwargs)
        assert message in str(error.value) and "\n" not in str(error.value)


def test_the_family_refuses_cfg_dropout_and_vsa_with_fastvideos_reasons():
    model = LTX2Config(preset="tiny").build()
    assert "empty prompt encoded through Gemma and the connector" in model.rules.cfg_dropout_refusal
    with pytest.raises(ValueError, match="ltx2 family cannot run VSA: FastVideo's LTX-2 trainer"):
        LTX2Config(preset="tiny", attention="vsa").build()


# ------------------------------------------------------------------------------------------------- noise levels


def test_the_shift_is_0_95_at_1024_tokens_and_2_05_at_4096():
    assert ltx2.shift_mu(1024) == pytest.approx(0.95) and ltx2.shift_mu(4096) == pytest.approx(2.05)
    assert ltx2.shift_mu(2560) == pytest.approx(1.5)  # linear, and not clamped beyond
    assert ltx2.shift_mu(8192) == pytest.approx(0.95 + 1.1 * 7168 / 3072)


def test_stretched_sigma_by_hand():
    """s = sigmoid(z + mu), stretched between sigmoid(mu - 2.5758) and sigmoid(mu + 3.0902), reflected below 1e-3."""
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731

    def by_hand(z, mu):
        lo, hi = sig(mu - 2.5758), sig(mu + 3.0902)
        raw = (sig(z + mu) - lo) / (hi - lo)
        return min(max(raw if raw >= 1e-3 else 2e-3 - raw, 0.0), 1.0)

    z = torch.tensor([0.0, 1.0, -3.0, 4.0, -2.5758, 2.0])
    for tokens, mu in ((1024, 0.95), (4096, 2.05)):
        want = torch.tensor([by_hand(float(v), mu) for v in z])
        torch.testing.assert_close(ltx2.stretched_sigma(z, tokens), want, rtol=0, atol=1e-6)
    got = ltx2.stretched_sigma(z, 1024)
    # mu = 0.95: s = sigmoid(0.95) = 0.721115, lo = sigmoid(-1.6258) = 0.164407, hi = sigmoid(4.0402) = 0.982710
    assert float(got[0]) == pytest.approx((0.721115 - 0.164407) / (0.982710 - 0.164407), abs=2e-6)  # 0.680320
    # z = -3: s = sigmoid(-2.05) = 0.114052 < lo, so raw < 0 and it is reflected to 2e-3 - raw = 0.063535
    assert float(got[2]) == pytest.approx(2e-3 - (0.114052 - 0.164407) / (0.982710 - 0.164407), abs=2e-6)
    assert float(got[3]) == 1.0 and float(got[4]) == pytest.approx(2e-3, abs=1e-6)  # clamped; at lo exactly: 2 eps
    # mu = 2.05: s = sigmoid(2.05) = 0.885948, lo = sigmoid(-0.5258) = 0.371497, hi = sigmoid(5.1402) = 0.994178
    assert float(ltx2.stretched_sigma(z, 4096)[0]) == pytest.approx((0.885948 - 0.371497) / (0.994178 - 0.371497),
                                                                    abs=2e-6)  # 0.826187


def keys_of(n, seed=3):
    return random.fold_in(random.key(seed), torch.arange(n))


def draws(keys):
    """What each key's three splits draw: the normal, the coin and U(1e-3, 1)."""
    parts = torch.stack([random.split(k, 3) for k in keys])
    return (torch.stack([random.normal(k, ()) for k in parts[:, 0]]), torch.stack([random.uniform(k, ()) for k in
                                                                                    parts[:, 1]]),
            torch.stack([random.uniform(k, (), minval=1e-3, maxval=1.0) for k in parts[:, 2]]))


def test_the_sampler_mixes_in_uniform_levels_by_each_samples_coin():
    x0 = torch.zeros(16, 8, 4, 16, 16)  # 4 x 16 x 16 = 1024 tokens: mu = 0.95
    keys = keys_of(16)
    normal, coin, uniform = draws(keys)
    stretched = ltx2.stretched_sigma(normal, 1024)
    never, never_t = ltx2.sigma_sampler(LTX2Config(preset="tiny", timestep_uniform_prob=0.0), keys, x0)
    always, _ = ltx2.sigma_sampler(LTX2Config(preset="tiny", timestep_uniform_prob=1.0), keys, x0)
    half, _ = ltx2.sigma_sampler(LTX2Config(preset="tiny", timestep_uniform_prob=0.5), keys, x0)
    torch.testing.assert_close(never, stretched, rtol=0, atol=0)
    torch.testing.assert_close(always, uniform, rtol=0, atol=0)
    assert bool(((always >= 1e-3) & (always < 1)).all())
    torch.testing.assert_close(half, torch.where(coin < 0.5, uniform, stretched), rtol=0, atol=0)
    assert 0 < int((coin < 0.5).sum()) < 16  # both kinds drawn
    assert never.dtype == torch.float32 and never.shape == (16,)
    torch.testing.assert_close(never_t, 1000 * never, rtol=0, atol=0)
    more, _ = ltx2.sigma_sampler(LTX2Config(preset="tiny", timestep_uniform_prob=0.0), keys, torch.zeros(16, 8, 4, 32,
                                                                                                            32))
    torch.testing.assert_close(more, ltx2.stretched_sigma(normal, 4096), rtol=0, atol=0)  # the token count's mu


def test_a_samples_level_depends_on_its_own_key_only():
    config, x0, keys = LTX2Config(preset="tiny"), torch.zeros(5, 8, 2, 4, 4), keys_of(5)
    sigma, t = ltx2.sigma_sampler(config, keys, x0)
    for b in range(5):
        alone, alone_t = ltx2.sigma_sampler(config, keys[b:b + 1], x0[:1])
        assert torch.equal(alone[0], sigma[b]) and torch.equal(alone_t[0], t[b])
    assert torch.equal(ltx2.sigma_sampler(config, keys, x0)[0], sigma)
    assert not torch.equal(ltx2.sigma_sampler(config, keys_of(5, seed=4), x0)[0], sigma)


def test_fine_tuning_draws_its_levels_with_the_family_sampler():
    config = LTX2Config(preset="tiny")
    model = config.build()
    params = model.weights.init(random.key(0))
    batch = model.batch(raw_batch(model, random.key(5)))
    method = finetune.Finetune()
    loss, aux = finetune.loss_fn(params, batch, random.key(9), model=model, config=method)
    x0 = model.normalize(batch["latents"].float())
    _, t_keys = flow.per_sample_noise(random.key(9), batch["sample_index"], tuple(x0.shape[1:]), x0.device)
    sigma, _ = ltx2.sigma_sampler(config, t_keys, x0)
    assert torch.isfinite(loss) and float(aux["sigma"]) == pytest.approx(float(sigma.mean()), abs=1e-7)


# --------------------------------------------------------------------------------------------------------- text


def test_each_version_takes_its_connectors_text_width():
    assert ltx2.text_width(LTX2Config(preset="ltx-2")) == 3840  # projected by the DiT's caption_projection
    assert ltx2.text_width(LTX2Config(preset="ltx-2.3")) == 4096  # the connector's video output, taken as is
    assert LTX2Config(preset="tiny").build().cond == {"text": ("L", 24), "text_mask": ("L",)}
    assert LTX2Config(preset="tiny-2.3").build().cond == {"text": ("L", 32), "text_mask": ("L",)}
    assert ltx2.PRESETS["ltx-2"].text_len == ltx2.PRESETS["ltx-2.3"].text_len == 1024


def test_a_text_embedding_of_the_other_versions_width_is_a_one_line_error():
    model = LTX2Config(preset="tiny").build()
    raw = {**raw_batch(model, random.key(0)), "text": torch.zeros(2, 5, 32)}
    with pytest.raises(ValueError) as error:
        model.batch(raw)
    message = str(error.value)
    assert message.startswith("ltx2: the batch's text embedding is 32 wide, but preset 'tiny' takes 24")
    assert "LTX-2.0 data stores the connector's 3840-wide" in message and "LTX-2.3 data its 4096-wide" in message
    assert "\n" not in message
    del raw["text_mask"]
    with pytest.raises(ValueError, match="ltx2 needs the batch tensor 'text_mask'"):
        model.batch(raw)


# ------------------------------------------------------------------------------------------------ export, presets


def test_the_export_is_an_ltx2_pipeline_whose_transformer_loads_and_equals(built, tmp_path):
    config, model, params = built
    model.export.folder(params, str(tmp_path / "out"))
    index = json.loads((tmp_path / "out" / "model_index.json").read_text())
    assert index["_class_name"] == "LTX2Pipeline"
    assert index["transformer"] == ["diffusers", "LTX2VideoTransformer3DModel"]
    assert index["vocoder"] == ["diffusers", "LTX2Vocoder" if config.preset == "tiny" else "LTX2VocoderWithBWE"]
    assert index["connectors"] == ["diffusers", "LTX2TextConnectors"]
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path / "out" / "scheduler")
    assert scheduler.config.use_dynamic_shifting and scheduler.config.shift_terminal == 0.1
    assert (scheduler.config.base_shift, scheduler.config.max_shift) == (0.95, 2.05)
    assert (scheduler.config.base_image_seq_len, scheduler.config.max_image_seq_len) == (1024, 4096)
    loaded = LTX2VideoTransformer3DModel.from_pretrained(tmp_path / "out" / "transformer")
    x, t, cond = inputs(model, random.key(1))
    torch.testing.assert_close(native(config, params, x, t, cond, module=loaded), model.apply(params, x, t, cond),
                               rtol=1e-5, atol=1e-5)
    assert all(torch.equal(loaded.state_dict()[n], p) for n, p in params.items())
    pipe = LTX2Pipeline.from_pretrained(tmp_path / "out", vae=None, audio_vae=None, text_encoder=None, tokenizer=None,
                                        connectors=None, vocoder=None)  # the base model's components left out
    assert isinstance(pipe.transformer, LTX2VideoTransformer3DModel) and pipe.scheduler.config.shift_terminal == 0.1


def test_presets_give_every_constructor_argument_and_the_released_sizes():
    arguments = {name for name in dfolder.constructor_defaults(LTX2VideoTransformer3DModel) if name != "self"}
    for name, preset in ltx2.PRESETS.items():
        assert set(preset.kwargs) == arguments, name
        stride = (1, 8, 8) if name == "world" else (8, 32, 32)  # the toy world's space-to-depth codec
        assert preset.kwargs["vae_scale_factors"] == stride and preset.latents.vae_stride == stride
    for name in ("ltx-2", "ltx-2.3"):
        spec = ltx2.PRESETS[name]
        assert spec.latents == ltx2.VIDEO and spec.latents.channels == 128
        assert spec.latents.mean == (0.0,) * 128 and spec.latents.std == (1.0,) * 128
        skeleton = build.skeleton(LTX2Config(preset=name))
        total = sum(p.numel() for p in skeleton.parameters())
        audio = sum(p.numel() for n, p in skeleton.named_parameters() if ltx2.owns_audio(n))
        assert 18.8e9 < total < 19.0e9 and 5.8e9 < audio < 5.9e9, (name, total, audio)  # "19B", "~5.8B audio"
    two, three = ltx2.LTX_2, ltx2.LTX_2_3
    assert {k for k in two if two[k] != three[k]} == {"gated_attn", "cross_attn_mod", "audio_gated_attn",
                                                        "audio_cross_attn_mod", "use_prompt_embeddings",
                                                        "perturbed_attn"}


@pytest.mark.parametrize("preset", ["tiny", "tiny-2.3"])
def test_dry_run_activation_figures_match_what_a_block_saves(preset):
    config = LTX2Config(preset=preset)
    model = config.build()
    spec = LTX2Config(preset=preset, compute_dtype="bf16").build().memory_spec()
    x, t, cond = inputs(model, random.key(1), frames=4, size=16, text_len=8)
    fp32, half, tokens = saved_per_group(config, x, t, cond)["transformer_blocks"]
    (group,) = spec.groups
    estimate = memory.block_activation_bytes(group, tokens, compute_bytes=2)
    assert abs(estimate - (fp32 + half)) <= 0.05 * (fp32 + half), (estimate, fp32 + half)
