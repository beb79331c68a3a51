"""LoRA as a model transform: the adapter forward equals the merged weights (outputs and gradients), the base never
changes, fine-tuning learns on every family, the exported files load in diffusers (PEFT and ComfyUI layouts) and
the merged folder with from_pretrained, and bad input is one clear error."""
import math
import re

import pytest
import torch
from diffusers import (ChronoEditPipeline, CogVideoXDDIMScheduler, CogVideoXPipeline, DPMSolverMultistepScheduler,
                       FlowMatchEulerDiscreteScheduler, HeliosPipeline, HeliosScheduler, HunyuanVideoPipeline,
                       MochiPipeline, SanaVideoPipeline, WanPipeline, WanVACEPipeline)
from safetensors.torch import load_file
from torch.func import grad

from fvx.core import grad as fvx_grad, random, role
from fvx.core.optim_config import AdamWConfig
from fvx_methods import finetune
from fvx_models import lora, lora_files
from fvx_models.allegro import AllegroConfig
from fvx_models.chronoedit import ChronoEditConfig
from fvx_models.cogvideox import CogVideoXConfig
from fvx_models.easyanimate import EasyAnimateConfig
from fvx_models.kandinsky6 import Kandinsky6Config
from fvx_models.latte import LatteConfig
from fvx_models.mochi import MochiConfig
from fvx_models.motif_video import MotifVideoConfig
from fvx_models.sana_video import SanaVideoConfig
from fvx_models.wan_vace import WanVACEConfig
from fvx_models.helios import HeliosConfig
from fvx_models.hunyuan_video import HunyuanVideoConfig
from fvx_models.wan import WanConfig

from family_cases import CASES, inputs, native_modules, raw_batch  # noqa: E402

LORA = lora.LoRAConfig(rank=4, alpha=8.0, target_modules=("to_q", "to_k", "to_v", "to_out", "ffn"))


def trained_adapters(model, key):
    """Adapters as after some training: A as initialised, B random (an untrained B is zero)."""
    adapters = model.weights.initial(key)
    return {name: random.normal(random.fold_in(key, i), tuple(p.shape)) * 0.1 if name.endswith(lora.B) else p
            for i, (name, p) in enumerate(adapters.items())}


@pytest.fixture(scope="module")
def tiny():
    plain = WanConfig(preset="tiny", frozen_dtype="fp32").build()
    adapted = WanConfig(preset="tiny", frozen_dtype="fp32", lora=LORA).build()
    base = adapted.weights.base(random.key(0))
    return plain, adapted, base, trained_adapters(adapted, random.key(1))


def test_untrained_adapters_leave_the_base_output_unchanged(tiny):
    plain, adapted, base, _ = tiny
    x, t, cond = inputs(adapted, random.key(2))
    fresh = adapted.weights.initial(random.key(1))
    assert all(torch.equal(p, torch.zeros_like(p)) for n, p in fresh.items() if n.endswith(lora.B))
    torch.testing.assert_close(adapted.apply(role.with_trained(base, fresh), x, t, cond), plain.apply(base, x, t, cond),
                               rtol=0, atol=0)


def test_the_adapter_forward_and_gradients_equal_the_merged_weights(tiny):
    plain, adapted, base, adapters = tiny
    x, t, cond = inputs(adapted, random.key(2))
    modules = adapted.export.adapters.args[0].modules
    assert len(modules) == 2 * (2 * 4 + 2)  # 2 blocks x (2 attentions x (q, k, v, out) + the 2 FFN layers)
    got = adapted.apply(role.with_trained(base, adapters), x, t, cond)
    want = plain.apply(lora.merged(base, adapters, modules, LORA.scale), x, t, cond)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)

    target = random.normal(random.key(3), tuple(x.shape))
    adapter_grads = grad(lambda a: ((adapted.apply(role.with_trained(base, a), x, t, cond) - target) ** 2).mean())(
        adapters)
    merged_grads = grad(lambda a: ((plain.apply(lora.merged(base, a, modules, LORA.scale), x, t, cond) - target) ** 2
                                   ).mean())(adapters)
    for name in adapters:
        torch.testing.assert_close(adapter_grads[name], merged_grads[name], rtol=1e-5, atol=1e-7)


