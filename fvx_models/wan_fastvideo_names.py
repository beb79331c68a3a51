"""FastVideo's internal Wan param names -> diffusers': how a Wan folder whose transformer weights FastVideo's own
converters wrote (TurboWan: ``scripts/checkpoint_conversion/convert_turbodiffusion_to_diffusers.py``, its
``TURBODIFFUSION_WEIGHT_MAPPING``) is read. Such a folder has diffusers' ``config.json`` but the names of FastVideo's
Wan modules (``blocks.N.to_q``, ``blocks.N.ffn.fc_in``, ``blocks.N.self_attn_residual_norm.norm``), which FastVideo
maps to through the diffusers -> internal part of ``param_names_mapping`` in
``fastvideo/configs/models/dits/wanvideo.py`` (lines 16-43, read for the names; the original-layout LoRA part is not
this). The tables below are that part's renames of the modules a T2V/I2V Wan (and a two-time Wan's delta embedder)
has, written per module: the names every other module has are the same in both namings (``blocks.N.attn2.to_q``,
``blocks.N.scale_shift_table``, ``proj_out``, SLA's ``blocks.N.attn1.attn_impl.proj_l``)."""
from __future__ import annotations

from typing import Iterable

ROOT = {
    "patch_embedding": "patch_embedding.proj",
    "condition_embedder.text_embedder.linear_1": "condition_embedder.text_embedder.fc_in",
    "condition_embedder.text_embedder.linear_2": "condition_embedder.text_embedder.fc_out",
    "condition_embedder.time_embedder.linear_1": "condition_embedder.time_embedder.mlp.fc_in",
    "condition_embedder.time_embedder.linear_2": "condition_embedder.time_embedder.mlp.fc_out",
    "condition_embedder.delta_embedder.linear_1": "condition_embedder.delta_embedder.mlp.fc_in",
    "condition_embedder.delta_embedder.linear_2": "condition_embedder.delta_embedder.mlp.fc_out",
    "condition_embedder.time_proj": "condition_embedder.time_modulation.linear",
    "condition_embedder.image_embedder.ff.net.0.proj": "condition_embedder.image_embedder.ff.fc_in",
    "condition_embedder.image_embedder.ff.net.2": "condition_embedder.image_embedder.ff.fc_out",
}
"""diffusers' module -> FastVideo's, at the transformer's root."""

BLOCK = {
    "attn1.to_q": "to_q", "attn1.to_k": "to_k", "attn1.to_v": "to_v", "attn1.to_out.0": "to_out",
    "attn1.norm_q": "norm_q", "attn1.norm_k": "norm_k", "attn2.to_out.0": "attn2.to_out",
    "ffn.net.0.proj": "ffn.fc_in", "ffn.net.2": "ffn.fc_out", "norm2": "self_attn_residual_norm.norm",
}
"""diffusers' module -> FastVideo's, inside ``blocks.N``."""

ALSO_INTERNAL = frozenset({"patch_embedding"})
"""diffusers' modules a FastVideo-named folder may hold under diffusers' name: TurboWan's converter keeps
``patch_embedding.weight`` (FastVideo's loader adds the ``.proj``), so it tells nothing about the naming."""

TO_DIFFUSERS_ROOT = {internal: diffusers for diffusers, internal in ROOT.items()}
TO_DIFFUSERS_BLOCK = {internal: diffusers for diffusers, internal in BLOCK.items()}


def _split(name: str) -> tuple[str, str, str]:
    """(``"blocks.N."`` or ``""``, the module within it, the param's own name): ``blocks.3.ffn.fc_in.weight`` ->
    (``"blocks.3."``, ``"ffn.fc_in"``, ``"weight"``)."""
    module, _, leaf = name.rpartition(".")
    parts = module.split(".", 2)
    if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit():
        return f"blocks.{parts[1]}.", parts[2], leaf
    return "", module, leaf


def diffusers_name(name: str) -> str | None:
    """The diffusers name of a param stored under a FastVideo-only name (``blocks.3.to_q.weight`` ->
    ``blocks.3.attn1.to_q.weight``); None for any other name."""
    block, module, leaf = _split(name)
    renamed = (TO_DIFFUSERS_BLOCK if block else TO_DIFFUSERS_ROOT).get(module)
    return None if renamed is None else f"{block}{renamed}.{leaf}"


def is_diffusers_only(name: str) -> bool:
    """Whether ``name`` is a diffusers name FastVideo's internal naming renames (``blocks.3.attn1.to_q.weight``)."""
    block, module, _ = _split(name)
    return module in (BLOCK if block else ROOT) and module not in ALSO_INTERNAL


def diffusers_names(stored: Iterable[str]) -> dict[str, str] | None:
    """FastVideo-only name -> diffusers name of each such key among ``stored`` (a component's weight keys), None when
    there is none (a diffusers folder); a ValueError naming a key of each when the keys mix the two namings."""
    stored = sorted(stored)
    renames = {name: diffusers_name(name) for name in stored if diffusers_name(name) is not None}
    if not renames:
        return None
    diffusers_only = [name for name in stored if is_diffusers_only(name)]
    if diffusers_only:
        raise ValueError(f"the keys mix FastVideo's internal Wan names ({next(iter(renames))!r}) with diffusers' "
                         f"({diffusers_only[0]!r}); a folder holds one naming")
    return renames
