"""The ``sample`` command's many-step sampler against each family's diffusers pipeline: a tiny random DiT, exported
by fvx (its ``transformer/`` and ``scheduler/`` loaded back with ``from_pretrained``), sampled from the same initial
latents, prompt embeddings, steps, scheduler settings and guidance, gives the same latents (CPU fp32; bitwise today,
asserted to 1e-6). The fvx side is what ``sample`` runs for a fine-tuned model: ``one_role.many_step_samplers(model)``
at a ``ValidationConfig``, drawn by ``validation.draw`` with the noise and keys of ``sampling.noise_and_keys`` and
``--negative-prompt``'s unconditional cond. Each pipeline gets only its transformer and scheduler (embeddings go in
as ``prompt_embeds``; a stand-in where ``__init__`` or the call needs a VAE or an image encoder) and returns
``output_type="latent"``. Where a pipeline differs by construction (HunyuanVideo's and LTX's own sigma spacing,
HunyuanVideo's embedded guidance, LTX's terminal stretch, Cosmos 2.5's UniPC and ``cond + g (cond - uncond)``), a
test names the settings under which the two agree and another shows the gap; docs/design.md has the details."""
import json
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
from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

from fvx.core import flow, random, unipc as fvx_unipc
from fvx.training import sampling, validation
from fvx.training.validation import ValidationConfig
from fvx_methods.library import one_role
from fvx_models import wan_vae
from fvx_models.cosmos import CosmosConfig
from fvx_models.hunyuan_video import HunyuanVideoConfig
from fvx_models.kandinsky5 import Kandinsky5Config
from fvx_models.ltx_video import LTXVideoConfig
from fvx_models.wan import WanConfig

from family_cases import inputs  # noqa: E402

STEPS, GUIDANCE = 3, 4.0
SEEDS = (0, 1)  # two videos: a batch of two prompts, the second's text padded
# equal bit for bit on an AVX2 CPU; an AVX512 one sums in another order (1.4e-6 and 2.3e-6 measured on values of ~0.1)
TIGHT = dict(rtol=0.0, atol=1e-5)


class Exported:
    """A tiny random model, its params, and fvx's diffusers export of them: the transformer and scheduler as the
    pipeline's ``from_pretrained`` loads them."""

    def __init__(self, config, transformer_cls, pipeline_cls, tmp_path_factory):
        self.model = config.build()
        self.params = self.model.weights.init(random.key(0))
        folder = tmp_path_factory.mktemp(self.model.name.replace(":", "_"))
        self.model.export.folder(self.params, str(folder))
        assert json.loads((folder / "model_index.json").read_text())["_class_name"] == pipeline_cls.__name__
        self.transformer = transformer_cls.from_pretrained(str(folder), subfolder="transformer").eval()
        assert self.transformer.dtype == torch.float32
        self.scheduler_config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())

    def scheduler(self, **changes):
        """A fresh copy of the exported scheduler (its class from the folder), with ``changes`` to its config."""
        cls = {"FlowMatchEulerDiscreteScheduler": FlowMatchEulerDiscreteScheduler,
               "UniPCMultistepScheduler": UniPCMultistepScheduler}[self.scheduler_config["_class_name"]]
        return cls.from_config({**self.scheduler_config, **changes})


def prompts(model, frames=2, size=4, batch=len(SEEDS)):
    """(noise [N, C, T, H, W] and sampler keys as ``sample`` draws them for SEEDS, the prompts' cond [N, ...] (the
    last row's text padded), a one-row negative-prompt cond (its text padded too))."""
    shape = (model.latents.channels, frames, size, size)
    noise, keys = sampling.noise_and_keys(SEEDS[:batch], shape)
    _, _, cond = inputs(model, random.key(1), batch=batch, frames=frames, size=size)
    _, _, negative = inputs(model, random.key(2), batch=1, frames=frames, size=size)
    negative = {name: t for name, t in negative.items() if name not in ("first_frame_latents", "image_embeds")}
    return noise, keys, cond, negative