def test_lora_fine_tuning_trains_only_the_adapters_and_the_base_stays_bit_identical():
    model = WanConfig(preset="tiny", lora=LORA).build()
    program = finetune.Finetune(optim=AdamWConfig(lr=1e-2, weight_decay=0.0)).build({"student": model}, total_steps=3)
    state, frozen = program.init(random.key(0)), program.frozen(random.key(0))
    base = frozen["student"]
    kept = {name: p.clone() for name, p in base.items()}
    assert sorted(state.roles["student"].params) == sorted(model.weights.trained_names)
    assert not any(p.requires_grad for p in base.values())
    assert base["blocks.0.attn1.to_q.weight"].dtype == torch.bfloat16  # the base is stored in frozen_dtype
    for i in range(3):
        state, metrics = program.step_(state, frozen, model.batch(raw_batch(model, random.key(10 + i))))
        assert math.isfinite(float(metrics["loss"]))
    assert all(torch.equal(base[name], kept[name]) for name in kept)
    assert any(bool(p.abs().sum()) for n, p in state.roles["student"].params.items() if n.endswith(lora.B))


@pytest.mark.parametrize("name", ["wan", "hunyuan_video"])
def test_lora_fine_tuning_lowers_a_fixed_key_eval_loss(name):
    config = CASES[name].config
    targets = ("to_", "proj", "ff", "linear")  # attention, feed-forward and HunyuanVideo's fused single-stream input
    model = type(config)(preset=config.preset, lora=lora.LoRAConfig(rank=4, alpha=8.0, target_modules=targets)).build()
    method = finetune.Finetune(optim=AdamWConfig(lr=1e-2, weight_decay=0.0))
    program = method.build({"student": model}, total_steps=16)
    state, frozen = program.init(random.key(0)), program.frozen(random.key(0))
    batches = [model.batch(raw_batch(model, random.key(10 + i % 2), first=2 * i)) for i in range(16)]

    def eval_loss(adapters):
        params = role.with_trained(frozen["student"], adapters)
        losses = [finetune.loss_fn(params, b, random.key(99), model=model, config=method)[0] for b in batches[:2]]
        return float(torch.stack(losses).mean())

    before = eval_loss(state.roles["student"].params)
    for batch in batches:
        state, _ = program.step_(state, frozen, batch)
    assert eval_loss(state.roles["student"].params) < 0.9 * before


# ------------------------------------------------------------------------------------------------------- export


def assert_loaded_lora_matches(pipe, case: str, folder, weight_name: str, adapted, base, adapters) -> None:
    """``pipe.load_lora_weights`` of the file, then its transformer (called as its pipeline calls it) equals fvx's
    LoRA model to 1e-5."""
    pipe.load_lora_weights(str(folder), weight_name=weight_name)
    x, t, cond = inputs(adapted, random.key(2))
    with torch.no_grad():
        loaded = CASES[case].native({"transformer": pipe.transformer}, x, t, cond)
    torch.testing.assert_close(loaded.float(), adapted.apply(role.with_trained(base, adapters), x, t, cond),
                               rtol=1e-5, atol=1e-5)


def wan_pipeline(base):
    (transformer,) = native_modules(CASES["wan"], base).values()
    return WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler())


@pytest.mark.parametrize("form, name", [("peft", lora_files.PEFT_FILE), ("comfyui", "my_run_lora_comfyui.safetensors"),
                                        ("musubi", "my_run_lora_musubi.safetensors")])
def test_exported_adapters_load_with_diffusers_load_lora_weights(tiny, tmp_path, form, name):
    """diffusers reads all three layouts (PEFT's keys; ComfyUI's and musubi-tuner's through its own converters of
    those formats), and its transformer then computes fvx's LoRA model. The original layouts' files are named after
    the export (the run), the PEFT file keeps diffusers' name."""
    pytest.importorskip("peft")
    plain, adapted, base, adapters = tiny
    written = adapted.export.adapters(adapters, str(tmp_path), form, stem="my_run")
    assert written.files == {"transformer": tmp_path / name}
    assert_loaded_lora_matches(wan_pipeline(base), "wan", tmp_path, name, adapted, base, adapters)


