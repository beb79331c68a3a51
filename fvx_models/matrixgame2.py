"""Matrix-Game 2.0 (family ``matrixgame2``): an action-conditioned image-to-video world model, diffusers' Wan 2.1
image-to-video transformer with Matrix-Game's action module on the blocks its config lists
(``fvx_models.matrixgame2_actions``). diffusers has no Matrix-Game class, so the transformer here is diffusers'
``WanTransformer3DModel`` with three changes, read from FastVideo's ``fastvideo/models/dits/matrixgame2/`` (its
``model.py``, ``causal_model.py``) and ``fastvideo/configs/models/dits/matrixgame2.py``:

- no text: the cross-attention context is the CLIP image embedding's 257 tokens alone, through the block's own
  ``to_q/to_k/to_v`` (no added image projections; diffusers' Wan with ``added_kv_proj_dim=None`` and no text tokens
  computes exactly that), and the condition embedder has no text projection;
- a block adds its action module's output to the hidden states after the cross-attention, before the feed-forward
  reads them (the order of Matrix-Game's blocks and FastVideo's causal one);
- the patch embedding's params are ``patch_embedding.proj.*``, as the released folders store them.

Inputs: ``[x_t | mask | first_frame_latents]`` on channels (``fvx_models.wan_i2v``'s concat form), the image
embedding ``image_embeds [B, 257, 1280]`` and the actions ``keyboard [B, F, K]``, ``mouse [B, F, 2]`` per video
frame, ``F = 4 (T - 1) + 1`` (the batch's ``keyboard``/``mouse``, FastVideo's ``keyboard_cond``/``mouse_cond``).
Released folders (``FastVideo/Matrix-Game-2.0-Base-Diffusers`` and the scenario's Zelda/Solaris checkpoints) load
and export under their own key names: diffusers' Wan names with the changes above and ``blocks.N.action_model.*``.
Their ``config.json`` names ``MatrixGame2WanModel`` (or its older and causal aliases) and holds the
``action_config``.
"""
from __future__ import annotations

import warnings
from typing import Any, Mapping, NamedTuple

import torch
from diffusers import WanTransformer3DModel
from diffusers.configuration_utils import register_to_config
from torch import nn

from fvx_models import diffusers_folder as dfolder, matrixgame2_actions as actions, wan, wan_i2v
from fvx_models.build import ModelConfig
from fvx_models.family import Architecture, Checkpoints, Conditioning, Family, Forward, Preset, require, skeleton_of

CLASS_ALIASES = ("MatrixGame2WanModel", "MatrixGameWanModel", "CausalMatrixGame2WanModel", "CausalMatrixGameWanModel")
ACTION_COND = ("keyboard", "mouse")


class Actions(NamedTuple):
    """What a block's action module reads in one forward: the clip's actions ``keyboard [B, F, K]``, ``mouse [B, F,
    2]`` (or None), the latent grid ``(T, H, W)`` of the tokens, the absolute latent frame they start at and, in a
    streaming model, the layer's attention plan."""

    keyboard: torch.Tensor
    mouse: torch.Tensor | None
    grid: tuple[int, int, int]
    first: int = 0
    plan: Any = None


