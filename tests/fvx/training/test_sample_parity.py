"""The ``sample`` command's many-step sampler against each family's diffusers pipeline: the same tiny random DiT
(exported by fvx, loaded back with ``from_pretrained``), the same initial latents, prompt embeddings, steps,
scheduler settings and guidance give the same latents (CPU fp32). The fvx side is exactly what ``sample`` runs for a
fine-tuned model: ``one_role.many_step_samplers(model)`` at a ``ValidationConfig``, drawn by ``sampling.draw`` with
the noise and keys of ``sampling.noise_and_keys`` and ``--negative-prompt``'s unconditional cond. Each pipeline is
built with only its transformer and scheduler (no text encoder: embeddings go in as ``prompt_embeds``) and returns
``output_type="latent"``. Where a pipeline differs by construction (HunyuanVideo's and LTX's own sigma spacing,
HunyuanVideo's embedded guidance, Cosmos 2.5's UniPC and ``cond + g (cond - uncond)``), the test names the settings
under which the two agree; /work/notes/sample_parity.md (docs/design.md) has the details."""
import math
import types

import numpy as np
import pytest
import torch
from diffusers import (AutoencoderKLWan, CosmosTransformer3DModel, FlowMatchEulerDiscreteScheduler,
                       HunyuanVideoPipeline, HunyuanVideoTransformer3DModel, Kandinsky5T2VPipeline,
                       Kandinsky5Transformer3DModel, LTXPipeline, LTXVideoTransformer3DModel,
                       UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel)
from diffusers.pipelines.cosmos.pipeline_cosmos2_5_predict import Cosmos2_5_PredictBasePipeline

from fvx.core import flow, random
from fvx.training import sampling
from fvx.training.validation import ValidationConfig
from fvx_methods.library import one_role
from fvx_models import wan_vae
from fvx_models.cosmos import CosmosConfig
from fvx_models.hunyuan_video import HunyuanVideoConfig
from fvx_models.kandinsky5 import Kandinsky5Config
from fvx_models.ltx_video import LTXVideoConfig
from fvx_models.wan import WanConfig

from family_cases import inputs  # noqa: E402

STEPS, SHIFT, GUIDANCE = 3, 3.0, 4.0
SEEDS = (0, 1)  # two videos: a batch of two prompts, the second's text padded
TOL = dict(rtol=1e-4, atol=1e-4)


def loaded(config, cls, tmp_path_factory):
    """(fvx model, its params, the diffusers transformer fvx's export of them loads as)."""
    model = config.build()
    params = model.init(random.key(0))
    folder = tmp_path_factory.mktemp(model.name)
    model.export(params, str(folder))
    module = cls.from_pretrained(str(folder), subfolder="transformer").eval()
    assert module.dtype == torch.float32
    return model, params, module


def prompts(model, frames=2, size=4, batch=len(SEEDS)):
    """(noise [N, C, T, H, W] and sampler keys as ``sample`` draws them for SEEDS, the prompts' cond [N, ...] (the
    last row's text padded), a one-row negative-prompt cond)."""
    shape = (model.latents.channels, frames, size, size)
    noise, keys = sampling.noise_and_keys(SEEDS[:batch], shape)
    _, _, cond = inputs(model, random.key(1), batch=batch, frames=frames, size=size)
    _, _, negative = inputs(model, random.key(2), batch=1, frames=frames, size=size)
    negative = {name: t for name, t in negative.items() if name not in ("first_frame_latents", "image_embeds")}
    return noise, keys, cond, negative