def test_the_peft_hint_says_comfyui_and_musubi_tuner_ignore_its_keys(tiny, tmp_path):
    plain, adapted, base, adapters = tiny
    written = adapted.export.adapters(adapters, str(tmp_path), "peft", stem="my_run")
    assert written.how_to_load == (
        f"pipe.load_lora_weights({str(tmp_path)!r})",
        "not for ComfyUI or musubi-tuner: they ignore PEFT keys (transformer.<module>.lora_A/lora_B) and load nothing "
        "from a PEFT file; export again with --lora --format comfyui (ComfyUI's LoraLoaderModelOnly) or --lora "
        "--format musubi (musubi-tuner's wan_generate_video.py --lora_weight)")


@pytest.mark.parametrize("form, name", [("peft", lora_files.PEFT_FILE), ("comfyui", "edit_lora_comfyui.safetensors")])
def test_chronoedit_adapters_load_with_its_pipelines_load_lora_weights(tmp_path, form, name):
    """ChronoEdit's adapters (Wan's names and original layout) load with ChronoEditPipeline.load_lora_weights, whose
    transformer then computes fvx's LoRA model (two latent frames: ChronoEdit's own RoPE)."""
    pytest.importorskip("peft")
    adapted = ChronoEditConfig(frozen_dtype="fp32", lora=lora.LoRAConfig(rank=4, alpha=8.0)).build()
    base, adapters = adapted.weights.base(random.key(0)), trained_adapters(adapted, random.key(1))
    written = adapted.export.adapters(adapters, str(tmp_path), form, stem="edit")
    assert written.files == {"transformer": tmp_path / name}
    (transformer,) = native_modules(CASES["chronoedit"], base).values()
    pipe = ChronoEditPipeline(tokenizer=None, text_encoder=None, image_encoder=None, image_processor=None,
                              transformer=transformer, vae=None, scheduler=FlowMatchEulerDiscreteScheduler())
    assert_loaded_lora_matches(pipe, "chronoedit", tmp_path, name, adapted, base, adapters)


@pytest.mark.parametrize("form, name, trainable", [("peft", lora_files.PEFT_FILE, ("base", "context")),
                                                   ("comfyui", "control_lora_comfyui.safetensors", ("base",))],
                         ids=["peft-both-branches", "comfyui-base"])
def test_vace_adapters_load_with_its_pipelines_load_lora_weights(tmp_path, form, name, trainable):
    """VACE's adapters load with WanVACEPipeline.load_lora_weights, whose transformer then computes fvx's LoRA model:
    PEFT's on both branches; ComfyUI's on the base (diffusers' converter of that layout refuses the context blocks'
    keys, ``vace_blocks.N.*``; ComfyUI itself keys a LoRA by every module name of its model)."""
    pytest.importorskip("peft")
    adapted = WanVACEConfig(frozen_dtype="fp32", lora=lora.LoRAConfig(rank=4, alpha=8.0), trainable=trainable).build()
    on_context = {name.startswith("vace_") for name in adapted.weights.trained_names}
    assert on_context == ({True, False} if "context" in trainable else {False})
    base, adapters = adapted.weights.base(random.key(0)), trained_adapters(adapted, random.key(1))
    written = adapted.export.adapters(adapters, str(tmp_path), form, stem="control")
    assert written.files == {"transformer": tmp_path / name}
    (transformer,) = native_modules(CASES["wan_vace"], base).values()
    pipe = WanVACEPipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=None,
                           scheduler=FlowMatchEulerDiscreteScheduler())
    assert_loaded_lora_matches(pipe, "wan_vace", tmp_path, name, adapted, base, adapters)