def fvx_sample(model, params, noise, keys, cond, negative, *, shift, guidance=GUIDANCE, schedule="diffusers",
               shift_terminal=None, solver="euler", karras=None):
    """What ``sample --steps --shift --guidance --schedule --shift-terminal --solver --karras --negative-prompt``
    draws for a fine-tuned model."""
    vcfg = ValidationConfig(num_steps=STEPS, flow_shift=shift, guidance_scale=guidance, schedule=schedule,
                            shift_terminal=shift_terminal, solver=solver, karras=karras)
    sampler = one_role.many_step_samplers(model)(params, False, vcfg)[0]
    assert sampler.guided and sampler.sampler == "ode" and (sampler.draw is None) == (solver == "euler")
    uncond = lambda c: model.uncond(c, "negative_prompt", negative)  # noqa: E731  (sampling._uncond's)
    latents, _ = validation.draw(sampler, noise, cond, keys, uncond, vcfg.guidance_scale)
    assert (latents - noise).abs().max() > 0.1  # the steps moved the latents
    return latents


def rows(negative, count):
    return {name: t.expand(count, *t.shape[1:]) for name, t in negative.items()}


def masked(cond):
    """The text as the family's encoder hands it to the pipeline: zeros after the valid tokens."""
    return cond["text"] * cond["text_mask"][..., None]


def quiet(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe


def video_size(noise, temporal, spatial):
    """The pipeline's ``num_frames``, ``height`` and ``width`` of latents ``[N, C, T, H, W]``."""
    _, _, frames, height, width = noise.shape
    return dict(num_frames=temporal * (frames - 1) + 1, height=spatial * height, width=spatial * width)


# ------------------------------------------------------------------------------------------------------------- Wan


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return Exported(WanConfig(preset="tiny"), WanTransformer3DModel, WanPipeline, tmp_path_factory)


@pytest.mark.parametrize("guidance", [GUIDANCE, 1.0])
def test_wan_t2v_equals_wan_pipeline(wan, guidance):
    """WanPipeline on the exported scheduler (FlowMatchEuler, shift 3) is ``--schedule diffusers --shift 3``; no VAE
    (its strides default to 4 and 8), latents in the DiT's scale as they are; no CFG at guidance 1 on either side."""
    noise, keys, cond, negative = prompts(wan.model)
    scheduler = wan.scheduler()
    pipe = quiet(WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=wan.transformer,
                             scheduler=scheduler))
    with torch.no_grad():
        want = pipe(prompt_embeds=masked(cond), negative_prompt_embeds=masked(rows(negative, noise.shape[0])),
                    latents=noise.clone(), num_inference_steps=STEPS, guidance_scale=guidance,
                    output_type="latent", return_dict=False, **video_size(noise, 4, 8))[0]
    shift = scheduler.config.shift
    got = fvx_sample(wan.model, wan.params, noise, keys, cond, negative, shift=shift, guidance=guidance)
    torch.testing.assert_close(got, want, **TIGHT)
    assert torch.equal(flow.scheduler_sigmas(shift, STEPS), scheduler.sigmas[:-1])
    # fvx's default levels (evenly spaced, shifted once) are not the scheduler's (spaced to its smallest training
    # level, so shifted twice at the low end): --schedule diffusers is what makes the match
    other = fvx_sample(wan.model, wan.params, noise, keys, cond, negative, shift=shift, guidance=guidance,
                       schedule="fvx")
    assert (other - want).abs().max() > 1e-2


# --------------------------------------------------------------------------------------------------- HunyuanVideo


@pytest.fixture(scope="module")
def hunyuan(tmp_path_factory):
    return Exported(HunyuanVideoConfig(preset="tiny"), HunyuanVideoTransformer3DModel, HunyuanVideoPipeline,
                    tmp_path_factory)


