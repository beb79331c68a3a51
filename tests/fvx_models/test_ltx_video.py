"""fvx_models.ltx_video against diffusers' LTXVideoTransformer3DModel and LTXPipeline (tiny preset): what is LTX-Video's
own (the token sequence, the timestep and RoPE inputs, the frame rate, LTX-Video-Trainer's noise levels, the VAE's
latent statistics, the presets, the LoRA its pipeline loads, bad input); tests/fvx_models/test_families.py holds what
every family shares."""
import json
import math

import pytest
import torch
from diffusers import (AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline,
                       LTXVideoTransformer3DModel)
from safetensors.torch import save_file

from fvx import run
from fvx.core import flow, grad, random
from fvx_methods import finetune
from fvx_models import build, diffusers_folder as dfolder, lora, lora_files, ltx_video
from fvx_models.ltx_video import LTXVideoConfig

from family_cases import CASES, inputs, native_modules, raw_batch  # noqa: E402
from test_lora import assert_loaded_lora_matches, trained_adapters  # noqa: E402

EXPERIMENT = str(__import__("pathlib").Path(__file__).parents[2] / "experiments" / "finetune_ltx_video.py")
QUICK = ["run.progress=false", "data.batch_size=2", "data.prefetch=1", "method.optim.warmup_steps=1"]


@pytest.fixture(scope="module")
def model():
    return LTXVideoConfig(preset="tiny").build()


@pytest.fixture(scope="module")
def params(model):
    return model.weights.init(random.key(0))


def native(params, x, t, cond, scale=(8 / 25, 32, 32)):
    """The diffusers module called as LTXPipeline calls it, with ``rope_interpolation_scale`` ``scale``."""
    (module,) = native_modules(CASES["ltx_video"], params).values()
    _, _, f, h, w = x.shape
    with torch.no_grad():
        out = module(hidden_states=LTXPipeline._pack_latents(x), encoder_hidden_states=cond["text"], timestep=t,
                     encoder_attention_mask=cond["text_mask"], num_frames=f, height=h, width=w,
                     rope_interpolation_scale=scale, return_dict=False)[0]
    return LTXPipeline._unpack_latents(out, f, h, w)


# ------------------------------------------------------------------------------------------------ the DiT's inputs


def test_the_dit_gets_tokens_the_timestep_as_it_is_and_the_pipelines_rope_scale(model):
    config = LTXVideoConfig(preset="tiny")
    x, t, cond = inputs(model, random.key(1), frames=3, size=4)
    kwargs, native_x = build.native_inputs(config, x, t, cond)
    assert native_x.shape == (2, 3, 4, 4, 8)  # BTHWC
    assert torch.equal(kwargs["hidden_states"], LTXPipeline._pack_latents(x))  # [B, T H W, C], pipeline order
    assert kwargs["timestep"] is t and t.dtype == torch.float32  # 0..1000 per sample, as t.expand(B) in the pipeline
    assert kwargs["encoder_attention_mask"] is cond["text_mask"] and kwargs["encoder_hidden_states"] is cond["text"]
    assert (kwargs["num_frames"], kwargs["height"], kwargs["width"]) == (3, 4, 4)
    assert kwargs["rope_interpolation_scale"] == (8 / 25, 32, 32)
    assert ltx_video.rope_scale(LTXVideoConfig(preset="tiny", fps=24)) == (8 / 24, 32, 32)


def test_the_frame_rate_sets_the_temporal_rope_scale_as_the_pipelines_frame_rate(params):
    at_24 = LTXVideoConfig(preset="tiny", fps=24.0).build()
    x, t, cond = inputs(at_24, random.key(1), frames=3)
    got = at_24.apply(params, x, t, cond)
    torch.testing.assert_close(got, native(params, x, t, cond, scale=(8 / 24, 32, 32)), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, native(params, x, t, cond), atol=1e-4)  # 25 fps differs


