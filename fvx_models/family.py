"""A model family as a spec: what a family file declares about its architecture, and nothing else.

A :class:`Family` holds the presets (the diffusers constructor's arguments, the latent space, the text length) and
its parts, each a record of what it is for: the :class:`Architecture` (meta skeleton, named groups of units: what
compiles as one graph and gathers its shards as one unit, what a unit saves, where attention kernels and QAT go), the
:class:`Forward` (how ``(x_t, t, cond)`` become the DiT's keyword arguments and its output a velocity), the
:class:`Conditioning` (what a data batch and a cond file give the DiT), the :class:`Checkpoints` (diffusers pipeline
components, the original layout), the :class:`Training` rules, what it denoises beside the video (:class:`Joint`) and
its data encoders. A family file reads as those sections. Sharding, remat, compute dtype, compilation and the
diffusers folder I/O are generic (``fvx_models.build``, ``fvx_models.diffusers_folder``) and apply to any spec.

Init. :func:`init_params` draws every param from ``fold_in(key, crc32(name))`` (so a param's values do not depend
on what else the model holds) by PyTorch's default rules: Linear/Conv weights and biases ~ U(-1/sqrt(fan_in),
1/sqrt(fan_in)), Embedding ~ N(0, 1), norm weights one and biases zero; a family adds rules for its own parameters
by local name (Wan's ``scale_shift_table``) or by the end of their name (``proj_keyboard.weight``: Matrix-Game's
action projections start at zero).
"""
from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, Callable, Mapping

import torch
from torch import nn

from fvx.core import random
from fvx.distributed import memory
from fvx_models import cond as fcond, layouts
from fvx_models.model import LatentSpace

InitRule = Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]  # (key, shape) -> fp32 tensor