def hunyuan_pipeline_latents(exported, noise, cond, negative, *, true_cfg_scale, embedded, sigmas=None):
    """HunyuanVideoPipeline (no VAE: strides 4 and 8): ``guidance_scale`` is the distilled guidance the DiT embeds
    (``g * 1000``), classifier-free guidance is ``true_cfg_scale`` with the negative embeddings (none at 1); its
    sigmas are its own (``sigmas=None``: ``linspace(1, 0, K + 1)[:-1]``, then the scheduler's shift)."""
    pipe = quiet(HunyuanVideoPipeline(text_encoder=None, tokenizer=None, transformer=exported.transformer, vae=None,
                                      scheduler=exported.scheduler(), text_encoder_2=None, tokenizer_2=None))
    neg = rows(negative, noise.shape[0])
    with torch.no_grad():
        return pipe(prompt_embeds=cond["text"], prompt_attention_mask=cond["text_mask"],
                    pooled_prompt_embeds=cond["pooled"], negative_prompt_embeds=neg["text"],
                    negative_prompt_attention_mask=neg["text_mask"], negative_pooled_prompt_embeds=neg["pooled"],
                    latents=noise.clone(), num_inference_steps=STEPS, sigmas=sigmas, guidance_scale=embedded,
                    true_cfg_scale=true_cfg_scale, output_type="latent", return_dict=False,
                    **video_size(noise, 4, 8))[0]


@pytest.mark.parametrize("guidance", [GUIDANCE, 1.0])
def test_hunyuan_video_equals_its_pipeline_with_true_cfg_on_fvx_levels(hunyuan, guidance):
    """The pipeline's own levels are fvx's default schedule (``--schedule fvx``, shift 7 as exported); its
    ``guidance_scale`` must be the model's ``embedded_guidance`` (6) and fvx's ``--guidance`` is its
    ``true_cfg_scale``."""
    noise, keys, cond, negative = prompts(hunyuan.model)
    embedded = HunyuanVideoConfig(preset="tiny").embedded_guidance
    want = hunyuan_pipeline_latents(hunyuan, noise, cond, negative, true_cfg_scale=guidance, embedded=embedded)
    shift = hunyuan.scheduler_config["shift"]
    got = fvx_sample(hunyuan.model, hunyuan.params, noise, keys, cond, negative, shift=shift, guidance=guidance,
                     schedule="fvx")
    torch.testing.assert_close(got, want, **TIGHT)
    other = fvx_sample(hunyuan.model, hunyuan.params, noise, keys, cond, negative, shift=shift, guidance=guidance)
    assert (other - want).abs().max() > 1e-2  # --schedule diffusers is not the pipeline's default


def test_hunyuan_video_on_the_diffusers_schedule_and_its_embedded_guidance(hunyuan):
    """``--schedule diffusers`` matches when the pipeline is handed the scheduler's default levels before its shift
    (``sigmas=linspace(1, shift(1 / 1000), K)``); a different embedded guidance gives different latents (it is an
    input of the distilled DiT, fixed by fvx's config, not classifier-free guidance)."""
    noise, keys, cond, negative = prompts(hunyuan.model)
    shift = hunyuan.scheduler_config["shift"]
    sigmas = list(np.linspace(1.0, hunyuan.scheduler().sigma_min, STEPS))  # the shifted grid's lowest level
    want = hunyuan_pipeline_latents(hunyuan, noise, cond, negative, true_cfg_scale=GUIDANCE, embedded=6.0,
                                    sigmas=sigmas)
    got = fvx_sample(hunyuan.model, hunyuan.params, noise, keys, cond, negative, shift=shift)
    torch.testing.assert_close(got, want, **TIGHT)
    other = hunyuan_pipeline_latents(hunyuan, noise, cond, negative, true_cfg_scale=GUIDANCE, embedded=3.0,
                                     sigmas=sigmas)
    assert (other - want).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------------------- Cosmos


class NoSafetyChecker:
    """The pipeline moves its checker to the device; text to world from embeddings checks nothing else."""

    def to(self, *args, **kwargs):
        return self


@pytest.fixture(scope="module")
def cosmos(tmp_path_factory):
    return Exported(CosmosConfig(preset="tiny"), CosmosTransformer3DModel, Cosmos2_5_PredictBasePipeline,
                    tmp_path_factory)