def test_padded_text_tokens_are_masked_out(model, params):
    x, t, cond = inputs(model, random.key(1))
    changed = {**cond, "text": cond["text"].clone()}
    changed["text"][-1, -2:] = 100.0  # the last sample's two padded tokens
    torch.testing.assert_close(model.apply(params, x, t, changed), model.apply(params, x, t, cond), rtol=0, atol=0)
    unmasked = {**changed, "text_mask": torch.ones_like(cond["text_mask"])}
    assert not torch.allclose(model.apply(params, x, t, unmasked), model.apply(params, x, t, cond))


def test_the_batch_cond_is_the_t5_embedding_and_its_mask_as_the_data_holds_them(model):
    raw = raw_batch(model, random.key(3))
    batch = model.batch(raw)
    assert sorted(batch["cond"]) == ["text", "text_mask"]
    assert torch.equal(batch["cond"]["text"], raw["text"]) and torch.equal(batch["cond"]["text_mask"], raw["text_mask"])
    assert model.cond == {"text": ("L", 16), "text_mask": ("L",)}


def test_every_param_trains_none_is_held_unused(model, params):
    """A forward and backward of the tiny model reaches every param: the family declares no unused params."""
    x, t, cond = inputs(model, random.key(1))
    _, grads = grad.value_and_grad(lambda p: model.apply(p, x, t, cond).square().mean())(params)
    assert [n for n, g in grads.items() if g is None or not bool(g.abs().sum())] == []
    assert ltx_video.LTX_VIDEO.training.held_frozen(LTXVideoConfig()) == frozenset()
    assert model.weights.trained_names == frozenset(params)


def test_the_zero_unconditional_is_finite(model, params):
    x, t, cond = inputs(model, random.key(1))
    assert torch.isfinite(model.apply(params, x, t, model.uncond(cond, "zero"))).all()  # all-masked cross-attention


# ----------------------------------------------------------------------------------------------------- presets


def test_presets_give_every_constructor_argument_and_the_released_sizes():
    defaults = dfolder.constructor_defaults(LTXVideoTransformer3DModel)
    arguments = {name for name in defaults if name != "self"}
    for name, preset in ltx_video.PRESETS.items():
        assert set(preset.kwargs) == arguments, name
    assert ltx_video.LTX_2B == {name: defaults[name] for name in arguments}  # diffusers' defaults are the 2B's
    counts = {name: sum(p.numel() for p in build.skeleton(LTXVideoConfig(preset=name)).parameters())
              for name in ("ltx-video-2b", "ltx-video-13b")}
    assert 1.8e9 < counts["ltx-video-2b"] < 2.0e9 and 13.0e9 < counts["ltx-video-13b"] < 14.0e9, counts
    for name in ("ltx-video-2b", "ltx-video-13b"):
        spec = LTXVideoConfig(preset=name).spec
        assert spec.text_len == 128 and spec.latents == ltx_video.IDENTITY
        assert spec.latents.vae_stride == (8, 32, 32) and spec.kwargs["caption_channels"] == 4096


def test_the_exported_folder_is_an_ltx_pipeline_with_the_presets_scheduler(model, params, tmp_path):
    model.export.folder(params, str(tmp_path / "out"))
    index = json.loads((tmp_path / "out" / "model_index.json").read_text())
    assert index["_class_name"] == "LTXPipeline" and index["vae"] == ["diffusers", "AutoencoderKLLTXVideo"]
    assert index["text_encoder"] == ["transformers", "T5EncoderModel"]
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path / "out" / "scheduler")
    assert scheduler.config.use_dynamic_shifting and scheduler.config.shift_terminal == 0.1
    assert (scheduler.config.base_shift, scheduler.config.max_shift) == (0.95, 2.05)
    pipe = LTXPipeline.from_pretrained(tmp_path / "out", vae=None, text_encoder=None, tokenizer=None)
    x, t, cond = inputs(model, random.key(1))
    torch.testing.assert_close(CASES["ltx_video"].native({"transformer": pipe.transformer}, x, t, cond),
                               model.apply(params, x, t, cond), rtol=1e-5, atol=1e-5)


