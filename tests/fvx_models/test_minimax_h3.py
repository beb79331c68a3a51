"""fvx_models.minimax_h3 (a joint video-and-audio DiT) against diffusers' MiniMaxH3Transformer3DModel called as its
modular pipeline calls it, and fvx_models.minimax_h3_audio against diffusers' audio decode step: the packed layout and
clean-time timesteps, the negated velocities, only valid text tokens, the coupled noise levels, the latent rules,
the presets, the exported pipeline folder, and bad input as one clear error."""
import functools
import inspect
import json
import math

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel, ModularPipeline
from diffusers.modular_pipelines.minimax_h3.before_denoise import (MiniMaxH3PrepareLayoutStep,
                                                                    MiniMaxH3SetTimestepsStep, patchify_video_latents)

from fvx.core import random, role
from fvx.core.optim_config import AdamWConfig
from fvx_methods import finetune
from fvx_models import build, minimax_h3
from fvx_models.minimax_h3 import MiniMaxH3Config
from fvx_models.minimax_h3_audio import MiniMaxH3AudioDecoder

CONFIG = MiniMaxH3Config(preset="tiny")
TINY_AUDIO_VAE = dict(encoder_dim=4, encoder_rates=(2, 2), latent_dim=32, latent_channels=32, num_attention_heads=2,
                      decoder_dim=8, decoder_rates=(2, 2), decoder_kernel_sizes=(4, 4), resblock_kernel_sizes=(3,),
                      resblock_dilation_sizes=((1,),), sampling_rate=160,
                      latents_mean=[0.1 * i - 1 for i in range(32)], latents_std=[1 + 0.05 * i for i in range(32)])


@pytest.fixture(scope="module")
def model():
    return CONFIG.build()


@pytest.fixture(scope="module")
def params(model):
    return model.weights.init(random.key(0))


def sample(key, *, frames=2, audio=8, text=5, valid=3, batch=1):
    """Latents ``{"video": [B, 48, T, 4, 4], "audio": [B, 2, 32, A]}``, ``t`` per modality and a text of ``valid``
    tokens padded to ``text`` (the padding is not zero: only the mask says it is padding)."""
    keys = random.split(key, 3)
    x = {"video": random.normal(keys[0], (batch, 48, frames, 4, 4)),
         "audio": random.normal(keys[1], (batch, 2, 32, audio))}
    t = {"video": torch.full((batch,), 700.0), "audio": torch.full((batch,), 300.0)}
    mask = torch.zeros(batch, text)
    mask[:, :valid] = 1
    return x, t, {"text": random.normal(keys[2], (batch, text, 32)), "text_mask": mask}


def diffusers_module(params):
    """The real diffusers module holding ``params`` (torch's RNG state restored after its own init)."""
    state = torch.get_rng_state()
    module = MiniMaxH3Transformer3DModel(**minimax_h3.TINY)
    torch.set_rng_state(state)
    module.load_state_dict(params)
    return module


def pipeline_call(module, x, t, cond):
    """The module called as diffusers' modular pipeline calls it for a t2va request, from its own steps' functions
    (``MiniMaxH3PrepareLayoutStep``, ``MiniMaxH3PrepareLatentsStep``'s audio rows, ``MiniMaxH3SetTimestepsStep`` with
    the clean times ``1 - sigma``), and the output unpacked as ``MiniMaxH3AfterDenoiseStep`` does, negated to fvx's
    ``noise - x0``."""
    video, audio = x["video"], x["audio"]
    prompt_embeds = cond["text"][:, cond["text_mask"][0].bool()]
    _, channels, frames, height, width = video.shape
    num_audio_latents = audio.shape[-1]
    patch = tuple(module.config.patch_size)
    position_ids, token_tags, video_indices, audio_indices, text_indices, cond_video, cond_audio = (
        MiniMaxH3PrepareLayoutStep.build_packed_sequence(torch.ones(prompt_embeds.shape[1], dtype=torch.long), frames,
                                                         height, width, num_audio_latents, patch, 2, 2, 0))
    video_time, audio_time = float(1 - t["video"][0] / 1000), float(1 - t["audio"][0] / 1000)
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_indices, audio_indices, cond_video, cond_audio, text_indices.numel(), video_time, audio_time,
        max(video_time, 0.999), 1.0)
    latents = patchify_video_latents(video, patch)
    audio_latents = audio[0].permute(0, 2, 1).reshape(-1, 32)  # [2, 32, A] -> 2 A channel-major rows
    with torch.no_grad():
        noise_pred, audio_noise_pred = module(
            hidden_states=latents[None], audio_hidden_states=audio_latents[None], encoder_hidden_states=prompt_embeds,
            timestep=timestep, timestep_indices=timestep_indices, token_tags=token_tags, position_ids=position_ids,
            video_indices=video_indices, audio_indices=audio_indices, text_indices=text_indices, return_dict=False)
    pt, ph, pw = patch
    rows = noise_pred[0].reshape(-1, frames // pt, height // ph, width // pw, channels, pt, ph, pw)
    video_v = rows.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(-1, channels, frames, height, width)
    audio_v = audio_noise_pred[0].reshape(2, num_audio_latents, 32).permute(0, 2, 1)[None]
    return {"video": -video_v, "audio": -audio_v}


# ------------------------------------------------------------------------------------------------------ the DiT


def test_apply_equals_the_modular_pipelines_call_negated(model, params):
    x, t, cond = sample(random.key(1))
    got = model.apply(params, x, t, cond)
    want = pipeline_call(diffusers_module(params), x, t, cond)
    assert set(got) == {"video", "audio"} and got["video"].shape == (1, 48, 2, 4, 4)
    assert got["audio"].shape == (1, 2, 32, 8)
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)