def test_cogvideox_adapters_load_with_its_pipelines_load_lora_weights(tmp_path):
    """CogVideoX's adapters (PEFT only: fvx writes no original layout of it) load with
    CogVideoXPipeline.load_lora_weights, whose transformer then computes fvx's LoRA model (the family's VP call)."""
    pytest.importorskip("peft")
    adapted = CogVideoXConfig(frozen_dtype="fp32", lora=lora.LoRAConfig(rank=4, alpha=8.0)).build()
    assert adapted.export.adapter_formats == ("peft",)
    base, adapters = adapted.weights.base(random.key(0)), trained_adapters(adapted, random.key(1))
    written = adapted.export.adapters(adapters, str(tmp_path), "peft")
    (transformer,) = native_modules(CASES["cogvideox"], base).values()
    pipe = CogVideoXPipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=None,
                             scheduler=CogVideoXDDIMScheduler())
    assert_loaded_lora_matches(pipe, "cogvideox", tmp_path, written.files["transformer"].name, adapted, base, adapters)


def test_sana_video_adapters_load_with_its_pipelines_load_lora_weights(tmp_path):
    """SANA-Video's adapters (PEFT; its linear self-attention's projections among them) load with
    SanaVideoPipeline.load_lora_weights, whose transformer then computes fvx's LoRA model."""
    pytest.importorskip("peft")
    adapted = SanaVideoConfig(frozen_dtype="fp32", lora=lora.LoRAConfig(rank=4, alpha=8.0)).build()
    assert any(".attn1.to_q." in name for name in adapted.weights.trained_names)
    base, adapters = adapted.weights.base(random.key(0)), trained_adapters(adapted, random.key(1))
    written = adapted.export.adapters(adapters, str(tmp_path), "peft")
    (transformer,) = native_modules(CASES["sana_video"], base).values()
    pipe = SanaVideoPipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=None,
                             scheduler=DPMSolverMultistepScheduler())
    assert_loaded_lora_matches(pipe, "sana_video", tmp_path, written.files["transformer"].name, adapted, base,
                               adapters)


def test_mochi_adapters_load_with_its_pipelines_load_lora_weights(tmp_path):
    """Mochi's adapters (PEFT) load with MochiPipeline.load_lora_weights, whose transformer (diffusers' own joint
    attention) then computes fvx's LoRA model (its masked joint attention)."""
    pytest.importorskip("peft")
    adapted = MochiConfig(frozen_dtype="fp32", lora=lora.LoRAConfig(rank=4, alpha=8.0)).build()
    base, adapters = adapted.weights.base(random.key(0)), trained_adapters(adapted, random.key(1))
    written = adapted.export.adapters(adapters, str(tmp_path), "peft")
    (transformer,) = native_modules(CASES["mochi"], base).values()
    pipe = MochiPipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=None,
                         scheduler=FlowMatchEulerDiscreteScheduler(invert_sigmas=True))
    assert_loaded_lora_matches(pipe, "mochi", tmp_path, written.files["transformer"].name, adapted, base, adapters)


I2V_LORA = lora.LoRAConfig(rank=2, alpha=4.0, target_modules=("to_q", "to_out", "add_k_proj", "add_v_proj"))


@pytest.fixture(scope="module")
def tiny_i2v():
    """Wan 2.1 I2V (tiny) with adapters on its attentions, the image cross-attention's k_img/v_img among them."""
    adapted = WanConfig(preset="tiny-i2v", frozen_dtype="fp32", lora=I2V_LORA).build()
    return adapted, adapted.weights.base(random.key(0)), trained_adapters(adapted, random.key(1))


def test_i2v_comfyui_adapters_load_with_diffusers_load_lora_weights(tiny_i2v, tmp_path):
    """ComfyUI's file of Wan 2.1 I2V adapters (``cross_attn.k_img``/``v_img`` among them) loads with diffusers'
    WanImageToVideoPipeline.load_lora_weights, whose transformer then computes fvx's LoRA model."""
    pytest.importorskip("peft")
    from diffusers import WanImageToVideoPipeline

    adapted, base, adapters = tiny_i2v
    written = adapted.export.adapters(adapters, str(tmp_path), "comfyui", stem="i2v")
    assert "diffusion_model.blocks.0.cross_attn.k_img.lora_down.weight" in load_file(written.files["transformer"])
    (transformer,) = native_modules(CASES["wan-i2v"], base).values()
    pipe = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=None, image_processor=None,
                                   image_encoder=None, transformer=transformer,
                                   scheduler=FlowMatchEulerDiscreteScheduler())
    pipe.load_lora_weights(str(tmp_path), weight_name=written.files["transformer"].name)
    x, t, cond = inputs(adapted, random.key(2))
    with torch.no_grad():
        loaded = CASES["wan-i2v"].native({"transformer": pipe.transformer}, x, t, cond)
    torch.testing.assert_close(loaded.float(), adapted.apply(role.with_trained(base, adapters), x, t, cond),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["comfyui", "musubi"])