def fvx_sample(model, params, noise, keys, cond, negative, *, steps=STEPS, shift=SHIFT, guidance=GUIDANCE,
               schedule="diffusers"):
    """What ``sample --steps --shift --guidance --schedule --negative-prompt`` draws for a fine-tuned model."""
    vcfg = ValidationConfig(num_steps=steps, flow_shift=shift, guidance_scale=guidance, schedule=schedule)
    sampler = one_role.many_step_samplers(model)(params, False, vcfg)[0]
    assert sampler.guided and sampler.sampler == "ode" and sampler.draw is None
    uncond = lambda c: model.uncond(c, "negative_prompt", negative)  # noqa: E731  (sampling._uncond's)
    return sampling.draw(sampler, noise, cond, keys, uncond, vcfg.guidance_scale)


def rows(negative, count):
    return {name: t.expand(count, *t.shape[1:]) for name, t in negative.items()}


def masked(cond):
    """The text as the family's encoder hands it to the pipeline: zeros after the valid tokens."""
    return cond["text"] * cond["text_mask"][..., None]


def quiet(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ------------------------------------------------------------------------------------------------------------- Wan


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return loaded(WanConfig(preset="tiny"), WanTransformer3DModel, tmp_path_factory)


def wan_pipeline_latents(module, noise, cond, negative, guidance, steps=STEPS, shift=SHIFT):
    """WanPipeline: no VAE (its scale factors default to 4 and 8), latents in the DiT's scale as they are."""
    pipe = quiet(WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=module,
                             scheduler=FlowMatchEulerDiscreteScheduler(shift=shift)))
    _, _, frames, height, width = noise.shape
    with torch.no_grad():
        return pipe(prompt_embeds=masked(cond), negative_prompt_embeds=masked(rows(negative, noise.shape[0])),
                    latents=noise.clone(), num_inference_steps=steps, guidance_scale=guidance,
                    height=8 * height, width=8 * width, num_frames=4 * (frames - 1) + 1, output_type="latent",
                    return_dict=False)[0]


@pytest.mark.parametrize("guidance", [GUIDANCE, 1.0])
def test_wan_t2v_equals_wan_pipeline(wan, guidance):
    model, params, module = wan
    noise, keys, cond, negative = prompts(model)
    want = wan_pipeline_latents(module, noise, cond, negative, guidance)
    got = fvx_sample(model, params, noise, keys, cond, negative, guidance=guidance)
    assert (got - noise).abs().max() > 0.1  # the steps moved the latents
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_diffusers_schedule_is_the_pipelines_and_fvxs_default_is_not(wan):
    """``--schedule diffusers`` is what makes the match: the default ``fvx`` levels (evenly spaced, shifted once)
    differ from ``FlowMatchEulerDiscreteScheduler.set_timesteps`` (spaced to its smallest level, shifted twice at the
    low end), and so do the latents."""
    model, params, module = wan
    noise, keys, cond, negative = prompts(model)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=SHIFT)
    scheduler.set_timesteps(STEPS)
    assert torch.equal(flow.scheduler_sigmas(SHIFT, STEPS), scheduler.sigmas[:-1])
    want = wan_pipeline_latents(module, noise, cond, negative, GUIDANCE)
    other = fvx_sample(model, params, noise, keys, cond, negative, schedule="fvx")
    assert (other - want).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------------- HunyuanVideo


@pytest.fixture(scope="module")
def hunyuan(tmp_path_factory):
    return loaded(HunyuanVideoConfig(preset="tiny"), HunyuanVideoTransformer3DModel, tmp_path_factory)


