"""The tiny model of every family the tests run, with inputs drawn from its cond spec and an independent reference:
the diffusers module(s) called directly, with the arguments their own pipeline passes."""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import numpy
import torch
from diffusers import (AllegroPipeline, AllegroTransformer3DModel, AnyFlowTransformer3DModel,
                       ChronoEditTransformer3DModel, CogVideoXDDIMScheduler, CogVideoXPipeline,
                       CogVideoXTransformer3DModel, CosmosTransformer3DModel, DDIMScheduler, DDPMScheduler,
                       EasyAnimateTransformer3DModel, HeliosTransformer3DModel, HunyuanVideo15Transformer3DModel,
                       HunyuanVideoTransformer3DModel, Kandinsky5T2VPipeline, Kandinsky5Transformer3DModel,
                       Kandinsky6Transformer3DModel, LatteTransformer3DModel, LTX2Pipeline,
                       LTX2VideoTransformer3DModel, LTXPipeline, LTXVideoTransformer3DModel, MochiTransformer3DModel,
                       MotifVideoTransformer3DModel, SanaVideoTransformer3DModel, SkyReelsV2Transformer3DModel,
                       WanAnimateTransformer3DModel, WanTransformer3DModel, WanVACETransformer3DModel)

from fvx.core import grad, random
from fvx.data import sections
from fvx.distributed import processes, sharding
from fvx_models.allegro import AllegroConfig
from fvx_models.anyflow import AnyFlowConfig
from fvx_models.build import ModelConfig
from fvx_models.chronoedit import ChronoEditConfig
from fvx_models.cogvideox import SCHEDULER as COGVIDEOX_SCHEDULER, CogVideoXConfig
from fvx_models.cosmos import CosmosConfig
from fvx_models.easyanimate import EasyAnimateConfig
from fvx_models.helios import HeliosConfig
from fvx_models.hunyuan_video import HunyuanVideoConfig
from fvx_models.hunyuan_video15 import HunyuanVideo15Config
from fvx_models.kandinsky5 import Kandinsky5Config
from fvx_models.kandinsky6 import Kandinsky6Config
from fvx_models.latte import SCHEDULER as LATTE_SCHEDULER, LatteConfig
from fvx_models.ltx2 import LTX2Config
from fvx_models.ltx_video import LTXVideoConfig
from fvx_models.mochi import MochiConfig
from fvx_models.motif_video import MotifVideoConfig
from fvx_models.sana_video import SanaVideoConfig
from fvx_models.skyreels_v2 import SkyReelsV2Config
from fvx_models.wan import WanConfig
from fvx_models.wan_moe import Wan22MoEConfig
from fvx_models.wan_animate import WanAnimateConfig
from fvx_models.wan_vace import WanVACEConfig
from fvx_models.wan_vace_moe import WanVACEMoEConfig


class Case(NamedTuple):
    config: ModelConfig
    classes: dict[str, type]  # pipeline component -> its diffusers class
    native: Callable  # (modules by component, x, t, cond) -> velocity


def _fresh(cls: type, kwargs: dict, params: dict) -> torch.nn.Module:
    """A real diffusers module holding ``params`` (torch's RNG state restored after its own init)."""
    state = torch.get_rng_state()
    module = cls(**kwargs)
    torch.set_rng_state(state)
    module.load_state_dict(params)
    return module


def _masked(cond):
    return cond["text"] * cond["text_mask"][..., None]


def wan_native(modules, x, t, cond):
    return modules["transformer"](x, t, _masked(cond), return_dict=False)[0]