def cosmos_pipeline_latents(exported, noise, cond, negative, guidance, scheduler):
    """Cosmos2_5_PredictBasePipeline, text to world: the tiny Wan VAE (its ``__init__`` reads the VAE's latent
    statistics and strides; nothing is encoded or decoded), ``guidance_scale`` its ``cond + g (cond - uncond)``."""
    vae = AutoencoderKLWan(**wan_vae.PRESETS["tiny"])
    pipe = quiet(Cosmos2_5_PredictBasePipeline(text_encoder=None, tokenizer=None, transformer=exported.transformer,
                                               vae=vae, scheduler=scheduler, safety_checker=NoSafetyChecker()))
    with torch.no_grad():
        return pipe(prompt_embeds=cond["text"], negative_prompt_embeds=rows(negative, noise.shape[0])["text"],
                    latents=noise.clone(), num_inference_steps=STEPS, guidance_scale=guidance, output_type="latent",
                    return_dict=False,
                    **video_size(noise, pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial))[0]


@pytest.mark.parametrize("guidance", [GUIDANCE, 1.0])
def test_cosmos_equals_its_pipeline_stepped_by_flow_match_euler(cosmos, guidance):
    """The pipeline's loop reads only ``scheduler.sigmas`` and ``scheduler.step``, so it runs on
    ``FlowMatchEulerDiscreteScheduler`` (shift 3 here); its guidance ``g_p`` is fvx's ``g = g_p + 1`` (none at
    ``g_p <= 1``)."""
    noise, keys, cond, negative = prompts(cosmos.model)
    want = cosmos_pipeline_latents(cosmos, noise, cond, negative, guidance - 1.0,
                                   FlowMatchEulerDiscreteScheduler(shift=3.0))
    got = fvx_sample(cosmos.model, cosmos.params, noise, keys, cond, negative, shift=3.0, guidance=guidance)
    torch.testing.assert_close(got, want, **TIGHT)


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # inside diffusers' UniPC
def test_cosmos_with_its_exported_unipc_scheduler_is_unipc_on_karras_levels(cosmos):
    """The exported (released) scheduler, UniPC on Karras flow sigmas 200..0.01 (levels 0.995..0.0099), is
    ``--solver unipc --karras 0.01,200``; an Euler sampler does not reproduce it."""
    noise, keys, cond, negative = prompts(cosmos.model)
    unipc = cosmos.scheduler()
    assert isinstance(unipc, UniPCMultistepScheduler) and unipc.config.use_karras_sigmas
    want = cosmos_pipeline_latents(cosmos, noise, cond, negative, GUIDANCE - 1.0, unipc)
    karras = (unipc.config.sigma_min, unipc.config.sigma_max)
    got = fvx_sample(cosmos.model, cosmos.params, noise, keys, cond, negative, shift=unipc.config.flow_shift,
                     solver="unipc", karras=karras)
    torch.testing.assert_close(got, want, rtol=0.0, atol=1e-5)  # the CFG sum's order, through UniPC's multistep
    assert torch.equal(unipc.sigmas[:-1], fvx_unipc.unipc_sigmas(STEPS, 1.0, karras))
    euler = fvx_sample(cosmos.model, cosmos.params, noise, keys, cond, negative, shift=unipc.config.flow_shift)
    assert (euler - want).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------------------ LTX-Video


@pytest.fixture(scope="module")
def ltx(tmp_path_factory):
    return Exported(LTXVideoConfig(preset="tiny"), LTXVideoTransformer3DModel, LTXPipeline, tmp_path_factory)


