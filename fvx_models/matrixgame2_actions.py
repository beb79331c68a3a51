"""Matrix-Game 2.0's action module: keyboard and mouse input, per video frame, added to a Wan block's hidden states
(FastVideo's ``fastvideo/models/dits/matrixgame2/action_module.py`` and ``configs/models/dits/matrixgame2.py``, read
for the design; the params keep their names, so released folders load as they are).

Actions come per video frame: ``keyboard [B, F, K]`` (FastVideo's universal model: W, S, A, D) and ``mouse [B, F, 2]``
(camera pitch and yaw), ``F = r (T - 1) + 1`` for ``T`` latent frames and the VAE's time compression ``r``. Latent
frame ``i`` reads the window of the ``r * windows_size`` video frames before its own, ``[r (i - w), r i)``, the
actions before frame 0 being frame 0's (padding). Two branches, each a residual on the hidden states ``x [B, T S, C]``
(``S`` tokens per frame):

- mouse: per token, its hidden state and the mouse window (flattened) go through an MLP; self-attention over the
  frames of that spatial position (``heads`` heads, RMS-normed q/k, a temporal RoPE) then ``proj_mouse``;
- keyboard: the keys of each frame are embedded (an MLP), a frame's window of embeddings gives a key and value; every
  token's query (from ``x`` after the mouse branch) attends over the frames' keyboard keys (q/k RMS-normed, the same
  temporal RoPE), then ``proj_keyboard``.

The temporal RoPE rotates the first ``rope_dims[0]`` dims of each head (GPT-J pairs) at the frame's absolute index with
base ``rope_theta``; the other dims sit at position 0 of their axes, so they are not rotated. Which frames a frame
attends is the caller's ``attend``: all (the bidirectional model), or the block-causal plan of a streaming one.
"""
from __future__ import annotations

from typing import Annotated, Callable

import msgspec
import torch
from diffusers.models.normalization import FP32LayerNorm, RMSNorm
from torch import nn
from torch.nn import functional as F

from fvx.config import Config

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (q, k, v) [N, T, heads, d] -> [N, T, h, d]


class ActionConfig(Config):
    """A Matrix-Game 2.0 action module (its released ``action_config``): on the blocks ``blocks``; keyboard width
    ``keyboard_dim``, mouse width ``mouse_dim`` (0: no mouse branch, Temple Run's model); ``windows_size`` latent
    frames of actions per frame, ``time_compression`` video frames per latent frame (the VAE's; 1 for the toy
    codec); widths of the keyboard embedding (``hidden_size``), the keyboard and mouse attention
    (``keyboard_hidden_dim``, ``mouse_hidden_dim``) in ``heads`` heads; the temporal RoPE's dims per axis (the first
    is rotated; they sum to a head's width) and base."""

    blocks: tuple[int, ...] = tuple(range(15))
    keyboard_dim: Annotated[int, msgspec.Meta(gt=0)] = 4
    mouse_dim: Annotated[int, msgspec.Meta(ge=0)] = 2
    hidden_size: Annotated[int, msgspec.Meta(gt=0)] = 128
    keyboard_hidden_dim: Annotated[int, msgspec.Meta(gt=0)] = 1024
    mouse_hidden_dim: Annotated[int, msgspec.Meta(gt=0)] = 1024
    heads: Annotated[int, msgspec.Meta(gt=0)] = 16
    windows_size: Annotated[int, msgspec.Meta(gt=0)] = 3
    time_compression: Annotated[int, msgspec.Meta(gt=0)] = 4
    rope_dims: tuple[int, int, int] = (8, 28, 28)
    rope_theta: float = 256.0
    qk_norm: bool = True
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        for name, width in (("keyboard_hidden_dim", self.keyboard_hidden_dim), ("mouse_hidden_dim",
                                                                                self.mouse_hidden_dim)):
            if width % self.heads or width // self.heads != sum(self.rope_dims):
                raise ValueError(f"action_config.{name} {width} over {self.heads} heads must give heads of "
                                 f"sum(rope_dims) = {sum(self.rope_dims)} dims")
        if self.rope_dims[0] % 2:
            raise ValueError(f"action_config.rope_dims[0] must be even (pairs are rotated), got {self.rope_dims[0]}")

    @property
    def window(self) -> int:
        """Video frames of actions a latent frame reads: ``time_compression * windows_size``."""
        return self.time_compression * self.windows_size

    def video_frames(self, latent_frames: int) -> int:
        """``F = r (T - 1) + 1``: the video frames (action rows) of ``latent_frames`` latent frames."""
        return self.time_compression * (latent_frames - 1) + 1

    def released(self, img_hidden_size: int, patch_size: tuple[int, int, int]) -> dict:
        """The ``action_config`` a released folder's config.json holds (FastVideo's names)."""
        return {"blocks": list(self.blocks), "enable_keyboard": True, "enable_mouse": self.mouse_dim > 0,
                "heads_num": self.heads, "hidden_size": self.hidden_size, "img_hidden_size": img_hidden_size,
                "keyboard_dim_in": self.keyboard_dim, "keyboard_hidden_dim": self.keyboard_hidden_dim,
                "mouse_dim_in": self.mouse_dim, "mouse_hidden_dim": self.mouse_hidden_dim,
                "mouse_qk_dim_list": list(self.rope_dims), "patch_size": list(patch_size), "qk_norm": self.qk_norm,
                "qkv_bias": self.qkv_bias, "rope_dim_list": list(self.rope_dims), "rope_theta": self.rope_theta,
                "vae_time_compression_ratio": self.time_compression, "windows_size": self.windows_size}