def ti2v_native(modules, x, t, cond):
    """WanPipeline with expand_timesteps: one timestep per token (all the sample's for text-to-video)."""
    tokens = x.shape[2] * (x.shape[3] // 2) * (x.shape[4] // 2)
    return modules["transformer"](x, t[:, None].expand(x.shape[0], tokens), _masked(cond), return_dict=False)[0]


def skyreels_fps_native(modules, x, t, cond):
    return modules["transformer"](x, t, _masked(cond), fps=[1] * x.shape[0], return_dict=False)[0]  # 24 fps


def routed(modules, latent_input, t, cond, boundary: float):
    """The two-expert pipelines' routing, one sample at a time: the high-noise expert at t >= boundary."""
    rows = [modules["transformer" if float(t[b]) >= boundary else "transformer_2"](
        latent_input[b:b + 1], t[b:b + 1], _masked(cond)[b:b + 1], return_dict=False)[0] for b in range(t.shape[0])]
    return torch.cat(rows)


def moe_native(modules, x, t, cond):
    """WanPipeline with two experts (Wan 2.2 A14B T2V): routed at 875."""
    return routed(modules, x, t, cond, 875.0)


def i2v_condition(x, cond, stride: int = 4):
    """WanImageToVideoPipeline.prepare_latents' condition: the video-frame mask (first frame given) packed ``stride``
    frames per latent frame, then the first-frame latents."""
    b, _, frames, h, w = x.shape
    mask = torch.ones(b, 1, (frames - 1) * stride + 1, h, w)
    mask[:, :, 1:] = 0
    mask = torch.cat([mask[:, :, :1].repeat_interleave(stride, dim=2), mask[:, :, 1:]], dim=2)
    mask = mask.view(b, -1, stride, h, w).transpose(1, 2)
    return torch.cat([mask, cond["first_frame_latents"][:, :, :frames]], dim=1)


def wan_i2v_native(modules, x, t, cond):
    """WanImageToVideoPipeline (Wan 2.1 I2V): [latents | condition] in, CLIP hidden states to the image attention,
    the text zero-padded to 512 tokens."""
    text = torch.nn.functional.pad(_masked(cond), (0, 0, 0, 512 - cond["text"].shape[1]))
    return modules["transformer"](torch.cat([x, i2v_condition(x, cond)], dim=1), t, text,
                                  encoder_hidden_states_image=cond["image_embeds"], return_dict=False)[0]


def moe_i2v_native(modules, x, t, cond):
    """WanImageToVideoPipeline with two experts (Wan 2.2 A14B I2V): [latents | condition], routed at 900."""
    return routed(modules, torch.cat([x, i2v_condition(x, cond)], dim=1), t, cond, 900.0)


def ti2v_i2v_native(modules, x, t, cond):
    """WanImageToVideoPipeline with expand_timesteps (Wan 2.2 TI2V-5B): the first latent frame replaced by the given
    one at timestep 0, one sample at a time; fvx's model then gives that frame the exact velocity toward it."""
    rows = []
    for b in range(x.shape[0]):
        keep = torch.ones(1, 1, *x.shape[2:])
        keep[:, :, 0] = 0
        given = cond["first_frame_latents"][b:b + 1, :, :x.shape[2]]
        latents = (1 - keep) * given + keep * x[b:b + 1]
        timestep = (keep[0][0][:, ::2, ::2] * t[b]).flatten()[None]
        out = modules["transformer"](latents, timestep, _masked(cond)[b:b + 1], return_dict=False)[0]
        exact = (x[b:b + 1, :, :1] - given[:, :, :1]) / (t[b] / 1000)
        rows.append(torch.cat([exact, out[:, :, 1:]], dim=2))
    return torch.cat(rows)


def vace_native(modules, x, t, cond):
    """WanVACEPipeline's call: the context as control_hidden_states at its default scale (one per VACE layer)."""
    scale = torch.ones(len(modules["transformer"].config.vace_layers))
    return modules["transformer"](hidden_states=x, timestep=t, encoder_hidden_states=_masked(cond),
                                  control_hidden_states=cond["vace_context"], control_hidden_states_scale=scale,
                                  return_dict=False)[0]


def vace_moe_native(modules, x, t, cond):
    """WanVACEPipeline with two VACE experts (Wan 2.2 VACE-Fun A14B): routed at 875, each sample with its context."""
    rows = [modules["transformer" if float(t[b]) >= 875.0 else "transformer_2"](
        hidden_states=x[b:b + 1], timestep=t[b:b + 1], encoder_hidden_states=_masked(cond)[b:b + 1],
        control_hidden_states=cond["vace_context"][b:b + 1], return_dict=False)[0] for b in range(t.shape[0])]
    return torch.cat(rows)


def animate_native(modules, x, t, cond):
    """WanAnimatePipeline's call: ``[latents | reference_latents]``, the text padded to 512 tokens after the image
    features, the pose latents and the face video."""
    text = torch.nn.functional.pad(_masked(cond), (0, 0, 0, 512 - cond["text"].shape[1]))
    return modules["transformer"](hidden_states=torch.cat([x, cond["reference_latents"]], dim=1), timestep=t,
                                  encoder_hidden_states=text, encoder_hidden_states_image=cond["image_embeds"],
                                  pose_hidden_states=cond["pose_latents"], face_pixel_values=cond["face_pixels"],
                                  return_dict=False)[0]


def cogvideox_native(modules, x, t, cond, snr_shift_scale: float = 1.0):
    """CogVideoXPipeline's call at the VP point of the flow level ``sigma = t / 1000`` (``abar = (1 - sigma)^2 /
    ((1 - sigma)^2 + sigma^2)``, the timestep interpolated on its scheduler's ``alphas_cumprod``): latents frames first
    scaled by ``sqrt(abar) + sqrt(1 - abar)``, the pipeline's RoPE tables; its ``v`` read back through the scheduler's
    v-prediction ``x0`` and the noise that implies, as ``noise - x0``."""
    transformer = modules["transformer"]
    table = CogVideoXDDIMScheduler(**COGVIDEOX_SCHEDULER, snr_shift_scale=snr_shift_scale).alphas_cumprod.double()
    sigma = t.double() / 1000
    abar = (1 - sigma) ** 2 / ((1 - sigma) ** 2 + sigma ** 2)
    tau = torch.from_numpy(numpy.interp(abar.numpy(), table.flip(0).numpy(), numpy.arange(999, -1, -1.0)))
    a, b = (c.float().view(-1, 1, 1, 1, 1) for c in (abar.sqrt(), (1 - abar).sqrt()))
    latents = (x * (a + b)).permute(0, 2, 1, 3, 4)
    given = cond.get("first_frame_latents")  # image-to-video: CogVideoXImageToVideoPipeline's channels
    hidden = latents if given is None else torch.cat([latents, given.permute(0, 2, 1, 3, 4)], dim=2)
    pipe = CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer,
                             scheduler=CogVideoXDDIMScheduler())
    rope = (pipe._prepare_rotary_positional_embeddings(x.shape[3] * 8, x.shape[4] * 8, x.shape[2], "cpu")
            if transformer.config.use_rotary_positional_embeddings else None)
    ofs = None if transformer.config.ofs_embed_dim is None else x.new_full((1,), 2.0)  # CogVideoX 1.5 I2V's ofs
    v = transformer(hidden_states=hidden, encoder_hidden_states=cond["text"], timestep=tau.float(),
                    image_rotary_emb=rope, ofs=ofs, return_dict=False)[0]
    x0 = a * latents - b * v
    noise = (latents - a * x0) / b
    return (noise - x0).permute(0, 2, 1, 3, 4)


