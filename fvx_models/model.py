"""The model interface methods see: one DiT of a family as pure functions over a params dict.

A family's config (``fvx_models.wan.WanConfig``, ...) builds a :class:`Model` through the generic builder
(``fvx_models.build``). Methods reach a model only through these fields; they never touch the skeleton module and
never name a family's conditioning keys. Tensors at this interface are in fvx's canonical layout: latents
``[B, C, T, H, W]``, timesteps ``[B]`` on the 0..1000 scale (``t = 1000 sigma``), conditioning a ``cond`` dict that the
family builds from the data (``Model.batch(raw)["cond"]``), and the output is the flow velocity ``v = noise - x0`` in
the latents' layout, whatever the family predicts natively.
"""
from __future__ import annotations

import contextlib
import dataclasses
import pathlib
from typing import Any, Callable, ContextManager, Mapping, NamedTuple

import torch

Params = dict[str, torch.Tensor]  # keyed like the diffusers state_dict, or its fvx.distributed.sharding.Shards
Cond = Mapping[str, torch.Tensor]  # the family's conditioning tensors, each with a leading batch dim


class LatentSpace(NamedTuple):
    """The VAE latents a model denoises: ``channels``, and how VAE latents map to the DiT's input scale,
    ``normalize(x) = ((x - mean_c) / std_c) * scale`` (per-channel statistics as Wan's VAEs, or a scalar scaling
    factor as HunyuanVideo's; None: 0 and 1; channels are dim 1 of video ``[B, C, T, H, W]`` and audio
    ``[B, C, F, A]`` latents alike). ``vae_stride`` is the VAE's (time, height, width) compression and ``vae`` names the
    VAE, for messages. Two models can share a batch only when their latent spaces are equal."""

    channels: int
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    scale: float = 1.0
    vae_stride: tuple[int, int, int] = (4, 8, 8)
    vae: str = ""

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents ``[B, C, T, H, W]`` -> the DiT's input scale, computed in fp32, returned in x's dtype."""
        x = latents.float()
        if self.mean is not None:
            x = x - self._stats(self.mean, latents)
        if self.std is not None:
            x = x / self._stats(self.std, latents)
        if self.scale != 1.0:
            x = x * self.scale
        return x.to(latents.dtype)

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`normalize`, before a VAE decode."""
        x = latents.float()
        if self.scale != 1.0:
            x = x / self.scale
        if self.std is not None:
            x = x * self._stats(self.std, latents)
        if self.mean is not None:
            x = x + self._stats(self.mean, latents)
        return x.to(latents.dtype)

    @staticmethod
    def _stats(values: tuple[float, ...], like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=like.device).view(1, -1, *(1,) * (like.dim() - 2))


@dataclasses.dataclass(frozen=True)
class Causal:
    """What a block-causal model adds to :class:`Model`: latent frames form blocks of ``frames_per_block``; a token
    attends to the tokens of its own block and of earlier blocks (those at most ``window`` frames back from its
    block's end, -1: all, plus the first ``sink`` frames), never to later ones. The KV cache is an explicit value
    (``fvx_models.block_causal.KVCache``), never state held by the model.

    empty_cache(frames) -> cache       the cache of a stream of ``frames`` latent frames, holding none yet (fixed
                                       shape: a ring of what a block can see, ``fvx_models.block_causal``)
    apply_cached(params, x_t, t, cond, cache) -> (v, cache)   the velocity of the next whole blocks ``x_t
                                       [B, C, f, H, W]`` (``t [B]`` or ``[B, f]``) attending to the cached frames, and
                                       the cache with these blocks' keys and values written (what the next block
                                       can see): keep it after a pass over the clean (context) frames, drop it
                                       after a denoising pass
    apply_teacher_forced(params, x_t, t, cond, clean) -> v    teacher forcing: noisy block ``b`` of ``x_t``
                                       attends to itself and the *clean* blocks ``< b`` of ``clean`` (same shape),
                                       in one forward over the ``[clean | noisy]`` sequence
    allocated_cache(frames, shape, device) -> cache   the empty cache of a stream of ``frames`` latent frames, its
                                       tensors allocated (zeros) for chunks of ``shape`` ``[B, C, f, H, W]``: a value
                                       of fixed shape to carry across training steps
    cache_bytes(frames, shape) -> int  the bytes of that cache (the dry run's carried state)
    max_frames                         the most latent frames a stream can reach (its position table), or None
    """

    frames_per_block: int
    window: int
    sink: int
    empty_cache: Callable[[int], Any]
    apply_cached: Callable[..., tuple[torch.Tensor, Any]]
    apply_teacher_forced: Callable[..., torch.Tensor]
    allocated_cache: Callable[[int, tuple[int, ...], torch.device], Any] | None = None
    cache_bytes: Callable[[int, tuple[int, ...]], int] | None = None
    max_frames: int | None = None