def test_the_dit_gets_the_t2va_layout_and_clean_time_timesteps(model):
    x, t, cond = sample(random.key(1))
    kwargs, _ = build.native_inputs(CONFIG, x, t, cond)
    # [text 3 | audio 2 x 8 | video 2 x 2 x 2]: tags 1, 2, 0
    assert kwargs["token_tags"].tolist() == [1] * 3 + [2] * 16 + [0] * 8
    assert kwargs["text_indices"].tolist() == [0, 1, 2] and kwargs["audio_indices"].tolist() == list(range(3, 19))
    assert kwargs["video_indices"].tolist() == list(range(19, 27)) and kwargs["position_ids"].shape == (27, 3)
    torch.testing.assert_close(kwargs["timestep"], torch.tensor([0.3, 0.7]), rtol=0, atol=1e-7)  # 1 - t / 1000
    assert kwargs["timestep_indices"].tolist() == [0] * 3 + [1] * 16 + [0] * 8  # text rows take the video's time
    assert kwargs["encoder_hidden_states"].shape == (1, 3, 32)  # the valid tokens only
    assert torch.equal(kwargs["audio_hidden_states"][0, :8], x["audio"][0, 0].T)  # left channel first, then right
    assert torch.equal(kwargs["audio_hidden_states"][0, 8:], x["audio"][0, 1].T)
    assert torch.equal(kwargs["hidden_states"][0], patchify_video_latents(x["video"], (1, 2, 2)))


def test_text_padding_changes_nothing(model, params):
    x, t, cond = sample(random.key(1))
    got = model.apply(params, x, t, cond)
    short = {"text": cond["text"][:, :3], "text_mask": torch.ones(1, 3)}
    longer = {"text": torch.cat([cond["text"], torch.full((1, 4, 32), 7.0)], 1),
              "text_mask": torch.cat([cond["text_mask"], torch.zeros(1, 4)], 1)}
    for other in (short, longer):
        out = model.apply(params, x, t, other)
        assert all(torch.equal(out[name], got[name]) for name in got)


def test_gradients_reach_both_times_and_every_param(model, params):
    x, t, cond = sample(random.key(1))
    t = {name: value.clone().requires_grad_() for name, value in t.items()}
    trainable = {name: p.clone().requires_grad_() for name, p in params.items()}
    out = model.apply(trainable, x, t, cond)
    (out["video"].square().mean() + out["audio"].square().mean()).backward()
    assert t["video"].grad.abs().item() > 0 and t["audio"].grad.abs().item() > 0
    assert all(p.grad is not None and p.grad.any() for p in trainable.values())  # no unused params


def test_remat_gives_the_same_gradients(params):
    x, t, cond = sample(random.key(1))
    grads = []
    for config in (CONFIG, MiniMaxH3Config(preset="tiny", remat=True)):
        trainable = {name: p.clone().requires_grad_() for name, p in params.items()}
        out = config.build().apply(trainable, x, t, cond)
        (out["video"].sum() + out["audio"].sum()).backward()
        grads.append({name: p.grad for name, p in trainable.items()})
    assert all(torch.equal(grads[0][name], grads[1][name]) for name in params)