def test_shift_mu_is_the_pipelines_calculate_shift():
    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

    for tokens in (128, 1024, 4032, 9000):
        assert math.isclose(ltx_video.shift_mu(tokens), calculate_shift(tokens, 1024, 4096, 0.95, 2.05))


# -------------------------------------------------------------------------------------------------- noise levels


def test_the_shifted_logit_normal_by_hand():
    """LTX-Video-Trainer's ShiftedLogitNormalTimestepSampler: sigmoid(std z + mu), mu linear through (1024, 0.95) and
    (4096, 2.05), unclamped, nothing stretched."""
    z = torch.tensor([0.0, 1.0, -3.0, 4.0])
    for tokens, std in ((1024, 1.0), (4032, 1.0), (9000, 0.5)):
        mu = 0.95 + (2.05 - 0.95) * (tokens - 1024) / (4096 - 1024)
        want = torch.tensor([1 / (1 + math.exp(-(std * float(v) + mu))) for v in z])
        torch.testing.assert_close(ltx_video.shifted_logit_normal_sigma(z, tokens, std), want, rtol=0, atol=1e-6)
    # 4032 tokens (the recipe's bucket): mu = 0.95 + 1.1 * 3008 / 3072 = 2.027083, sigmoid(mu) = 0.883611
    assert float(ltx_video.shifted_logit_normal_sigma(z, 4032, 1.0)[0]) == pytest.approx(0.883611, abs=1e-6)


def keys_of(n, seed=3):
    return random.fold_in(random.key(seed), torch.arange(n))


def test_the_sampler_draws_from_each_samples_key_at_the_latents_token_count():
    keys = keys_of(16)
    normal = torch.stack([random.normal(k, ()) for k in keys])
    config = LTXVideoConfig(preset="tiny")
    sigma, t = ltx_video.sigma_sampler(config, keys, torch.zeros(16, 8, 4, 16, 16))  # 1024 tokens
    torch.testing.assert_close(sigma, ltx_video.shifted_logit_normal_sigma(normal, 1024, 1.0), rtol=0, atol=0)
    assert sigma.dtype == torch.float32 and sigma.shape == (16,)
    assert torch.equal(t, torch.round(1000 * sigma)) and not torch.equal(t, 1000 * sigma)  # the trainer's integers
    more, _ = ltx_video.sigma_sampler(config, keys, torch.zeros(16, 8, 12, 14, 24))  # 4032 tokens
    torch.testing.assert_close(more, ltx_video.shifted_logit_normal_sigma(normal, 4032, 1.0), rtol=0, atol=0)
    narrow, _ = ltx_video.sigma_sampler(LTXVideoConfig(preset="tiny", timestep_std=0.5), keys,
                                        torch.zeros(16, 8, 4, 16, 16))
    torch.testing.assert_close(narrow, ltx_video.shifted_logit_normal_sigma(normal, 1024, 0.5), rtol=0, atol=0)
    uniform, _ = ltx_video.sigma_sampler(LTXVideoConfig(preset="tiny", timestep_sampling="uniform"), keys,
                                         torch.zeros(16, 8, 4, 16, 16))
    torch.testing.assert_close(uniform, torch.stack([random.uniform(k, ()) for k in keys]), rtol=0, atol=0)
    for b in range(16):  # a sample's level depends on its own key only
        assert torch.equal(ltx_video.sigma_sampler(config, keys[b:b + 1], torch.zeros(1, 8, 4, 16, 16))[0][0],
                           sigma[b])


def test_fine_tuning_draws_its_levels_with_the_family_sampler(model, params):
    batch = model.batch(raw_batch(model, random.key(5)))
    method = finetune.Finetune()
    loss, aux = finetune.loss_fn(params, batch, random.key(9), model=model, config=method)
    x0 = model.normalize(batch["latents"].float())
    _, t_keys = flow.per_sample_noise(random.key(9), batch["sample_index"], tuple(x0.shape[1:]), x0.device)
    sigma, _ = ltx_video.sigma_sampler(LTXVideoConfig(preset="tiny"), t_keys, x0)
    assert torch.isfinite(loss) and float(aux["sigma"]) == pytest.approx(float(sigma.mean()), abs=1e-7)
    with pytest.raises(ValueError, match="method.weighting_scheme=logit_normal: model ltx_video:tiny draws its "
                                         "training noise levels with its own sampler"):
        finetune.Finetune(weighting_scheme="logit_normal").build({"student": model}, total_steps=1)


