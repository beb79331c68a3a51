"""Which of diffusers' transformers fvx trains: every video DiT class has an fvx family, or a written reason here.

:func:`family_classes` finds the diffusers class each fvx family wraps (its first preset's skeleton, built on meta);
:func:`uncovered` lists the installed ``diffusers.models.transformers`` classes with neither a family nor a reason in
:data:`NOT_VIDEO` (image, audio and other models: no video to train) or :data:`NO_FAMILY` (a video DiT without a
family yet, and why). A diffusers upgrade that adds a transformer shows up there until it is sorted.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil

_IMAGE = "an image DiT: no time axis to train a video on"
NOT_VIDEO: dict[str, str] = {
    **{name: _IMAGE for name in (
        "AuraFlowTransformer2DModel", "BriaFibo2Transformer2DModel", "BriaFiboTransformer2DModel",
        "BriaTransformer2DModel", "ChromaTransformer2DModel", "CogView3PlusTransformer2DModel",
        "CogView4Transformer2DModel", "DiTTransformer2DModel", "DreamLiteTransformer2DModel",
        "ErnieImageTransformer2DModel", "Flux2Transformer2DModel", "Flux3Transformer2DModel", "FluxTransformer2DModel",
        "GlmImageTransformer2DModel", "HiDreamImageTransformer2DModel", "HunyuanDiT2DModel",
        "HunyuanImageTransformer2DModel", "Ideogram4Transformer2DModel", "Krea2Transformer2DModel",
        "LongCatImageTransformer2DModel", "Lumina2Transformer2DModel", "LuminaNextDiT2DModel",
        "NucleusMoEImageTransformer2DModel", "OmniGenTransformer2DModel", "OvisImageTransformer2DModel",
        "PRXTransformer2DModel", "PixArtTransformer2DModel", "QwenImage21Transformer2DModel",
        "QwenImageTransformer2DModel", "SD3Transformer2DModel", "SanaTransformer2DModel", "Transformer2DModel",
        "ZImageTransformer2DModel")},
    **{name: "an audio or music model: no video" for name in (
        "AceStepTransformer1DModel", "LongCatAudioDiTTransformer", "MiniMaxMusic3RVQDepthDecoder",
        "MiniMaxMusic3Transformer1DModel", "StableAudio3DiTModel", "StableAudioDiTModel", "T5FilmDecoder")},
    "PriorTransformer": "an image-embedding prior (unCLIP, Shap-E): it makes no pixels or latents of a video",
    "RFD4ProteinaTransformer": "a protein structure model",
    "TransformerTemporalModel": "a temporal layer inside UNet video models (AnimateDiff, SVD), not a DiT of its own",
    **{name: ("an image generation and editing DiT (its docstring): JoyImageEditPipeline makes images, the reference "
              "images and the edit each one frame of a sequence") for name in (
        "JoyImageEditTransformer3DModel", "JoyImageEditPlusTransformer3DModel")},
}
"""diffusers transformers that are not video models, and what they are."""

NO_FAMILY: dict[str, str] = {
    "AnyFlowFARTransformer3DModel": (
        "a flow-map student distilled from a teacher (the mean velocity from t to r); its forward switches on a "
        "mutable kv_cache dict and builds a flex BlockMask over a Python chunk_partition list"),
    "ConsisIDTransformer3DModel": (
        "identity-preserving CogVideoX I2V: its id_cond and id_vit_hidden come from insightface, EVA-CLIP and facexlib "
        "face models that diffusers does not ship (consisid_utils imports them); not built yet"),
    "Kandinsky6SRTransformer3DModel": (
        "no objective to port: its released weights are pi-Flow distilled (out_visual_dim 640, PiflowScheduler's "
        "n_grid 10 x 64) and its SR target (denoising from low-res K-VAE latents mixed with noise, tiled) has no "
        "published trainer; its K-VAE (Kandinsky6SRVAE) is not the DiT's HunyuanVideo VAE"),
    "SanaWMTransformer3DModel": (
        "a camera-controlled image-to-video world model: per-frame camera poses and Pluecker maps "
        "(sana_wm cam_utils) beside LTX-2 latents and Gemma-2 text; not built yet"),
    "SanaWMLTX2RefinerTransformer3DModel": (
        "SANA-WM's stage-2 refiner of stage-1 latents: it attends through a mutable sink and history KV cache it "
        "writes detached, with absolute RoPE its caller builds"),
    "WanAnimate2Transformer3DModel": (
        "diffusers ships no pipeline for it (nothing to check a forward against), and it runs two passes: an "
        "'extract' forward fills a per-layer KV cache that the 'cached' forward reads under a flex BlockMask cached on "
        "the module; .item() and .tolist() on grid tensors"),
}
"""diffusers video DiTs fvx has no family for, and why."""


def diffusers_transformers() -> dict[str, type]:
    """Every model class defined in the installed ``diffusers.models.transformers`` modules, by name."""
    from diffusers import ModelMixin
    from diffusers.models import transformers

    found = {}
    for info in pkgutil.iter_modules(transformers.__path__):
        module = importlib.import_module(f"{transformers.__name__}.{info.name}")
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, ModelMixin) and value.__module__ == module.__name__:
                found[name] = value
    return found


def _model_configs() -> list[type]:
    import fvx_models
    from fvx_models.build import ModelConfig

    for info in pkgutil.iter_modules(fvx_models.__path__):
        importlib.import_module(f"fvx_models.{info.name}")
    pending, configs = [ModelConfig], []
    while pending:
        for sub in pending.pop().__subclasses__():
            configs.append(sub)
            pending.append(sub)
    return configs


def family_classes() -> dict[str, list[str]]:
    """diffusers class name -> the fvx families wrapping it (the first diffusers class in each family's skeleton's
    MRO; a family of two experts counts under its single-expert family)."""
    found: dict[str, list[str]] = {}
    for config_class in _model_configs():
        family = config_class.family
        skeleton = family.architecture.skeleton(config_class(preset=next(iter(family.presets))))
        wrapped = next((c for c in type(skeleton).__mro__ if c.__module__.startswith("diffusers.models.")), None)
        if wrapped is not None:
            found.setdefault(wrapped.__name__, []).append(family.name)
    return found


def uncovered() -> list[str]:
    """The installed diffusers transformers with neither an fvx family nor a reason here (should be none)."""
    covered = set(family_classes()) | set(NOT_VIDEO) | set(NO_FAMILY)
    return sorted(set(diffusers_transformers()) - covered)