class Written(NamedTuple):
    """What an export wrote: pipeline component -> its folder or file, what a person runs to load them, and the
    dtypes its tensors are stored in."""

    files: dict[str, pathlib.Path]
    how_to_load: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ("float32",)


class StepRange(NamedTuple):
    """One of the timestep ranges a model trains one of per step (:attr:`Rules.step_ranges`): chosen with
    ``probability``, its levels those with ``t_min <= t < t_max`` (0..1000)."""

    probability: float
    t_min: float
    t_max: float


@dataclasses.dataclass(frozen=True)
class Weights:
    """A model's params: drawn, read from a folder, what a role trains and what it holds frozen. Params are *placed*:
    what these return is what :attr:`Model.apply` takes, this rank's local shards (an
    ``fvx.distributed.sharding.Shards``) when the model is built on a device mesh, else whole tensors. No method places
    or casts params itself.

    init(key) -> params             the architecture's random fp32 params from an fvx key (no adapters; tests)
    load(folder) -> params          the architecture's params from a local diffusers folder (a pipeline root or the
                                    component folder), fp32
    initial(key)                    what a role of this model trains and saves, fp32: every param, or those a
                                    family config leaves trainable (one expert), or the adapters (``lora``: A drawn,
                                    B zeros); read from the config's ``path`` when it names a folder, else drawn
    base(key, whole_model=)         what a trained role holds frozen (the base of a LoRA model, an expert left
                                    frozen; ``{}`` for a plain model), in the config's ``frozen_dtype`` (bf16 but
                                    the modules diffusers keeps in fp32), detached; ``whole_model=True``: every
                                    param of the architecture, as a frozen role (a teacher) holds it
    base_id(whole_model=)           what ``base`` holds, hashable (None when nothing): equal ids give equal tensors
                                    from the same key, so roles share one copy (``fvx.core.role.frozen_params``)
    trained_names                   the params ``initial`` returns
    layout                          the shard layout on a mesh, else None
    """

    init: Callable[[torch.Tensor], Params]
    load: Callable[[str], Params]
    initial: Callable[[torch.Tensor], Params]
    base: Callable[..., Params]
    base_id: Callable[..., Any]
    trained_names: frozenset[str]
    layout: Mapping[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class Exports:
    """What a model writes for people and other tools.

    folder(params, folder, form=, dtype=, stem=) -> Written   whole params (base and trained; adapters merged into
                                    their weights, in fp32) -> ``form="diffusers"``: a diffusers pipeline folder, the
                                    family's component folders (``transformer/``, ...) and pipeline files that
                                    ``from_pretrained`` loads; ``"comfyui"``: one file per component in the family's
                                    original layout, named after ``stem`` (fvx_models.original_layout). Each param is
                                    written in ``dtype`` ("fp32", "bf16"), or by default as trained (fp32) or, for
                                    what the role held frozen, as the base folder stores it (``build.export_dtypes``)
    adapters(params, folder, form, stem=) -> Written   a LoRA model's adapters as files other tools load
                                    (``"peft"`` for diffusers' ``load_lora_weights``, ``"comfyui"``, ``"musubi"``,
                                    named after ``stem``; fvx_models.lora_files); None for a model without adapters
    formats, adapter_formats        the forms ``folder`` and ``adapters`` write (the original layouts when the family
                                    has one)
    """

    folder: Callable[..., Written]
    adapters: Callable[..., Written] | None = None
    formats: tuple[str, ...] = ("diffusers",)
    adapter_formats: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Rules:
    """What a method must respect when it trains or samples the model: the family's own noise levels and timestep
    ranges, what latents fit, and what the model cannot do (each refusal a one-line reason, None when it can).

    sigma_sampler(keys, x0) -> (sigma, t)   the model's own training noise levels from per-sample keys ``[B, 2]``
                                    (dicts keyed by modality for a joint model), which replace a method's timestep
                                    density; None: the method's
    step_ranges                     timestep ranges (:class:`StepRange`) of which a step trains one, drawn from the
                                    step key, the same on every rank and micro-batch (Wan 2.2 A14B: one expert's
                                    range per step); a method drawing its levels from a density (fine-tuning) maps
                                    its draws onto the chosen range's levels; (): one range, the whole grid
    joint_sigmas(levels) -> {modality: levels}   a joint model's per-modality levels ``[K]`` at the shared clock's
                                    ``levels`` ``[K]``, what its samplers step along (``flow.euler_sample``)
    latent_rule(shape) -> why       why latents of ``shape`` do not fit beyond :meth:`Model.check_latents`' rule (a
                                    trained resolution range), or None
    cfg_dropout_refusal             why the model refuses data with CFG dropout, or None
    two_time                        ``apply(params, x_t, t, cond, r=)`` takes a second time ``r [B]``: the model is a
                                    flow map, ``u`` the average velocity from ``t`` to ``r`` (``x_r = x_t - ((t - r) /
                                    1000) u``); ``r`` left out is ``t``, the instantaneous velocity
    two_time_refusal                why no config of the model's family takes a second time ``r`` and which families
                                    do (a flow map's refusal); None when its config can (``ModelConfig.two_time``)
    forward_ad_refusal              why ``apply`` has no forward-mode derivatives (its attention kernel), or None
    loss_weight(sigma) -> [B]       the per-sample weight of a velocity loss at levels ``sigma [B]`` (a family
                                    trained with another objective: CogVideoX's); None: one
    sampling_sigmas(steps) -> [K]   the levels the family's own pipeline samples on (``validation.schedule=model``);
                                    None: it has none
    corrupt_cond(keys, cond) -> cond   the family's training-time corruption of a batch's cond, one draw per sample
                                    from its key ``[B, 2]`` (Helios's noised and dropped history), which fine-tuning
                                    applies; None: none
    """

    sigma_sampler: Callable[[torch.Tensor, Any], tuple[Any, Any]] | None = None
    step_ranges: tuple[StepRange, ...] = ()
    joint_sigmas: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None = None
    latent_rule: Callable[[tuple[int, ...]], str | None] = lambda shape: None
    cfg_dropout_refusal: str | None = None
    two_time: bool = False
    two_time_refusal: str | None = None
    forward_ad_refusal: str | None = None
    loss_weight: Callable[[torch.Tensor], torch.Tensor] | None = None
    sampling_sigmas: Callable[[int], torch.Tensor] | None = None
    corrupt_cond: Callable[[torch.Tensor, Any], Any] | None = None


@dataclasses.dataclass(frozen=True)
class Kernels:
    """How ``apply`` computes: the attention kernel and what a training step runs within, and the compiled graphs.

    attention                       the kernel of its self-attention (``fvx_models.attention.kernels``)
    attention_step(step) -> context  what a training step ``step`` runs within: VSA at its scheduled sparsity (the
                                    context's value; None for other kernels), QAT in its training form (outside:
                                    validation's forms); the experiment enters it around every step of every model
    dense_apply                     a VSA model's ``apply`` in the dense view (sparsity 0, its gate kept), what
                                    FastVideo's critic and teacher see; None for other kernels (see
                                    :meth:`Model.dense`)
    compile_stats                   the ``fvx.distributed.compile.CompileStats`` of the compiled units, or None
    """

    attention: str = "sdpa"
    attention_step: Callable[[int], ContextManager] = lambda step: contextlib.nullcontext()
    dense_apply: Callable[..., torch.Tensor] | None = None
    compile_stats: Any = None


@dataclasses.dataclass(frozen=True)
class Model:
    """One architecture of a model family, as pure functions (see the module docstring for layouts): what it denoises
    and is conditioned on, ``apply`` and the data functions every method calls, and four parts: its ``weights``
    (:class:`Weights`), what it ``export``-s (:class:`Exports`), the ``rules`` training and sampling respect
    (:class:`Rules`) and its compute ``kernels`` (:class:`Kernels`).

    latents, cond, patch_size       the latent space it denoises, its cond tensors (name -> shape after the batch
                                    dim; "L": the text length), its DiT's patch (time, height, width)
    modalities                      a joint model's modalities -> latent space (``"video"`` first, ``latents``;
                                    ``"audio"``: latents ``[B, C, F, A]``); {} for a video model. A joint model's
                                    ``apply`` takes ``x_t`` and ``t`` as dicts keyed by modality and returns one
                                    fp32 velocity per modality; its batch's ``latents`` are such a dict
    apply(params, x_t, t, cond)     velocity ``[B, C, T, H, W]`` fp32, ``params`` the base and the trained params
                                    together (``fvx.core.role.with_trained(base, params)``); remat, compute dtype and
                                    compilation are the config's
    batch(raw) -> batch             a data batch as methods see it: ``latents``, ``sample_index``, ... and ``cond``,
                                    the family's conditioning made from the data entries it reads (a ValueError
                                    names a missing tensor and the family)
    uncond(cond, mode, negative)    the unconditional cond for CFG: ``"zero"``, ``"keep"`` or ``"negative_prompt"``
                                    (``negative``, a cond of one row from :meth:`load_negative`, expanded to the
                                    batch); an image-to-video model's given image is kept in every mode
    load_cond(path, text_only=) -> (cond, captions)   a cond file (safetensors of the family's cond tensors,
                                    captions in its metadata or None): validation prompts; ``text_only``: without
                                    the given image's tensors (negative prompts)
    window_cond(cond, start, frames, given) -> cond   the cond of latent frames ``[start, start + frames)`` of a
                                    longer clip scored as a clip of its own, on the given first frame ``given``
                                    (condition latents, or None: the clip's own); None: the cond is the same for any
                                    window (``Family.conditioning.window``)
    causal                          a block-causal (streaming) model's extra functions (:class:`Causal`), else None;
                                    its ``apply`` then also takes one timestep per latent frame, ``t [B, T]``
    lead_frames                     latent frames in front of the video that the model denoises and its pipeline
                                    drops before decoding (Wan-Animate's reference slot): :meth:`denormalize` drops them
    memory_spec()                   an ``fvx.distributed.memory.ModelSpec`` from the meta skeleton (``--dry-run``)
    """

    name: str
    latents: LatentSpace
    cond: Mapping[str, tuple]  # cond tensor name -> its shape after the batch dim ("L": the text length)
    patch_size: tuple[int, int, int]
    apply: Callable[[Params, torch.Tensor, torch.Tensor, Cond], torch.Tensor]
    batch: Callable[[Mapping[str, Any]], dict[str, Any]]
    uncond: Callable[..., dict[str, torch.Tensor]]
    load_cond: Callable[..., tuple[dict[str, torch.Tensor], tuple[str, ...] | None]]
    memory_spec: Callable[[], Any]
    weights: Weights
    export: Exports
    rules: Rules = Rules()
    kernels: Kernels = Kernels()
    causal: Causal | None = None
    modalities: Mapping[str, LatentSpace] = dataclasses.field(default_factory=dict)
    window_cond: Callable[[Cond, int, int, torch.Tensor | None], dict[str, torch.Tensor]] | None = None
    lead_frames: int = 0

    def dense(self) -> Model:
        """The model as a role that must see dense attention sees it (a VSA model's dense view; else itself)."""
        if self.kernels.dense_apply is None:
            return self
        return dataclasses.replace(self, apply=self.kernels.dense_apply,
                                   kernels=dataclasses.replace(self.kernels, dense_apply=None))

    @property
    def latent_channels(self) -> int:
        return self.latents.channels

    @property
    def joint(self) -> bool:
        """Whether the model denoises more than one modality (``modalities``)."""
        return bool(self.modalities)

    def normalize(self, latents: Any) -> Any:
        """VAE latents -> the DiT's input scale (a joint model's dict, modality by modality)."""
        if isinstance(latents, Mapping):
            return {name: self.modalities[name].normalize(x) for name, x in latents.items()}
        return self.latents.normalize(latents)

    def denormalize(self, latents: Any) -> Any:
        """The DiT's latents as a VAE decodes them: in its scale, the video's frames alone (``lead_frames``
        dropped; a joint model's dict, modality by modality)."""
        if isinstance(latents, Mapping):
            return {name: self.modalities[name].denormalize(x) for name, x in latents.items()}
        return self.latents.denormalize(latents[:, :, self.lead_frames:])

    def load_negative(self, path: str, where: str) -> dict[str, torch.Tensor]:
        """The one-row cond of the negative-prompt file ``path`` (``where`` names the knob in errors)."""
        cond, _ = self.load_cond(path, text_only=True)
        count = next(iter(cond.values())).shape[0]
        if count != 1:
            raise ValueError(f"{where} {path!r} holds {count} prompts; a negative prompt is one")
        return cond

    def check_latents(self, shape: Any, where: str = "latents") -> None:
        """Raise a ValueError naming both shapes unless ``shape`` is ``[B, C, T, H, W]`` that this model accepts (a
        joint model's: a dict of shapes keyed by its modalities, each modality's ``[B, C, ...]`` of its channels)."""
        if self.joint:
            shape = self._joint_shapes(shape, where)
            self._check_video(shape["video"], f"{where}['video']")
        else:
            self._check_video(tuple(shape), where)
        why = self.rules.latent_rule(shape)
        if why is not None:
            raise ValueError(f"{where} of shape {shape} do not fit model {self.name}: {why}")

    def _check_video(self, shape: tuple[int, ...], where: str) -> None:
        ok = (
            len(shape) == 5
            and shape[1] == self.latents.channels
            and all(size % patch == 0 for size, patch in zip(shape[2:], self.patch_size))
        )
        if not ok:
            raise ValueError(
                f"{where} of shape {tuple(shape)} do not fit model {self.name}: it takes [B, C, T, H, W] with "
                f"C = {self.latents.channels} and T, H, W divisible by the patch size {self.patch_size}"
            )

    def _joint_shapes(self, shapes: Any, where: str) -> dict[str, tuple[int, ...]]:
        """``shapes`` as ``{modality: shape}``; a ValueError unless keyed by the modalities, each modality's shape
        ``[B, C, ...]`` with the video's ``B`` and its own channels."""
        if not (isinstance(shapes, Mapping) and set(shapes) == set(self.modalities)):
            got = sorted(shapes) if isinstance(shapes, Mapping) else tuple(shapes)
            raise ValueError(f"{where} of model {self.name} must be latents of {', '.join(self.modalities)} "
                             f"(it denoises them together), got {got}")
        shapes = {name: tuple(int(size) for size in shapes[name]) for name in self.modalities}
        batch = shapes["video"][0] if shapes["video"] else None
        for name, space in self.modalities.items():
            shape = shapes[name]
            if name != "video" and (len(shape) < 3 or shape[0] != batch or shape[1] != space.channels):
                raise ValueError(f"{where}['{name}'] of shape {shape} do not fit model {self.name}: it takes "
                                 f"[{batch}, {space.channels}, ...] ({name} latents of the video's samples)")
        return shapes


def check_shared_data(models: Mapping[str, Model], *, data_role: str) -> None:
    """A ValueError naming both roles' models unless every model takes the latent space and conditioning of
    ``models[data_role]`` (the one the data is for): a teacher and a student must denoise the same latents from the
    same text embeddings. Checked from the configs alone, before any weight loads."""
    data = models[data_role]
    for role, model in models.items():
        if model.latents != data.latents:
            raise ValueError(f"roles {data_role!r} ({data.name}) and {role!r} ({model.name}) denoise different latent "
                             f"spaces: {_latent_summary(data.latents)} vs {_latent_summary(model.latents)}")
        if dict(model.cond) != dict(data.cond):
            raise ValueError(f"roles {data_role!r} ({data.name}) and {role!r} ({model.name}) take different "
                             f"conditioning: {dict(data.cond)} vs {dict(model.cond)}")


def _latent_summary(space: LatentSpace) -> str:
    stats = "per-channel statistics" if space.mean is not None or space.std is not None else "no statistics"
    what = f"{space.channels} channels, {stats}"
    if space.mean is not None:
        what += f" (mean[0] {space.mean[0]}, std[0] {space.std[0] if space.std else 1})"
    if space.scale != 1.0:
        what += f", scale {space.scale}"
    return what + (f", VAE {space.vae}" if space.vae else "")