def ltx_pipeline_latents(exported, noise, cond, negative, guidance, scheduler):
    """LTXPipeline: no VAE (compression 8 x 32 x 32, frame rate 25: the RoPE scale fvx uses), latents packed to tokens
    in and out (``_pack_latents`` / ``_unpack_latents``, patch 1), CFG as one batch ``[uncond | cond]``; its sigmas
    are its own, ``linspace(1, 1 / K, K)`` then the scheduler's shift (``mu`` of the token count when dynamic)."""
    pipe = quiet(LTXPipeline(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None,
                             transformer=exported.transformer))
    _, _, frames, height, width = noise.shape
    neg = rows(negative, noise.shape[0])
    with torch.no_grad():
        out = pipe(prompt_embeds=cond["text"], prompt_attention_mask=cond["text_mask"],
                   negative_prompt_embeds=neg["text"], negative_prompt_attention_mask=neg["text_mask"],
                   latents=LTXPipeline._pack_latents(noise.clone()), num_inference_steps=STEPS,
                   guidance_scale=guidance, output_type="latent", return_dict=False, **video_size(noise, 8, 32))[0]
    return LTXPipeline._unpack_latents(out, frames, height, width)


@pytest.mark.parametrize("guidance", [GUIDANCE, 1.0])
def test_ltx_video_with_a_static_shift_equals_its_pipeline_on_fvx_levels(ltx, guidance):
    """With a static-shift scheduler (as fvx exports the 13B preset: ``use_dynamic_shifting=False``; shift 3 here),
    the pipeline's levels are fvx's default schedule (``--schedule fvx``)."""
    noise, keys, cond, negative = prompts(ltx.model)
    scheduler = ltx.scheduler(use_dynamic_shifting=False, shift_terminal=None, shift=3.0)
    want = ltx_pipeline_latents(ltx, noise, cond, negative, guidance, scheduler)
    got = fvx_sample(ltx.model, ltx.params, noise, keys, cond, negative, shift=3.0, guidance=guidance,
                     schedule="fvx")
    torch.testing.assert_close(got, want, **TIGHT)


def test_ltx_video_dynamic_shift_is_e_to_the_mu_and_its_terminal_stretch_is_shift_terminal(ltx):
    """The exported (0.9.0 / 0.9.1) scheduler shifts dynamically, ``exp`` type: at one token count that is the
    static shift ``e^mu`` (``mu``: the pipeline's ``calculate_shift``), and it stretches its levels to end at
    ``shift_terminal=0.1``: ``--shift e^mu --schedule fvx --shift-terminal 0.1`` is the pipeline as released."""
    noise, keys, cond, negative = prompts(ltx.model)
    config = ltx.scheduler_config
    assert config["use_dynamic_shifting"] and config["time_shift_type"] == "exponential"
    assert config["shift_terminal"] == 0.1
    mu = calculate_shift(math.prod(noise.shape[2:]), config["base_image_seq_len"], config["max_image_seq_len"],
                         config["base_shift"], config["max_shift"])
    got = fvx_sample(ltx.model, ltx.params, noise, keys, cond, negative, shift=math.exp(mu), schedule="fvx")
    want = ltx_pipeline_latents(ltx, noise, cond, negative, GUIDANCE, ltx.scheduler(shift_terminal=None))
    torch.testing.assert_close(got, want, rtol=0.0, atol=1e-5)  # e^mu through float64 vs the scheduler's fp32
    stretched = fvx_sample(ltx.model, ltx.params, noise, keys, cond, negative, shift=math.exp(mu), schedule="fvx",
                           shift_terminal=0.1)
    released = ltx_pipeline_latents(ltx, noise, cond, negative, GUIDANCE, ltx.scheduler())
    torch.testing.assert_close(stretched, released, rtol=0.0, atol=1e-5)
    assert (released - got).abs().max() > 1e-2


# ----------------------------------------------------------------------------------------------------- Kandinsky 5


@pytest.fixture(scope="module")
def kandinsky(tmp_path_factory):
    return Exported(Kandinsky5Config(preset="tiny"), Kandinsky5Transformer3DModel, Kandinsky5T2VPipeline,
                    tmp_path_factory)


def packed_text(cond):
    """(the text cut to the batch's longest valid length, cu_seqlens [N + 1] of the rows' valid lengths): what the
    pipeline's tokenizer (padding to the longest prompt) and ``encode_prompt`` give."""
    lengths = cond["text_mask"].sum(dim=1).clamp(min=1).to(torch.int32)
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    return cond["text"][:, :int(lengths.max())], cu


