"""Kandinsky 6: its video-only forward against the diffusers module as Kandinsky6TI2VAPipeline calls it without audio
is the family test's (tests/fvx_models/test_families.py, case "kandinsky6"); here: the joint video-and-audio forward
against the pipeline's call with audio, the params a video-only model holds frozen (exactly those its forward sends
no gradient) and a joint one trains (all), the audio latent rules, the released preset, the exported folder, and its
encoders and audio decoder: the pipeline's prompt encoding (its template cropped, the real tokens after the pooled
CLIP row), the HunyuanVideo VAE's mean, the MMAudio VAE's mean of the mono mix at the pipeline's audio length, and
the pipeline's audio decode."""
import inspect
import json
import math

import PIL.Image

import pytest
import torch
import transformers
from diffusers import (FlowMatchEulerDiscreteScheduler, Kandinsky6TI2VAPipeline, Kandinsky6Transformer3DModel,
                       MMAudioVAE, MMAudioVocoder)
from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_ti2va import _PROMPT_TEMPLATE, _QWEN_CROP_START

import encoder_checks
from fvx.core import grad, random, role
from fvx_models import hunyuan_video, kandinsky6
from fvx_models.kandinsky6 import Kandinsky6Config
from fvx_models.kandinsky6_audio import Kandinsky6AudioDecoder
from fvx_models.lora import LoRAConfig
from test_encoders_kandinsky5 import SPECIALS, qwen_tokenizer, tiny_qwen

from family_cases import inputs  # noqa: E402

PROMPTS = ["red bars moving left", "a cat"]
# a tiny MMAudio VAE (20 latent features, the tiny DiT's in_audio_dim; 32 samples a latent) and its vocoder
TINY_AUDIO_VAE = dict(mel_bins=16, latent_channels=20, hidden_channels=8, channel_multipliers=(1, 2),
                      layers_per_block=1, sample_rate=8000, n_fft=64, hop_length=16)
TINY_VOCODER = dict(num_mels=16, upsample_initial_channel=16, upsample_rates=(4, 4), upsample_kernel_sizes=(8, 8),
                    resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),))


@pytest.fixture(scope="module")
def joint():
    model = Kandinsky6Config(preset="tiny", train_audio=True).build()
    return model, model.weights.init(random.key(0))


def joint_sample(key, audio=6, batch=2):
    """Video ``[B, 16, 3, 4, 4]`` and audio ``[B, 1, 20, A]`` latents at one level, a text of 5 rows (3 valid)."""
    keys = random.split(key, 4)
    x = {"video": random.normal(keys[0], (batch, 16, 3, 4, 4)), "audio": random.normal(keys[1], (batch, 1, 20, audio))}
    t = torch.tensor([700.0, 250.0])[:batch]
    mask = torch.ones(batch, 5)
    mask[:, 3:] = 0
    cond = {"text": random.normal(keys[2], (batch, 5, 32)), "pooled": random.normal(keys[3], (batch, 16)),
            "text_mask": mask}
    return x, {"video": t, "audio": t}, cond


def test_the_joint_forward_is_the_pipelines_call_with_audio(joint):
    """Kandinsky6TI2VAPipeline with sample_audio: channels-last ``latents | zero condition | zero mask``, the audio
    latents ``[B, C=20, A]`` permuted to ``[B, A, 20]`` (``prepare_audio_latents``), one timestep for both; the audio
    prediction permuted back as the pipeline does after its loop."""
    model, params = joint
    x, t, cond = joint_sample(random.key(1))
    v = model.apply(params, x, t, cond)
    module = Kandinsky6Transformer3DModel(**kandinsky6.TINY)
    module.load_state_dict(params)
    native = pipeline_call(module, x, t, cond)
    torch.testing.assert_close(v["video"], native["video"], rtol=0, atol=0)
    torch.testing.assert_close(v["audio"], native["audio"], rtol=0, atol=0)