def hunyuan_pipeline_latents(module, noise, cond, negative, *, true_cfg_scale, embedded, sigmas=None):
    """HunyuanVideoPipeline: ``guidance_scale`` is the distilled guidance the DiT embeds (``g * 1000``), classifier-
    free guidance is ``true_cfg_scale`` with the negative embeddings; its sigmas are its own (``sigmas=None``:
    ``linspace(1, 0, K + 1)[:-1]``, then the scheduler's shift)."""
    pipe = quiet(HunyuanVideoPipeline(text_encoder=None, tokenizer=None, transformer=module, vae=None,
                                      scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT), text_encoder_2=None,
                                      tokenizer_2=None))
    _, _, frames, height, width = noise.shape
    neg = rows(negative, noise.shape[0])
    with torch.no_grad():
        return pipe(prompt_embeds=cond["text"], prompt_attention_mask=cond["text_mask"],
                    pooled_prompt_embeds=cond["pooled"], negative_prompt_embeds=neg["text"],
                    negative_prompt_attention_mask=neg["text_mask"], negative_pooled_prompt_embeds=neg["pooled"],
                    latents=noise.clone(), num_inference_steps=STEPS, sigmas=sigmas, guidance_scale=embedded,
                    true_cfg_scale=true_cfg_scale, height=8 * height, width=8 * width,
                    num_frames=4 * (frames - 1) + 1, output_type="latent", return_dict=False)[0]


@pytest.mark.parametrize("guidance", [GUIDANCE, 1.0])
def test_hunyuan_video_equals_its_pipeline_with_true_cfg_on_fvx_levels(hunyuan, guidance):
    """The pipeline's own levels are fvx's default schedule (``--schedule fvx``); its ``guidance_scale`` must be the
    model's ``embedded_guidance`` (6) and fvx's ``--guidance`` is its ``true_cfg_scale``."""
    model, params, module = hunyuan
    noise, keys, cond, negative = prompts(model)
    embedded = HunyuanVideoConfig(preset="tiny").embedded_guidance
    want = hunyuan_pipeline_latents(module, noise, cond, negative, true_cfg_scale=guidance, embedded=embedded)
    got = fvx_sample(model, params, noise, keys, cond, negative, guidance=guidance, schedule="fvx")
    assert (got - noise).abs().max() > 0.1
    torch.testing.assert_close(got, want, **TOL)


def test_hunyuan_video_with_the_diffusers_schedule_given_as_the_pipelines_sigmas(hunyuan):
    """``--schedule diffusers`` matches when the pipeline is handed the scheduler's default levels before its shift
    (``linspace(1, shift(1 / 1000), K)``), and a different embedded guidance gives different latents (it is not
    classifier-free guidance)."""
    model, params, module = hunyuan
    noise, keys, cond, negative = prompts(model)
    low = float(flow.training_sigmas(SHIFT)[-1])
    sigmas = list(np.linspace(1.0, low, STEPS))
    want = hunyuan_pipeline_latents(module, noise, cond, negative, true_cfg_scale=GUIDANCE, embedded=6.0,
                                    sigmas=sigmas)
    got = fvx_sample(model, params, noise, keys, cond, negative, schedule="diffusers")
    torch.testing.assert_close(got, want, **TOL)
    other = hunyuan_pipeline_latents(module, noise, cond, negative, true_cfg_scale=GUIDANCE, embedded=3.0,
                                     sigmas=sigmas)
    assert (other - want).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------------------- Cosmos


class NoSafetyChecker:
    """The pipeline moves its checker to the device; text-to-world with embeddings checks nothing else."""

    def to(self, *args, **kwargs):
        return self


@pytest.fixture(scope="module")
def cosmos(tmp_path_factory):
    return loaded(CosmosConfig(preset="tiny"), CosmosTransformer3DModel, tmp_path_factory)


def cosmos_pipeline_latents(module, noise, cond, negative, guidance, scheduler):
    """Cosmos2_5_PredictBasePipeline, text to world: the tiny Wan VAE (its ``__init__`` reads the VAE's latent
    statistics and strides; nothing is encoded or decoded), ``guidance_scale`` its ``cond + g (cond - uncond)``."""
    vae = AutoencoderKLWan(**wan_vae.PRESETS["tiny"])
    pipe = quiet(Cosmos2_5_PredictBasePipeline(text_encoder=None, tokenizer=None, transformer=module, vae=vae,
                                               scheduler=scheduler, safety_checker=NoSafetyChecker()))
    _, _, frames, height, width = noise.shape
    with torch.no_grad():
        return pipe(prompt_embeds=cond["text"], negative_prompt_embeds=rows(negative, noise.shape[0])["text"],
                    latents=noise.clone(), num_inference_steps=STEPS, guidance_scale=guidance,
                    height=pipe.vae_scale_factor_spatial * height, width=pipe.vae_scale_factor_spatial * width,
                    num_frames=pipe.vae_scale_factor_temporal * (frames - 1) + 1, output_type="latent",
                    return_dict=False)[0]