def sana_video_native(modules, x, t, cond):
    """SanaVideoPipeline's call: latents, the text and its padding mask, the timestep; its output the velocity."""
    return modules["transformer"](x, encoder_hidden_states=cond["text"], encoder_attention_mask=cond["text_mask"],
                                  timestep=t, return_dict=False)[0]


def mochi_native(modules, x, t, cond):
    """MochiPipeline's call: the inverted timestep ``1000 - t``, the text and its mask (diffusers' own per-sample
    joint attention); its output ``x0 - noise``, negated."""
    return -modules["transformer"](hidden_states=x, encoder_hidden_states=cond["text"], timestep=1000 - t,
                                   encoder_attention_mask=cond["text_mask"], return_dict=False)[0]


def latte_native(modules, x, t, cond):
    """LattePipeline's call, one prompt at a time (its embedding cut to the real tokens, no mask), at the VP point of
    the flow level ``sigma = t / 1000`` on its DDIM scheduler's ``alphas_cumprod`` (the timestep interpolated there);
    the first half of its output (epsilon) read back through that point's ``x0`` as ``noise - x0``."""
    table = DDIMScheduler(**LATTE_SCHEDULER).alphas_cumprod.double()
    sigma = t.double() / 1000
    abar = (1 - sigma) ** 2 / ((1 - sigma) ** 2 + sigma ** 2)
    tau = torch.from_numpy(numpy.interp(abar.numpy(), table.flip(0).numpy(), numpy.arange(999, -1, -1.0)))
    a, b = (c.float().view(-1, 1, 1, 1, 1) for c in (abar.sqrt(), (1 - abar).sqrt()))
    latents = x * (a + b)
    eps = torch.cat([modules["transformer"](hidden_states=latents[i:i + 1], timestep=tau[i:i + 1].float(),
                                            encoder_hidden_states=cond["text"][i:i + 1, cond["text_mask"][i].bool()],
                                            return_dict=False)[0][:, :x.shape[1]] for i in range(x.shape[0])])
    x0 = (latents - b * eps) / a
    return eps - x0


