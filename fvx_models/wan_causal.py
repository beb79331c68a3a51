"""Block-causal, KV-cached Wan (FastVideo's WanCausalModel, spec §3.2) by wrapping diffusers'
``WanTransformer3DModel``.

The DiT is diffusers' own, with its own params (an ordinary Wan 2.1 folder loads, and exports back, unchanged); three
pieces are swapped in, none of which touches the DiT's code: the RoPE module becomes :class:`FrameRope`, which
offsets positions by the first frame of the chunk and returns a :class:`Plan` (the blocks' ``rotary_emb`` argument,
so remat recomputes from the same explicit input); a forward pre-hook on each block hands its self-attention that
layer's view of the plan (:class:`LayerPlan`: the layer's cached keys and values); and self-attention runs
:class:`BlockCausalAttention` (``fvx_models.block_causal``; cross-attention is unchanged). What one forward is asked
to do (a :class:`Call`: the KV cache, the teacher-forcing layout) is bound to the RoPE module for that forward only
(``bind``), by the functions of ``Model.causal``, which take the cache as an argument and return the next one.

Image-to-video (the Wan 2.1 I2V presets, ``fvx_models.wan_i2v``'s concat form) as FastVideo's causal Matrix-Game
gives the first frame: a forward pre-hook on the DiT builds each chunk's ``[x_t | mask | first-frame latents]`` from
the clip's first-frame latents cut at the chunk's absolute frames (its cache's next frame), the mask one on the clip's
frame 0 only, so a stream's later chunks see the given frame through the cache, as the bidirectional model sees it
through attention. Teacher forcing of such a model is refused.

Timesteps: ``t [B]``, or one per latent frame ``t [B, T]`` given to the DiT per token (its Wan 2.2 TI2V path). Teacher
forcing feeds ``[clean | noisy]`` frames, clean ones at ``t = 0``, sharing positions frame for frame.

Sequence parallelism (:func:`sequence_parallel`): Wan's token split and gather; the plan's RoPE tables are sliced to
the rank's tokens, while its query blocks and mask index the whole sequence, which self-attention sees after the
all-to-all to the rank's heads, so the attention itself is unchanged. A KV cache then holds the rank's heads.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Annotated, Any, Callable, Literal, Mapping

import msgspec
import torch
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed
from torch import nn

from fvx.distributed import sequence_parallel as fsp
from fvx_models import block_causal as bc, wan, wan_i2v, wan_sequence_parallel
from fvx_models.build import DTYPES, ModelConfig
from fvx_models.family import skeleton_of
from fvx_models.model import Causal

PRESETS = {name: wan.PRESETS[name] for name in ("tiny", "tiny-deep", "world", "wan2.1-t2v-1.3b", "wan2.1-t2v-14b",
                                                "tiny-i2v", "world-i2v", "wan2.1-i2v-14b-480p", "wan2.1-i2v-14b-720p")}
# every block saves its per-token modulation when timesteps come per frame (the DFSFT/TFSFT/KD forward)
ACTIVATIONS = {"blocks": wan.PER_TOKEN_T_ACTIVATIONS["blocks"]}
REMAINDER = ("FastVideo's Self-Forcing puts a remainder in the first block, frames [0, F + rem), its training mask in "
             "a short last block, and its causal sampler refuses one; fvx needs whole blocks: choose num_latent_t (or "
             "world frames) divisible by F")


@dataclasses.dataclass
class Call:
    """What one forward is asked to do: attend to ``cache`` (None: the chunk starts at frame 0), or run the
    teacher-forcing layout. The forward leaves its :class:`Plan` in ``plan`` (the chunk's keys and values)."""

    cache: bc.KVCache | None = None
    teacher_forcing: bool = False
    plan: Plan | None = None


@dataclasses.dataclass
class Plan:
    """A forward's attention plan, shared by every block: RoPE tables ``[1, L, 1, head_dim]`` (fp64, as diffusers'),
    the query blocks, the mask (``block_attention="mask"``) and the cache; ``layers`` collects each layer's view."""

    cos: torch.Tensor
    sin: torch.Tensor
    blocks: tuple[bc.QueryBlock, ...]
    mask: torch.Tensor | None
    cache: bc.KVCache
    layers: dict[int, LayerPlan] = dataclasses.field(default_factory=dict)

    def layer(self, index: int) -> LayerPlan:
        cached = (self.cache.keys[index], self.cache.values[index]) if self.cache.keys else None
        view = LayerPlan(self.cos, self.sin, self.blocks, self.mask, cached)
        self.layers[index] = view
        return view


@dataclasses.dataclass
class LayerPlan:
    """What one block's self-attention reads (the plan and its layer's cached ``(keys, values)`` or None) and leaves
    (``kv``: the chunk's keys and values ``[B, L, heads, head_dim]``). Holds no layer index, so every block's
    compiled graph is the same."""

    cos: torch.Tensor
    sin: torch.Tensor
    blocks: tuple[bc.QueryBlock, ...]
    mask: torch.Tensor | None
    cached: tuple[torch.Tensor, torch.Tensor] | None
    kv: tuple[torch.Tensor, torch.Tensor] | None = None


class FrameRope(WanRotaryPosEmbed):
    """Wan's RoPE from the chunk's first frame on, returning the forward's :class:`Plan` (module docstring)."""

    def __init__(self, attention_head_dim: int, patch_size: tuple[int, int, int], max_seq_len: int, *,
                 frames_per_block: int, window: int, sink: int, attention: str, compiled: bool) -> None:
        super().__init__(attention_head_dim, patch_size, max_seq_len)
        self.frames_per_block, self.window, self.sink = frames_per_block, window, sink
        self.attention, self.compiled = attention, compiled
        self.call: Call | None = None
        self.sequence = fsp.SPGroup()  # sequence parallelism (sequence_parallel installs it)

    def forward(self, hidden_states: torch.Tensor) -> Plan:
        call = self.call or Call()
        cache = call.cache or bc.KVCache()
        _, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.patch_size
        ppf, pph, ppw = frames // p_t // (2 if call.teacher_forcing else 1), height // p_h, width // p_w
        if ppf % self.frames_per_block:
            raise ValueError(f"wan_causal: {ppf} latent frames are not whole blocks of num_frames_per_block="
                             f"{self.frames_per_block} ({REMAINDER})")
        start = cache.next_frame
        if start + ppf > self.max_seq_len:
            raise ValueError(f"wan_causal: frames {start}..{start + ppf - 1} exceed the RoPE table of "
                             f"rope_max_seq_len={self.max_seq_len} frames")
        cos, sin = (self._table(table, start, ppf, pph, ppw) for table in (self.freqs_cos, self.freqs_sin))
        if call.teacher_forcing:
            cos, sin = torch.cat([cos, cos], dim=1), torch.cat([sin, sin], dim=1)
        blocks = bc.plan_blocks(cache.slots, start, ppf, pph * ppw, frames_per_block=self.frames_per_block,
                                window=self.window, sink=self.sink, teacher_forcing=call.teacher_forcing)
        queries = cos.shape[1]
        if not self._masked(call):
            call.plan = Plan(cos, sin, blocks, None, cache)
            return call.plan
        mask = bc.mask_of(blocks, queries, len(cache.slots) * pph * ppw + queries, hidden_states.device)
        call.plan = Plan(cos, sin, (), mask, cache)  # the plan a compiled block sees: tensors only
        return call.plan

    def _masked(self, call: Call) -> bool:
        """Whether attention runs as one masked SDPA: ``block_attention="mask"``, or ``"auto"`` for a cached call of a
        compiled model (its mask an input tensor, so the stream's later chunks reuse its graph)."""
        return self.attention == "mask" or (self.attention == "auto" and self.compiled and call.cache is not None)

    def _table(self, table: torch.Tensor, start: int, ppf: int, pph: int, ppw: int) -> torch.Tensor:
        """``[1, ppf pph ppw, 1, head_dim]`` of frames ``start..start+ppf-1`` (diffusers' layout)."""
        t_part, h_part, w_part = table.split([self.t_dim, self.h_dim, self.w_dim], dim=1)
        parts = (t_part[start:start + ppf].view(ppf, 1, 1, -1).expand(ppf, pph, ppw, -1),
                 h_part[:pph].view(1, pph, 1, -1).expand(ppf, pph, ppw, -1),
                 w_part[:ppw].view(1, 1, ppw, -1).expand(ppf, pph, ppw, -1))
        return torch.cat(parts, dim=-1).reshape(1, ppf * pph * ppw, 1, -1)


class BlockCausalAttention:
    """Self-attention of a Wan block under a :class:`LayerPlan` (stateless; one instance serves every block). Under
    sequence parallelism (``sequence``) it attends over all tokens of the rank's heads, between two all-to-alls."""

    def __init__(self, sequence: fsp.SPGroup = fsp.SPGroup()) -> None:
        self.sequence = sequence

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: Any = None,
                 attention_mask: Any = None, rotary_emb: LayerPlan | None = None) -> torch.Tensor:
        plan = rotary_emb
        query, key, value = wan_sequence_parallel.self_attention_heads(attn, hidden_states, (plan.cos, plan.sin),
                                                                       self.sequence)
        plan.kv = (key, value)
        if plan.cached is not None:
            key, value = torch.cat([plan.cached[0], key], dim=1), torch.cat([plan.cached[1], value], dim=1)
        out = fsp.to_tokens(bc.attend(query, key, value, plan.blocks, plan.mask), self.sequence)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _layer_view(index: int, block: nn.Module, args: tuple) -> tuple | None:
    """A block's forward pre-hook: its self-attention gets this layer's view of the forward's plan."""
    hidden_states, encoder_hidden_states, temb, plan = args
    if not isinstance(plan, Plan):
        return None
    return hidden_states, encoder_hidden_states, temb, plan.layer(index)