def test_i2v_adapters_on_the_image_embedder_key_the_modules_the_original_checkpoint_has(tmp_path, form):
    """Adapters on every linear layer of Wan 2.1 I2V (the image embedder's ``img_emb.proj.1``/``.3`` too) are keyed
    by the rule each tool looks LoRA keys up by, applied to the original checkpoint's weights (the whole export, which
    diffusers' converter reads back: tests/fvx_models/test_original_layout.py): ComfyUI's ``diffusion_model.<key>``
    (comfy/lora.py ``model_lora_keys_unet``), musubi-tuner's ``lora_unet_<key, dots as underscores>``
    (``utils/lora_utils.py``); A, B and alpha as trained."""
    config = lora.LoRAConfig(rank=2, alpha=4.0, target_modules=("to_", "add_", "ffn", "image_embedder", "proj_out"))
    adapted = WanConfig(preset="tiny-i2v", frozen_dtype="fp32", lora=config).build()
    base, adapters = adapted.weights.base(random.key(0)), trained_adapters(adapted, random.key(1))
    checkpoint = load_file(adapted.export.folder(role.with_trained(base, adapters), str(tmp_path / "whole"),
                                          form="comfyui").files["transformer"])
    rule = {"comfyui": lambda key: f"diffusion_model.{key}", "musubi": lambda key: "lora_unet_" + key.replace(".", "_")}
    looked_up = {rule[form](key.removesuffix(".weight")): key.removesuffix(".weight") for key in checkpoint
                 if key.endswith(".weight")}
    stored = load_file(adapted.export.adapters(adapters, str(tmp_path / form), form).files["transformer"])
    stems = {key.rsplit(".", 2)[0] if key.endswith(".weight") else key.rsplit(".", 1)[0] for key in stored}
    assert stems <= looked_up.keys()
    assert {looked_up[stem] for stem in stems} >= {"img_emb.proj.1", "img_emb.proj.3", "blocks.0.cross_attn.k_img"}
    assert len(stems) == len(adapted.export.adapters.args[0].modules)
    stem = rule[form]("img_emb.proj.3")
    name = "condition_embedder.image_embedder.ff.net.2"
    assert torch.equal(stored[f"{stem}.lora_down.weight"], adapters[f"{name}.{lora.A}"])
    assert torch.equal(stored[f"{stem}.lora_up.weight"], adapters[f"{name}.{lora.B}"])
    assert stored[f"{stem}.alpha"].item() == 4.0


@pytest.mark.parametrize("form, key", [("comfyui", "diffusion_model.blocks.1.cross_attn.o"),
                                       ("musubi", "lora_unet_blocks_1_cross_attn_o")])
def test_comfyui_and_musubi_files_key_each_module_by_its_original_name(tiny, tmp_path, form, key):
    """``blocks.1.attn2.to_out.0`` is the original ``blocks.1.cross_attn.o``: ComfyUI's keys keep its dots under
    ``diffusion_model.``, musubi-tuner's (kohya's) write it with underscores under ``lora_unet_``."""
    plain, adapted, base, adapters = tiny
    written = adapted.export.adapters(adapters, str(tmp_path), form)
    stored = load_file(written.files["transformer"])
    name = "blocks.1.attn2.to_out.0"
    assert torch.equal(stored[f"{key}.lora_down.weight"], adapters[f"{name}.{lora.A}"])
    assert torch.equal(stored[f"{key}.lora_up.weight"], adapters[f"{name}.{lora.B}"])
    assert stored[f"{key}.alpha"].item() == LORA.alpha
    assert len(stored) == 3 * len(adapters) // 2
    if form == "musubi":
        pattern = r"lora_unet_blocks_\d+_((self|cross)_attn_[qkvo]|ffn_[02])\.(lora_down\.weight|lora_up\.weight|alpha)"
        assert all(re.fullmatch(pattern, k) for k in stored), sorted(stored)[:4]