@pytest.mark.parametrize("guidance", [GUIDANCE, 1.0])
def test_cosmos_equals_its_pipeline_stepped_by_flow_match_euler(cosmos, guidance):
    """The pipeline's loop reads only ``scheduler.sigmas`` and ``scheduler.step``, so it runs on
    ``FlowMatchEulerDiscreteScheduler``; its guidance ``g_p`` is fvx's ``g = g_p + 1`` (none at ``g_p <= 1``)."""
    model, params, module = cosmos
    noise, keys, cond, negative = prompts(model)
    want = cosmos_pipeline_latents(module, noise, cond, negative, guidance - 1.0,
                                   FlowMatchEulerDiscreteScheduler(shift=SHIFT))
    got = fvx_sample(model, params, noise, keys, cond, negative, guidance=guidance)
    assert (got - noise).abs().max() > 0.1
    torch.testing.assert_close(got, want, **TOL)


def test_cosmos_with_its_released_unipc_scheduler_is_another_solver(cosmos):
    """The released scheduler (UniPC, Karras flow sigmas 200..0.01, shift 1, as fvx exports it) is a multistep
    predictor-corrector on other levels: an Euler sampler cannot reproduce it, only approach it as steps grow."""
    model, params, module = cosmos
    noise, keys, cond, negative = prompts(model)
    unipc = UniPCMultistepScheduler(use_karras_sigmas=True, use_flow_sigmas=True, prediction_type="flow_prediction",
                                    flow_shift=1.0, sigma_max=200.0, sigma_min=0.01)
    want = cosmos_pipeline_latents(module, noise, cond, negative, GUIDANCE - 1.0, unipc)
    got = fvx_sample(model, params, noise, keys, cond, negative, shift=1.0)
    assert (got - want).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------------------ LTX-Video


@pytest.fixture(scope="module")
def ltx(tmp_path_factory):
    return loaded(LTXVideoConfig(preset="tiny"), LTXVideoTransformer3DModel, tmp_path_factory)


def ltx_pipeline_latents(module, noise, cond, negative, guidance, scheduler):
    """LTXPipeline: no VAE (compression 8 x 32 x 32, frame rate 25, the RoPE scale fvx uses), latents packed to tokens
    in and out (``_pack_latents`` / ``_unpack_latents``, patch 1); its sigmas are its own, ``linspace(1, 1 / K, K)``
    then the scheduler's shift (``mu`` from the token count, used only by a dynamic-shift scheduler)."""
    pipe = quiet(LTXPipeline(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None, transformer=module))
    _, _, frames, height, width = noise.shape
    neg = rows(negative, noise.shape[0])
    with torch.no_grad():
        out = pipe(prompt_embeds=cond["text"], prompt_attention_mask=cond["text_mask"],
                   negative_prompt_embeds=neg["text"], negative_prompt_attention_mask=neg["text_mask"],
                   latents=LTXPipeline._pack_latents(noise.clone()), num_inference_steps=STEPS,
                   guidance_scale=guidance, height=32 * height, width=32 * width, num_frames=8 * (frames - 1) + 1,
                   output_type="latent", return_dict=False)[0]
    return LTXPipeline._unpack_latents(out, frames, height, width)