def allegro_native(modules, x, t, cond):
    """AllegroPipeline's call at the VP point of the flow level ``sigma = t / 1000`` on ``DDPMScheduler()``'s
    ``alphas_cumprod`` (the timestep interpolated there): the text and its mask, the pipeline's own RoPE for the latent
    grid (pixels = latents x 8); its noise prediction read back through that point's ``x0`` as ``noise - x0``."""
    transformer = modules["transformer"]
    table = DDPMScheduler().alphas_cumprod.double()
    sigma = t.double() / 1000
    abar = (1 - sigma) ** 2 / ((1 - sigma) ** 2 + sigma ** 2)
    tau = torch.from_numpy(numpy.interp(abar.numpy(), table.flip(0).numpy(), numpy.arange(999, -1, -1.0)))
    a, b = (c.float().view(-1, 1, 1, 1, 1) for c in (abar.sqrt(), (1 - abar).sqrt()))
    latents = x * (a + b)
    pipe = AllegroPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer,
                           scheduler=DDPMScheduler())
    rope = pipe._prepare_rotary_positional_embeddings(x.shape[0], x.shape[3] * 8, x.shape[4] * 8, x.shape[2], "cpu")
    eps = transformer(hidden_states=latents, encoder_hidden_states=cond["text"], timestep=tau.float(),
                      encoder_attention_mask=cond["text_mask"], image_rotary_emb=rope, return_dict=False)[0]
    x0 = (latents - b * eps) / a
    return eps - x0


def easyanimate_native(modules, x, t, cond):
    """EasyAnimatePipeline's call: latents, the timestep, every text row without a mask; its output the velocity."""
    return modules["transformer"](x, t, encoder_hidden_states=cond["text"], return_dict=False)[0]


def motif_video_native(modules, x, t, cond):
    """MotifVideoPipeline's text-to-video call: ``latents | zero condition | zero mask`` on channels, the timestep,
    the text and its mask (as bools); its output the velocity."""
    b, c, f, h, w = x.shape
    hidden = torch.cat([x, torch.zeros(b, c, f, h, w), torch.zeros(b, 1, f, h, w)], dim=1)
    return modules["transformer"](hidden_states=hidden, timestep=t, encoder_hidden_states=cond["text"],
                                  encoder_attention_mask=cond["text_mask"].bool(), return_dict=False)[0]


def motif_video_i2v_native(modules, x, t, cond):
    """MotifVideoImage2VideoPipeline's call: ``latents | first-frame condition | mask (1 on frame 0)``, the SigLIP
    features beside the text."""
    b, c, f, h, w = x.shape
    mask = torch.zeros(b, 1, f, h, w)
    mask[:, :, 0] = 1
    hidden = torch.cat([x, cond["first_frame_latents"][:, :, :f], mask], dim=1)
    return modules["transformer"](hidden_states=hidden, timestep=t, encoder_hidden_states=cond["text"],
                                  encoder_attention_mask=cond["text_mask"].bool(), image_embeds=cond["image_embeds"],
                                  return_dict=False)[0]


def hunyuan_native(modules, x, t, cond):
    """HunyuanVideoPipeline's call: guidance passed as guidance_scale * 1000."""
    guidance = torch.full((x.shape[0],), 6.0) * 1000.0
    return modules["transformer"](x, t, cond["text"], cond["text_mask"], cond["pooled"], guidance=guidance,
                                  return_dict=False)[0]


def anyflow_native(modules, x, t, cond):
    """AnyFlowPipeline's call: frames first, one t and r per frame (r = t: the instantaneous velocity)."""
    frames = t[:, None].expand(x.shape[0], x.shape[2])
    out = modules["transformer"](x.permute(0, 2, 1, 3, 4), frames, frames, _masked(cond), return_dict=False)[0]
    return out.permute(0, 2, 1, 3, 4)