def test_the_merged_export_loads_with_from_pretrained_and_equals_base_plus_scaled_ba(tiny, tmp_path):
    from diffusers import WanTransformer3DModel

    plain, adapted, base, adapters = tiny
    adapted.export.folder(role.with_trained(base, adapters), str(tmp_path))
    loaded = WanTransformer3DModel.from_pretrained(tmp_path / "transformer").state_dict()
    name = "blocks.1.attn2.to_v"
    want = base[f"{name}.weight"] + LORA.scale * adapters[f"{name}.{lora.B}"] @ adapters[f"{name}.{lora.A}"]
    torch.testing.assert_close(loaded[f"{name}.weight"], want, rtol=0, atol=1e-7)
    assert torch.equal(loaded["proj_out.weight"], base["proj_out.weight"])
    assert not any("lora" in key for key in loaded)


@pytest.mark.parametrize("case, config_class, pipeline", [
    ("hunyuan_video", HunyuanVideoConfig, lambda transformer: HunyuanVideoPipeline(
        text_encoder=None, tokenizer=None, transformer=transformer, vae=None,
        scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder_2=None, tokenizer_2=None)),
    ("helios", HeliosConfig, lambda transformer: HeliosPipeline(
        tokenizer=None, text_encoder=None, vae=None, scheduler=HeliosScheduler(stages=1), transformer=transformer))])
def test_peft_exports_load_with_their_pipelines(tmp_path, case, config_class, pipeline):
    pytest.importorskip("peft")
    adapted = config_class(preset="tiny", frozen_dtype="fp32", lora=LORA).build()
    base = adapted.weights.base(random.key(0))
    adapters = trained_adapters(adapted, random.key(1))
    (transformer,) = native_modules(CASES[case], base).values()
    adapted.export.adapters(adapters, str(tmp_path), "peft")
    assert adapted.export.adapter_formats == ("peft",)  # neither has an original layout in fvx
    assert_loaded_lora_matches(pipeline(transformer), case, tmp_path, lora_files.PEFT_FILE, adapted, base, adapters)


# ---------------------------------------------------------------------------------------------------- bad input


def test_a_target_that_matches_nothing_lists_module_names():
    with pytest.raises(ValueError, match=r"match no linear layer; some of its linear layers: .*blocks\.N\.attn1\.to_q"):
        WanConfig(preset="tiny", lora=lora.LoRAConfig(target_modules=("qkv_proj_nope",))).build()


def test_a_rank_above_a_targets_dimension_names_the_target():
    with pytest.raises(ValueError, match=r"lora.rank 4096 exceeds the dimensions of target 'blocks.0.attn1.to_q'"):
        WanConfig(preset="tiny", lora=lora.LoRAConfig(rank=4096)).build()


@pytest.mark.parametrize("rank", [0, -2])
def test_a_rank_below_one_is_refused(rank):
    with pytest.raises(ValueError, match="lora.rank must be a positive integer"):
        lora.LoRAConfig(rank=rank)


def test_an_original_layout_export_of_a_module_without_an_original_name_names_it(tmp_path):
    from fvx_models.skyreels_v2 import SkyReelsV2Config

    adapted = lora.LoRAConfig(rank=2, target_modules=("fps_projection",))
    model = SkyReelsV2Config(preset="tiny-fps", lora=adapted).build()
    for form in ("comfyui", "musubi"):
        with pytest.raises(ValueError, match=r"module 'fps_projection.net.0.proj' has no name in the original "
                                             r"skyreels_v2 layout; use --format peft"):
            model.export.adapters(model.weights.initial(random.key(0)), str(tmp_path / form), form)
    assert list(tmp_path.iterdir()) == []