def test_kandinsky5_equals_its_pipeline(kandinsky):
    """Kandinsky5T2VPipeline on the exported scheduler (FlowMatchEuler, shift 5): no VAE (strides 4 and 8),
    channels-last latents ``[x | zeros | zero mask]`` in (its ``prepare_latents`` keeps given latents as they are),
    the first C channels out; the text rows cut to the longest valid one, their lengths as ``cu_seqlens``."""
    noise, keys, cond, negative = prompts(kandinsky.model)
    scheduler = kandinsky.scheduler()
    pipe = quiet(Kandinsky5T2VPipeline(transformer=kandinsky.transformer, vae=None, text_encoder=None,
                                       tokenizer=None, text_encoder_2=None, tokenizer_2=None, scheduler=scheduler))
    x = noise.permute(0, 2, 3, 4, 1)
    x = torch.cat([x, torch.zeros_like(x), torch.zeros_like(x[..., :1])], dim=-1)
    text, cu = packed_text(cond)
    neg = rows(negative, noise.shape[0])
    neg_text, neg_cu = packed_text(neg)
    with torch.no_grad():
        out = pipe(prompt_embeds_qwen=text, prompt_embeds_clip=cond["pooled"], prompt_cu_seqlens=cu,
                   negative_prompt_embeds_qwen=neg_text, negative_prompt_embeds_clip=neg["pooled"],
                   negative_prompt_cu_seqlens=neg_cu, latents=x, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                   output_type="latent", return_dict=False, **video_size(noise, 4, 8))[0]
    got = fvx_sample(kandinsky.model, kandinsky.params, noise, keys, cond, negative, shift=scheduler.config.shift)
    torch.testing.assert_close(got, out.permute(0, 4, 1, 2, 3), **TIGHT)


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
    """What an image processor returns (a ``BatchFeature``): the encoder's keyword arguments, movable."""

    def to(self, device):
        return self


@pytest.fixture(scope="module")
def wan_i2v(tmp_path_factory):
    return Exported(WanConfig(preset="tiny-i2v"), WanTransformer3DModel, WanImageToVideoPipeline, tmp_path_factory)


def test_wan_i2v_equals_wan_image_to_video_pipeline(wan_i2v):
    """WanImageToVideoPipeline, one video (it encodes one image for the whole batch, and refuses ``image_embeds``
    with an ``image``, which it needs for the condition latents): stand-ins for its VAE and CLIP give the cond's
    ``first_frame_latents`` (fvx's data: the first frame's latents, then zeros) and ``image_embeds``; the text
    zero-padded to its T5's 512 tokens (as fvx's model pads it); the image kept in the unconditional pass."""
    noise, keys, cond, negative = prompts(wan_i2v.model, batch=1)
    cond["first_frame_latents"][:, :, 1:] = 0
    scheduler = wan_i2v.scheduler()
    pipe = quiet(WanImageToVideoPipeline(tokenizer=None, text_encoder=None,
                                         image_encoder=GivenImageEncoder(cond["image_embeds"]),
                                         image_processor=lambda images, return_tensors: Pixels(pixel_values=images),
                                         transformer=wan_i2v.transformer,
                                         vae=GivenLatentsVAE(cond["first_frame_latents"]), scheduler=scheduler))

    def padded(c):
        return torch.nn.functional.pad(masked(c), (0, 0, 0, 512 - c["text"].shape[1]))

    size = video_size(noise, 4, 8)
    with torch.no_grad():
        want = pipe(image=torch.zeros(1, 3, size["height"], size["width"]), prompt_embeds=padded(cond),
                    negative_prompt_embeds=padded(negative), latents=noise.clone(), num_inference_steps=STEPS,
                    guidance_scale=GUIDANCE, output_type="latent", return_dict=False, **size)[0]
    got = fvx_sample(wan_i2v.model, wan_i2v.params, noise, keys, cond, negative, shift=scheduler.config.shift)
    torch.testing.assert_close(got, want, **TIGHT)