def pipeline_call(module, x, t, cond):
    """``module`` called as the pipeline calls it with audio (the test above), its outputs as fvx's layout."""
    latents = x["video"].permute(0, 2, 3, 4, 1)
    hidden = torch.cat([latents, torch.zeros_like(latents), torch.zeros_like(latents[..., :1])], dim=-1)
    with torch.no_grad():
        video, audio = module(hidden_states=hidden, audio_hidden_states=x["audio"][:, 0].permute(0, 2, 1),
                              encoder_hidden_states=cond["text"], pooled_projections=cond["pooled"],
                              timestep=t["video"], encoder_attention_mask=cond["text_mask"].bool(), return_dict=False)
    return {"video": video.permute(0, 4, 1, 2, 3), "audio": audio.permute(0, 2, 1)[:, None]}


def test_the_toy_worlds_stereo_frames_are_tokens_of_both_channels_features():
    """The world preset reads audio ``[B, 2, 32, A]`` as ``A`` tokens of 64 features: token ``a`` is channel 0's 32
    features of column ``a``, then channel 1's; the output goes back the same way."""
    config = Kandinsky6Config(preset="world", train_audio=True)
    audio = torch.arange(2 * 2 * 32 * 5.0).reshape(2, 2, 32, 5)
    x = {"video": torch.zeros(2, 1, 4, 4, 192), "audio": audio}
    cond = {"text": torch.zeros(2, 3, 32), "pooled": torch.zeros(2, 16), "text_mask": torch.ones(2, 3)}
    tokens = kandinsky6.inputs(config, x, {"video": torch.ones(2), "audio": torch.ones(2)}, cond, False)
    tokens = tokens["audio_hidden_states"]
    assert tokens.shape == (2, 5, 64)
    assert torch.equal(tokens[1, 3], torch.cat([audio[1, 0, :, 3], audio[1, 1, :, 3]]))
    out = kandinsky6.output(config, (torch.zeros(2, 1, 4, 4, 192), tokens), x, None, cond)
    assert torch.equal(out["audio"], audio)


def test_a_video_only_model_holds_exactly_the_audio_branch_frozen_and_a_joint_one_trains_all(joint):
    config = Kandinsky6Config(preset="tiny")
    model = config.build()
    params = model.weights.init(random.key(0))
    x, t, cond = inputs(model, random.key(1))
    grads = grad.grad(lambda p: model.apply(p, x, t, cond).square().mean())(params)
    without = {name for name, g in grads.items() if g is None or not g.abs().max() > 0}
    frozen = {name for name in params if kandinsky6.owns_audio(name)}
    assert without == frozen | {kandinsky6.TOKEN_TYPES} == set(params) - model.weights.trained_names
    assert all(n.startswith(("audio_", "visual_transformer_blocks.")) for n in frozen)
    assert "audio_out_layer.out_layer.weight" in frozen and "out_layer.out_layer.weight" not in frozen

    joint_model, joint_params = joint
    x, t, cond = joint_sample(random.key(2))
    grads = grad.grad(lambda p: sum(v.square().mean() for v in joint_model.apply(p, x, t, cond).values()))(
        joint_params)
    assert set(joint_params) - joint_model.weights.trained_names == {kandinsky6.TOKEN_TYPES}
    assert all(g is not None and g.abs().max() > 0 for name, g in grads.items() if name != kandinsky6.TOKEN_TYPES)