@pytest.mark.cuda
def test_apply_on_a_gpu_matches_the_cpu(model, params):
    """The layout (fp64 positions, indices) and the RoPE frequencies follow the latents to the GPU."""
    x, t, cond = sample(random.key(1))
    want = model.apply(params, x, t, cond)
    cuda = {name: p.cuda() for name, p in params.items()}
    got = model.apply(cuda, {k: v.cuda() for k, v in x.items()}, {k: v.cuda() for k, v in t.items()},
                      {k: v.cuda() for k, v in cond.items()})
    for name in want:
        assert got[name].is_cuda
        torch.testing.assert_close(got[name].cpu(), want[name], rtol=1e-4, atol=1e-4)


def test_the_model_is_joint_and_trains_the_audio_branch(model, params):
    assert model.joint and model.modalities == {"video": minimax_h3.WORLD_LATENTS, "audio": minimax_h3.AUDIO_LATENTS}
    owned = {name for name in params if minimax_h3.MINIMAX_H3.joint.modalities["audio"].owns(name)}
    assert owned == {"audio_proj_in.weight", "audio_proj_in.bias", "audio_proj_out.weight", "audio_proj_out.bias"}
    assert model.weights.trained_names == frozenset(params)
    latents = torch.randn(1, 2, 32, 5)
    assert torch.equal(model.normalize({"video": torch.zeros(1, 48, 2, 4, 4), "audio": latents})["audio"], latents)


def test_a_finetune_step_updates_video_and_audio_params(model):
    program = finetune.Finetune(optim=AdamWConfig(lr=1e-3)).build({"student": model}, total_steps=1)
    state, frozen = program.init(random.key(0)), program.frozen(random.key(0))
    x, _, cond = sample(random.key(2), valid=5)
    raw = {"latents": x["video"], "audio_latents": x["audio"], **cond, "sample_index": torch.tensor([0])}
    before = {name: p.clone() for name, p in state.roles["student"].params.items()}
    state, metrics = program.step_(state, frozen, model.batch(raw))
    assert all(math.isfinite(float(metrics[name])) for name in ("loss", "video_finetune_loss", "audio_finetune_loss"))
    after = state.roles["student"].params
    assert not torch.equal(before["audio_proj_out.weight"], after["audio_proj_out.weight"])
    assert not torch.equal(before["proj_out.weight"], after["proj_out.weight"])


# --------------------------------------------------------------------------------------------------------- time


def test_coupled_sigmas_by_hand():
    video, audio = minimax_h3.coupled_sigmas(torch.tensor([0.0, 0.5, 1.0]))
    torch.testing.assert_close(video, torch.tensor([0.0, 12 / 13, 1.0]), rtol=0, atol=1e-7)  # 6 / 6.5
    torch.testing.assert_close(audio, torch.tensor([0.0, 0.75, 1.0]), rtol=0, atol=1e-7)  # 1.5 / 2


def test_the_sampler_draws_one_stage_per_sample_from_its_own_key(model):
    keys = torch.vmap(random.split)(random.fold_in(random.key(5), torch.arange(4)))[:, 1]
    x0 = {"video": torch.zeros(4, 48, 2, 4, 4), "audio": torch.zeros(4, 2, 32, 8)}
    sigma, t = model.rules.sigma_sampler(keys, x0)
    assert set(sigma) == set(t) == {"video", "audio"} and sigma["video"].shape == (4,)
    for name in sigma:
        torch.testing.assert_close(t[name], 1000 * sigma[name], rtol=0, atol=0)
    base_v = sigma["video"] / (12 - 11 * sigma["video"])  # the inverse shifts: one base b for both modalities
    base_a = sigma["audio"] / (3 - 2 * sigma["audio"])
    torch.testing.assert_close(base_v, base_a, rtol=1e-5, atol=1e-6)
    assert len(set(base_v.tolist())) == 4 and bool(((base_v >= 0) & (base_v < 1)).all())
    for b in range(4):  # a sample's draw depends on its own key only
        alone, _ = model.rules.sigma_sampler(keys[b:b + 1], {name: v[b:b + 1] for name, v in x0.items()})
        assert all(torch.equal(alone[name], sigma[name][b:b + 1]) for name in sigma)
    again, _ = model.rules.sigma_sampler(keys, x0)
    assert all(torch.equal(again[name], sigma[name]) for name in sigma)