class PatchEmbed(nn.Module):
    """The patch embedding under the released name ``patch_embedding.proj``."""

    def __init__(self, proj: nn.Conv3d) -> None:
        super().__init__()
        self.proj = proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class ActionBlock(nn.Module):
    """A diffusers Wan block (its class swapped, its modules kept) with the action module between the
    cross-attention and the feed-forward; a block without ``action_model`` computes diffusers' block exactly."""

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                rotary_emb: Any, acts: Actions | None = None) -> torch.Tensor:
        if temb.ndim == 4:  # one timestep per token: [B, L, 6, dim]
            mod = (self.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
            shift, scale, gate, c_shift, c_scale, c_gate = (m.squeeze(2) for m in mod)
        else:
            shift, scale, gate, c_shift, c_scale, c_gate = (self.scale_shift_table + temb.float()).chunk(6, dim=1)
        norm = (self.norm1(hidden_states.float()) * (1 + scale) + shift).type_as(hidden_states)
        attn = self.attn1(norm, None, None, rotary_emb)
        hidden_states = (hidden_states.float() + attn * gate).type_as(hidden_states)
        norm = self.norm2(hidden_states.float()).type_as(hidden_states)
        hidden_states = hidden_states + self.attn2(norm, encoder_hidden_states, None, None)
        if acts is not None and getattr(self, "action_model", None) is not None:
            hidden_states = self.run_actions(hidden_states, acts, rotary_emb)
        norm = (self.norm3(hidden_states.float()) * (1 + c_scale) + c_shift).type_as(hidden_states)
        ff = self.ffn(norm)
        return (hidden_states.float() + ff.float() * c_gate).type_as(hidden_states)

    def run_actions(self, hidden_states: torch.Tensor, acts: Actions, rotary_emb: Any) -> torch.Tensor:
        """The action module over all the clip's frames (the bidirectional model)."""
        return actions.apply_actions(self.action_model, hidden_states, acts.grid, acts.keyboard, acts.mouse,
                                     first=acts.first)


class MatrixGame2WanModel(WanTransformer3DModel):
    """diffusers' Wan with Matrix-Game 2.0's changes (module docstring); ``action_config`` as released folders hold
    it (FastVideo's names)."""

    stored_class_names = CLASS_ALIASES
    block_class = ActionBlock

    @register_to_config
    def __init__(self, patch_size: tuple[int, ...] = (1, 2, 2), num_attention_heads: int = 12,
                 attention_head_dim: int = 128, in_channels: int = 36, out_channels: int = 16, text_dim: int = 0,
                 freq_dim: int = 256, ffn_dim: int = 8960, num_layers: int = 30, cross_attn_norm: bool = True,
                 qk_norm: str | None = "rms_norm_across_heads", eps: float = 1e-6, image_dim: int | None = 1280,
                 added_kv_proj_dim: int | None = None, rope_max_seq_len: int = 1024,
                 pos_embed_seq_len: int | None = None, action_config: dict | None = None) -> None:
        with warnings.catch_warnings():  # the text projection's zero-width Linear, replaced below
            warnings.simplefilter("ignore", UserWarning)
            super().__init__(patch_size=patch_size, num_attention_heads=num_attention_heads,
                             attention_head_dim=attention_head_dim, in_channels=in_channels,
                             out_channels=out_channels, text_dim=text_dim, freq_dim=freq_dim, ffn_dim=ffn_dim,
                             num_layers=num_layers, cross_attn_norm=cross_attn_norm, qk_norm=qk_norm, eps=eps,
                             image_dim=image_dim, added_kv_proj_dim=added_kv_proj_dim,
                             rope_max_seq_len=rope_max_seq_len, pos_embed_seq_len=pos_embed_seq_len)
        self.patch_embedding = PatchEmbed(self.patch_embedding)
        self.condition_embedder.text_embedder = nn.Identity()
        dim = num_attention_heads * attention_head_dim
        self.actions = action_config_of(action_config or {})
        for index, block in enumerate(self.blocks):
            block.__class__ = self.block_class
            if index in self.actions.blocks:
                block.action_model = actions.ActionModule(self.actions, dim)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, image_latents: torch.Tensor,
                encoder_hidden_states_image: torch.Tensor, keyboard: torch.Tensor | None = None,
                mouse: torch.Tensor | None = None, return_dict: bool = False) -> tuple[torch.Tensor]:
        """diffusers' Wan forward (``return_dict=False``) on ``[x_t | mask | image_latents]`` (the clip's first-frame
        latents ``[B, C, T', H, W]``, cut to the frames of ``x_t``; the mask one on the clip's frame 0), with no
        text and the actions handed to every block; ``timestep [B]`` or one per token ``[B, L]``."""
        rotary_emb = self.rope(hidden_states)
        first = self.first_frame(rotary_emb)
        mask_channels = self.config.in_channels - 2 * hidden_states.shape[1]
        hidden_states = wan_i2v.chunk_concat_input(hidden_states, image_latents, first, mask_channels, "matrixgame2")
        batch, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.config.patch_size
        grid = (frames // p_t, height // p_h, width // p_w)
        x = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()
        per_token = timestep.shape[1] if timestep.ndim == 2 else None
        no_text = x.new_zeros(batch, 0, x.shape[-1])
        temb, timestep_proj, _, context = self.condition_embedder(
            timestep.flatten(), no_text, encoder_hidden_states_image, timestep_seq_len=per_token)
        timestep_proj = timestep_proj.unflatten(2 if per_token else 1, (6, -1))
        acts = None if keyboard is None else Actions(keyboard, mouse, grid, first)
        for block in self.blocks:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                x = self._gradient_checkpointing_func(block, x, context, timestep_proj, rotary_emb, acts)
            else:
                x = block(x, context, timestep_proj, rotary_emb, acts)
        if temb.ndim == 3:
            shift, scale = (self.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
            shift, scale = shift.squeeze(2), scale.squeeze(2)
        else:
            shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        x = (self.norm_out(x.float()) * (1 + scale) + shift).type_as(x)
        x = self.proj_out(x).reshape(batch, *grid, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return (x.flatten(6, 7).flatten(4, 5).flatten(2, 3),)

    def first_frame(self, rotary_emb: Any) -> int:
        """The absolute latent frame the forward's frames start at: 0 (a streaming model reads its cache's)."""
        return 0


def action_config_of(released: Mapping[str, Any]) -> actions.ActionConfig:
    """The :class:`~fvx_models.matrixgame2_actions.ActionConfig` of a released ``action_config`` (FastVideo's names);
    an empty one: no action modules."""
    if not released:
        return actions.ActionConfig(blocks=())
    return actions.ActionConfig(
        blocks=tuple(released["blocks"]), keyboard_dim=released["keyboard_dim_in"],
        mouse_dim=released["mouse_dim_in"] if released.get("enable_mouse", True) else 0,
        hidden_size=released["hidden_size"], keyboard_hidden_dim=released["keyboard_hidden_dim"],
        mouse_hidden_dim=released["mouse_hidden_dim"], heads=released["heads_num"],
        windows_size=released["windows_size"], time_compression=released["vae_time_compression_ratio"],
        rope_dims=tuple(released["mouse_qk_dim_list"]), rope_theta=float(released["rope_theta"]),
        qk_norm=released["qk_norm"], qkv_bias=released["qkv_bias"])


# ------------------------------------------------------------------------------------------------------------ presets


def _released(config: actions.ActionConfig, kwargs: Mapping[str, Any]) -> dict:
    return config.released(kwargs["num_attention_heads"] * kwargs["attention_head_dim"], kwargs["patch_size"])


def _preset(wan_kwargs: Mapping[str, Any], action: actions.ActionConfig, latents: Any, shift: float) -> Preset:
    kwargs = {name: wan_kwargs[name] for name in (
        "patch_size", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "freq_dim",
        "ffn_dim", "num_layers", "cross_attn_norm", "qk_norm", "eps", "rope_max_seq_len")}
    kwargs.update(text_dim=0, image_dim=wan_kwargs["image_dim"], added_kv_proj_dim=None, pos_embed_seq_len=None)
    kwargs["action_config"] = _released(action, kwargs)
    return Preset(kwargs, latents, 0, {"flow_shift": shift, "i2v": wan_i2v.CONCAT})


RELEASED_ACTIONS = actions.ActionConfig()  # FastVideo's MatrixGame2WanVideoArchConfig.action_config
TINY_ACTIONS = actions.ActionConfig(blocks=(1,), hidden_size=8, keyboard_hidden_dim=32, mouse_hidden_dim=32, heads=2,
                                    rope_dims=(4, 6, 6))
WORLD_ACTIONS = actions.ActionConfig(blocks=(0, 1, 2), hidden_size=16, keyboard_hidden_dim=64, mouse_hidden_dim=64,
                                     heads=4, rope_dims=(8, 4, 4), windows_size=1, time_compression=1)
PRESETS = {
    # the tiny Wan in Matrix-Game's layout: [x | 4-channel mask | first frame] in, a 16-wide image embedding
    "tiny": _preset({**wan.TINY, "in_channels": 36, "image_dim": 16}, TINY_ACTIONS, wan.TINY_VAE, 5.0),
    # the toy world's (fvx.data.toy_world, kind "matrixgame2"): the codec's 192 channels, time stride 1, so actions
    # come one per latent frame; the image embedding is the first frame's latent tokens
    "world": _preset({**wan.TINY, "in_channels": 385, "out_channels": 192, "patch_size": (1, 1, 1),
                      "num_attention_heads": 4, "attention_head_dim": 64, "ffn_dim": 512, "num_layers": 3,
                      "image_dim": 192}, WORLD_ACTIONS, wan.WORLD_CODEC, 5.0),
    # Wan 2.1 1.3B I2V with the released action modules on blocks 0-14 (keyboard W/S/A/D, mouse)
    "matrix-game-2.0": _preset({**wan.WAN21_1_3B, "in_channels": 36, "image_dim": 1280}, RELEASED_ACTIONS,
                               wan.WAN21_VAE, 5.0),
    # the GTA driving model: keyboard W/S, steering by mouse
    "matrix-game-2.0-gta": _preset({**wan.WAN21_1_3B, "in_channels": 36, "image_dim": 1280},
                                   actions.ActionConfig(keyboard_dim=2), wan.WAN21_VAE, 5.0),
    # the Temple Run model: 7 keys, no mouse
    "matrix-game-2.0-templerun": _preset({**wan.WAN21_1_3B, "in_channels": 36, "image_dim": 1280},
                                         actions.ActionConfig(keyboard_dim=7, mouse_dim=0), wan.WAN21_VAE, 5.0),
}


def action_config(config: ModelConfig) -> actions.ActionConfig:
    return action_config_of(config.spec.kwargs["action_config"])


# ---------------------------------------------------------------------------------------------------- conditioning


def cond_spec(config: ModelConfig) -> dict[str, tuple]:
    """First-frame latents, the image embedding and the actions per video frame ``F`` (module docstring)."""
    acts = action_config(config)
    spec = {**wan_i2v.cond_spec(config), "keyboard": ("F", acts.keyboard_dim)}
    if acts.mouse_dim:
        spec["mouse"] = ("F", acts.mouse_dim)
    return spec


def cond_from_batch(config: ModelConfig, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The image condition and the actions of a ``data.kind='matrixgame2'`` batch; with latents, the actions of the
    clip's video frames (longer stored actions cut, shorter ones refused)."""
    cond = wan_i2v.cond_from_batch(config, batch)
    names = tuple(cond_spec(config))[len(cond):]
    require(batch, names, config.family.name, "the actions per video frame: parquet columns keyboard_cond and "
            "mouse_cond of data.kind='matrixgame2' data")
    cond.update({name: batch[name] for name in names})
    if "latents" in batch:  # the clip's video frames, as FastVideo keeps the first (T - 1) r + 1 rows
        frames = batch["latents"].shape[2]
        check_actions(config, cond, frames, "the batch", at_least=True)
        cond.update({name: cond[name][:, :action_config(config).video_frames(frames)] for name in names})
    return cond


def check_actions(config: ModelConfig, cond: Mapping[str, torch.Tensor], latent_frames: int, where: str, *,
                  at_least: bool = False) -> None:
    """A ValueError (one line) unless each action tensor of ``cond`` has the width the model reads and ``F = r (T -
    1) + 1`` rows for ``latent_frames`` ``T`` (``at_least``: at least that many, a streamed clip's)."""
    acts = action_config(config)
    need = acts.video_frames(latent_frames)
    for name, width in (("keyboard", acts.keyboard_dim), ("mouse", acts.mouse_dim)):
        if name not in cond:
            continue
        tensor = cond[name]
        rows = tensor.shape[1] if tensor.dim() == 3 else -1
        if tensor.dim() != 3 or tensor.shape[2] != width or (rows < need if at_least else rows != need):
            raise ValueError(f"{config.family.name}:{config.preset}: {where}'s {name} actions are "
                             f"{list(tensor.shape)}; {latent_frames} latent frames take [B, {need}, {width}] "
                             f"({name} [T, {width}] per video frame, T = {acts.time_compression} x "
                             f"({latent_frames} - 1) + 1)")


def inputs(config: ModelConfig, x_t: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    check_actions(config, cond, x_t.shape[2], "the cond")
    return {"hidden_states": x_t, "timestep": t, "image_latents": cond["first_frame_latents"],
            "encoder_hidden_states_image": cond["image_embeds"], "keyboard": cond["keyboard"],
            "mouse": cond.get("mouse"), "return_dict": False}


def window_cond(config: ModelConfig, cond: Mapping[str, torch.Tensor], start: int, frames: int,
                given: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The cond of latent frames ``[start, start + frames)`` of a longer clip scored as a clip (a streaming chunk,
    as FastVideo's long tuning scores it): the actions of its video frames ``[r start, r (start + frames - 1)]``, the
    given first frame's condition latents, or the clip's own first frame when None."""
    r = action_config(config).time_compression
    out = dict(cond)
    for name in ACTION_COND:
        if name in cond:
            if cond[name].shape[1] < r * (start + frames - 1) + 1:
                raise ValueError(f"{config.family.name}: the {name} actions ({cond[name].shape[1]} video frames) end "
                                 f"before latent frame {start + frames - 1} of the window")
            out[name] = cond[name][:, r * start:r * (start + frames - 1) + 1]
    out["first_frame_latents"] = cond["first_frame_latents"][:, :, :frames] if given is None else given
    return out


def zero_cond(cond: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The "zero" unconditional: no actions (zero keys and mouse), the image kept (guidance is on the actions)."""
    return {name: torch.zeros_like(t) if name in ACTION_COND else t for name, t in cond.items()}


# a fresh action module starts as the identity: its output projections at zero (FastVideo's CausalMatrixGame2WanModel
# .init_weights), so a model drawn from keys, or an action module added to a Wan, is the image-to-video model at first
ZERO_PROJECTIONS = {f"action_model.{name}.{part}": (lambda key, shape: torch.zeros(shape))
                    for name in ("proj_mouse", "proj_keyboard") for part in ("weight", "bias")}


def skeleton(config: ModelConfig) -> nn.Module:
    return skeleton_of(MatrixGame2WanModel, config.spec.kwargs, wan.rebuild_rope)


def pipeline_files(config: ModelConfig, folder: Any) -> None:
    """FastVideo's Matrix-Game pipeline files beside the exported ``transformer/``: ``model_index.json`` (its
    ``MatrixGame2I2VPipeline``; diffusers has none) and ``scheduler/`` (the preset's flow shift). The VAE and CLIP
    image encoder it names are the base model's: copy them from it."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    FlowMatchEulerDiscreteScheduler(shift=config.spec.options["flow_shift"]).save_config(folder / "scheduler")
    components = {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
                  "transformer": ("diffusers", type(config.family.architecture.skeleton(config)).__name__),
                  "vae": ("diffusers", "AutoencoderKLWan"), "image_encoder": ("transformers", "CLIPVisionModel"),
                  "image_processor": ("transformers", "CLIPImageProcessor")}
    dfolder.write_model_index(folder, "MatrixGame2I2VPipeline", components)


MATRIXGAME2 = Family(
    name="matrixgame2",
    presets=PRESETS,
    encoders=wan.ENCODERS,
    architecture=Architecture(
        skeleton=skeleton,
        unit_groups={"blocks": ("blocks",)},
        activations={"blocks": wan.BLOCK_ACTIVATIONS},
        widths=wan.widths,
        init_rules={"scale_shift_table": wan.scale_shift_init, **ZERO_PROJECTIONS},
        self_attention=("blocks.*.attn1",),
        linear_qat=wan.NVFP4_LINEARS,
    ),
    forward=Forward(inputs=inputs),
    conditioning=Conditioning(
        spec=cond_spec,
        from_batch=cond_from_batch,
        data_keys=("first_frame_latents", "image_embeds", *ACTION_COND),
        image=wan_i2v.IMAGE_COND,
        zero=zero_cond,
        window=window_cond,
        cfg_dropout_refusal="Matrix-Game 2.0 has no text to drop (FastVideo's recipes set training_cfg_rate 0)",
    ),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
)


class MatrixGame2Config(ModelConfig, tag="matrixgame2"):
    """A Matrix-Game 2.0 DiT (presets: tiny, world, matrix-game-2.0, matrix-game-2.0-gta, matrix-game-2.0-templerun):
    Wan 2.1 I2V with keyboard and mouse action modules, no text (module docstring). Its data is
    ``data.kind='matrixgame2'``; its encoders are Wan's VAE and CLIP image encoder."""

    family = MATRIXGAME2
