"""Cosmos 3 Omni: its forward against the diffusers module called as Cosmos3OmniPipeline calls it (the packed layout
from the pipeline's own _prepare_text_segment and _prepare_vision_segment), the unconditional as the empty prompt,
the params it trains (all but those no velocity reads), a batch run sample by sample (so DMD2 trains it too), the
released preset, the export and a LoRA through the module's load_lora_adapter, the dry run's activation figures, its
encoders (the pipeline's tokenization as ids, the Wan 2.2 VAE's latents normalised as the pipeline's _encode_video)
and the toy world's words."""
import inspect
import json
import pathlib
import re
import sys
import types

import msgspec
import numpy
import pytest
import tokenizers
import torch
import transformers
from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, Cosmos3OmniTransformer, UniPCMultistepScheduler

from fvx import config as fconfig, run
from fvx.core import grad, random, role
from fvx.data import preprocess, toy_world
from fvx.distributed import memory
from fvx.training import config_checks
from fvx_methods.dmd2 import DMD2
from fvx_models import cosmos3, wan
from fvx_models.cosmos3 import Cosmos3Config
from fvx_models.lora import LoRAConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from activations import saved_per_group  # noqa: E402

IDS = [3.0, 7.0, 1.0, 9.0, 0.0, 0.0]  # a prompt of 4 token ids, padded to 6
TINY = Cosmos3Config(preset="tiny")


@pytest.fixture(scope="module")
def model():
    return TINY.build()


@pytest.fixture(scope="module")
def params(model):
    return model.weights.init(random.key(0))


def sample(key, tokens=4, frames=3, size=4):
    """Latents ``[1, 16, frames, size, size]``, a timestep and a prompt of ``tokens`` ids padded to 6."""
    x = random.normal(key, (1, 16, frames, size, size))
    mask = torch.zeros(1, len(IDS))
    mask[:, :tokens] = 1
    return x, torch.tensor([700.0]), {"text": torch.tensor([IDS])[..., None], "text_mask": mask}


def module_of(params):
    module = Cosmos3OmniTransformer(**cosmos3.TINY)
    module.load_state_dict(params)
    return module


def pipeline_call(module, x, t, ids, fps=24.0, image=False, condition_frames=None):
    """``module`` called as Cosmos3OmniPipeline's step calls it: the packed layout from its own
    ``_prepare_text_segment`` and ``_prepare_vision_segment`` (``image``: frame 0 a condition frame;
    ``condition_frames``: the video call's condition frame indexes), every noised patch at ``t``."""
    pipe = types.SimpleNamespace(transformer=module, vae_scale_factor_temporal=4)
    text = Cosmos3OmniPipeline._prepare_text_segment(pipe, ids, "cpu")
    vision = Cosmos3OmniPipeline._prepare_vision_segment(pipe, x, image, text["vision_start_temporal_offset"], fps,
                                                         text["und_len"], "cpu", condition_frames)
    with torch.no_grad():
        out = module(input_ids=text["input_ids"], text_indexes=text["text_indexes"],
                     position_ids=torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"]], dim=1),
                     und_len=text["und_len"], sequence_length=text["und_len"] + vision["num_vision_tokens"],
                     vision_tokens=[x], vision_token_shapes=vision["vision_token_shapes"],
                     vision_sequence_indexes=vision["vision_sequence_indexes"],
                     vision_mse_loss_indexes=vision["vision_mse_loss_indexes"],
                     vision_timesteps=torch.full((vision["num_noisy_vision_tokens"],), float(t[0])),
                     vision_noisy_frame_indexes=vision["vision_noisy_frame_indexes"], return_dict=False)
    return out[0][0]


@pytest.mark.parametrize("fps", [24.0, 16.0])
def test_the_forward_is_the_pipelines_call_on_the_prompts_real_tokens(params, fps):
    model = Cosmos3Config(preset="tiny", fps=fps).build()
    x, t, cond = sample(random.key(1))
    v = model.apply(params, x, t, cond)
    torch.testing.assert_close(v, pipeline_call(module_of(params), x, t, [3, 7, 1, 9], fps), rtol=0, atol=0)