def rope_of(config: WanCausalConfig, rope_class: type[FrameRope] = FrameRope) -> Callable[[nn.Module], None]:
    """A skeleton's rebuild that installs ``rope_class`` (:class:`FrameRope` or a subclass) with the config's
    block-causal knobs."""
    kwargs = config.spec.kwargs

    def rebuild(module: nn.Module) -> None:
        module.rope = rope_class(kwargs["attention_head_dim"], kwargs["patch_size"], kwargs["rope_max_seq_len"],
                                 frames_per_block=config.num_frames_per_block, window=config.local_attn_size,
                                 sink=config.sink_size, attention=config.block_attention,
                                 compiled=config.compile != "none")

    return rebuild


def _given_frames(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The DiT's forward pre-hook of an image-to-video model: ``hidden_states`` becomes the chunk's ``[x_t | mask |
    first-frame latents]`` (module docstring), the latents taken from the ``image_latents`` argument."""
    call = module.rope.call or Call()
    if call.teacher_forcing:
        raise ValueError("wan_causal: teacher forcing of an image-to-video model is not supported (its [clean | noisy] "
                         "layout has two frame 0s): use dfsft or self_forcing")
    kwargs = dict(kwargs)
    x, given = kwargs.pop("hidden_states"), kwargs.pop("image_latents")
    first = call.cache.next_frame if call.cache is not None else 0
    mask_channels = module.config.in_channels - 2 * x.shape[1]
    return args, {"hidden_states": wan_i2v.chunk_concat_input(x, given, first, mask_channels, "wan_causal"), **kwargs}


def skeleton(config: WanCausalConfig) -> nn.Module:
    """diffusers' Wan on meta with the RoPE, the blocks' pre-hooks and the self-attention processor swapped in (and
    an image-to-video preset's given frames)."""
    module = skeleton_of(WanTransformer3DModel, config.spec.kwargs, rope_of(config))
    processor = BlockCausalAttention()
    for index, block in enumerate(module.blocks):
        block.attn1.set_processor(processor)
        block.register_forward_pre_hook(functools.partial(_layer_view, index))
    if wan_i2v.form(config) == wan_i2v.CONCAT:
        module.register_forward_pre_hook(_given_frames, with_kwargs=True)
    return module


@contextlib.contextmanager
def bind(module: nn.Module, call: Call | None):
    """``call`` bound to the RoPE module for one forward (None: a plain block-causal forward from frame 0)."""
    module.rope.call = call
    try:
        yield
    finally:
        module.rope.call = None


def _split_plan(group: fsp.SPGroup, module: nn.Module, args: tuple, plan: Plan) -> Plan:
    """The RoPE module's forward hook: the plan's tables of this rank's tokens (its blocks and mask stay whole)."""
    plan.cos, plan.sin = (fsp.split_tokens(table, group).contiguous() for table in (plan.cos, plan.sin))
    return plan


def sequence_parallel(config: WanCausalConfig, module: nn.Module, group: fsp.SPGroup) -> None:
    """Ulysses sequence parallelism on the block-causal skeleton (module docstring)."""
    wan_sequence_parallel.split_token_sequence(config, module, group)
    module.rope.register_forward_hook(functools.partial(_split_plan, group))
    module.rope.sequence = group
    processor = BlockCausalAttention(group)
    for block in module.blocks:
        block.attn1.set_processor(processor)


def inputs(config: WanCausalConfig, x_t: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """Wan's inputs; per-frame ``t [B, T]`` becomes one timestep per token ``[B, T h w]``; an image-to-video
    model's first-frame latents go whole to its pre-hook (:func:`_given_frames`), which cuts them to the chunk."""
    if t.dim() == 2:
        _, p_h, p_w = config.spec.kwargs["patch_size"]
        t = t.repeat_interleave((x_t.shape[3] // p_h) * (x_t.shape[4] // p_w), dim=1)
    kwargs = {"hidden_states": x_t, "timestep": t, "encoder_hidden_states": wan.masked_text(cond), "return_dict": False}
    if wan_i2v.form(config) == wan_i2v.CONCAT:
        kwargs["image_latents"] = cond["first_frame_latents"]
    if "image_embeds" in cond:
        kwargs["encoder_hidden_states"] = wan.padded_text(kwargs["encoder_hidden_states"], config)
        kwargs["encoder_hidden_states_image"] = cond["image_embeds"]
    return kwargs


# -------------------------------------------------------------------------------------------- the streaming functions


def causal(config: WanCausalConfig, apply: Any, module: nn.Module) -> Causal:
    """``Model.causal`` over the generic ``apply(..., call=)``."""
    kwargs = config.spec.kwargs
    _, p_h, p_w = kwargs["patch_size"]
    layers, head_dim = kwargs["num_layers"], kwargs["attention_head_dim"]
    heads = kwargs["num_attention_heads"] // module.rope.sequence.size  # a KV cache holds the rank's heads under SP
    layout = dict(frames_per_block=config.num_frames_per_block, window=config.local_attn_size, sink=config.sink_size)
    dtype = DTYPES[config.compute_dtype]  # what attention computes in
    who = f"wan_causal:{config.preset}"

    def allocated_cache(frames, shape, device):
        tokens = (shape[3] // p_h) * (shape[4] // p_w)
        return bc.allocate(bc.empty(frames, **layout), layers=layers, batch=shape[0], tokens_per_frame=tokens,
                           heads=heads, head_dim=head_dim, dtype=dtype, device=device)

    def cache_bytes(frames, shape):
        slots = bc.ring_slots(frames, **layout)
        tokens = (shape[3] // p_h) * (shape[4] // p_w)
        return 2 * layers * shape[0] * slots * tokens * heads * head_dim * dtype.itemsize

    def apply_cached(params, x_t, t, cond, cache):
        tokens = (x_t.shape[3] // p_h) * (x_t.shape[4] // p_w)
        bc.check_cache(cache, batch=x_t.shape[0], layers=layers, tokens_per_frame=tokens, heads=heads,
                       head_dim=head_dim, who=who)
        cache = bc.allocate(cache, layers=layers, batch=x_t.shape[0], tokens_per_frame=tokens, heads=heads,
                            head_dim=head_dim, dtype=dtype, device=x_t.device)
        call = Call(cache=cache)
        v = apply(params, x_t, t, cond, call=call)
        kv = [call.plan.layers[i].kv for i in range(layers)]
        after = bc.write(cache, [k for k, _ in kv], [v_ for _, v_ in kv], x_t.shape[2], tokens, **layout)
        return v, after

    def apply_teacher_forced(params, x_t, t, cond, clean):
        if config.local_attn_size != -1:
            raise ValueError(f"{who}: teacher forcing needs global attention (local_attn_size -1, as FastVideo "
                             f"requires), got local_attn_size={config.local_attn_size}")
        if tuple(clean.shape) != tuple(x_t.shape):
            raise ValueError(f"{who}: teacher forcing needs clean frames of the noisy frames' shape "
                             f"{tuple(x_t.shape)}, got {tuple(clean.shape)}")
        frames = x_t.shape[2]
        per_frame = t[:, None].expand(x_t.shape[0], frames) if t.dim() == 1 else t
        both = torch.cat([clean.to(x_t.dtype), x_t], dim=2)
        t_both = torch.cat([torch.zeros_like(per_frame), per_frame], dim=1)
        return apply(params, both, t_both, cond, call=Call(teacher_forcing=True))[:, :, frames:]

    return Causal(frames_per_block=config.num_frames_per_block, window=config.local_attn_size,
                  sink=config.sink_size, empty_cache=lambda frames: bc.empty(frames, **layout),
                  apply_cached=apply_cached, apply_teacher_forced=apply_teacher_forced,
                  allocated_cache=allocated_cache, cache_bytes=cache_bytes,
                  max_frames=config.spec.kwargs["rope_max_seq_len"] * config.spec.kwargs["patch_size"][0])


WAN_CAUSAL = wan.WAN.variant(
    name="wan_causal",
    presets=PRESETS,
    architecture={
        "skeleton": skeleton,
        "activations": ACTIVATIONS,
        "sequence_parallel": sequence_parallel,
        "whole_graph_refusal": "its forward binds per-call state (a KV cache, the teacher-forcing layout)",
        "vsa_refusal": "each query block attends to its own prefix of frames, which tiles of the whole grid do not "
                       "follow (FastVideo's causal Wan has no VSA either: its blocks take flash or SDPA only)",
    },
    forward={
        "inputs": inputs,
        "per_frame_timesteps": True,
        "bind": bind,
        "causal": causal,
    },
)


class WanCausalConfig(ModelConfig, tag="wan_causal"):
    """A block-causal Wan 2.1 DiT (presets: tiny, tiny-deep, world, wan2.1-t2v-1.3b, wan2.1-t2v-14b and the
    image-to-video tiny-i2v, world-i2v, wan2.1-i2v-14b-480p, wan2.1-i2v-14b-720p; ordinary Wan weights): latent
    frames in blocks of ``num_frames_per_block``, each attending to itself and earlier blocks within
    ``local_attn_size`` frames (-1: all) plus the first ``sink_size`` frames; ``block_attention`` "prefix" (one
    SDPA per block over its keys), "mask" (one masked SDPA) or "auto" (the mask for the cached chunks of a compiled
    model, so a stream of any length compiles to one graph per grad mode; else prefix). Its data and folder are
    Wan 2.1's: the encoders are Wan's record."""

    family = WAN_CAUSAL

    num_frames_per_block: Annotated[int, msgspec.Meta(ge=1)] = 3
    local_attn_size: int = -1
    sink_size: Annotated[int, msgspec.Meta(ge=0)] = 0
    block_attention: Literal["auto", "prefix", "mask"] = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        window = self.local_attn_size
        if window != -1 and window < self.num_frames_per_block:
            raise ValueError(f"local_attn_size must be -1 (global) or at least num_frames_per_block="
                             f"{self.num_frames_per_block} frames, got {window}")
        if window != -1 and self.sink_size >= window:
            raise ValueError(f"sink_size {self.sink_size} must be below local_attn_size {window}")