@pytest.mark.parametrize("train_audio", [False, True])
def test_image_to_video_is_the_pipelines_call_with_a_reference_image(train_audio):
    """Kandinsky6TI2VAPipeline(image=...): the reference latents appended as a tail frame, in the condition mask, of
    token type 1 at frame 0's RoPE position; the video's own frames noised; the tail's prediction dropped. An
    image-to-video model trains the token-type table (a text-to-video one holds it frozen, the test above)."""
    model = Kandinsky6Config(preset="tiny", first_frame=True, train_audio=train_audio).build()
    params = model.weights.init(random.key(0))
    x, t, cond = joint_sample(random.key(1))
    given = torch.zeros_like(x["video"])
    given[:, :, 0] = random.normal(random.key(5), given[:, :, 0].shape)
    cond["first_frame_latents"] = given
    if not train_audio:
        x, t = x["video"], t["video"]
    v = model.apply(params, x, t, cond)
    module = Kandinsky6Transformer3DModel(**kandinsky6.TINY)
    module.load_state_dict(params)
    video = x["video"] if train_audio else x
    latents = torch.cat([video.permute(0, 2, 3, 4, 1), given[:, :, 0].permute(0, 2, 3, 1)[:, None]], dim=1)
    frames, size = video.shape[2], video.shape[3]
    mask = torch.zeros_like(latents[..., :1])
    mask[:, -1] = 1
    types = torch.zeros(2, frames + 1, dtype=torch.long)
    types[:, -1] = 1
    positions = (torch.tensor([0, 1, 2, 0]), torch.arange(size // 2), torch.arange(size // 2))
    audio = {"audio_hidden_states": x["audio"][:, 0].permute(0, 2, 1)} if train_audio else {}
    with torch.no_grad():
        out = module(hidden_states=torch.cat([latents, torch.zeros_like(latents), mask], dim=-1),
                     encoder_hidden_states=cond["text"], pooled_projections=cond["pooled"], timestep=t["video"]
                     if train_audio else t, visual_rope_pos=positions, encoder_attention_mask=cond["text_mask"].bool(),
                     visual_token_type_ids=types, return_dict=False, **audio)
    native = out[0][:, :-1].permute(0, 4, 1, 2, 3)
    torch.testing.assert_close(v["video"] if train_audio else v, native, rtol=0, atol=0)
    if train_audio:
        torch.testing.assert_close(v["audio"], out[1].permute(0, 2, 1)[:, None], rtol=0, atol=0)
    assert kandinsky6.TOKEN_TYPES in model.weights.trained_names
    out = (lambda p: model.apply(p, x, t, cond)["video"]) if train_audio else (lambda p: model.apply(p, x, t, cond))
    assert grad.grad(lambda p: out(p).square().mean())(params)[kandinsky6.TOKEN_TYPES].abs().max() > 0


def test_image_to_video_without_the_first_frame_is_a_one_line_error():
    config = Kandinsky6Config(preset="tiny", first_frame=True)
    batch = {"text": torch.zeros(1, 4, 32), "text_mask": torch.ones(1, 4), "latents": torch.zeros(1, 16, 2, 4, 4)}
    with pytest.raises(ValueError, match="first_frame_latent of data.kind='i2v' data") as error:
        config.family.conditioning.from_batch(config, batch)
    assert "\n" not in str(error.value)


def test_a_joint_lora_adapts_the_audio_branch_and_loads_with_the_transformers_load_lora_adapter(tmp_path):
    """With train_audio the audio branch gets adapters too; the PEFT file loads through the transformer's own
    ``load_lora_adapter`` and the module then computes fvx's joint LoRA model, audio included."""
    pytest.importorskip("peft")
    adapted = Kandinsky6Config(preset="tiny", train_audio=True, frozen_dtype="fp32",
                               lora=LoRAConfig(rank=4, alpha=8.0)).build()
    assert any(name.startswith("audio_") for name in adapted.weights.trained_names)
    base = adapted.weights.base(random.key(0))
    adapters = {name: random.normal(random.fold_in(random.key(1), i), tuple(p.shape)) * 0.1
                for i, (name, p) in enumerate(adapted.weights.initial(random.key(1)).items())}
    written = adapted.export.adapters(adapters, str(tmp_path), "peft")
    module = Kandinsky6Transformer3DModel(**kandinsky6.TINY)
    module.load_state_dict(base)
    module.load_lora_adapter(str(tmp_path), weight_name=written.files["transformer"].name, prefix="transformer")
    x, t, cond = joint_sample(random.key(2))
    native = pipeline_call(module, x, t, cond)
    v = adapted.apply(role.with_trained(base, adapters), x, t, cond)
    for name in ("video", "audio"):
        torch.testing.assert_close(v[name], native[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("audio, match", [
    ((1, 1, 10, 6), r"audio latents must be \[B, 1, 20, A\], got \[1, 1, 10, 6\]"),
    ((1, 1, 20, 2049), "audio RoPE holds 2048 positions; these audio latents have 2049"),
])
def test_audio_latents_that_do_not_fit_are_refused_in_one_line(joint, audio, match):
    model, _ = joint
    with pytest.raises(ValueError, match=match) as error:
        model.check_latents({"video": (1, 16, 3, 4, 4), "audio": audio})
    assert "\n" not in str(error.value)


def test_the_released_preset_is_diffusers_defaults_with_what_released_checkpoints_set():
    """diffusers' docstring: "Released checkpoints set `text_token_padding`, `ca_rope`, `cross_gates`, and
    `fix_modulation` to `True`"; its pipeline's image conditioning needs two token types."""
    signature = inspect.signature(Kandinsky6Transformer3DModel.__init__).parameters
    released = {"text_token_padding": True, "ca_rope": True, "cross_gates": True, "fix_modulation": True,
                "visual_token_type_num_embeddings": 2}
    preset = Kandinsky6Config(preset="kandinsky6").spec
    assert preset.kwargs == {**{name: p.default for name, p in signature.items() if name != "self"}, **released}
    docstring = " ".join(Kandinsky6Transformer3DModel.__doc__.split())
    assert ("Released checkpoints set `text_token_padding`, `ca_rope`, `cross_gates`, and `fix_modulation` to `True`"
            in docstring)
    assert preset.latents == hunyuan_video.LATENTS and preset.text_len == 1 + kandinsky6.TEXT_LEN


def test_an_export_is_a_kandinsky6_pipeline_folder_with_the_audio_branch_as_loaded(tmp_path):
    model = Kandinsky6Config(preset="tiny").build()
    params = model.weights.init(random.key(0))
    written = model.export.folder(params, str(tmp_path))
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "Kandinsky6TI2VAPipeline"
    loaded = Kandinsky6Transformer3DModel.from_pretrained(written.files["transformer"])
    assert all(torch.equal(p, params[name]) for name, p in loaded.state_dict().items() if name in params)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Kandinsky6TI2VAPipeline folder with every encoder and the audio VAE and vocoder (no transformer)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("kandinsky6")
    template = _PROMPT_TEMPLATE
    tokenizer = encoder_checks.template_cropping_tokenizer(
        qwen_tokenizer, {SPECIALS[0]: 0}, SPECIALS[1:], [template.format(p) for p in PROMPTS],
        template.split("{}")[0], _QWEN_CROP_START)
    clip_tokenizer = encoder_checks.tiny_clip_tokenizer(PROMPTS)
    Kandinsky6TI2VAPipeline(
        transformer=None, vae=encoder_checks.tiny_hunyuan_vae(), text_encoder=tiny_qwen(len(tokenizer)),
        tokenizer=tokenizer, text_encoder_2=encoder_checks.tiny_clip_text(len(clip_tokenizer)),
        tokenizer_2=clip_tokenizer, scheduler=FlowMatchEulerDiscreteScheduler(),
        audio_vae=MMAudioVAE(**TINY_AUDIO_VAE), vocoder=MMAudioVocoder(**TINY_VOCODER)).save_pretrained(path)
    return path


def test_text_is_the_pooled_row_then_the_pipelines_real_tokens_and_video_the_vaes_mean(folder):
    opened = kandinsky6.ENCODERS.open(folder, ["text", "video"])
    assert type(opened.pipe.tokenizer) is transformers.Qwen2Tokenizer
    rows = opened.encode_text(PROMPTS)
    embeds, pooled, mask, *_ = opened.pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False,
                                                         max_sequence_length=kandinsky6.TEXT_LEN)
    assert embeds.shape[1] == kandinsky6.TEXT_LEN and mask.sum(1).tolist() == [5, 3]  # the words and <|im_end|>
    encoder_checks.assert_pooled_row_then_tokens(rows, pooled, [e[m] for e, m in zip(embeds, mask)])
    encoder_checks.assert_video_latents_are_the_posterior_mean(kandinsky6.ENCODERS, folder, (3, 5, 32, 32),
                                                               (4, 2, 4, 4))


def test_the_first_frame_is_the_pipelines_encode_image_of_the_reference(folder, monkeypatch):
    """The pipeline's ``encode_image`` of a PIL reference at the video's size (its mean: the pipeline samples), as
    frame 0 of ``[C, t, h, w]``, the other latent frames zero."""
    from diffusers.pipelines.kandinsky6 import pipeline_kandinsky6_ti2va

    opened = kandinsky6.ENCODERS.open(folder, ["first_frame"])
    video = encoder_checks.random_clip((3, 9, 32, 32))
    rgb = ((video[:, 0] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    image = PIL.Image.fromarray(rgb.permute(1, 2, 0).numpy())
    pixels = rgb[:, None].float() / 127.5 - 1
    given = opened.encode_first_frame(torch.cat([pixels, video[:, 1:]], dim=1))
    monkeypatch.setattr(pipeline_kandinsky6_ti2va, "retrieve_latents", lambda out, generator: out.latent_dist.mode())
    expected = opened.pipe.encode_image(image, 32, 32, torch.device("cpu"), torch.float32)[0].permute(2, 0, 1)
    assert given.shape == (4, 3, 4, 4) and not given[:, 1:].any()
    torch.testing.assert_close(given[:, 0], expected, rtol=1e-5, atol=1e-5)


def test_audio_is_the_vaes_mean_of_the_mono_mix_at_the_pipelines_length(folder):
    """A 9-frame clip at 16 fps has 4500 samples at 8 kHz; the pipeline makes ceil(9 / 16 8000 / 32) = 141 audio
    latents for its 3 latent frames, so the mix is zero-padded to 141 x 32 samples before the VAE."""
    opened = kandinsky6.ENCODERS.open(folder, ["audio"])
    waveform = torch.rand(2, 4500, generator=torch.Generator().manual_seed(3)) * 2 - 1
    latents = opened.encode_audio(waveform, 8000)
    vae = opened.pipe.audio_vae
    count = math.ceil(((3 - 1) * 4 + 1) / 16 * vae.config.sample_rate / vae.latent_hop_length)
    mono = torch.nn.functional.pad(waveform.mean(0), (0, count * vae.latent_hop_length - 4500))
    assert latents.shape == (1, 20, count) == (1, 20, 141)
    torch.testing.assert_close(latents[0], vae.encode(mono[None]).latent_dist.mean[0])
    with pytest.raises(ValueError, match="takes 8000 Hz audio, got 16000 Hz: set data.preprocess.audio_rate=8000"):
        opened.encode_audio(waveform, 16000)


def test_the_audio_decoder_is_the_pipelines_decode_after_the_models_denormalize(folder):
    """The pipeline decodes the DiT's audio latents ``[B, A, 20]`` permuted to ``[B, 20, A]``, divided by the VAE's
    scaling factor, through the VAE to a mel spectrogram and the vocoder to ``[B, 1, S]``, keeping channel 0."""
    assert kandinsky6.AUDIO_SCALE == inspect.signature(MMAudioVAE.__init__).parameters["scaling_factor"].default
    model = Kandinsky6Config(preset="tiny", train_audio=True).build()
    dit = random.normal(random.key(4), (2, 1, 20, 7))
    clean = model.denormalize({"video": torch.zeros(2, 16, 1, 2, 2), "audio": dit})["audio"]
    decoder = Kandinsky6AudioDecoder(path=str(folder)).build()
    vae = MMAudioVAE.from_pretrained(folder / "audio_vae")
    vocoder = MMAudioVocoder.from_pretrained(folder / "vocoder")
    with torch.no_grad():
        mel = vae.decode(dit[:, 0] / vae.config.scaling_factor, return_dict=False)[0]
        expected = vocoder(mel, return_dict=False)[0][:, 0]
    waveforms = decoder.decode(clean)
    assert waveforms.shape == (2, 1, 7 * 32) and decoder.sample_rate == 8000
    torch.testing.assert_close(waveforms[:, 0], expected)


def test_a_folder_without_a_vocoder_is_a_one_line_error(folder, tmp_path):
    (tmp_path / "audio_vae").symlink_to(folder / "audio_vae")
    with pytest.raises(ValueError, match=r"no config.json in .*vocoder'; copy vocoder/ from the Kandinsky 6 base"):
        Kandinsky6AudioDecoder(path=str(tmp_path)).build()
    (tmp_path / "vocoder").symlink_to(folder / "audio_vae")
    with pytest.raises(ValueError, match="describes a MMAudioVAE, not an MMAudioVocoder"):
        Kandinsky6AudioDecoder(path=str(tmp_path)).build()