def test_a_bad_timestep_std_is_refused_in_one_line():
    for std in (math.inf, math.nan):
        with pytest.raises(ValueError, match="ltx_video timestep_std must be a positive finite standard deviation"):
            LTXVideoConfig(preset="tiny", timestep_std=std)


# --------------------------------------------------------------------------------------------- latent statistics


def tiny_vae(channels: int = 8) -> AutoencoderKLLTXVideo:
    """A tiny LTX VAE (diffusers' own test sizes: 4x4x4 compression) with drawn statistics and scaling factor 0.7."""
    state = torch.get_rng_state()
    vae = AutoencoderKLLTXVideo(latent_channels=channels, block_out_channels=(8, 8, 8, 8),
                                decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
                                decoder_layers_per_block=(1, 1, 1, 1, 1),
                                spatio_temporal_scaling=(True, True, False, False),
                                decoder_spatio_temporal_scaling=(True, True, False, False), patch_size=1,
                                scaling_factor=0.7)
    torch.set_rng_state(state)
    vae.latents_mean.copy_(random.normal(random.key(5), (channels,)))
    vae.latents_std.copy_(random.uniform(random.key(6), (channels,), minval=0.5, maxval=2.0))
    return vae


@pytest.fixture(scope="module")
def vae_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("ltx_pipeline")
    vae = tiny_vae()
    vae.save_pretrained(root / "vae")
    return root, vae