def kandinsky5_native(modules, x, t, cond):
    """Kandinsky5T2VPipeline's call: channels-last latents with the zero image condition and mask, the text as long as
    the batch's longest prompt (its tokenizer pads to that), RoPE positions of the patched grid, the pipeline's RoPE
    scale for the pixel size (latents x 8), dense attention."""
    transformer = modules["transformer"]
    latents = x.permute(0, 2, 3, 4, 1)
    b, f, h, w, _ = latents.shape
    if transformer.visual_cond:
        latents = torch.cat([latents, torch.zeros_like(latents), torch.zeros(b, f, h, w, 1)], dim=-1)
    length = int(cond["text_mask"].sum(dim=1).max())
    out = transformer(hidden_states=latents, encoder_hidden_states=cond["text"][:, :length],
                      pooled_projections=cond["pooled"], timestep=t,
                      visual_rope_pos=[torch.arange(f), torch.arange(h // 2), torch.arange(w // 2)],
                      text_rope_pos=torch.arange(length),
                      scale_factor=Kandinsky5T2VPipeline._get_scale_factor(None, h * 8, w * 8), sparse_params=None,
                      return_dict=True).sample
    return out.permute(0, 4, 1, 2, 3)


def helios_native(modules, x, t, cond):
    """HeliosPipeline's call: the zero-padded text, the memory split [first, newest] / mid / long with its positions."""
    index, memory, window = cond["frame_indices"].long(), cond["framepack_history"], x.shape[2]
    return modules["transformer"](
        hidden_states=x, timestep=t, encoder_hidden_states=_masked(cond), indices_hidden_states=index[:, :window],
        indices_latents_history_short=index[:, window:window + 2],
        indices_latents_history_mid=index[:, window + 2:window + 4],
        indices_latents_history_long=index[:, window + 4:], latents_history_short=memory[:, :, :2],
        latents_history_mid=memory[:, :, 2:4], latents_history_long=memory[:, :, 4:], return_dict=False)[0]


def kandinsky6_native(modules, x, t, cond):
    """Kandinsky6TI2VAPipeline's text-to-video call without audio: channels-last ``latents | zero condition | zero
    mask``, the text, its pooled vector and its mask as bools (None when nothing is padded, as the pipeline passes
    it), the visual RoPE positions left to the DiT."""
    latents = x.permute(0, 2, 3, 4, 1)
    hidden = torch.cat([latents, torch.zeros_like(latents), torch.zeros_like(latents[..., :1])], dim=-1)
    mask = cond["text_mask"].bool()
    out = modules["transformer"](hidden_states=hidden, encoder_hidden_states=cond["text"],
                                  pooled_projections=cond["pooled"], timestep=t, audio_hidden_states=None,
                                  encoder_attention_mask=None if mask.all() else mask, return_dict=False)
    assert len(out) == 1  # no audio without audio latents
    return out[0].permute(0, 4, 1, 2, 3)


def cosmos_native(modules, x, t, cond):
    """Cosmos2_5_PredictBasePipeline's text-to-world call: no conditioning frames (indicator and mask zero), the
    timestep ``indicator * 1e-4 + (1 - indicator) * sigma`` as [B, 1, T, 1, 1], a zero padding mask at the pixel size
    (latents x 8), the prompt embeds as they are, no fps; then the conditioning frames' velocity put back (none)."""
    b, _, f, h, w = x.shape
    indicator = torch.zeros(b, 1, f, 1, 1)
    mask = indicator.expand(-1, -1, -1, h, w)
    timestep = indicator * 0.0001 + (1 - indicator) * (t / 1000.0).view(b, 1, 1, 1, 1)
    out = modules["transformer"](hidden_states=x, condition_mask=mask, timestep=timestep,
                                 encoder_hidden_states=cond["text"], padding_mask=torch.zeros(1, 1, 8 * h, 8 * w),
                                 return_dict=False)[0]
    return x * mask + out * (1 - mask)


def ltx_video_native(modules, x, t, cond):
    """LTXPipeline's call: latents packed to tokens by its own _pack_latents, t (0..1000) per sample, the T5 mask as
    encoder_attention_mask, the latent grid and rope_interpolation_scale (vae_t / frame_rate, vae_s, vae_s) at its
    default frame_rate 25 with the LTX VAE's 8x32x32 compression; the tokens unpacked by its _unpack_latents."""
    _, _, f, h, w = x.shape
    out = modules["transformer"](hidden_states=LTXPipeline._pack_latents(x), encoder_hidden_states=cond["text"],
                                 timestep=t, encoder_attention_mask=cond["text_mask"], num_frames=f, height=h,
                                 width=w, rope_interpolation_scale=(8 / 25, 32, 32), return_dict=False)[0]
    return LTXPipeline._unpack_latents(out, f, h, w)


def hunyuan_video15_native(modules, x, t, cond):
    """HunyuanVideo15Pipeline's text-to-video call: [latents | zero condition latents | zero mask] on channels, the
    zero image_embeds placeholder of its 729 tokens, t as given (0..1000), the Qwen and ByT5 streams and masks."""
    b, c, f, h, w = x.shape
    transformer = modules["transformer"]
    hidden = torch.cat([x, torch.zeros(b, c, f, h, w), torch.zeros(b, 1, f, h, w)], dim=1)
    image_embeds = torch.zeros(b, 729, transformer.config.image_embed_dim)
    return transformer(hidden_states=hidden, image_embeds=image_embeds, timestep=t,
                       encoder_hidden_states=cond["text"], encoder_attention_mask=cond["text_mask"],
                       encoder_hidden_states_2=cond["text_2"], encoder_attention_mask_2=cond["text_mask_2"],
                       return_dict=False)[0]


def ltx2_native(modules, x, t, cond, fps: float = 24.0):
    """LTX2Pipeline's modality-isolated pass (video only): latents packed by its own _pack_latents, one zero audio
    latent frame and one zero audio text token, timestep = sigma = t, the latent grid and frame rate."""
    module = modules["transformer"]
    k = module.config
    b, _, f, h, w = x.shape
    audio_text = k["caption_channels"] if k["use_prompt_embeddings"] else k["audio_cross_attention_dim"]
    video, _ = module(hidden_states=LTX2Pipeline._pack_latents(x),
                      audio_hidden_states=torch.zeros(b, 1, k["audio_in_channels"]),
                      encoder_hidden_states=cond["text"], audio_encoder_hidden_states=torch.zeros(b, 1, audio_text),
                      timestep=t, sigma=t, encoder_attention_mask=cond["text_mask"], num_frames=f, height=h, width=w,
                      fps=fps, audio_num_frames=1, isolate_modalities=True,
                      use_cross_timestep=not k["use_prompt_embeddings"], return_dict=False)
    return LTX2Pipeline._unpack_latents(video, f, h, w)


CASES: dict[str, Case] = {
    "wan": Case(WanConfig(preset="tiny"), {"transformer": WanTransformer3DModel}, wan_native),
    "wan-ti2v": Case(WanConfig(preset="tiny-ti2v"), {"transformer": WanTransformer3DModel}, ti2v_native),
    "skyreels_v2": Case(SkyReelsV2Config(preset="tiny"), {"transformer": SkyReelsV2Transformer3DModel}, wan_native),
    "skyreels_v2-fps": Case(SkyReelsV2Config(preset="tiny-fps"), {"transformer": SkyReelsV2Transformer3DModel},
                            skyreels_fps_native),
    "wan_moe": Case(Wan22MoEConfig(preset="tiny"), {"transformer": WanTransformer3DModel,
                                                    "transformer_2": WanTransformer3DModel}, moe_native),
    "hunyuan_video": Case(HunyuanVideoConfig(preset="tiny"), {"transformer": HunyuanVideoTransformer3DModel},
                          hunyuan_native),
    "anyflow": Case(AnyFlowConfig(preset="tiny"), {"transformer": AnyFlowTransformer3DModel}, anyflow_native),
    "wan-i2v": Case(WanConfig(preset="tiny-i2v"), {"transformer": WanTransformer3DModel}, wan_i2v_native),
    "wan-ti2v-i2v": Case(WanConfig(preset="tiny-ti2v", first_frame=True), {"transformer": WanTransformer3DModel},
                         ti2v_i2v_native),
    "wan_moe-i2v": Case(Wan22MoEConfig(preset="tiny-i2v"), {"transformer": WanTransformer3DModel,
                                                             "transformer_2": WanTransformer3DModel}, moe_i2v_native),
    "kandinsky5": Case(Kandinsky5Config(preset="tiny"), {"transformer": Kandinsky5Transformer3DModel},
                       kandinsky5_native),
    "cosmos": Case(CosmosConfig(preset="tiny"), {"transformer": CosmosTransformer3DModel},
                   cosmos_native),
    "ltx_video": Case(LTXVideoConfig(preset="tiny"), {"transformer": LTXVideoTransformer3DModel}, ltx_video_native),
    "hunyuan_video15": Case(HunyuanVideo15Config(preset="tiny"), {"transformer": HunyuanVideo15Transformer3DModel},
                            hunyuan_video15_native),
    "ltx2": Case(LTX2Config(preset="tiny"), {"transformer": LTX2VideoTransformer3DModel}, ltx2_native),
    # ChronoEditPipeline calls its DiT as WanImageToVideoPipeline calls Wan 2.1 I2V; two latent frames (its RoPE's
    # own case: the edit at the end of the reasoning window)
    "chronoedit": Case(ChronoEditConfig(preset="tiny"), {"transformer": ChronoEditTransformer3DModel}, wan_i2v_native),
    "wan_vace": Case(WanVACEConfig(preset="tiny"), {"transformer": WanVACETransformer3DModel}, vace_native),
    "wan_vace_moe": Case(WanVACEMoEConfig(preset="tiny"), {"transformer": WanVACETransformer3DModel,
                                                           "transformer_2": WanVACETransformer3DModel},
                         vace_moe_native),
    "wan_animate": Case(WanAnimateConfig(preset="tiny"), {"transformer": WanAnimateTransformer3DModel},
                        animate_native),
    "cogvideox": Case(CogVideoXConfig(preset="tiny"), {"transformer": CogVideoXTransformer3DModel}, cogvideox_native),
    "cogvideox-2b": Case(CogVideoXConfig(preset="tiny-2b"), {"transformer": CogVideoXTransformer3DModel},
                         functools.partial(cogvideox_native, snr_shift_scale=3.0)),
    "cogvideox-i2v": Case(CogVideoXConfig(preset="tiny-i2v"), {"transformer": CogVideoXTransformer3DModel},
                          cogvideox_native),
    "cogvideox-1.5": Case(CogVideoXConfig(preset="tiny-1.5"), {"transformer": CogVideoXTransformer3DModel},
                          cogvideox_native),
    "cogvideox-1.5-i2v": Case(CogVideoXConfig(preset="tiny-1.5-i2v"), {"transformer": CogVideoXTransformer3DModel},
                              cogvideox_native),
    "motif_video-i2v": Case(MotifVideoConfig(preset="tiny-i2v", first_frame=True),
                            {"transformer": MotifVideoTransformer3DModel}, motif_video_i2v_native),
    "sana_video": Case(SanaVideoConfig(preset="tiny"), {"transformer": SanaVideoTransformer3DModel}, sana_video_native),
    "mochi": Case(MochiConfig(preset="tiny"), {"transformer": MochiTransformer3DModel}, mochi_native),
    "latte": Case(LatteConfig(preset="tiny"), {"transformer": LatteTransformer3DModel}, latte_native),
    "allegro": Case(AllegroConfig(preset="tiny"), {"transformer": AllegroTransformer3DModel}, allegro_native),
    "easyanimate": Case(EasyAnimateConfig(preset="tiny"), {"transformer": EasyAnimateTransformer3DModel},
                        easyanimate_native),
    "motif_video": Case(MotifVideoConfig(preset="tiny"), {"transformer": MotifVideoTransformer3DModel},
                        motif_video_native),
    "kandinsky6": Case(Kandinsky6Config(preset="tiny"), {"transformer": Kandinsky6Transformer3DModel},
                       kandinsky6_native),
    "helios": Case(HeliosConfig(preset="tiny"), {"transformer": HeliosTransformer3DModel}, helios_native),
}
FAMILIES = ["wan", "wan-ti2v", "skyreels_v2", "wan_moe", "hunyuan_video", "anyflow", "wan-i2v", "wan-ti2v-i2v",
            "kandinsky5", "cosmos", "ltx_video", "hunyuan_video15", "ltx2",
            "chronoedit", "wan_vace", "cogvideox", "sana_video", "mochi", "latte", "allegro",
            "easyanimate", "motif_video", "kandinsky6", "cogvideox-i2v", "helios",
            "wan_animate"]  # one case per family and layout
# (CogVideoX 1.5's and Motif-Video's image-to-video cases, another layout's inputs to a DiT the list has, run the tests
# of every case, CASES: forward, export, remat)


def native_modules(case: Case, params: dict) -> dict[str, torch.nn.Module]:
    """Each pipeline component as a real diffusers module holding its part of ``params``."""
    family, kwargs = case.config.family, dict(case.config.spec.kwargs)
    modules = {}
    for component, prefix in family.checkpoints.components.items():
        part = {name[len(prefix):]: p for name, p in params.items() if name.startswith(prefix)}
        modules[component] = _fresh(case.classes[component], kwargs, part)
    return modules


def inputs(model, key: torch.Tensor, *, batch: int = 2, frames: int = 2, size: int = 4, text_len: int = 5,
           t: tuple[float, ...] = (30.0, 910.5)):
    """(x_t, t, cond) for ``model``: normal latents and cond tensors from its spec, masks with padding in the last
    sample, per-sample timesteps (``t`` straddles Wan 2.2 A14B's boundary of 875)."""
    k = random.split(key, 2 + len(model.cond))
    x = random.normal(k[0], (batch, model.latents.channels, frames, size, size))
    cond = {}
    for i, (name, shape) in enumerate(model.cond.items()):
        dims = tuple({"L": text_len, "T": frames, "H": size, "W": size, "N": 3, "P": frames + 20,
                      "Tp": frames - 1, "Ff": 4 * (frames - 2) + 1}.get(s, s) for s in shape)
        if name == "frame_indices":  # a section's positions (fvx.data.sections' vanilla layout)
            layout = sections.SectionsConfig(window=frames, order="vanilla")
            cond[name] = sections.cut(torch.zeros(1, frames + 1, 1, 1), layout)[0]["frame_indices"].expand(batch, -1)
        elif name == "text_mask":
            mask = torch.ones(batch, text_len)
            mask[-1, text_len - 2:] = 0
            cond[name] = mask
        else:
            cond[name] = random.normal(k[2 + i], (batch, *dims))
    return x, torch.tensor(t[:batch], dtype=torch.float32), cond


def raw_batch(model, key: torch.Tensor, *, batch: int = 2, frames: int = 2, size: int = 4, text_len: int = 5,
              first: int = 0) -> dict:
    """A data batch as fvx.data.datasets makes it, for ``model``'s family (HunyuanVideo's text packs the pooled vector
    as row 0, as FastVideo's data does)."""
    x, _, cond = inputs(model, key, batch=batch, frames=frames, size=size, text_len=text_len)
    if "pooled" in cond:
        pooled = torch.nn.functional.pad(cond["pooled"], (0, cond["text"].shape[-1] - cond["pooled"].shape[-1]))
        text = torch.cat([pooled[:, None], cond["text"]], dim=1)
        mask = torch.cat([torch.ones(batch, 1), cond["text_mask"]], dim=1)
    else:
        text, mask = cond["text"], cond["text_mask"]
    image = {name: cond[name] for name in ("first_frame_latents", "image_embeds", "vace_context",  # I2V data,
                                           "framepack_history", "frame_indices",  # a section's, an animation's
                                           "reference_latents", "pose_latents", "face_pixels") if name in cond}
    if "first_frame_latents" in image:  # the first frame's latents (normalised, as FastVideo stores them), then zeros
        given = model.normalize(x[:, :, :1])
        image["first_frame_latents"] = torch.cat([given, torch.zeros_like(x[:, :, 1:])], dim=2)
    glyph = {}  # HunyuanVideo 1.5's ByT5 glyph embedding and its mask: batch entries of their own
    if "text_2" in cond:
        glyph = {"text_2": cond["text_2"], "text_mask_2": torch.ones(batch, cond["text_2"].shape[1])}
        glyph["text_mask_2"][-1, 1:] = 0
    return {"latents": x, "text": text, "text_mask": mask, "sample_index": torch.arange(first, first + batch), **image,
            **glyph}


def vp_finetune_draws(config: ModelConfig, abar: torch.Tensor) -> tuple:
    """fvx's fine-tuning loss of a tiny DDPM-schedule family (``abar``: its table) on a batch of 3 (params from key 0,
    the step's key 7), and what that step drew: ``(loss, params, batch, x0, noise, integer timesteps)``, for a
    reference to noise and score as the family's own trainer does."""
    from fvx.core import flow
    from fvx_methods import finetune
    from fvx_models import vp_flow

    model = config.build()
    params = model.weights.init(random.key(0))
    batch = model.batch(raw_batch(model, random.key(1), batch=3))
    key = random.key(7)
    loss, _ = finetune.loss_fn(params, batch, key, model=model, config=finetune.Finetune())
    x0 = model.normalize(batch["latents"])
    noise, t_keys = flow.per_sample_noise(key, batch["sample_index"], tuple(x0.shape[1:]), x0.device)
    sigma, _ = model.rules.sigma_sampler(t_keys, x0)
    return loss, params, batch, x0, noise, vp_flow.timestep_of(abar, sigma).round().long()


def causal_loss_and_grads(config: ModelConfig, mesh=None, rows: Callable[[dict], dict] = lambda batch: batch):
    """Loss and full gradients of a tiny block-causal Wan (``config``: blocks of 1 frame) on a global batch of 4, of
    which this rank takes ``rows``: its per-frame-timestep forward, the teacher-forced one and a KV-cached chunk after
    a cached clean frame (on ``mesh``: the rank-mean loss and the unsharded gradients)."""
    model = config.build(**({} if mesh is None else {"mesh": mesh}))
    params = model.weights.init(random.key(0))
    raw = raw_batch(model, random.key(40), batch=4)
    t = torch.tensor([[900.0, 10.0], [500.0, 600.0], [0.0, 999.0], [250.0, 250.0]])
    local = rows({**raw, "t": t})
    cond = model.batch({k: local[k] for k in raw})["cond"]
    x, clean = local["latents"], local["latents"].flip(-1)

    def loss_fn(p):
        full = model.apply(p, x, local["t"], cond)
        forced = model.causal.apply_teacher_forced(p, x, local["t"], cond, clean)
        _, cache = model.causal.apply_cached(p, clean[:, :, :1], local["t"][:, 0] * 0, cond,
                                             model.causal.empty_cache(x.shape[2]))
        cached, _ = model.causal.apply_cached(p, x[:, :, 1:], local["t"][:, 1], cond, cache)
        return full.square().mean() + forced.square().mean() + cached.square().mean()

    loss, grads = grad.value_and_grad(loss_fn)(params)
    if mesh is None:
        return float(loss), grads
    return float(processes.dp_mean(loss, processes.group_of(mesh))), sharding.unshard(grads, mesh)