def test_remat_and_compiled_units_give_the_adapters_the_same_gradients(tiny):
    plain, adapted, base, adapters = tiny
    x, t, cond = inputs(adapted, random.key(2))
    target = random.normal(random.key(3), tuple(x.shape))

    def grads_of(model):  # fvx.core.grad: autograd outside the compiled regions (torch.func cannot remat)
        loss = lambda a: ((model.apply(role.with_trained(base, a), x, t, cond) - target) ** 2).mean()  # noqa: E731
        return fvx_grad.value_and_grad(loss)(adapters)[1]

    want = grads_of(adapted)
    for knobs in (dict(remat=True), dict(compile="blocks", compile_backend="aot_eager", remat=True)):
        got = grads_of(WanConfig(preset="tiny", frozen_dtype="fp32", lora=LORA, **knobs).build())
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)


def test_two_experts_export_one_peft_file_per_component_and_say_how_each_loads(tmp_path):
    """Wan 2.2 A14B: adapters on both experts; each expert's file holds its own, keyed as diffusers' transformer, and
    the printed calls load them into a two-expert WanPipeline that then computes fvx's model."""
    pytest.importorskip("peft")
    from fvx_models.wan_moe import Wan22MoEConfig

    config = Wan22MoEConfig(preset="tiny", frozen_dtype="fp32", lora=lora.LoRAConfig(rank=2, target_modules=("to_q",)))
    model = config.build()
    base, adapters = model.weights.base(random.key(0)), trained_adapters(model, random.key(1))
    written = model.export.adapters(adapters, str(tmp_path), "peft")
    second = "pytorch_lora_weights_transformer_2.safetensors"
    assert [p.name for p in written.files.values()] == [lora_files.PEFT_FILE, second]
    for path, expert in zip(written.files.values(), ("transformer.", "transformer_2.")):
        stored = load_file(path)
        assert stored and all(k.startswith("transformer.blocks.") for k in stored)
        assert all(torch.equal(t, adapters[expert + k[len("transformer."):]]) for k, t in stored.items())
    calls, note = written.how_to_load[:2], written.how_to_load[2:]
    assert calls == (
        f"pipe.load_lora_weights({str(tmp_path)!r})  # transformer: the high-noise expert",
        f"pipe.load_lora_weights({str(tmp_path)!r}, weight_name={second!r}, load_into_transformer_2=True)  "
        "# transformer_2: the low-noise expert")
    assert len(note) == 1 and note[0].startswith("not for ComfyUI or musubi-tuner: they ignore PEFT keys")
    modules = native_modules(CASES["wan_moe"], base)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(),
                       boundary_ratio=config.boundary, **modules)
    for line in calls:
        eval(line.split("  #")[0], {"pipe": pipe})  # the call as printed
    x, t, cond = inputs(model, random.key(2))  # one sample per expert
    with torch.no_grad():
        loaded = CASES["wan_moe"].native({"transformer": pipe.transformer, "transformer_2": pipe.transformer_2}, x, t,
                                         cond)
    torch.testing.assert_close(loaded, model.apply(role.with_trained(base, adapters), x, t, cond), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("form", ["comfyui", "musubi"])
def test_two_experts_original_layout_files_are_high_and_low_noise_with_musubi_tuners_flags(tmp_path, form):
    """Wan 2.2 A14B: ``<run>_lora_<form>_high_noise`` holds the high-noise expert's (``transformer``) adapters,
    ``..._low_noise`` the low-noise one's; the musubi hint gives musubi-tuner's ``wan_generate_video.py`` flag of each
    (``--lora_weight_high_noise``, ``--lora_weight``)."""
    from fvx_models.wan_moe import Wan22MoEConfig

    model = Wan22MoEConfig(preset="tiny", lora=lora.LoRAConfig(rank=2, target_modules=("to_q",))).build()
    adapters = trained_adapters(model, random.key(1))
    written = model.export.adapters(adapters, str(tmp_path), form, stem="a14b")
    high, low = (tmp_path / f"a14b_lora_{form}_{tag}.safetensors" for tag in ("high_noise", "low_noise"))
    assert written.files == {"transformer": high, "transformer_2": low}
    key = {"comfyui": "diffusion_model.blocks.0.self_attn.q", "musubi": "lora_unet_blocks_0_self_attn_q"}[form]
    for path, expert in ((high, "transformer"), (low, "transformer_2")):
        assert torch.equal(load_file(path)[f"{key}.lora_up.weight"], adapters[f"{expert}.blocks.0.attn1.to_q.{lora.B}"])
    if form == "musubi":
        assert written.how_to_load == (
            f"musubi-tuner: wan_generate_video.py --lora_weight_high_noise {high} (transformer: the high-noise expert)",
            f"musubi-tuner: wan_generate_video.py --lora_weight {low} (transformer_2: the low-noise expert)")
    else:
        assert written.how_to_load == tuple(
            f"ComfyUI: put {path.name} in models/loras/ and apply it with a LoraLoaderModelOnly node ({which})"
            for path, which in ((high, "transformer: the high-noise expert"),
                                (low, "transformer_2: the low-noise expert")))


@pytest.mark.parametrize("case, config_class", [("latte", LatteConfig), ("allegro", AllegroConfig),
                                               ("easyanimate", EasyAnimateConfig)])
def test_adapters_of_a_family_without_a_diffusers_lora_loader_load_with_peft(tmp_path, case, config_class):
    """diffusers has no LoRA loader for Latte, Allegro or EasyAnimate; their PEFT file loads with peft's own
    ``set_peft_model_state_dict`` into the diffusers module, which then computes fvx's LoRA model (the family's VP
    call)."""
    peft = pytest.importorskip("peft")
    adapted = config_class(frozen_dtype="fp32", lora=lora.LoRAConfig(rank=4, alpha=8.0)).build()
    base, adapters = adapted.weights.base(random.key(0)), trained_adapters(adapted, random.key(1))
    written = adapted.export.adapters(adapters, str(tmp_path), "peft")
    state = {k.removeprefix("transformer."): v for k, v in load_file(written.files["transformer"]).items()}
    (transformer,) = native_modules(CASES[case], base).values()
    targets = sorted({k.split(".lora_")[0] for k in state})
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=targets), transformer)
    assert not peft.set_peft_model_state_dict(transformer, state).unexpected_keys
    x, t, cond = inputs(adapted, random.key(2))
    with torch.no_grad():
        loaded = CASES[case].native({"transformer": transformer}, x, t, cond)
    torch.testing.assert_close(loaded, adapted.apply(role.with_trained(base, adapters), x, t, cond), rtol=1e-5,
                               atol=1e-5 * float(loaded.abs().max()))


