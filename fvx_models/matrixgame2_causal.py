"""Block-causal, KV-cached Matrix-Game 2.0 (family ``matrixgame2_causal``; FastVideo's
``CausalMatrixGame2WanModel``): ``fvx_models.matrixgame2``'s transformer with ``fvx_models.wan_causal``'s block-causal
self-attention, and the action module made block-causal too.

Every self-attention runs as the block-causal Wan's (its RoPE module plans the forward: frames in blocks of
``num_frames_per_block``, a window of ``local_attn_size`` frames, ``sink_size`` sink frames). The action module's two
attentions run over frames, per spatial position, under the same rule at frame granularity (FastVideo's
``_prepare_blockwise_causal_attn_mask_action``): a frame reads the action keys of its own block and of the frames its
block can see. Streaming caches those keys and values beside the self-attention's: the cache
(``fvx_models.block_causal.KVCache``) holds the video layers, then per action block its mouse and keyboard keys, all
in the video's token layout (one row per frame and spatial position), so the ring of slots, its writes and its
checkpointing are the block-causal Wan's and the action cache stays bounded by the window as the video's does.

Image-to-video as FastVideo's causal Matrix-Game gives it: each chunk's input is ``[x_t | mask | first-frame
latents]`` of the chunk's own frames (the mask one on the clip's frame 0 only), and its action windows are cut from
the clip's actions at the chunk's absolute frames. Teacher forcing is refused (no Matrix-Game recipe uses it).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import torch
from torch import nn

from fvx_models import block_causal as bc, matrixgame2 as mg, matrixgame2_actions as actions, wan_causal
from fvx_models.build import DTYPES
from fvx_models.family import skeleton_of
from fvx_models.model import Causal


@dataclasses.dataclass
class ActionLayer:
    """What one action block reads in a forward (the frame-level plan, its cached action keys/values ``(mouse k, v,
    keyboard k, v)`` in token layout or None) and leaves (``kv``: the chunk's, :class:`~matrixgame2_actions.ActionKV`)."""

    blocks: tuple[bc.QueryBlock, ...]
    mask: torch.Tensor | None
    cached: tuple[torch.Tensor, ...] | None
    kv: actions.ActionKV = dataclasses.field(default_factory=actions.ActionKV)


class ActionFrameRope(wan_causal.FrameRope):
    """The block-causal Wan's RoPE module, whose plan also holds the frame-level plan of the action attention."""

    def forward(self, hidden_states: torch.Tensor) -> wan_causal.Plan:
        plan = super().forward(hidden_states)
        frames = hidden_states.shape[2] // self.patch_size[0]
        slots = plan.cache.slots
        plan.action_blocks = bc.plan_blocks(slots, plan.cache.next_frame, frames, 1,
                                            frames_per_block=self.frames_per_block, window=self.window,
                                            sink=self.sink)
        plan.action_mask = (None if plan.mask is None else
                            bc.mask_of(plan.action_blocks, frames, len(slots) + frames, hidden_states.device))
        plan.action_layers = {}
        return plan


def to_frames(tokens: torch.Tensor, per_frame: int) -> torch.Tensor:
    """``[B, T S, h, d]`` (token layout) -> ``[B S, T, h, d]`` (each spatial position's frames)."""
    b, length, h, d = tokens.shape
    return tokens.view(b, length // per_frame, per_frame, h, d).transpose(1, 2).reshape(b * per_frame, -1, h, d)


def to_tokens(frames: torch.Tensor, per_frame: int) -> torch.Tensor:
    """The inverse of :func:`to_frames`."""
    bs, t, h, d = frames.shape
    return frames.view(bs // per_frame, per_frame, t, h, d).transpose(1, 2).reshape(bs // per_frame, t * per_frame,
                                                                                    h, d)


class CausalActionBlock(mg.ActionBlock):
    """The action block whose action attentions follow the forward's block-causal frame plan."""

    def run_actions(self, hidden_states: torch.Tensor, acts: mg.Actions, rotary_emb: Any) -> torch.Tensor:
        layer: ActionLayer = acts.plan
        per_frame = acts.grid[1] * acts.grid[2]

        def attend(offset: int):
            def run(q, k, v):
                if layer.cached is not None:
                    k = torch.cat([to_frames(layer.cached[offset], per_frame).to(k.dtype), k], dim=1)
                    v = torch.cat([to_frames(layer.cached[offset + 1], per_frame).to(v.dtype), v], dim=1)
                return bc.attend(q, k, v, layer.blocks, layer.mask)
            return run

        return actions.apply_actions(self.action_model, hidden_states, acts.grid, acts.keyboard, acts.mouse,
                                     first=acts.first, attend_mouse=attend(0), attend_keyboard=attend(2),
                                     kv=layer.kv)


class CausalMatrixGame2WanModel(mg.MatrixGame2WanModel):
    """The block-causal Matrix-Game transformer: a streaming chunk starts at its cache's next frame."""

    block_class = CausalActionBlock

    def first_frame(self, rotary_emb: Any) -> int:
        return rotary_emb.cache.next_frame if isinstance(rotary_emb, wan_causal.Plan) else 0


def _layer_view(index: int, slot: int | None, block: nn.Module, args: tuple) -> tuple | None:
    """A block's forward pre-hook: its self-attention gets this layer's view of the plan, its action module the
    frame plan, the chunk's first frame and its cached action keys (``slot``: its first layer in the cache)."""
    hidden_states, context, temb, plan, acts = args
    if not isinstance(plan, wan_causal.Plan):
        return None
    first = plan.cache.next_frame
    if acts is not None and slot is not None:
        cache = plan.cache
        cached = ((cache.keys[slot], cache.values[slot], cache.keys[slot + 1], cache.values[slot + 1])
                  if cache.keys else None)
        plan.action_layers[index] = ActionLayer(plan.action_blocks, plan.action_mask, cached)
        acts = acts._replace(first=first, plan=plan.action_layers[index])
    elif acts is not None:
        acts = acts._replace(first=first)
    return hidden_states, context, temb, plan.layer(index), acts


def action_slots(config: Any) -> dict[int, int]:
    """Block index -> its first layer in the cache: after the video layers, two per action block (mouse,
    keyboard; a model without a mouse branch keeps an empty pair for it)."""
    layers = config.spec.kwargs["num_layers"]
    return {block: layers + 2 * i for i, block in enumerate(mg.action_config(config).blocks)}


def skeleton(config: Any) -> nn.Module:
    """The Matrix-Game transformer on meta with the block-causal RoPE, self-attention and action attention."""
    module = skeleton_of(CausalMatrixGame2WanModel, config.spec.kwargs, wan_causal.rope_of(config, ActionFrameRope))
    processor = wan_causal.BlockCausalAttention()
    slots = action_slots(config)
    for index, block in enumerate(module.blocks):
        block.attn1.set_processor(processor)
        block.register_forward_pre_hook(functools.partial(_layer_view, index, slots.get(index)))
    return module


def inputs(config: Any, x_t: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """Matrix-Game's inputs; per-frame ``t [B, T]`` one timestep per token; the actions may run past the chunk."""
    mg.check_actions(config, cond, x_t.shape[2], "the cond", at_least=True)
    kwargs = {"hidden_states": x_t, "timestep": t, "image_latents": cond["first_frame_latents"],
              "encoder_hidden_states_image": cond["image_embeds"], "keyboard": cond["keyboard"],
              "mouse": cond.get("mouse"), "return_dict": False}
    if t.dim() == 2:
        _, p_h, p_w = config.spec.kwargs["patch_size"]
        kwargs["timestep"] = t.repeat_interleave((x_t.shape[3] // p_h) * (x_t.shape[4] // p_w), dim=1)
    return kwargs


def causal(config: Any, apply: Any, module: nn.Module) -> Causal:
    """``Model.causal``: the block-causal Wan's streaming functions with the action layers in the cache."""
    kwargs = config.spec.kwargs
    _, p_h, p_w = kwargs["patch_size"]
    layers, heads, head_dim = kwargs["num_layers"], kwargs["num_attention_heads"], kwargs["attention_head_dim"]
    acts = mg.action_config(config)
    action_heads = acts.heads
    widths = (acts.mouse_hidden_dim // action_heads, acts.keyboard_hidden_dim // action_heads)
    layout = dict(frames_per_block=config.num_frames_per_block, window=config.local_attn_size, sink=config.sink_size)
    dtype = DTYPES[config.compute_dtype]
    who = f"matrixgame2_causal:{config.preset}"
    slots = action_slots(config)
    order = sorted(slots)

    def allocated(cache, batch, tokens, device):
        if cache.keys:
            return cache
        video = bc.allocate(cache, layers=layers, batch=batch, tokens_per_frame=tokens, heads=heads,
                            head_dim=head_dim, dtype=dtype, device=device)
        rows = len(cache.slots) * tokens
        extra = [torch.zeros(batch, rows, action_heads, widths[i % 2], dtype=dtype, device=device)
                 for i in range(2 * len(order))]
        return video._replace(keys=video.keys + tuple(extra), values=video.values + tuple(torch.zeros_like(e)
                                                                                          for e in extra))

    def allocated_cache(frames, shape, device):
        return allocated(bc.empty(frames, **layout), shape[0], (shape[3] // p_h) * (shape[4] // p_w), device)

    def cache_bytes(frames, shape):
        slots = bc.ring_slots(frames, **layout)
        tokens = shape[0] * slots * (shape[3] // p_h) * (shape[4] // p_w)
        per_token = layers * heads * head_dim + len(order) * action_heads * sum(widths)
        return 2 * tokens * per_token * dtype.itemsize

    def apply_cached(params, x_t, t, cond, cache):
        tokens = (x_t.shape[3] // p_h) * (x_t.shape[4] // p_w)
        if not isinstance(cache, bc.KVCache):
            raise ValueError(f"{who}: the KV cache must be a fvx_models.block_causal.KVCache (Model.causal."
                             f"empty_cache), got {type(cache).__name__}")
        if cache.keys and len(cache.keys) != layers + 2 * len(order):
            raise ValueError(f"{who}: the KV cache has {len(cache.keys)} layers; the model keeps {layers} video "
                             f"and {2 * len(order)} action layers")
        mg.check_actions(config, cond, cache.next_frame + x_t.shape[2], "the cond", at_least=True)
        cache = allocated(cache, x_t.shape[0], tokens, x_t.device)
        call = wan_causal.Call(cache=cache)
        v = apply(params, x_t, t, cond, call=call)
        plan = call.plan
        keys = [plan.layers[i].kv[0] for i in range(layers)]
        values = [plan.layers[i].kv[1] for i in range(layers)]
        for block in order:
            kv = plan.action_layers[block].kv
            for branch in ("mouse", "keyboard"):
                k, v_ = kv.get(branch, (None, None))
                if k is None:  # no mouse branch: its pair of cache layers stays empty
                    slot = slots[block] + (branch == "keyboard")
                    k = v_ = torch.zeros(x_t.shape[0] * tokens, x_t.shape[2], *cache.keys[slot].shape[2:],
                                         dtype=dtype, device=x_t.device)
                keys.append(to_tokens(k, tokens))
                values.append(to_tokens(v_, tokens))
        after = bc.write(cache, keys, values, x_t.shape[2], tokens, **layout)
        return v, after

    def apply_teacher_forced(params, x_t, t, cond, clean):
        raise ValueError(f"{who}: teacher forcing is not supported (no Matrix-Game recipe uses it; its action windows "
                         "would need the [clean | noisy] layout): use dfsft or self_forcing")

    return Causal(frames_per_block=config.num_frames_per_block, window=config.local_attn_size,
                  sink=config.sink_size, empty_cache=lambda frames: bc.empty(frames, **layout),
                  apply_cached=apply_cached, apply_teacher_forced=apply_teacher_forced,
                  allocated_cache=allocated_cache, cache_bytes=cache_bytes,
                  max_frames=kwargs["rope_max_seq_len"] * kwargs["patch_size"][0])


MATRIXGAME2_CAUSAL = mg.MATRIXGAME2.variant(
    name="matrixgame2_causal",
    architecture={
        "skeleton": skeleton,
        "activations": wan_causal.ACTIVATIONS,
        "whole_graph_refusal": "its forward binds per-call state (a KV cache, the block-causal plan)",
        "vsa_refusal": wan_causal.WAN_CAUSAL.architecture.vsa_refusal,
    },
    forward={
        "inputs": inputs,
        "per_frame_timesteps": True,
        "bind": wan_causal.bind,
        "causal": causal,
    },
)


class MatrixGame2CausalConfig(wan_causal.WanCausalConfig, tag="matrixgame2_causal"):
    """A block-causal Matrix-Game 2.0 DiT (presets as ``matrixgame2``'s; its folders are the same): the streaming
    student of the world-model scenarios. Knobs as the block-causal Wan's: blocks of ``num_frames_per_block`` latent
    frames, a window of ``local_attn_size`` frames (-1: all) with ``sink_size`` sink frames, ``block_attention``."""

    family = MATRIXGAME2_CAUSAL