def test_latents_stats_normalise_as_the_pipelines_normalize_latents(vae_folder):
    root, vae = vae_folder
    from_root = LTXVideoConfig(preset="tiny", latents_stats=str(root)).build()
    from_vae = LTXVideoConfig(preset="tiny", latents_stats=str(root / "vae")).build()
    assert from_root.latents == from_vae.latents and from_root.latents.scale == pytest.approx(0.7)
    assert from_root.latents.vae_stride == (vae.temporal_compression_ratio, vae.spatial_compression_ratio,
                                            vae.spatial_compression_ratio) == (4, 4, 4)
    raw = random.normal(random.key(7), (2, 8, 3, 4, 4)) * 3 + 1
    with torch.no_grad():
        want = LTXPipeline._normalize_latents(raw, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        back = LTXPipeline._denormalize_latents(want, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    torch.testing.assert_close(from_root.latents.normalize(raw), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(from_root.latents.denormalize(want), back, rtol=1e-6, atol=1e-6)
    # the RoPE scale follows that VAE's compression, as the pipeline's vae_*_compression_ratio
    config = LTXVideoConfig(preset="tiny", latents_stats=str(root))
    assert ltx_video.rope_scale(config) == (4 / 25, 4, 4)


def test_without_latents_stats_the_latents_are_taken_as_already_normalised():
    latents = LTXVideoConfig(preset="tiny").build().latents
    x = random.normal(random.key(7), (1, 8, 2, 4, 4))
    assert torch.equal(latents.normalize(x), x) and torch.equal(latents.denormalize(x), x)


def test_bad_latents_stats_folders_are_one_line_errors(vae_folder, tmp_path, model, params):
    root, _ = vae_folder
    (tmp_path / "empty").mkdir()
    model.export.folder(params, str(tmp_path / "dit"))
    wide = tmp_path / "wide"
    tiny_vae(16).save_pretrained(wide)
    no_stats = tmp_path / "no_stats"
    no_stats.mkdir()
    (no_stats / "config.json").write_text((root / "vae" / "config.json").read_text())
    save_file({"decoder.conv_out.conv.bias": torch.zeros(3)}, str(no_stats / "diffusion_pytorch_model.safetensors"))
    zero_std = tmp_path / "zero_std"
    vae = tiny_vae()
    vae.latents_std.zero_()
    vae.save_pretrained(zero_std)
    cases = [(tmp_path / "nope", "no such folder; give the LTX-Video VAE folder"),
             (tmp_path / "empty", "no config.json in"),
             (tmp_path / "dit" / "transformer", "describes a LTXVideoTransformer3DModel, not an AutoencoderKLLTXVideo"),
             (wide, "the VAE has 16 latent channels; preset 'tiny' denoises 8"),
             (no_stats, "hold no latents_mean nor latents_std"),
             (zero_std, "latents_std finite and positive")]
    for folder, message in cases:
        with pytest.raises(ValueError, match="ltx_video latents_stats") as error:
            LTXVideoConfig(preset="tiny", latents_stats=str(folder))
        assert message in str(error.value) and "\n" not in str(error.value), (message, str(error.value))


def test_the_run_refuses_bad_knobs_in_one_line_and_writes_nothing(tmp_path, capsys):
    cases = [(["models.student.latents_stats=/nonexistent/vae"], "ltx_video latents_stats '/nonexistent/vae'"),
             (["models.student.fps=0"], "Expected `float` > 0.0 - at `$.models[...].fps`"),
             (["models.student.fps=inf"], "models.student.fps takes a finite number"),
             (["models.student.timestep_std=0"], "Expected `float` > 0.0 - at `$.models[...].timestep_std`"),
             (["models.student.timestep_sampling=gauss"],
              "models.student.timestep_sampling must be one of 'shifted_logit_normal', 'uniform'"),
             (["method.weighting_scheme=logit_normal"], "draws its training noise levels with its own sampler"),
             (["data.synthetic.text_dim=15"], "must be [B, L, 16], got [2, 8, 15]"),
             (["data.synthetic.latent_shape=[4,2,8,8]"],
              "batch latents of shape (2, 4, 2, 8, 8) do not fit model ltx_video:tiny")]
    for args, message in cases:
        out = tmp_path / "run"
        assert run.main([EXPERIMENT, "--out", str(out), *QUICK, *args]) == 2, message
        err = capsys.readouterr().err
        assert err.startswith("fvx.run: error:") and message in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_a_non_finite_frame_rate_is_refused():
    with pytest.raises(ValueError, match="ltx_video fps must be a positive finite frame rate"):
        LTXVideoConfig(preset="tiny", fps=math.inf)


def test_a_batch_missing_the_mask_or_of_another_width_names_it(model):
    raw = raw_batch(model, random.key(0))
    del raw["text_mask"]
    with pytest.raises(ValueError, match="ltx_video needs the batch tensor 'text_mask'"):
        model.batch(raw)
    wide = {**raw_batch(model, random.key(0)), "text": torch.zeros(2, 5, 15)}
    with pytest.raises(ValueError, match=r"ltx_video: the batch's cond\['text'\] must be \[B, L, 16\], got \[2, 5, 15"):
        model.batch(wide)


# -------------------------------------------------------------------------------------------------------- LoRA


def test_the_peft_lora_export_loads_with_ltx_pipelines_load_lora_weights(tmp_path):
    pytest.importorskip("peft")
    config = LTXVideoConfig(preset="tiny", frozen_dtype="fp32", lora=lora.LoRAConfig(
        rank=4, alpha=8.0, target_modules=("to_q", "to_k", "to_v", "to_out.0", "ff.net")))
    adapted = config.build()
    base = adapted.weights.base(random.key(0))
    adapters = trained_adapters(adapted, random.key(1))
    assert len(adapters) == 2 * 2 * (2 * 4 + 2)  # (A, B) x 2 blocks x (2 attentions x (q, k, v, out) + 2 FFN layers)
    assert adapted.export.adapter_formats == ("peft",)  # no original layout in fvx
    adapted.export.adapters(adapters, str(tmp_path), "peft")
    (transformer,) = native_modules(CASES["ltx_video"], base).values()
    pipe = LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
                       transformer=transformer)
    assert_loaded_lora_matches(pipe, "ltx_video", tmp_path, lora_files.PEFT_FILE, adapted, base, adapters)


# ------------------------------------------------------------------------------------------------- activations
