"""Mochi 1: a flow DiT on an inverted clock, its joint attention as one masked call. Its forward against the diffusers
module (diffusers' own per-sample attention) as MochiPipeline calls it is the family test's
(tests/fvx_models/test_families.py, case "mochi", which also compiles it whole into one graph); its LoRA loads with
MochiPipeline (tests/fvx_models/test_lora.py). Here: Euler on fvx's levels is the pipeline's inverted-sigma scheduler
stepping, a fully padded-but-one prompt attends as the valid tokens alone, its encoders, the released preset and the
exported folder."""
import inspect
import json

import torch
import transformers
from diffusers import (AutoencoderKLMochi, FlowMatchEulerDiscreteScheduler, MochiPipeline,
                       MochiTransformer3DModel)

import encoder_checks
from fvx.core import flow, random
from fvx_models import mochi
from fvx_models.mochi import MochiConfig
from tiny_wan_pipeline import WORDS, tiny_t5_tokenizer

from family_cases import CASES, inputs, native_modules  # noqa: E402


def test_euler_on_fvx_levels_is_the_pipelines_inverted_scheduler():
    """MochiPipeline's loop (its scheduler with ``invert_sigmas``, the DiT at the scheduler's timestep) and fvx's Euler
    on the same levels land on the same latents from the same noise."""
    case = CASES["mochi"]
    model = case.config.build()
    params = model.weights.init(random.key(0))
    noise, _, cond = inputs(model, random.key(3), batch=2)
    scheduler = FlowMatchEulerDiscreteScheduler(invert_sigmas=True)
    levels = torch.linspace(1.0, 0.1, 6)
    scheduler.set_timesteps(sigmas=levels.numpy())  # as the pipeline passes them; the scheduler holds 1 - sigma
    ours = flow.euler_sample(model.apply, params, noise, levels, cond=cond)

    (transformer,) = native_modules(case, params).values()
    latents = noise.clone()
    for t in scheduler.timesteps:
        out = transformer(hidden_states=latents, encoder_hidden_states=cond["text"], timestep=t.expand(2),
                          encoder_attention_mask=cond["text_mask"], return_dict=False)[0]
        latents = scheduler.step(out, t, latents, return_dict=False)[0]
    torch.testing.assert_close(ours, latents, rtol=0, atol=1e-4)


def test_padded_text_tokens_change_nothing():
    """What the masked joint attention reads of the text is its valid tokens: other values in the padded rows leave
    the velocity as it is."""
    model = MochiConfig(preset="tiny").build()
    params = model.weights.init(random.key(0))
    x, t, cond = inputs(model, random.key(4))
    padded = cond["text_mask"] == 0
    noisy = {**cond, "text": torch.where(padded[..., None], torch.randn_like(cond["text"]) * 10, cond["text"])}
    assert padded.any()
    torch.testing.assert_close(model.apply(params, x, t, noisy), model.apply(params, x, t, cond), rtol=0, atol=1e-5)


def test_a_folder_encodes_t5_under_its_mask_and_the_vaes_mean(tmp_path):
    torch.manual_seed(0)
    text = transformers.T5EncoderModel(transformers.T5Config(vocab_size=len(WORDS), d_model=16, d_kv=4, d_ff=32,
                                                             num_layers=2, num_heads=4))
    vae = AutoencoderKLMochi(encoder_block_out_channels=(32, 32, 32, 32), decoder_block_out_channels=(32, 32, 32, 32),
                             latent_channels=12, layers_per_block=(1, 1, 1, 1, 1),
                             add_attention_block=(False, False, False, False, False))
    MochiPipeline(tokenizer=tiny_t5_tokenizer(), text_encoder=text, vae=vae, transformer=None,
                  scheduler=FlowMatchEulerDiscreteScheduler(invert_sigmas=True)).save_pretrained(tmp_path)
    opened = mochi.ENCODERS.open(tmp_path, ["text", "video"])
    prompts = ["red bars moving left", "a cat"]
    rows = opened.encode_text(prompts)
    embeds, mask = opened.pipe._get_t5_prompt_embeds(prompts, max_sequence_length=256)
    assert [len(r) for r in rows] == mask.sum(1).tolist() == [5, 3]
    assert all(torch.equal(r, e[:len(r)]) for r, e in zip(rows, embeds))
    video = encoder_checks.random_clip((3, 7, 16, 16))  # 6 frames a latent frame: 1 + 6
    assert torch.equal(opened.encode_video(video), opened.pipe.vae.encode(video[None]).latent_dist.mode()[0])


def test_the_released_preset_is_mochi_1_and_its_vae_statistics():
    preset = MochiConfig(preset="mochi-1").spec
    signature = [name for name in inspect.signature(MochiTransformer3DModel.__init__).parameters if name != "self"]
    assert sorted(preset.kwargs) == sorted(signature)
    defaults = {name: p.default for name, p in inspect.signature(MochiTransformer3DModel.__init__).parameters.items()}
    assert all(preset.kwargs[name] == defaults[name] for name in preset.kwargs)  # genmo's, diffusers' defaults
    vae = {name: p.default for name, p in inspect.signature(AutoencoderKLMochi.__init__).parameters.items()}
    assert (preset.latents.mean, preset.latents.std) == (vae["latents_mean"], vae["latents_std"])
    assert preset.latents.vae_stride == (6, 8, 8) and vae["scaling_factor"] == 1.0


def test_an_export_is_a_mochi_pipeline_folder_with_its_inverted_scheduler(tmp_path):
    model = MochiConfig(preset="tiny").build()
    params = model.weights.init(random.key(0))
    written = model.export.folder(params, str(tmp_path))
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "MochiPipeline" and index["vae"] == ["diffusers", "AutoencoderKLMochi"]
    assert FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path / "scheduler").config.invert_sigmas
    loaded = MochiTransformer3DModel.from_pretrained(written.files["transformer"])
    assert all(torch.equal(p, params[name]) for name, p in loaded.state_dict().items() if name in params)