def test_image_to_video_is_the_pipelines_call_with_frame_0_the_given_one(params):
    """The pipeline's image call: latent frame 0 the clean given latents, a condition frame (no timestep, no
    prediction); fvx's velocity there is the exact one toward it, ``(x_t - x_first) / sigma``; its other frames the
    module's."""
    model = Cosmos3Config(preset="tiny", first_frame=True).build()
    x, t, cond = sample(random.key(8))
    given = torch.zeros_like(x)
    given[:, :, 0] = random.normal(random.key(9), given[:, :, 0].shape)
    v = model.apply(params, x, t, {**cond, "first_frame_latents": given})
    latents = torch.cat([given[:, :, :1], x[:, :, 1:]], dim=2)
    native = pipeline_call(module_of(params), latents, t, [3, 7, 1, 9], image=True)
    torch.testing.assert_close(v[:, :, 1:], native[:, :, 1:], rtol=0, atol=0)
    torch.testing.assert_close(v[:, :, :1], (x[:, :, :1] - given[:, :, :1]) / 0.7)
    assert model.cond["first_frame_latents"] == (16, "T", "H", "W")


def test_video_to_video_is_the_pipelines_video_call_with_the_clips_first_frames_given(params):
    """The pipeline's video call (``condition_frame_indexes_vision`` [0, 1]): the first 2 latent frames the clip's
    own, normalised, clean condition frames; fvx's velocity there the exact one toward them; the rest the module's. The
    cond is the batch's own latents, kept by the unconditional."""
    model = Cosmos3Config(preset="tiny", given_frames=2).build()
    x, t, cond = sample(random.key(8), frames=4)
    clip = random.normal(random.key(9), x.shape)
    batch = model.batch({"latents": clip, "text": cond["text"], "text_mask": cond["text_mask"]})
    assert torch.equal(batch["cond"]["given_latents"], clip) and model.cond["given_latents"] == (16, "T", "H", "W")
    v = model.apply(params, x, t, batch["cond"])
    given = model.latents.normalize(clip[:, :, :2])
    native = pipeline_call(module_of(params), torch.cat([given, x[:, :, 2:]], dim=2), t, [3, 7, 1, 9],
                           condition_frames=[0, 1])
    torch.testing.assert_close(v[:, :, 2:], native[:, :, 2:], rtol=0, atol=0)
    torch.testing.assert_close(v[:, :, :2], (x[:, :, :2] - given) / 0.7)
    assert torch.equal(model.uncond(batch["cond"], "zero")["given_latents"], clip)


@pytest.mark.parametrize("override, match", [
    (["models.student.given_frames=1", "models.student.first_frame=true"], "give an image .* not both"),
    (["models.student.given_frames=4"], "given_frames=4 leaves none of these latents' 4 frames to make"),
])
def test_bad_video_to_video_settings_are_one_line_errors(override, match, tmp_path, capsys):
    experiment = str(ROOT / "experiments" / "finetune_cosmos3.py")
    code = run.main([experiment, "--out", str(tmp_path / "run"), "--steps", "1", *override])
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(error) == 1 and re.search(match, error[0]) and not (tmp_path / "run").exists()


def test_the_zero_unconditional_is_the_empty_prompt(model, params):
    x, t, cond = sample(random.key(2))
    v = model.apply(params, x, t, model.uncond(cond, "zero"))
    torch.testing.assert_close(v, pipeline_call(module_of(params), x, t, []), rtol=0, atol=0)


def test_exactly_the_params_no_velocity_reads_are_held_frozen(model, params):
    """The language-model head, the text's final norm and the last layer's text path after its keys and values get
    no gradient from the video's velocity; everything else trains (the text's own layers through the keys and values
    the video attends to)."""
    x, t, cond = sample(random.key(3))
    grads = grad.grad(lambda p: model.apply(p, x, t, cond).square().mean())(params)
    without = {name for name, g in grads.items() if g is None or not g.abs().max() > 0}
    assert without == set(params) - model.weights.trained_names == cosmos3.unused(TINY)
    assert {"lm_head.weight", "norm.weight", "layers.1.mlp.up_proj.weight"} <= without
    assert "layers.0.mlp.up_proj.weight" not in without and "layers.1.self_attn.to_k.weight" not in without