@pytest.mark.parametrize("guidance", [GUIDANCE, 1.0])
def test_ltx_video_equals_its_pipeline_with_a_static_shift_on_fvx_levels(ltx, guidance):
    """With a static-shift scheduler (LTX-Video 0.9.5 / 0.9.7 release ``use_dynamic_shifting=False``, shift 1;
    here 3), the pipeline's levels are fvx's default schedule (``--schedule fvx``)."""
    model, params, module = ltx
    noise, keys, cond, negative = prompts(model)
    want = ltx_pipeline_latents(module, noise, cond, negative, guidance, FlowMatchEulerDiscreteScheduler(shift=SHIFT))
    got = fvx_sample(model, params, noise, keys, cond, negative, guidance=guidance, schedule="fvx")
    assert (got - noise).abs().max() > 0.1
    torch.testing.assert_close(got, want, **TOL)


def test_ltx_video_dynamic_shift_is_a_static_shift_of_e_to_the_mu(ltx):
    """A dynamic (exponential) shift without a terminal stretch is the static shift ``e^mu``, ``mu`` the pipeline's
    ``calculate_shift`` of the token count: ``--shift e^mu --schedule fvx`` matches. The 0.9.0 / 0.9.1 releases'
    scheduler also stretches the levels to end at ``shift_terminal=0.1``, which neither fvx schedule lays out."""
    model, params, module = ltx
    noise, keys, cond, negative = prompts(model)
    bounds = dict(base_shift=0.95, max_shift=2.05, base_image_seq_len=1024, max_image_seq_len=4096)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, **bounds)
    tokens = math.prod(noise.shape[2:])
    slope = (bounds["max_shift"] - bounds["base_shift"]) / (bounds["max_image_seq_len"] - bounds["base_image_seq_len"])
    mu = bounds["base_shift"] + slope * (tokens - bounds["base_image_seq_len"])
    want = ltx_pipeline_latents(module, noise, cond, negative, GUIDANCE, scheduler)
    got = fvx_sample(model, params, noise, keys, cond, negative, shift=math.exp(mu), schedule="fvx")
    torch.testing.assert_close(got, want, **TOL)


# ----------------------------------------------------------------------------------------------------- Kandinsky 5


@pytest.fixture(scope="module")
def kandinsky(tmp_path_factory):
    return loaded(Kandinsky5Config(preset="tiny"), Kandinsky5Transformer3DModel, tmp_path_factory)


def packed_text(cond):
    """(the text cut to the batch's longest valid length, cu_seqlens [N + 1] of the rows' valid lengths): what the
    pipeline's tokenizer (padding to the longest prompt) and ``encode_prompt`` give."""
    lengths = cond["text_mask"].sum(dim=1).clamp(min=1).to(torch.int32)
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    return cond["text"][:, :int(lengths.max())], cu


def test_kandinsky5_equals_its_pipeline(kandinsky):
    """Kandinsky5T2VPipeline: no VAE (strides 4 and 8), channels-last latents ``[x | zeros | zero mask]`` in (its
    ``prepare_latents`` keeps given latents as they are) and the first C channels out."""
    model, params, module = kandinsky
    noise, keys, cond, negative = prompts(model)
    pipe = quiet(Kandinsky5T2VPipeline(transformer=module, vae=None, text_encoder=None, tokenizer=None,
                                       text_encoder_2=None, tokenizer_2=None,
                                       scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT)))
    n, _, frames, height, width = noise.shape
    x = noise.permute(0, 2, 3, 4, 1)
    x = torch.cat([x, torch.zeros_like(x), torch.zeros_like(x[..., :1])], dim=-1)
    text, cu = packed_text(cond)
    neg = rows(negative, n)
    neg_text, neg_cu = packed_text(neg)
    with torch.no_grad():
        out = pipe(prompt_embeds_qwen=text, prompt_embeds_clip=cond["pooled"], prompt_cu_seqlens=cu,
                   negative_prompt_embeds_qwen=neg_text, negative_prompt_embeds_clip=neg["pooled"],
                   negative_prompt_cu_seqlens=neg_cu, latents=x, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                   height=8 * height, width=8 * width, num_frames=4 * (frames - 1) + 1, output_type="latent",
                   return_dict=False)[0]
    want = out.permute(0, 4, 1, 2, 3)
    got = fvx_sample(model, params, noise, keys, cond, negative)
    assert (got - noise).abs().max() > 0.1
    torch.testing.assert_close(got, want, **TOL)