def _norm(width: int, enabled: bool) -> nn.Module:
    return RMSNorm(width, eps=1e-6, elementwise_affine=True) if enabled else nn.Identity()


class ActionModule(nn.Module):
    """The params of one block's action module, named as Matrix-Game's; :func:`apply_actions` is its forward."""

    def __init__(self, config: ActionConfig, dim: int) -> None:
        super().__init__()
        c, kb, bias = config.mouse_hidden_dim, config.keyboard_hidden_dim, config.qkv_bias
        self.keyboard_embed = nn.Sequential(nn.Linear(config.keyboard_dim, config.hidden_size), nn.SiLU(),
                                            nn.Linear(config.hidden_size, config.hidden_size))
        if config.mouse_dim:
            self.mouse_mlp = nn.Sequential(nn.Linear(config.mouse_dim * config.window + dim, c),
                                           nn.GELU(approximate="tanh"), nn.Linear(c, c),
                                           FP32LayerNorm(c, elementwise_affine=True))
            self.t_qkv = nn.Linear(c, 3 * c, bias=bias)
            self.img_attn_q_norm = _norm(c // config.heads, config.qk_norm)
            self.img_attn_k_norm = _norm(c // config.heads, config.qk_norm)
            self.proj_mouse = nn.Linear(c, dim, bias=bias)
        self.key_attn_q_norm = _norm(kb // config.heads, config.qk_norm)
        self.key_attn_k_norm = _norm(kb // config.heads, config.qk_norm)
        self.mouse_attn_q = nn.Linear(dim, kb, bias=bias)
        self.keyboard_attn_kv = nn.Linear(config.hidden_size * config.window, 2 * kb, bias=bias)
        self.proj_keyboard = nn.Linear(kb, dim, bias=bias)
        self.config = config


def windows(actions: torch.Tensor, first: int, count: int, config: ActionConfig) -> torch.Tensor:
    """``[B, count, r w, D]``: the action windows of latent frames ``first .. first + count - 1`` from per-video-frame
    ``actions [B, F, D]`` (frame 0's action repeated before it)."""
    pad = config.window
    padded = torch.cat([actions[:, :1].expand(-1, pad, -1), actions], dim=1)
    r = config.time_compression
    return torch.stack([padded[:, r * i:r * i + pad] for i in range(first, first + count)], dim=1)


def rope_tables(config: ActionConfig, first: int, count: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(cos, sin) ``[count, d / 2]`` of the temporal RoPE at frames ``first ..`` (module docstring), fp32."""
    rotated, head_dim = config.rope_dims[0], sum(config.rope_dims)
    freqs = 1.0 / config.rope_theta ** (torch.arange(0, rotated, 2, dtype=torch.float32, device=device) / rotated)
    angles = torch.outer(torch.arange(first, first + count, dtype=torch.float32, device=device), freqs)
    still = torch.zeros(count, (head_dim - rotated) // 2, device=device)
    return torch.cat([angles.cos(), still.cos()], dim=1), torch.cat([angles.sin(), still.sin()], dim=1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J RoPE of ``x [N, T, heads, d]`` with ``cos, sin [T, d / 2]``: pairs ``(x_2j, x_2j+1)`` rotated."""
    even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
    cos, sin = cos[:, None], sin[:, None]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2).type_as(x)


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Every frame attends every frame: SDPA over ``[N, T, heads, d]``."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


class ActionKV(dict):
    """One forward's action keys and values per branch (``"mouse"``, ``"keyboard"``), each ``[B S, T, h, d]`` (a
    token's frames; the keyboard's the same for every token), post-norm and post-RoPE: what a streaming model caches."""


def apply_actions(module: ActionModule, x: torch.Tensor, grid: tuple[int, int, int], keyboard: torch.Tensor,
                  mouse: torch.Tensor | None, *, first: int = 0, attend_mouse: Attend = full_attention,
                  attend_keyboard: Attend = full_attention, kv: ActionKV | None = None) -> torch.Tensor:
    """``x [B, T S, C]`` plus the mouse and keyboard branches (module docstring) for latent frames ``first ..
    first + T - 1`` of the clip whose per-video-frame actions are ``keyboard [B, F, K]``, ``mouse [B, F, 2]``.
    ``attend_*(q, k, v)`` attend over frames (``k``: the chunk's, to which a streaming caller prepends its cache);
    ``kv`` collects the chunk's keys and values."""
    config = module.config
    frames, height, width = grid
    batch, tokens = x.shape[0], height * width
    heads = config.heads
    cos, sin = rope_tables(config, first, frames, x.device)
    if config.mouse_dim:
        per_token = x.view(batch, frames, tokens, -1).transpose(1, 2).reshape(batch * tokens, frames, -1)
        window = windows(mouse.to(x.dtype), first, frames, config).flatten(2)  # [B, T, r w 2]
        window = window[:, None].expand(batch, tokens, frames, window.shape[-1]).reshape(batch * tokens, frames, -1)
        hidden = module.mouse_mlp(torch.cat([per_token, window], dim=-1))
        q, k, v = module.t_qkv(hidden).view(batch * tokens, frames, 3, heads, -1).unbind(2)
        q = rotate(module.img_attn_q_norm(q).to(v.dtype), cos, sin)
        k = rotate(module.img_attn_k_norm(k).to(v.dtype), cos, sin)
        if kv is not None:
            kv["mouse"] = (k, v)
        out = attend_mouse(q, k, v)  # [B S, T, h, d]
        out = out.reshape(batch, tokens, frames, -1).transpose(1, 2).reshape(batch, frames * tokens, -1)
        x = x + module.proj_mouse(out)
    embedded = module.keyboard_embed(keyboard.to(x.dtype))
    group = windows(embedded, first, frames, config).flatten(2)  # [B, T, r w hidden]
    k, v = module.keyboard_attn_kv(group).view(batch, frames, 2, heads, -1).unbind(2)
    q = module.mouse_attn_q(x).view(batch, frames, tokens, heads, -1)
    q = module.key_attn_q_norm(q).to(v.dtype).transpose(1, 2).reshape(batch * tokens, frames, heads, -1)
    q = rotate(q, cos, sin)
    k = rotate(module.key_attn_k_norm(k).to(v.dtype), cos, sin)
    k, v = k.repeat_interleave(tokens, dim=0), v.repeat_interleave(tokens, dim=0)  # every token's frames: [B S, T, h, d]
    if kv is not None:
        kv["keyboard"] = (k, v)
    out = attend_keyboard(q, k, v)
    out = out.reshape(batch, tokens, frames, -1).transpose(1, 2).reshape(batch, frames * tokens, -1)
    return x + module.proj_keyboard(out)