def test_remat_gives_the_same_gradients(model, params):
    """Its layers hand the checkpoint function their bound ``__call__``, which fvx's remat takes as the layer."""
    x, t, cond = sample(random.key(7))
    loss = lambda m: lambda p: m.apply(p, x, t, cond).square().mean()  # noqa: E731
    plain = grad.grad(loss(model))(params)
    recomputed = grad.grad(loss(Cosmos3Config(preset="tiny", remat=True).build()))(params)
    assert all(torch.equal(plain[name], recomputed[name]) for name in plain if plain[name] is not None)


def test_a_batch_runs_sample_by_sample_and_text_that_is_not_ids_is_a_one_line_error(model, params):
    """The DiT takes one packed sequence a call, so a batch of two prompts of other lengths is two calls."""
    x, t, cond = sample(random.key(4))
    other = sample(random.key(10), tokens=6)
    two = [torch.cat(pair) for pair in ((x, other[0]), (t, torch.tensor([300.0])))]
    v = model.apply(params, *two, {name: torch.cat([cond[name], other[2][name]]) for name in cond})
    torch.testing.assert_close(v[:1], model.apply(params, x, t, cond), rtol=0, atol=0)
    torch.testing.assert_close(v[1:], model.apply(params, other[0], torch.tensor([300.0]), other[2]), rtol=0, atol=0)
    batch = {"text": torch.zeros(1, 6, 32), "text_mask": torch.ones(1, 6), "latents": x}
    with pytest.raises(ValueError, match=r"text_embedding \[6, 32\] must be \[L, 1\], the prompt's token ids"):
        TINY.family.conditioning.from_batch(TINY, batch)


def test_dmd2_trains_it_on_batches_of_prompts_of_other_lengths(model):
    """A method that calls its roles on whole batches (DMD2's generator, critic and teacher) runs it sample by sample."""
    x, t, cond = sample(random.key(11))
    other = sample(random.key(12), tokens=6)
    batch = {"latents": torch.cat([x, other[0]]), "sample_index": torch.arange(2),
             "cond": {name: torch.cat([cond[name], other[2][name]]) for name in cond}}
    program = DMD2(generator_update_interval=1).build({"student": model, "critic": model, "teacher": model},
                                                      total_steps=1)
    program.check(batch)
    state, frozen = program.init(random.key(0)), program.frozen(random.key(0))
    before = state.roles["student"].params["proj_out.weight"].clone()
    state, metrics = program.step_(state, frozen, batch)
    assert torch.isfinite(metrics["generator_loss"])
    assert not torch.equal(before, state.roles["student"].params["proj_out.weight"])


def test_cfg_dropout_is_refused_in_one_line(model):
    loaded = fconfig.load_experiment(ROOT / "experiments" / "finetune_cosmos3.py")
    config = msgspec.structs.replace(loaded, data=msgspec.structs.replace(loaded.data, cfg_rate=0.1))
    with pytest.raises(fconfig.ConfigError, match=r"data.cfg_rate = 0.1: models.student \(cosmos3:tiny\) takes no CFG "
                       r"dropout \(its prompt is token ids") as error:
        config_checks.check_cfg_dropout(config, {"student": model})
    assert "\n" not in str(error.value)


def test_the_released_preset_is_diffusers_defaults():
    signature = inspect.signature(Cosmos3OmniTransformer.__init__).parameters
    defaults = {name: p.default for name, p in signature.items() if name not in ("self", "dtype")}
    preset = Cosmos3Config(preset="cosmos3-omni").spec
    assert preset.kwargs == {**defaults, "rope_axes_dim": (24, 20, 20)}  # the class's default when None
    assert preset.latents == wan.WAN22_VAE


def test_an_export_loads_with_from_pretrained_and_a_lora_with_load_lora_adapter(model, params, tmp_path):
    written = model.export.folder(params, str(tmp_path / "full"))
    assert json.loads((tmp_path / "full" / "model_index.json").read_text())["_class_name"] == "Cosmos3OmniPipeline"
    loaded = Cosmos3OmniTransformer.from_pretrained(written.files["transformer"])
    assert all(torch.equal(p, params[name]) for name, p in loaded.state_dict().items())

    pytest.importorskip("peft")
    adapted = Cosmos3Config(preset="tiny", frozen_dtype="fp32", lora=LoRAConfig(rank=4, alpha=8.0)).build()
    base = adapted.weights.base(random.key(0))
    adapters = {name: random.normal(random.fold_in(random.key(1), i), tuple(p.shape)) * 0.1
                for i, (name, p) in enumerate(adapted.weights.initial(random.key(1)).items())}
    written = adapted.export.adapters(adapters, str(tmp_path / "lora"), "peft")
    module = module_of(base)
    module.load_lora_adapter(str(tmp_path / "lora"), weight_name=written.files["transformer"].name,
                             prefix="transformer")
    x, t, cond = sample(random.key(5))
    torch.testing.assert_close(adapted.apply(role.with_trained(base, adapters), x, t, cond),
                               pipeline_call(module, x, t, [3, 7, 1, 9]), rtol=1e-5, atol=1e-5)