# ------------------------------------------------------------------------------------------------------ the rules


def test_audio_frames_follow_the_clip_of_the_video_latents():
    assert [minimax_h3.audio_frames(n) for n in (2, 7, 37)] == [8, 37, 207]  # 5, 22, 124 frames at 24 fps
    for bad in (1, 3, 36):
        with pytest.raises(ValueError, match=rf"^minimax_h3: latent_frames must be 5 n \+ 2 .*got {bad}$"):
            minimax_h3.audio_frames(bad)


def test_wrong_audio_length_is_refused_in_one_line_and_a_batch_runs_sample_by_sample(model, params):
    released = functools.partial(minimax_h3.latent_rule, MiniMaxH3Config(preset="minimax-h3"))
    assert released({"video": (1, 24, 2, 4, 4), "audio": (1, 2, 32, 8)}) is None
    assert released((1, 24, 7, 4, 4)) is None  # the video's shape alone
    why = released({"video": (1, 24, 2, 4, 4), "audio": (1, 2, 32, 9)})
    assert "9 frames" in why and "2 frames" in why and "8 audio latents" in why
    assert "5 n + 2" in released({"video": (1, 24, 4, 4, 4), "audio": (1, 2, 32, 8)})
    # the tiny preset takes the toy world's latents (8 audio latents a frame), of any length, but audio [B, 2, 32, A]
    assert model.rules.latent_rule({"video": (1, 48, 4, 4, 4), "audio": (1, 2, 32, 32)}) is None
    with pytest.raises(ValueError, match=r"do not fit model minimax_h3:tiny: audio latents must be \[B, 2, 32, A\]"):
        model.check_latents({"video": (1, 48, 2, 4, 4), "audio": (1, 2, 16, 9)})
    x, t, cond = sample(random.key(1), batch=2)  # a batch runs sample by sample (one packed document a forward)
    v = model.apply(params, x, t, cond)
    for i in range(2):
        row = model.apply(params, *(role.rows(part, slice(i, i + 1)) for part in (x, t, cond)))
        assert all(torch.equal(v[name][i:i + 1], row[name]) for name in v)
    x, t, cond = sample(random.key(1), valid=0)
    with pytest.raises(ValueError, match=r"^minimax_h3: cond\['text_mask'\] marks no valid text token"):
        model.apply(params, x, t, cond)


def test_the_refusals_are_one_line():
    family = minimax_h3.MINIMAX_H3
    assert "zero-text" in family.conditioning.cfg_dropout_refusal and family.architecture.sequence_parallel is None
    for knobs, words in (({"attention": "vsa"}, "packed text-audio-video"), ({"compile": "model"}, "valid text")):
        with pytest.raises(ValueError, match=words) as error:
            MiniMaxH3Config(preset="tiny", **knobs).build()
        assert "\n" not in str(error.value)


# ----------------------------------------------------------------------------------------------------- presets


def test_presets_give_every_constructor_argument_and_the_release_is_diffusers_defaults():
    signature = inspect.signature(MiniMaxH3Transformer3DModel.__init__).parameters
    for preset in minimax_h3.PRESETS.values():
        assert set(preset.kwargs) == set(signature) - {"self"}
    release = minimax_h3.PRESETS["minimax-h3"]
    assert release.kwargs == {name: p.default for name, p in signature.items() if name != "self"}
    assert release.latents.channels == 24 and release.latents.vae_stride == (3, 16, 16) and release.text_len == 1024
    tiny = minimax_h3.PRESETS["tiny"].kwargs
    assert (tiny["in_channels"], tiny["audio_in_channels"], tiny["patch_size"], tiny["text_dim"]) == (48, 32,
                                                                                                       (1, 2, 2), 32)


def test_the_released_skeleton_has_33_billion_params_of_which_the_modality_heads_are_few():
    spec = MiniMaxH3Config(preset="minimax-h3").build().memory_spec()  # a meta skeleton
    counts = {name: math.prod(shape) for name, shape in spec.shapes.items()}
    audio = sum(n for name, n in counts.items() if name.startswith(("audio_proj_in.", "audio_proj_out.")))
    video = sum(n for name, n in counts.items() if name.startswith(("proj_in.", "proj_out.")))
    assert (sum(counts.values()), video, audio) == (33_122_992_896, 1_037_664, 349_472)
    assert [(g.name, g.count, g.dim, g.ffn_dim, g.text_tokens) for g in spec.groups] == [
        ("transformer_blocks", 50, 5376, 14336, False), ("token_refiner", 2, 5376, 14336, True)]