@pytest.mark.parametrize("case, config_class", [("motif_video", MotifVideoConfig), ("kandinsky6", Kandinsky6Config)])
def test_adapters_load_with_the_transformers_load_lora_adapter(tmp_path, case, config_class):
    """Motif-Video's and Kandinsky 6's pipelines have no LoRA loader; their transformers' own ``load_lora_adapter``
    (diffusers' PEFT mixin) reads the PEFT file and its config (rank 4, alpha 8: named by its file, as the pipelines'
    loaders take it), and then computes fvx's LoRA model. Kandinsky 6's frozen audio branch has no adapters."""
    pytest.importorskip("peft")
    adapted = config_class(frozen_dtype="fp32", lora=lora.LoRAConfig(rank=4, alpha=8.0)).build()
    assert not any(name.startswith("audio_") or ".audio_dec_block." in name for name in adapted.weights.trained_names)
    base, adapters = adapted.weights.base(random.key(0)), trained_adapters(adapted, random.key(1))
    written = adapted.export.adapters(adapters, str(tmp_path), "peft")
    (transformer,) = native_modules(CASES[case], base).values()
    transformer.load_lora_adapter(str(tmp_path), weight_name=written.files["transformer"].name, prefix="transformer")
    x, t, cond = inputs(adapted, random.key(2))
    with torch.no_grad():
        loaded = CASES[case].native({"transformer": transformer}, x, t, cond)
    torch.testing.assert_close(loaded, adapted.apply(role.with_trained(base, adapters), x, t, cond), rtol=1e-5,
                               atol=1e-5)