# ------------------------------------------------------------------------------------------------------- Wan I2V


class StandIn(torch.nn.Module):
    """A pipeline component on the CPU in fp32 (what the pipeline asks of its modules) with no weights."""

    device = torch.device("cpu")
    dtype = torch.float32


class GivenLatentsVAE(StandIn):
    """A stand-in VAE whose ``encode`` gives fixed latents (identity statistics): the image's latents fvx's cond
    carries (``first_frame_latents``), in place of encoding a picture."""

    def __init__(self, latents):
        super().__init__()
        self.latents = latents
        channels = latents.shape[1]
        self.config = types.SimpleNamespace(z_dim=channels, latents_mean=[0.0] * channels,
                                            latents_std=[1.0] * channels, scale_factor_temporal=4,
                                            scale_factor_spatial=8)

    def encode(self, video):
        return types.SimpleNamespace(latent_dist=types.SimpleNamespace(mode=lambda: self.latents))


class GivenImageEncoder(StandIn):
    """A stand-in CLIP vision model whose penultimate hidden states are fixed: the cond's ``image_embeds``."""

    def __init__(self, embeds):
        super().__init__()
        self.embeds = embeds

    def forward(self, pixel_values, output_hidden_states):
        return types.SimpleNamespace(hidden_states=[self.embeds, None])


class Pixels(dict):
    """What an image processor returns (a ``BatchFeature``): keyword arguments of the encoder, movable."""

    def to(self, device):
        return self


@pytest.fixture(scope="module")
def wan_i2v(tmp_path_factory):
    return loaded(WanConfig(preset="tiny-i2v"), WanTransformer3DModel, tmp_path_factory)


def test_wan_i2v_equals_wan_image_to_video_pipeline(wan_i2v):
    """WanImageToVideoPipeline, one video (it encodes one image for the batch, and takes ``image_embeds`` only
    without an ``image``, which it needs for the condition): stand-ins for its VAE and CLIP that give the cond's
    ``first_frame_latents`` (fvx's data: the first frame's latents, then zeros) and ``image_embeds``; the text
    zero-padded to the 512 tokens of its T5 (as fvx's model pads it)."""
    model, params, module = wan_i2v
    noise, keys, cond, negative = prompts(model, batch=1)
    cond["first_frame_latents"][:, :, 1:] = 0
    pipe = quiet(WanImageToVideoPipeline(tokenizer=None, text_encoder=None,
                                         image_encoder=GivenImageEncoder(cond["image_embeds"]),
                                         image_processor=lambda images, return_tensors: Pixels(pixel_values=images),
                                         transformer=module,
                                         vae=GivenLatentsVAE(cond["first_frame_latents"]),
                                         scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT)))
    _, _, frames, height, width = noise.shape

    def padded(c):
        return torch.nn.functional.pad(masked(c), (0, 0, 0, 512 - c["text"].shape[1]))

    with torch.no_grad():
        want = pipe(image=torch.zeros(1, 3, 8 * height, 8 * width), prompt_embeds=padded(cond),
                    negative_prompt_embeds=padded(negative),
                    latents=noise.clone(), num_inference_steps=STEPS, guidance_scale=GUIDANCE, height=8 * height,
                    width=8 * width, num_frames=4 * (frames - 1) + 1, output_type="latent", return_dict=False)[0]
    got = fvx_sample(model, params, noise, keys, cond, negative)
    assert (got - noise).abs().max() > 0.1
    torch.testing.assert_close(got, want, **TOL)