@dataclasses.dataclass(frozen=True)
class Preset:
    """One architecture of a family: the diffusers constructor's arguments (every one, so a folder's config.json
    can be checked), its latent space, the text length its encoder pads to, and family facts of this preset
    (``options``, e.g. Wan 2.2 TI2V's per-token timesteps; ``"activations"`` overrides the family's per group)."""

    kwargs: Mapping[str, Any]
    latents: LatentSpace
    text_len: int
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Modality:
    """A modality a DiT denoises beside the video (audio): ``latents(config)``, its latent space (the latents of one
    sample ``[C, ...]``: MiniMax-H3's audio ``[2, 32, A]``), and ``owns(name)``, whether a param belongs to it (its
    branch: frozen when the modality is not trained)."""

    latents: Callable[[Any], LatentSpace]
    owns: Callable[[str], bool]


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What the DiT is and how it divides: built on meta, split into units, placed under kernels. Callables take the
    family's config (a ``fvx_models.build.ModelConfig``).

    skeleton(config) -> module           params on meta, buffers real; no RNG read
    unit_groups                          group name -> ModuleList paths whose children are that group's units (what
                                         compiles as one graph and gathers its shards as one unit)
    activations                          group name -> what one unit saves per token (measured; fvx.distributed.memory)
    widths(config) -> (dim, {group: (dim, ffn_dim)})   the root's and each group's widths, for the dry run
    patch(config) -> (t, h, w)           the DiT's patch over the latents; None: its constructor's ``patch_size`` (a
                                         tuple, or spatial with ``patch_size_t``)
    text_groups                          groups that run over the text tokens (a token refiner)
    init_rules                           param local name (or the end of its name) -> :data:`InitRule`, beside the
                                         default rules
    derived(config) -> {name: fn(params)}   params a folder may lack, made from the loaded (or drawn) ones (a two-time
                                         Wan's delta embedder from its time embedder)
    whole_graph_refusal                  why the forward cannot compile as one graph (``compile=model``), e.g.
                                         data-dependent control flow; None: it can
    sequence_parallel(config, module, group)   installs Ulysses sequence parallelism on the skeleton for the
                                         ``fvx.distributed.sequence_parallel.SPGroup`` ``group``: where the token
                                         sequence is split and gathered, what per-token inputs (RoPE tables, timesteps)
                                         are sliced, how self-attention runs over all tokens of the rank's heads (None:
                                         the family refuses SP)
    self_attention                       module-name patterns (``fnmatch``) of the self-attention modules over the
                                         video tokens, where ``attention=vsa`` runs (``fvx_models.attention.install``;
                                         other kernels run in every attention module)
    vsa_refusal                          why the self-attention cannot run VSA (its sequence is not exactly the video
                                         grid's tokens in (t, h, w) order), or None
    qat_attention                        module-name patterns of the attention modules ``attention=qat`` quantizes
                                         (None: every one; LTX-2: its video self-attention, as FastVideo's)
    linear_qat                           module-name patterns of the curated NVFP4 linear set
                                         (``fvx_models.linear_qat``; () none: ``linear_qat.modules`` must name one)
    """

    skeleton: Callable[[Any], nn.Module]
    unit_groups: Mapping[str, tuple[str, ...]]
    activations: Mapping[str, memory.BlockActivations]
    widths: Callable[[Any], tuple[int, Mapping[str, tuple[int, int]]]]
    patch: Callable[[Any], tuple[int, int, int]] | None = None
    text_groups: frozenset[str] = frozenset()
    init_rules: Mapping[str, InitRule] = dataclasses.field(default_factory=dict)
    derived: Callable[[Any], Mapping[str, Callable[[Mapping[str, Any]], Any]]] = lambda config: {}
    whole_graph_refusal: str | None = None
    sequence_parallel: Callable[[Any, nn.Module, Any], None] | None = None
    self_attention: tuple[str, ...] = ()
    vsa_refusal: str | None = None
    qat_attention: tuple[str, ...] | None = None
    linear_qat: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Forward:
    """How one call of the DiT is made from fvx's canonical ``(x_t, t, cond)`` and read back as a flow velocity.

    inputs(config, x, t, cond, sharded) -> kwargs   the DiT's forward arguments from ``x`` (``x_t`` in ``layout``),
                                         inputs in the compute dtype
    layout                               the latent layout the DiT's ``hidden_states`` take and its prediction comes
                                         in (``fvx_models.layouts``: ``"BCTHW"``, frames first ``"BTCHW"``, channels
                                         last ``"BTHWC"``); the builder converts ``x_t`` to it and the output back
    output(config, out, x, t, cond) -> tensor   the DiT's output as the flow velocity ``noise - x0``, shaped and
                                         laid out as the input ``x`` (it sees the inputs: a token sequence unflattened
                                         to ``x``'s shape, an x0 prediction turned into ``(x - x0) / sigma``, a given
                                         first frame's exact velocity); default ``out[0]``
    per_frame_timesteps                  the call also takes one timestep per latent frame, ``t [B, T]``
    with_r(config, kwargs, x, r) -> kwargs   the DiT's arguments with a second time ``r [B]`` (a flow map's target
                                         time) when ``config.two_time`` (``fvx_models.wan_two_time``)
    bind(module, call) -> context        binds what one forward is asked to do (``call``, or None for a plain
                                         forward) to the skeleton for the duration of that forward (a causal
                                         family's KV cache and teacher-forcing layout)
    causal(config, apply, module) -> Causal   a block-causal family's streaming functions
                                         (``fvx_models.model.Causal``) over ``apply(..., call=)``
    lead_frames                          latent frames in front of the video the DiT denoises and its pipeline drops
                                         before decoding (Wan-Animate's reference slot)
    """

    inputs: Callable[..., dict[str, Any]]
    layout: str = "BCTHW"
    output: Callable[..., torch.Tensor] = lambda config, out, x, t, cond: out[0]
    per_frame_timesteps: bool = False
    with_r: Callable[[Any, dict, torch.Tensor, torch.Tensor], dict] | None = None
    bind: Callable[[nn.Module, Any], Any] | None = None
    causal: Callable[[Any, Callable, nn.Module], Any] | None = None
    lead_frames: int = 0

    def __post_init__(self) -> None:
        layouts.check(self.layout, "a family's forward")


def ones_text_mask(cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A mask of ones over the cond's text tokens ``[N, L]``: what a cond file without ``text_mask`` stands for."""
    return torch.ones(cond["text"].shape[:2])


TEXT_MASK_DEFAULT = {"text_mask": ones_text_mask}  # ``Conditioning.defaults`` of a family whose text has a mask


@dataclasses.dataclass(frozen=True)
class Conditioning:
    """What the DiT is conditioned on and where it comes from: the data's columns, cond files, unconditionals.

    spec(config) -> spec                 the cond tensors and their shapes (``fvx_models.cond``)
    from_batch(config, batch)            a data batch's ``cond`` (a ValueError names a missing tensor)
    data_keys                            the data batch's entries ``from_batch`` reads (named as
                                         ``fvx.data.datasets`` names them)
    image                                cond tensors that hold the given image of an image-to-video model (first-frame
                                         latents, image embeddings): every unconditional keeps them (guidance is on
                                         the text, as the I2V pipelines guide) and negative-prompt files lack them
    zero(cond) -> cond                   the "zero" unconditional (default: every tensor zeroed)
    blank                                cond tensors whose unconditional is a transform of their own -> that
                                         transform, in the "zero" and "negative_prompt" modes alike (Wan-Animate's
                                         blank face, every pixel -1); negative-prompt files lack them
    defaults                             cond tensors a cond file may leave out -> how to make them
    window(config, cond, start, frames, given) -> cond   the cond of latent frames ``[start, start + frames)`` of a
                                         longer clip scored as a clip of its own (a streaming stage's chunk):
                                         per-frame inputs cut to the window, the given first frame ``given``
                                         (condition latents ``[B, C, frames, H, W]``, or None: the clip's own);
                                         None: the cond does not depend on the frames (text)
    cfg_dropout_refusal                  why the family refuses training data with CFG dropout (``data.cfg_rate``), or
                                         None
    """

    spec: Callable[[Any], fcond.Spec]
    from_batch: Callable[[Any, Mapping[str, Any]], dict[str, torch.Tensor]]
    data_keys: tuple[str, ...] = ("text", "text_mask")
    image: frozenset[str] = frozenset()
    zero: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]] = fcond.zeros
    blank: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = dataclasses.field(default_factory=dict)
    defaults: Mapping[str, Callable] = dataclasses.field(default_factory=dict)
    window: Callable[[Any, Any, int, int, torch.Tensor | None], dict[str, torch.Tensor]] | None = None
    cfg_dropout_refusal: str | None = None


def text_conditioning(width: str, what: str) -> Conditioning:
    """The conditioning of a family whose DiT reads one text embedding and its padding mask: ``text [L, W]`` (``W``
    the preset's constructor argument ``width``) and ``text_mask [L]`` from a data batch (``what`` names the embedding
    in a missing tensor's error); a cond file without the mask stands for all ones."""

    def spec(config: Any) -> fcond.Spec:
        return {"text": ("L", config.spec.kwargs[width]), "text_mask": ("L",)}

    def from_batch(config: Any, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        require(batch, ("text", "text_mask"), config.family.name, what)
        return {"text": batch["text"], "text_mask": batch["text_mask"]}

    return Conditioning(spec=spec, from_batch=from_batch, defaults=TEXT_MASK_DEFAULT)


def packed_pooled_conditioning(text_width: str, pooled_width: str, what: str,
                               zero: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]] = fcond.zeros
                               ) -> Conditioning:
    """The conditioning of a family whose DiT reads text tokens, their mask and a pooled CLIP vector, its data in
    FastVideo's packed form (:func:`packed_pooled_cond`): ``text [L, W]``, ``text_mask [L]`` and ``pooled [P]``
    (``W``, ``P`` the preset's constructor arguments ``text_width``, ``pooled_width``; ``what`` names the packed
    embedding in a missing tensor's error; ``zero`` the family's unconditional)."""

    def spec(config: Any) -> fcond.Spec:
        k = config.spec.kwargs
        return {"text": ("L", k[text_width]), "text_mask": ("L",), "pooled": (k[pooled_width],)}

    def from_batch(config: Any, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return packed_pooled_cond(batch, config.spec.kwargs[pooled_width], config.family.name, what)

    return Conditioning(spec=spec, from_batch=from_batch, zero=zero, defaults=TEXT_MASK_DEFAULT)


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    """Where the params live on disk: the diffusers pipeline's components and files, the original layout other tools
    load, and other namings of a folder's weights.

    components                           diffusers pipeline component -> the prefix of its params (by default one
                                         component, ``transformer``, prefix ""; "transformer." and "transformer_2."
                                         for two experts)
    pipeline_files(config, folder)       writes the pipeline's ``model_index.json`` and ``scheduler/`` beside the
                                         exported components
    original_name(name) -> name          a param's or module's name in the family's original checkpoint layout
                                         (what ComfyUI and musubi-tuner load; None: it has none there); None: the
                                         family has no original layout in fvx
    stored_names(keys) -> {stored: name}   the family's other naming of a folder's weights, recognised by a
                                         component's keys (``fvx_models.diffusers_folder.StoredNames``; Wan's:
                                         FastVideo's internal names, TurboWan's folders); None: diffusers' names only
    component_notes                      component -> what it is, for a person choosing files (Wan 2.2's experts)
    component_tags                       component -> what its original-layout export file is tagged with (Wan 2.2's
                                         experts: ``high_noise``, ``low_noise``, as ComfyUI's and musubi-tuner's
                                         files); a component without one is tagged by its name
    original_formats                     the tools whose LoRA files the original layout serves (``comfyui``,
                                         ``musubi``: ``fvx_models.lora_files``); ComfyUI's also makes whole weights
    musubi_script                        musubi-tuner's sampling script that loads the family's files
    """

    components: Mapping[str, str] = dataclasses.field(default_factory=lambda: {"transformer": ""})
    pipeline_files: Callable[[Any, Any], None] | None = None
    original_name: Callable[[str], str | None] | None = None
    stored_names: Callable[[set[str]], Mapping[str, str] | None] | None = None
    component_notes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    component_tags: Mapping[str, str] = dataclasses.field(default_factory=dict)
    original_formats: tuple[str, ...] = ("comfyui", "musubi")
    musubi_script: str = "wan_generate_video.py"


@dataclasses.dataclass(frozen=True)
class Training:
    """The rules a family sets on training it, whatever the method.

    held_frozen(config) -> names         params no role of this config trains: those the DiT does not use under it (a
                                         mode's branch, e.g. the image embedder of an image-to-video model run as
                                         text-to-video) and those its own trainers never train (CogVideoX I2V's
                                         learned position table, a buffer in diffusers); held frozen as a role's base
                                         (no update, no decay, no optimizer state, no LoRA adapters) and exported as
                                         loaded
    latent_rule(config, shape) -> why    why latents of ``shape`` ``[B, C, T, H, W]`` (a joint model's: a dict of
                                         shapes keyed by modality) do not fit the model beyond
                                         channels and patch divisibility (a trained resolution range), or None
    sigma_sampler(config, keys, x0) -> (sigma, t)   the family's own training noise levels (one per sample from
                                         per-sample keys ``[B, 2]``; dicts keyed by modality for a joint model),
                                         replacing a method's timestep density (LTX-2's shifted logit-normal,
                                         MiniMax-H3's coupled draws); None: the method's
    step_ranges(config) -> ranges        the timestep ranges (``fvx_models.model.StepRange``) of which a training
                                         step trains one (Wan 2.2 A14B's experts' ranges); (): the whole grid
    one_sample                           why the DiT takes one sample a call (MiniMax-H3's packed sequence has no
                                         batch axis): the model's ``apply`` runs a batch sample by sample; or None
    loss_weight(config, sigma) -> [B]    the per-sample weight of the velocity loss at levels ``sigma [B]``: a family
                                         trained with another objective, as the flow's loss (CogVideoX's weighted x0
                                         loss of v-prediction); None: one
    sampling_sigmas(config, steps) -> [K]   the levels the family's own pipeline samples ``steps`` steps on (an
                                         Euler step between two is its scheduler's step: CogVideoX's DDIM), which
                                         ``validation.schedule=model`` uses; None: it has none of its own
    corrupt_cond(config, keys, cond) -> cond   the family's own training-time corruption of the cond, one draw per
                                         sample from its key ``[B, 2]`` (Helios's noised and dropped history), which
                                         fine-tuning applies before the forward; None: the cond as the batch has it
    """

    held_frozen: Callable[[Any], frozenset[str]] = lambda config: frozenset()
    latent_rule: Callable[[Any, tuple[int, ...]], str | None] = lambda config, shape: None
    sigma_sampler: Callable[[Any, torch.Tensor, Any], tuple[Any, Any]] | None = None
    step_ranges: Callable[[Any], tuple] = lambda config: ()
    one_sample: str | None = None
    loss_weight: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    sampling_sigmas: Callable[[Any, int], torch.Tensor] | None = None
    corrupt_cond: Callable[[Any, torch.Tensor, Any], Any] | None = None


@dataclasses.dataclass(frozen=True)
class Joint:
    """What a DiT denoises beside the video (none for a video-only DiT).

    modalities                           ``"audio"`` -> :class:`Modality`: its latent space and the params that
                                         belong to it
    trained(config) -> names             the modalities a model of ``config`` trains ("video" and those of
                                         ``modalities`` it trains; None: all): more than one makes a joint model,
                                         whose ``inputs`` and ``output`` take and give dicts keyed by modality; the
                                         params of a modality left out are held frozen as ``held_frozen`` params are
                                         (LTX-2's audio branch)
    sigmas(config, levels) -> {modality: levels}   the level each modality of a joint model is at when the shared
                                         clock is at ``levels`` (MiniMax-H3's per-modality shifts): how validation
                                         samples it; None: every modality at the shared levels
    """

    modalities: Mapping[str, Modality] = dataclasses.field(default_factory=dict)
    trained: Callable[[Any], tuple[str, ...]] | None = None
    sigmas: Callable[[Any, torch.Tensor], dict[str, torch.Tensor]] | None = None


_PARTS = ("architecture", "forward", "conditioning", "checkpoints", "training", "joint")


@dataclasses.dataclass(frozen=True)
class Family:
    """The spec of a model family (module docstring), in parts: its ``architecture`` (skeleton, units, where kernels
    go), one ``forward`` (the DiT's arguments and its output as a velocity), its ``conditioning``, its
    ``checkpoints`` (diffusers folders, original layout), its ``training`` rules, what it denoises ``joint``-ly
    beside the video, and its data ``encoders`` (``fvx_models.encoders.Encoders``; None: preprocessing refuses).
    Callables take the family's config (a ``fvx_models.build.ModelConfig``), whose ``preset`` names one of
    ``presets``."""

    name: str
    presets: Mapping[str, Preset]
    architecture: Architecture
    forward: Forward
    conditioning: Conditioning
    checkpoints: Checkpoints
    training: Training = Training()
    joint: Joint = Joint()
    encoders: Any = None

    def trained(self, config: Any) -> tuple[str, ...]:
        """The modalities a model of ``config`` trains: ``joint.trained``, by default video and every other."""
        joint = self.joint
        return ("video", *joint.modalities) if joint.trained is None else joint.trained(config)

    def preset(self, name: str) -> Preset:
        if name not in self.presets:
            raise ValueError(f"unknown {self.name} preset {name!r}; valid presets: {', '.join(self.presets)}")
        return self.presets[name]

    def variant(self, **changes: Any) -> Family:
        """This family with ``changes``: a top-level field's new value, or for a part a dict of its fields to change
        (``variant(name="skyreels_v2", forward={"inputs": inputs})``): a family derived from another."""
        for part in _PARTS:
            if isinstance(changes.get(part), Mapping):
                changes[part] = dataclasses.replace(getattr(self, part), **changes[part])
        return dataclasses.replace(self, **changes)


def skeleton_of(module_class: type, kwargs: Mapping[str, Any], rebuild: Callable[[nn.Module], None] = lambda m: None
                ) -> nn.Module:
    """``module_class(**kwargs)`` with its params on meta (no RNG read), then ``rebuild`` (which re-creates the
    submodules that hold buffers, e.g. RoPE tables, on the CPU); a RuntimeError if a buffer is left on meta."""
    with torch.device("meta"):
        module = module_class(**kwargs)
    with torch.device("cpu"):
        rebuild(module)
    still_meta = [name for name, buffer in module.named_buffers() if buffer.is_meta]
    if still_meta:
        raise RuntimeError(f"{module_class.__name__} skeleton: buffers left on meta (diffusers changed?): {still_meta}")
    return module


def check_trainable(names: tuple[str, ...], valid: tuple[str, ...], what: str, field: str = "trainable") -> None:
    """A ValueError unless a config's ``field`` ``names`` name at least one ``what`` (of ``valid``) and none twice."""
    if not names or len(set(names)) != len(names):
        raise ValueError(f"{field} must name each {what} to train once (of {', '.join(valid)}), got {list(names)}")


def require(batch: Mapping[str, Any], names: tuple[str, ...], family: str, what: str) -> None:
    """A ValueError naming the first of ``names`` the batch lacks, and the family that needs it."""
    for name in names:
        if name not in batch:
            raise ValueError(f"{family} needs the batch tensor {name!r} ({what}), but the batch has "
                             f"{sorted(k for k in batch if not k.startswith('_'))}")


def first_frame_spec(config: Any) -> fcond.Spec:
    """Image-to-video's given first frame: its latents ``[C, T, H, W]`` (data.kind=i2v's ``first_frame_latent``)."""
    return {"first_frame_latents": (config.spec.latents.channels, "T", "H", "W")}


def first_frame_from_batch(config: Any, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The given first frame's latents from a batch of kind i2v (i2va); a ValueError names the parquet column it
    lacks."""
    kind = "i2va" if "audio_latents" in batch else "i2v"
    require(batch, ("first_frame_latents",), config.family.name, "the first frame's latents: parquet column "
            f"first_frame_latent of data.kind='{kind}' data")
    return {"first_frame_latents": batch["first_frame_latents"]}


def packed_pooled_cond(batch: Mapping[str, Any], pooled_dim: int, family: str, what: str) -> dict[str, torch.Tensor]:
    """FastVideo's packed text embedding ``[B, 1 + L, D]`` (row 0 the pooled CLIP vector zero-padded to ``D``, rows 1:
    the text tokens; HunyuanVideo's and Kandinsky 5's data) as ``text``, ``text_mask`` and ``pooled [B, pooled_dim]``;
    a ValueError names ``family`` unless the batch has that form (``what``: the embedding, for a missing tensor)."""
    require(batch, ("text", "text_mask"), family, what)
    text, mask = batch["text"], batch["text_mask"]
    if text.dim() != 3 or text.shape[1] < 2 or text.shape[2] < pooled_dim:
        raise ValueError(f"{family}: the batch's text embedding {list(text.shape)} is not the packed "
                         f"[B, 1 + L, D] form (row 0 the pooled CLIP vector of width {pooled_dim})")
    return {"text": text[:, 1:], "text_mask": mask[:, 1:], "pooled": text[:, 0, :pooled_dim]}


def pack_pooled(pooled: torch.Tensor, tokens: list[torch.Tensor]) -> list[torch.Tensor]:
    """FastVideo's packed text rows ``[1 + L_i, D]`` (HunyuanVideo's and Kandinsky 5's): row 0 each prompt's pooled
    CLIP vector (``pooled [B, P]``) zero-padded to ``D``, then its tokens ``[L_i, D]``; :func:`packed_pooled_cond`
    unpacks them."""
    rows = []
    for vector, text in zip(pooled, tokens):
        if vector.shape[0] > text.shape[1]:
            raise ValueError(f"the pooled CLIP vector ({vector.shape[0]} wide) does not fit in a row of the text "
                             f"embedding ({text.shape[1]} wide)")
        head = torch.nn.functional.pad(vector.to(text.dtype), (0, text.shape[1] - vector.shape[0]))
        rows.append(torch.cat([head[None], text]))
    return rows



# ------------------------------------------------------------------------------------------------------------ init


def _is_norm(module: nn.Module) -> bool:
    return any(cls.__name__.endswith("Norm") for cls in type(module).__mro__)


def _default_rule(owner: nn.Module, local_name: str) -> InitRule | None:
    if isinstance(owner, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        bound = 1.0 / math.sqrt(math.prod(owner.weight.shape[1:]))
        return lambda key, shape: random.uniform(key, shape, minval=-bound, maxval=bound)
    if isinstance(owner, nn.Embedding):
        return lambda key, shape: random.normal(key, shape)
    if _is_norm(owner):
        return (lambda key, shape: torch.ones(shape)) if local_name == "weight" else (lambda key, shape: torch.zeros(shape))
    return None


def init_params(module: nn.Module, key: torch.Tensor, rules: Mapping[str, InitRule], who: str) -> dict[str, torch.Tensor]:
    """Random fp32 params of ``module`` keyed like its state_dict (module docstring); no global RNG."""
    params = {}
    for module_name, owner in module.named_modules():
        for local_name, param in owner.named_parameters(recurse=False):
            name = f"{module_name}.{local_name}" if module_name else local_name
            rule = (next((r for key, r in rules.items() if "." in key and name.endswith("." + key)), None)
                    or rules.get(local_name) or _default_rule(owner, local_name))
            if rule is None:
                raise ValueError(f"{who} init: no rule for parameter {name!r} of a {type(owner).__name__}")
            params[name] = rule(random.fold_in(key, zlib.crc32(name.encode())), tuple(param.shape))
    return params