def test_the_export_loads_with_from_pretrained_and_the_modular_pipeline(model, params, tmp_path):
    model.export.folder(params, str(tmp_path))
    loaded = MiniMaxH3Transformer3DModel.from_pretrained(str(tmp_path / "transformer"))
    assert all(torch.equal(loaded.state_dict()[name], p) for name, p in params.items())
    x, t, cond = sample(random.key(1))
    got, want = model.apply(params, x, t, cond), pipeline_call(loaded, x, t, cond)
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "MiniMaxH3ModularPipeline"
    assert index["transformer"] == ["diffusers", "MiniMaxH3Transformer3DModel"]
    assert index["audio_vae"] == ["diffusers", "AutoencoderKLMiniMaxH3Audio"]
    pipe = ModularPipeline.from_pretrained(str(tmp_path))  # reads modular_model_index.json
    pipe.load_components(names=["transformer", "scheduler", "audio_scheduler"])
    assert type(pipe).__name__ == "MiniMaxH3ModularPipeline"
    assert (pipe.scheduler.config.shift, pipe.audio_scheduler.config.shift) == (12.0, 3.0)
    assert all(torch.equal(pipe.transformer.state_dict()[name], p) for name, p in params.items())


# -------------------------------------------------------------------------------------------- the audio decoder


@pytest.fixture(scope="module")
def audio_vae_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    state = torch.get_rng_state()
    torch.manual_seed(0)
    AutoencoderKLMiniMaxH3Audio(**TINY_AUDIO_VAE).save_pretrained(str(root / "audio_vae"))
    torch.set_rng_state(state)
    return root


def test_the_audio_decoder_decodes_stereo_as_the_pipelines_decode_step(audio_vae_folder):
    decoder = MiniMaxH3AudioDecoder(path=str(audio_vae_folder)).build(random.key(0))
    assert (decoder.sample_rate, decoder.samples_per_latent) == (160, 4)
    latents = random.normal(random.key(1), (2, 2, 32, 5))
    waveform = decoder.decode(latents)
    assert waveform.shape == (2, 2, 20) and waveform.dtype == torch.float32 and waveform.abs().max() <= 1
    vae = AutoencoderKLMiniMaxH3Audio.from_pretrained(str(audio_vae_folder / "audio_vae"))
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1)
    for b in range(2):  # MiniMaxH3AudioDecodeStep: denormalise, the stereo channels as a batch, permute(1, 0, 2)
        with torch.no_grad():
            audio = vae.decode(latents[b] * std + mean, return_dict=False)[0]
        torch.testing.assert_close(waveform[b:b + 1], audio.float().permute(1, 0, 2), rtol=1e-6, atol=1e-6)
    # the vae folder itself works as well as the pipeline root
    assert MiniMaxH3AudioDecoder(path=str(audio_vae_folder / "audio_vae")).build().sample_rate == 160
    wrong = r"^minimax_h3_audio decode: latents must be \[B, 2, 32, A\], got \(1, 32, 5\)$"
    with pytest.raises(ValueError, match=wrong):
        decoder.decode(latents[0, :1])


def test_a_bad_audio_vae_folder_is_a_one_line_error(audio_vae_folder, tmp_path):
    with pytest.raises(ValueError, match=r"^minimax_h3_audio path '.*nowhere': no such folder"):
        MiniMaxH3AudioDecoder(path=str(tmp_path / "nowhere")).build()
    with pytest.raises(ValueError, match=r"no config.json in"):
        MiniMaxH3AudioDecoder(path=str(tmp_path)).build()
    config = json.loads((audio_vae_folder / "audio_vae" / "config.json").read_text())
    for name, change in (("other", {"_class_name": "AutoencoderKLWan"}), ("nostats", {"latents_mean": None})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError) as error:
            MiniMaxH3AudioDecoder(path=str(tmp_path / name)).build()
        assert "\n" not in str(error.value) and ("AutoencoderKLWan" in str(error.value)
                                                 or "latents_mean None" in str(error.value))
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^minimax_h3_audio: cannot load the audio VAE in") as error:
        MiniMaxH3AudioDecoder(path=str(tmp_path / "noweights")).build()
    assert "\n" not in str(error.value)
