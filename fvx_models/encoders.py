"""A family's data encoders: the VAE, text encoder(s) and image encoder its diffusers pipeline loads from a folder.

A family spec declares one :class:`Encoders` record (its ``Family.encoders``): which diffusers
pipeline class loads the components, which folder components each encoding needs, and how each is called, exactly as
that pipeline calls it (its ``encode_prompt``; its VAE's ``encode``). ``preprocess`` (``fvx.data.preprocess``),
``encode-prompts`` and ``sample`` open the same record with :meth:`Encoders.open`, which loads only the components asked
for, as diffusers loads them (``Pipeline.from_pretrained(folder, <component>=None for the others)``), in one dtype.

The tensors at this interface are what FastVideo's parquet stores (``fvx.data.parquet``), one sample at a time:
a text embedding ``[L, D]`` (its real tokens only: the reader pads and masks), VAE latents ``[C, t, h, w]`` in the
VAE's own scale (training normalises them), I2V's first-frame latents (normalised, as FastVideo stores them) and
image features ``[N, D]``. Videos come in as ``[3, T, H, W]`` float in [-1, 1].
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Callable, Iterable

import torch

from fvx_models import diffusers_folder as dfolder

Part = str  # "text", "video", "first_frame", "image", "audio", "context", "animation", "decode": what a record encodes

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Encoders:
    """How a family encodes its data (the module docstring).

    pipeline         the diffusers pipeline class whose ``from_pretrained`` loads the components and whose
                     ``encode_prompt`` makes the text embedding (a folder whose ``model_index.json`` names another
                     diffusers pipeline, e.g. the family's I2V one, loads with that)
    text             the folder components text encoding needs (e.g. ``("tokenizer", "text_encoder")``)
    encode_text(pipe, prompts) -> [[L, D], ...]   each prompt's text embedding as stored: the pipeline's
                     ``encode_prompt`` output cut to its real tokens (packed as the family's data packs it);
                     ``text_states_clip``: it is ``encode_text(pipe, prompts, clips)``, each prompt's
                     ``fvx.data.preprocess.Clip`` (length, rate, size) stated in its text as the pipeline states it
                     (Cosmos 3's duration and resolution sentences)
    text_2, encode_text_2(pipe, prompts) -> [[L2, D2], ...]   a second text stream the family's DiT reads beside the
                     first (HunyuanVideo 1.5's ByT5 glyph text), stored in fvx's ``text_embedding_2`` column; empty /
                     None: the family has one stream
    video            the components video encoding needs
    encode_video(pipe, video) -> latents   video ``[B, 3, T, H, W]`` in [-1, 1] -> ``[B, C, t, h, w]`` VAE latents,
                     the posterior's mean (no draw), in the VAE's own scale
    decode_video(pipe, latents) -> video   VAE latents ``[B, C, t, h, w]`` in its own scale (a model's
                     ``denormalize`` undoes the DiT's scaling) -> video ``[B, 3, T, H, W]`` in [-1, 1] (default: the
                     pipeline's ``vae.decode(latents).sample``)
    frame_step       clips hold ``frame_base + frame_step * k`` frames (the VAE's temporal compression; 1: any
                     count); ``frame_base`` 1 but for a family whose clips start otherwise (MiniMax-H3's 17 n + 5)
    pixel_multiple   heights and widths are multiples of this (the VAE's spatial compression times the DiT's patch)
    image, encode_image(pipe, frames) -> [B, N, D]   I2V's image encoder (frames ``[B, 3, H, W]`` in [0, 1]) as the
                     I2V pipeline calls it; empty / None: the family's I2V has none
    image_wanted(config) -> bool   whether a model of ``config`` reads image features (Wan 2.1 I2V's CLIP embedding;
                     not Wan 2.2's I2V, whose folders have no image encoder: FastVideo then stores empty bytes)
    first_frame(pipe, video) -> latents   I2V's condition latents ``[B, C, t, h, w]``: the first frame followed by zero
                     frames, encoded and normalised as FastVideo stores them (default: the family has no I2V)
    context(pipe, video, mask, references) -> [1, C', t, h, w]   a control family's context of one control video
                     ``[1, 3, T, H, W]`` in [-1, 1], its mask ``[1, 1, T, H, W]`` in [0, 1] (None: everything to be
                     made) and reference images (``[3, H, W]`` in [-1, 1]) as its pipeline builds it (VACE's);
                     ``references(pipe, images) -> [C, R, h, w]`` the reference images' latent frames in the VAE's own
                     scale, which go in front of the video's; None: the family takes no control context
    animation(pipe, reference, pose, face, previous, background, mask) -> {name: tensor}   a character-animation
                     family's inputs of one segment (Wan-Animate's, in its animate or replace mode:
                     ``fvx_models.wan_animate.encode_animation``); None: it takes none
    audio, encode_audio(pipe, waveform, rate) -> [B, C, F, A]   a joint model's audio latents from stereo waveforms
                     ``[B, 2, S]`` at ``rate`` Hz; ``audio_refusal``: why there is none (one line)
    stand_ins        ``(component, object)`` pairs given to ``from_pretrained`` in place of a component encoding never
                     uses that the pipeline would build itself when given None (Cosmos 2.5's safety checker)
    load(folder, components, dtype) -> pipe   loads ``components`` itself, for a pipeline whose ``from_pretrained``
                     loads none (a diffusers modular pipeline: MiniMax-H3's); None: ``from_pretrained`` as above
    own_loaders      ``(component, load(path))`` pairs: components fvx loads itself from their subfolder, where the
                     class ``model_index.json`` names does not load them as the pipeline was written for
                     (HunyuanVideo's Llama 3 tokenizer under transformers 5; Kandinsky 5's processor, whose text call
                     is its tokenizer's, without torchvision)
    """

    pipeline: str
    text: tuple[str, ...]
    encode_text: Callable[..., list[torch.Tensor]]
    text_states_clip: bool = False
    text_2: tuple[str, ...] = ()
    encode_text_2: Callable[[Any, list[str]], list[torch.Tensor]] | None = None
    video: tuple[str, ...] = ("vae",)
    encode_video: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    decode_video: Callable[[Any, torch.Tensor], torch.Tensor] = lambda pipe, latents: pipe.vae.decode(latents).sample
    frame_step: int = 4
    frame_base: int = 1
    pixel_multiple: int = 16
    image: tuple[str, ...] = ()
    encode_image: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    image_wanted: Callable[[Any], bool] = lambda config: True
    first_frame: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    context: Callable[[Any, torch.Tensor, torch.Tensor | None, list[torch.Tensor]], torch.Tensor] | None = None
    references: Callable[[Any, list[torch.Tensor]], torch.Tensor] | None = None
    animation: Callable[..., dict[str, torch.Tensor]] | None = None
    audio: tuple[str, ...] = ()
    encode_audio: Callable[[Any, torch.Tensor, int], torch.Tensor] | None = None
    audio_refusal: str | None = None
    stand_ins: tuple[tuple[str, Any], ...] = ()
    load: Callable[[pathlib.Path, tuple[str, ...], torch.dtype], Any] | None = None
    own_loaders: tuple[tuple[str, Callable[[pathlib.Path], Any]], ...] = ()

    def components(self, parts: Iterable[Part]) -> tuple[str, ...]:
        """The folder components ``parts`` need, in a fixed order."""
        needed: list[str] = []
        for part in parts:
            for name in {"text": self.text + self.text_2, "video": self.video, "first_frame": self.video,
                         "context": self.video, "animation": self.video,
                         "image": self.image, "audio": self.audio, "decode": self.video}[part]:
                if name not in needed:
                    needed.append(name)
        return tuple(needed)

    def refusal(self, parts: Iterable[Part]) -> str | None:
        """Why this family cannot encode ``parts`` (one line), or None."""
        parts = set(parts)
        if "first_frame" in parts and self.first_frame is None:
            return "it has no image-to-video encoding in fvx (no first-frame latents)"
        if "context" in parts and self.context is None:
            return "it takes no control context in fvx (VACE's control video, mask and reference images)"
        if "animation" in parts and self.animation is None:
            return "it takes no animation inputs in fvx (Wan-Animate's reference image, pose and face videos)"
        if "image" in parts and self.encode_image is None:
            return "it has no image encoder in fvx"
        if "audio" in parts and self.encode_audio is None:
            return self.audio_refusal or "it encodes no audio"
        if "video" in parts and self.encode_video is None:
            return "it has no video encoder in fvx"
        return None

    def check(self, folder: pathlib.Path, parts: tuple[Part, ...], who: str) -> dict[str, Any]:
        """``folder``'s ``model_index.json`` after checking that the family can encode ``parts`` and that the folder
        has every component they need; a one-line ValueError naming the first problem."""
        why = self.refusal(parts)
        if why is not None:
            raise ValueError(f"{who}: the family cannot encode {', '.join(parts)}: {why}")
        index = _model_index(folder, who)
        for name in self.components(parts):
            if index.get(name) in (None, [None, None]) or not (folder / name).is_dir():
                raise ValueError(f"{who} {str(folder)!r} has no {name!r} component (in model_index.json and a "
                                 f"{name}/ folder), which {', '.join(parts)} encoding needs")
        if "video" in parts and "vae" in self.video:
            _require_encoder_weights(folder / "vae", who)
        return index

    def open(self, folder: str | pathlib.Path, parts: Iterable[Part], *, dtype: str = "fp32",
             device: torch.device | str = "cpu", who: str = "the model folder") -> Opened:
        """The components ``parts`` need, loaded from ``folder`` (a diffusers pipeline root) as diffusers loads them.

        A ValueError (one line, naming the folder and the component) when the folder lacks one: checked from its
        ``model_index.json`` and subfolders before any weight is read."""
        parts, folder = tuple(parts), pathlib.Path(folder)
        index = self.check(folder, parts, who)
        needed = self.components(parts)
        import diffusers  # diffusers' pipelines import slowly: only when a folder is opened

        named = index.get("_class_name")  # the folder's own pipeline (an I2V folder's loads its image encoder)
        pipeline_class = getattr(diffusers, named if isinstance(named, str) and hasattr(diffusers, named)
                                 else self.pipeline)
        own = dict(self.own_loaders)
        skipped = {name: None for name, value in index.items()
                   if not name.startswith("_") and isinstance(value, list) and (name not in needed or name in own)}
        pipe = (self.load(folder, needed, _DTYPES[dtype]) if self.load is not None else
                pipeline_class.from_pretrained(folder, dtype=_DTYPES[dtype], **{**skipped, **dict(self.stand_ins)}))
        for name, load in own.items():  # set afterwards: from_pretrained refuses an object of another class
            if name in needed:
                setattr(pipe, name, load(folder / name))
        for name in needed:
            module = getattr(pipe, name, None)
            if isinstance(module, torch.nn.Module):
                module.requires_grad_(False).eval()
        if "decode" in parts and hasattr(getattr(pipe, "vae", None), "enable_tiling"):
            pipe.vae.enable_tiling()  # diffusers' VAEs tile only frames larger than a tile: large videos
        return Opened(self, pipe, needed, torch.device(device), parts)


@dataclasses.dataclass
class Opened:
    """An :class:`Encoders` record with its components loaded. Each encoding moves the components it needs to
    ``device`` and the others back to the CPU, so one device holds one encoder at a time."""

    encoders: Encoders
    pipe: Any
    components: tuple[str, ...]
    device: torch.device
    parts: tuple[Part, ...] = ()

    def _use(self, names: tuple[str, ...]) -> None:
        for name in self.components:
            module = getattr(self.pipe, name, None)
            if isinstance(module, torch.nn.Module):
                module.to(self.device if name in names else "cpu")

    @torch.no_grad()
    def encode_text(self, prompts: list[str], clips: list[Any] | None = None) -> list[torch.Tensor]:
        """Each prompt's stored text embedding ``[L, D]`` fp32 on the CPU; ``clips``: what each describes
        (``fvx.data.preprocess.Clip``), which a family whose text states it needs (a ValueError without)."""
        self._use(self.encoders.text)
        if not self.encoders.text_states_clip:
            return [t.float().cpu() for t in self.encoders.encode_text(self.pipe, list(prompts))]
        if clips is None or len(clips) != len(prompts):
            raise ValueError(f"{self.encoders.pipeline} states each prompt's clip (length, rate, size) in its text: "
                             "encode prompts with their clips")
        return [t.float().cpu() for t in self.encoders.encode_text(self.pipe, list(prompts), list(clips))]

    @torch.no_grad()
    def encode_text_2(self, prompts: list[str]) -> list[torch.Tensor] | None:
        """Each prompt's second text stream ``[L2, D2]`` fp32 on the CPU; None when the family has one stream."""
        if self.encoders.encode_text_2 is None:
            return None
        self._use(self.encoders.text_2)
        return [t.float().cpu() for t in self.encoders.encode_text_2(self.pipe, list(prompts))]

    @torch.no_grad()
    def encode_video(self, video: torch.Tensor) -> torch.Tensor:
        """Latents ``[C, t, h, w]`` fp32 of one clip ``[3, T, H, W]`` in [-1, 1]."""
        self._use(self.encoders.video)
        vae = self.pipe.vae
        x = video[None].to(self.device, vae.dtype)
        return self.encoders.encode_video(self.pipe, x)[0].float().cpu()

    @torch.no_grad()
    def decode_video(self, latents: torch.Tensor) -> torch.Tensor:
        """Videos ``[B, 3, T, H, W]`` fp32 in [0, 1] on the CPU of VAE latents ``[B, C, t, h, w]`` in its own scale."""
        self._use(self.encoders.video)
        x = latents.to(self.device, self.pipe.vae.dtype)
        return (self.encoders.decode_video(self.pipe, x).float().cpu() / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode_first_frame(self, video: torch.Tensor) -> torch.Tensor:
        """I2V's condition latents ``[C, t, h, w]`` of one clip ``[3, T, H, W]`` in [-1, 1]."""
        self._use(self.encoders.video)
        x = video[None].to(self.device, self.pipe.vae.dtype)
        return self.encoders.first_frame(self.pipe, x)[0].float().cpu()

    @torch.no_grad()
    def encode_context(self, video: torch.Tensor, mask: torch.Tensor | None,
                       references: list[torch.Tensor]) -> torch.Tensor:
        """A control family's context ``[C', t, h, w]`` of a control video ``[3, T, H, W]`` in [-1, 1], its mask
        ``[1, T, H, W]`` in [0, 1] (None: ones) and reference images ``[3, H, W]`` in [-1, 1]."""
        self._use(self.encoders.video)
        dtype = self.pipe.vae.dtype
        mask = None if mask is None else mask[None].to(self.device, dtype)
        refs = [image.to(self.device, dtype) for image in references]
        return self.encoders.context(self.pipe, video[None].to(self.device, dtype), mask, refs)[0].float().cpu()

    @torch.no_grad()
    def encode_references(self, references: list[torch.Tensor]) -> torch.Tensor:
        """The reference images' latent frames ``[C, R, h, w]`` (VAE scale) of images ``[3, H, W]`` in [-1, 1]."""
        self._use(self.encoders.video)
        refs = [image.to(self.device, self.pipe.vae.dtype) for image in references]
        return self.encoders.references(self.pipe, refs).float().cpu()

    @torch.no_grad()
    def encode_animation(self, reference: torch.Tensor, pose: torch.Tensor, face: torch.Tensor,
                         previous: torch.Tensor | None = None, background: torch.Tensor | None = None,
                         mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """A character-animation family's inputs of one segment (:attr:`Encoders.animation`): a reference image
        ``[3, H, W]``, a pose video ``[3, F, H, W]`` and the previous segment's last frames ``[3, P, H, W]`` (None:
        none) in [-1, 1], the face video ``[3, F, S, S]`` uint8; the replace mode's background video ``[3, F, H, W]``
        and its mask ``[1, F, H, W]`` (1: to be made; None: the animate mode)."""
        self._use(self.encoders.video)
        dtype = self.pipe.vae.dtype

        def on_device(video: torch.Tensor | None) -> torch.Tensor | None:
            return None if video is None else video.to(self.device, dtype)

        out = self.encoders.animation(self.pipe, on_device(reference), on_device(pose), face, on_device(previous),
                                      on_device(background), None if mask is None else mask.to(self.device))
        return {name: t.cpu() if t.dtype == torch.uint8 else t.float().cpu() for name, t in out.items()}

    @torch.no_grad()
    def encode_image(self, frame: torch.Tensor) -> torch.Tensor | None:
        """I2V's image features ``[N, D]`` of a frame ``[3, H, W]`` in [0, 1]; None when the image encoder was not
        opened (the model reads no image features: FastVideo then stores empty bytes)."""
        if self.encoders.encode_image is None or "image" not in self.parts:
            return None
        self._use(self.encoders.image)
        return self.encoders.encode_image(self.pipe, frame[None].to(self.device))[0].float().cpu()

    @torch.no_grad()
    def encode_audio(self, waveform: torch.Tensor, rate: int) -> torch.Tensor:
        """Audio latents ``[C, F, A]`` of a stereo waveform ``[2, S]`` at ``rate`` Hz."""
        self._use(self.encoders.audio)
        return self.encoders.encode_audio(self.pipe, waveform[None].to(self.device), rate)[0].float().cpu()


def _require_encoder_weights(vae: pathlib.Path, who: str) -> None:
    """A ValueError unless the VAE folder's safetensors hold its encoder (``encoder.*``): a decoder-only VAE (as some
    exports ship) would otherwise load with a randomly initialised encoder and only a warning."""
    files = sorted(vae.glob("*.safetensors"))
    if not files:
        return  # another weight format: diffusers reports what it cannot load
    if not any(name.startswith("encoder.") for name in dfolder.stored_shapes(files, who)):
        raise ValueError(f"{who}: the VAE in {str(vae)!r} has no encoder weights (encoder.*; a decoder-only VAE), "
                         "which video encoding needs")


def _model_index(folder: pathlib.Path, who: str) -> dict[str, Any]:
    path = folder / "model_index.json"
    if not path.is_file() and (folder / "modular_model_index.json").is_file():  # a modular pipeline's only index
        path = folder / "modular_model_index.json"
    if not path.is_file():
        raise ValueError(f"{who} {str(folder)!r} is not a diffusers pipeline folder (it has no model_index.json)")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{who}: {str(path)!r} is not readable JSON: {error}") from None


# ------------------------------------------------------------------------------------------- shared encoding steps


def processor_tokenizer(path: pathlib.Path) -> Any:
    """A folder's ``Qwen2VLProcessor`` (``Qwen2_5_VLProcessor``) as its tokenizer, loaded as the processor loads it
    (``AutoTokenizer``): the Kandinsky pipelines call the processor on text alone, which it hands to this tokenizer
    unchanged, and transformers 5 builds the processor itself only with torchvision (its video processor's)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path)


class NoSafetyChecker:
    """Given to a Cosmos pipeline as its ``safety_checker``, which it would otherwise build (``cosmos_guardrail``, its
    own models): encoding never calls it."""


def real_tokens(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Rows ``[L_i, D]`` of a padded ``[B, L, D]`` embedding: each prompt's tokens where ``mask`` ``[B, L]`` is set
    (padding is the reader's job: it pads to ``data.text_len`` and masks)."""
    return [e[m.bool()] for e, m in zip(embeds, mask)]


def latent_mean(vae: Any, video: torch.Tensor) -> torch.Tensor:
    """The mean (mode) of a diffusers VAE's posterior of ``video`` ``[B, 3, T, H, W]`` in [-1, 1]: no noise drawn."""
    return vae.encode(video).latent_dist.mode()


def scaled_first_frame(pipe: Any, video: torch.Tensor) -> torch.Tensor:
    """Image-to-video's condition of a pipeline that encodes the image alone and scales it by the VAE's
    ``scaling_factor`` (CogVideoX's ``prepare_latents``, Kandinsky 6's ``encode_image``; the mean where they sample),
    then zero latent frames to the clip's latent length: ``[B, C, t, h, w]``."""
    first = latent_mean(pipe.vae, video[:, :, :1]).float() * pipe.vae.config.scaling_factor
    frames = (video.shape[2] - 1) // pipe.vae_scale_factor_temporal + 1
    return torch.cat([first, first.new_zeros(*first.shape[:2], frames - 1, *first.shape[3:])], dim=2)


def token_mask(tokenizer: Any, max_length: int, prompts: list[str], *, clean: bool = False) -> torch.Tensor:
    """The attention mask ``[B, max_length]`` a pipeline's ``encode_prompt`` tokenizes ``prompts`` with (padded to
    ``max_length``, truncated; ``clean``: after diffusers' Wan ``prompt_clean``)."""
    if clean:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        prompts = [prompt_clean(p) for p in prompts]
    return tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True, add_special_tokens=True,
                     return_attention_mask=True, return_tensors="pt").attention_mask


def pil_images(frames: torch.Tensor) -> list[Any]:
    """Frames ``[B, 3, H, W]`` in [0, 1] as RGB PIL images (the 8-bit pixels they were decoded from)."""
    from PIL import Image

    pixels = (frames.float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(p) for p in pixels]


def pipeline_normalized_latents(pipe: Any, video: torch.Tensor) -> torch.Tensor:
    """The VAE's posterior mean of ``video`` ``[B, 3, T, H, W]`` in [-1, 1], normalised by its statistics as the
    pipeline's ``_normalize_latents`` does (``(z - latents_mean) * scaling_factor / latents_std``): ``[B, C, t, h, w]``
    in the DiT's scale (the LTX pipelines' static method: LTX-Video's and LTX-2's)."""
    vae = pipe.vae
    return pipe._normalize_latents(latent_mean(vae, video), vae.latents_mean, vae.latents_std,
                                   vae.config.scaling_factor)