def test_dry_run_activation_figures_match_what_a_layer_saves():
    """Per video token, the growth from 16 x 16 to 32 x 32 latents (4 frames, patched 2 x 2) of what the first layer
    saves (saved-tensor hooks, bf16), against the family's figures."""
    config = Cosmos3Config(preset="tiny")
    spec = Cosmos3Config(preset="tiny", compute_dtype="bf16").build().memory_spec()
    saved = [saved_per_group(config, *sample(random.key(6), tokens=6, frames=4, size=size))["layers"]
             for size in (16, 32)]
    tokens = [4 * (size // 2) ** 2 for size in (16, 32)]
    measured = (sum(saved[1][:2]) - sum(saved[0][:2])) / (tokens[1] - tokens[0])
    group = next(g for g in spec.groups if g.name == "layers")
    estimate = memory.block_activation_bytes(group, 1, compute_bytes=2)
    assert abs(estimate - measured) <= 0.05 * measured, (estimate, measured)


# ----------------------------------------------------------------------------------------------------- encoders

WORDS = ["red", "bars", "moving", "left", "You", "are", "a", "helpful", "assistant", "who", "will", "generate",
         "videos", "from", "give", "prompt.", "system", "user", "assistant"]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<unk>"]
CHAT = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer of the template's and a prompt's words, with Qwen's chat markers and vision start."""
    vocab = {word: i for i, word in enumerate(dict.fromkeys(SPECIALS + WORDS))}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<|im_end|>", unk_token="<unk>",
                                                chat_template=CHAT)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Cosmos3OmniPipeline folder: the tokenizer and a 48-channel Wan VAE with Wan 2.2's statistics."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("cosmos3")
    vae = AutoencoderKLWan(base_dim=8, z_dim=48, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                           latents_mean=list(wan.WAN22_LATENTS_MEAN), latents_std=list(wan.WAN22_LATENTS_STD))
    Cosmos3OmniPipeline(transformer=None, text_tokenizer=tiny_tokenizer(), vae=vae,
                        scheduler=UniPCMultistepScheduler(), enable_safety_checker=False).save_pretrained(path)
    return path


def test_text_is_the_pipelines_tokenization_of_the_prompt_stating_its_clip(folder):
    """The pipeline's default prompt augmentation: a video's prompt gets its duration and resolution sentences (an
    image's its resolution and the image system prompt), a negative prompt their inverses; the ids are
    ``tokenize_prompt``'s for that clip."""
    opened = cosmos3.ENCODERS.open(folder, ["text"])
    prompt, tokenizer = "red bars moving left", opened.pipe.text_tokenizer
    clips = [preprocess.Clip(93, 24.0, 704, 1280), preprocess.Clip(1, 24.0, 512, 512),
             preprocess.Clip(93, 24.0, 704, 1280, negative=True)]
    rows = opened.encode_text([prompt] * 3, clips)
    video, _ = opened.pipe.tokenize_prompt(prompt, num_frames=93, height=704, width=1280, fps=24.0)
    image, _ = opened.pipe.tokenize_prompt(prompt, num_frames=1, height=512, width=512, fps=24.0)
    _, negative = opened.pipe.tokenize_prompt("", negative_prompt=prompt, num_frames=93, height=704, width=1280,
                                              fps=24.0)
    for row, ids in zip(rows, (video, image, negative)):
        assert row.dtype == torch.float32 and row[:, 0].long().tolist() == ids
        assert ids[-2:] == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|vision_start|>")]
    bare, _ = opened.pipe.tokenize_prompt(prompt, add_resolution_template=False, add_duration_template=False)
    assert len(video) > len(bare) and negative not in (video, image)  # the sentences appended; their inverses
    assert "generate videos" in tokenizer.decode(video) and "generate videos" not in tokenizer.decode(image)
    with pytest.raises(ValueError, match="states each prompt's clip .* encode prompts with their clips") as error:
        opened.encode_text([prompt])
    assert "\n" not in str(error.value)


def test_encode_prompts_states_the_cut_clip_and_its_inverse_for_negative_prompts(folder, tmp_path):
    """encode-prompts (validation prompts, a negative prompt) states the clip data.preprocess cuts: 33 frames at
    16 fps of 256 x 320 here; --negative the inverse sentences, as the pipeline writes its negative prompt."""
    (tmp_path / "prompts.txt").write_text("a cat\n")
    experiment, shape = str(ROOT / "experiments" / "finetune_cosmos3.py"), dict(num_frames=33, height=256, width=320)
    overrides = [f"models.student.path={folder}", "data.world=null", "data.text_len=128",
                 "data.preprocess.num_frames=35", "data.preprocess.train_fps=16", "data.preprocess.max_height=256",
                 "data.preprocess.max_width=320"]
    pipe = cosmos3.ENCODERS.open(folder, ["text"]).pipe
    for flags, ids in (([], pipe.tokenize_prompt("a cat", fps=16.0, **shape)[0]),
                       (["--negative"], pipe.tokenize_prompt("", negative_prompt="a cat", fps=16.0, **shape)[1])):
        out = tmp_path / f"cond{len(flags)}.safetensors"
        assert run.main(["encode-prompts", experiment, str(tmp_path / "prompts.txt"), "--out", str(out), *flags,
                         *overrides]) == 0
        cond, _ = TINY.build().load_cond(str(out))
        assert cond["text"][0, cond["text_mask"][0].bool(), 0].long().tolist() == ids


def test_video_latents_normalised_and_the_first_frame_are_the_pipelines_encode_video(folder):
    """The clip's latents, normalised by the latent space, and image-to-video's frame 0: the pipeline encodes the image
    held still for the clip and keeps latent frame 0."""
    opened = cosmos3.ENCODERS.open(folder, ["video", "first_frame"])
    video = torch.rand(1, 3, 5, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    raw = opened.encode_video(video[0])
    torch.testing.assert_close(wan.WAN22_VAE.normalize(raw[None]), opened.pipe._encode_video(video),
                               rtol=1e-5, atol=1e-5)
    still = video[:, :, :1].expand(-1, -1, 5, -1, -1)
    torch.testing.assert_close(opened.encode_first_frame(video[0])[:, 0], opened.pipe._encode_video(still)[0, :, 0],
                               rtol=1e-5, atol=1e-5)


def test_video_to_videos_given_frames_are_the_pipelines_encoding_of_the_repeat_padded_video(folder):
    """The pipeline's video call encodes the given video's first 5 frames (2 latent frames) with the last repeated to
    the clip's 9; the Wan 2.2 VAE is causal in time, so those 2 latent frames are the whole clip's first 2, which the
    cond holds (the batch's latents)."""
    opened = cosmos3.ENCODERS.open(folder, ["video"])
    clip = torch.rand(1, 3, 9, 32, 32, generator=torch.Generator().manual_seed(2)) * 2 - 1
    padded = torch.cat([clip[:, :, :5], clip[:, :, 4:5].expand(-1, -1, 4, -1, -1)], dim=2)
    own = wan.WAN22_VAE.normalize(opened.encode_video(clip[0])[None])
    torch.testing.assert_close(own[:, :, :2], opened.pipe._encode_video(padded)[:, :, :2], rtol=1e-5, atol=1e-5)


def test_the_toy_worlds_words_are_its_captions_token_ids():
    config = toy_world.WorldConfig(text="words")
    texts = toy_world.prompt_texts(config)
    assert len(texts) == len(config.prompts)
    assert texts[1].shape == (4, 1) and numpy.array_equal(
        texts[1][:, 0], [toy_world.WORDS.index(w) for w in toy_world.caption(config, *config.prompts[1]).split()])
    assert max(int(t.max()) for t in texts) < Cosmos3Config(preset="world").spec.kwargs["vocab_size"]
