"""HunyuanVideo FramePack (fvx_models.hunyuan_framepack): its forward is diffusers' DiT called as
HunyuanVideoFramepackPipeline calls it on a section and its history (fvx.data.sections), one sample per forward, bad
section data refused naming the column, and its LoRA files load as diffusers and musubi-tuner load them."""
import inspect
import json
import pathlib

import pytest
import torch
from diffusers import (FlowMatchEulerDiscreteScheduler, HunyuanVideoFramepackPipeline,
                       HunyuanVideoFramepackTransformer3DModel)
from safetensors.torch import load_file

from fvx import config as fconfig
from fvx.core import random, role
from fvx.core.optim_config import AdamWConfig
from fvx.data import sections
from fvx.data.sections import SectionsConfig
from fvx_methods import dfsft, dmd2, finetune, meanflow, scm
from fvx_models import hunyuan_framepack, hunyuan_video, lora, lora_files
from fvx_models.hunyuan_framepack import FramepackConfig
from fvx_models.lora import LoRAConfig

TEXT = 5
EXPERIMENTS = pathlib.Path(__file__).resolve().parents[2] / "experiments"


@pytest.fixture(scope="module")
def model():
    return FramepackConfig(preset="tiny").build()


@pytest.fixture(scope="module")
def params(model):
    return model.weights.init(random.key(0))


def section_batch(order: str = "inverted_anti_drifting", section: int = 1, key: int = 1) -> dict:
    """A data batch of one section of a random 7-frame clip (windows of 2), as kind framepack data holds it: the
    packed text (pooled row, then tokens with two padded), SigLIP-like features, the history and its positions."""
    k = random.split(random.key(key), 4)
    part = sections.cut(random.normal(k[0], (16, 7, 4, 4)), SectionsConfig(window=2, order=order))[section]
    pooled, text = random.normal(k[1], (1, 16)), random.normal(k[2], (1, TEXT, 32))
    mask = torch.ones(1, TEXT)
    mask[0, -2:] = 0
    return {"latents": part["latents"][None], "text": torch.cat([torch.nn.functional.pad(pooled, (0, 16))[:, None],
                                                                  text * mask[..., None]], dim=1),
            "text_mask": torch.cat([torch.ones(1, 1), mask], dim=1), "image_embeds": random.normal(k[3], (1, 3, 16)),
            "framepack_history": part["history"][None], "frame_indices": part["frame_indices"][None],
            "sample_index": torch.tensor([0])}


def pipeline_call(module, x, t, batch, guidance: float = 1.0):
    """HunyuanVideoFramepackPipeline's transformer call: the unpacked text, the history split into its clean (first
    frame and 1x), 2x and 4x latents, each with its frame indices (int64 aranges, as the pipeline splits them)."""
    index, history = batch["frame_indices"][0].long(), batch["framepack_history"]
    window = x.shape[2]
    return module(hidden_states=x, timestep=t, encoder_hidden_states=batch["text"][:, 1:],
                  encoder_attention_mask=batch["text_mask"][:, 1:], pooled_projections=batch["text"][:, 0, :16],
                  image_embeds=batch["image_embeds"], indices_latents=index[:window],
                  guidance=torch.full((x.shape[0],), guidance * 1000.0), latents_clean=history[:, :, :2],
                  indices_latents_clean=index[window:window + 2], latents_history_2x=history[:, :, 2:4],
                  indices_latents_history_2x=index[window + 2:window + 4], latents_history_4x=history[:, :, 4:],
                  indices_latents_history_4x=index[window + 4:], return_dict=False)[0]


def diffusers_module(params, config=FramepackConfig(preset="tiny")):
    state = torch.get_rng_state()
    module = HunyuanVideoFramepackTransformer3DModel(**config.spec.kwargs)
    torch.set_rng_state(state)
    module.load_state_dict(params)
    return module


@pytest.mark.parametrize("order, section", [("inverted_anti_drifting", 0), ("inverted_anti_drifting", 2),
                                            ("vanilla", 1)])
def test_apply_equals_the_pipelines_call_on_a_section_and_its_history(model, params, order, section):
    batch = section_batch(order, section)
    x, t = random.normal(random.key(5), tuple(batch["latents"].shape)), torch.tensor([640.0])
    ours = model.apply(params, x, t, model.batch(batch)["cond"])
    with torch.no_grad():
        reference = pipeline_call(diffusers_module(params), x, t, batch)
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)


def test_the_history_and_the_image_features_change_the_velocity(model, params):
    batch = section_batch()
    x, t = random.normal(random.key(5), tuple(batch["latents"].shape)), torch.tensor([640.0])
    base = model.apply(params, x, t, model.batch(batch)["cond"])
    for name in ("framepack_history", "image_embeds"):
        changed = model.apply(params, x, t, model.batch({**batch, name: batch[name] + 1})["cond"])
        assert (changed - base).abs().max() > 1e-3, name


def test_a_finetune_step_trains_on_micro_batches_of_one_and_a_batch_row_by_row(model):
    rows = [section_batch(section=n, key=n) for n in range(2)]
    batch = {name: torch.cat([r[name] for r in rows]) for name in rows[0]}
    batch["sample_index"] = torch.arange(2)
    program = finetune.Finetune(grad_accum=2, optim=AdamWConfig(lr=1e-3)).build({"student": model}, total_steps=2)
    state, frozen = program.init(random.key(0)), program.frozen(random.key(0))
    before = {name: p.clone() for name, p in state.roles["student"].params.items()}
    state, logs = program.step_(state, frozen, model.batch(batch))
    assert torch.isfinite(logs["loss"]) and any(not torch.equal(before[n], p)
                                                for n, p in state.roles["student"].params.items())
    params = model.weights.init(random.key(0))  # two sections of other frame positions in one call: row by row
    x, t, cond = model.batch(batch)["latents"], torch.tensor([300.0, 800.0]), model.batch(batch)["cond"]
    v = model.apply(params, x, t, cond)
    for i in range(2):
        row = model.apply(params, *(role.rows(part, slice(i, i + 1)) for part in (x, t, cond)))
        assert torch.equal(v[i:i + 1], row)


@pytest.mark.parametrize("change, message", [
    (lambda b: {k: v for k, v in b.items() if k != "framepack_history"},
     r"needs the batch tensor 'framepack_history' \(a section's history and frame positions: data.kind='framepack'"),
    (lambda b: {**b, "framepack_history": b["framepack_history"][:, :, :19]},
     r"framepack_history \[16, 19, 4, 4\] must be \[16, 20, 4, 4\]"),
    (lambda b: {**b, "latents": b["latents"][:, :, :1]},
     r"frame_indices \[22\] must be \[21\] .*data.num_latent_t must not cut a section"),
    (lambda b: {**b, "image_embeds": b["image_embeds"][..., :8]}, r"clip_feature \[3, 8\] must be \[N, 16\]"),
])
def test_bad_section_data_is_refused_in_one_line_naming_the_column(model, change, message):
    with pytest.raises(ValueError, match=message) as error:
        model.batch(change(section_batch()))
    assert "\n" not in str(error.value)


def test_presets_give_every_constructor_argument_and_the_release_is_framepack_i2v_hy():
    signature = inspect.signature(HunyuanVideoFramepackTransformer3DModel.__init__).parameters
    for name in hunyuan_framepack.PRESETS:
        assert set(FramepackConfig(preset=name).spec.kwargs) == set(signature) - {"self"}, name
    released = FramepackConfig(preset="framepack-i2v").spec
    assert released.kwargs == {**hunyuan_video.PRESETS["hunyuanvideo-t2v"].kwargs, "has_image_proj": True,
                               "image_proj_dim": 1152, "has_clean_x_embedder": True}
    assert released.latents == hunyuan_video.LATENTS and released.text_len == 257


def test_an_export_is_a_framepack_pipeline_folder(model, params, tmp_path):
    written = model.export.folder(params, str(tmp_path))
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "HunyuanVideoFramepackPipeline"
    assert index["image_encoder"] == ["transformers", "SiglipVisionModel"]
    loaded = HunyuanVideoFramepackTransformer3DModel.from_pretrained(written.files["transformer"])
    assert all(torch.equal(p, params[name]) for name, p in loaded.state_dict().items())
    assert model.export.formats == ("diffusers",)  # lllyasviel's layout is diffusers' names


LORA = LoRAConfig(rank=4, alpha=2.0)


@pytest.fixture(scope="module")
def adapted():
    adapted = FramepackConfig(preset="tiny", frozen_dtype="fp32", lora=LORA).build()
    base = adapted.weights.base(random.key(0))
    adapters = {name: random.normal(random.fold_in(random.key(1), n), tuple(p.shape)) * 0.1
                for n, (name, p) in enumerate(adapted.weights.initial(random.key(1)).items())}  # B non-zero
    return adapted, base, adapters


def test_peft_adapters_load_with_the_pipelines_load_lora_weights(adapted, tmp_path):
    pytest.importorskip("peft")
    model, base, adapters = adapted
    written = model.export.adapters(adapters, str(tmp_path), "peft")
    assert model.export.adapter_formats == ("peft", "musubi")
    assert "scales them as if alpha were the rank" in written.how_to_load[-1]
    pipe = HunyuanVideoFramepackPipeline(text_encoder=None, tokenizer=None, transformer=diffusers_module(base),
                                         vae=None, scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder_2=None,
                                         tokenizer_2=None, image_encoder=None, feature_extractor=None)
    pipe.load_lora_weights(str(tmp_path), weight_name=lora_files.PEFT_FILE)
    batch = section_batch()
    x, t = random.normal(random.key(5), tuple(batch["latents"].shape)), torch.tensor([640.0])
    with torch.no_grad():
        loaded = pipeline_call(pipe.transformer, x, t, batch)
    ours = model.apply(role.with_trained(base, adapters), x, t, model.batch(batch)["cond"])
    torch.testing.assert_close(loaded, ours, rtol=1e-5, atol=1e-5)


def test_musubi_adapters_are_kohya_keys_of_the_diffusers_module_names_with_their_alpha(adapted, tmp_path):
    """musubi-tuner's FramePack DiT names its modules as diffusers does; its LoRA keys are ``lora_unet_`` and the
    module name with underscores, with ``.alpha`` (its PEFT conversion would take alpha = rank)."""
    model, base, adapters = adapted
    written = model.export.adapters(adapters, str(tmp_path), "musubi")
    stored = load_file(written.files["transformer"])
    modules = {name.replace(".", "_"): name for name in {k.rsplit(".", 2)[0] for k in adapters}}
    assert len(stored) == 3 * len(modules)
    for stem, name in modules.items():
        key = f"lora_unet_{stem}"
        assert torch.equal(stored[f"{key}.lora_down.weight"], adapters[f"{name}.{lora.A}"])
        assert torch.equal(stored[f"{key}.lora_up.weight"], adapters[f"{name}.{lora.B}"])
        assert stored[f"{key}.alpha"].item() == LORA.alpha
    assert written.how_to_load[0].startswith("musubi-tuner: fpack_generate_video.py --lora_weight")
    with pytest.raises(ValueError, match=r"a hunyuan_framepack LoRA exports as peft, musubi"):
        model.export.adapters(adapters, str(tmp_path / "c"), "comfyui")


METHODS = {"dmd2": lambda: dmd2.DMD2(cfg_uncond="zero"), "scm": scm.SCM, "meanflow": meanflow.MeanFlow,
           "dfsft": dfsft.DFSFT}
REFUSALS = ("not causal", "block-causal", "has no r input")  # what a method may say a plain model lacks


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_steps_on_a_section_or_refuses_the_model_in_one_line(model, method):
    """Fine-tuning is above; the distillation and flow-map methods take a step on one section (FramePack is a flow
    model), or refuse it before the first step naming what it lacks."""
    batch = model.batch(section_batch())
    models = {name: model for name in ("student", "critic", "teacher", "ema")}
    try:
        program = METHODS[method]().build(models, total_steps=2)
        program.check(batch)
    except ValueError as error:
        assert "\n" not in str(error) and any(r in str(error) for r in REFUSALS), str(error)
        return
    state = program.init(random.key(0))._replace(carry=program.carry(batch))
    state, metrics = program.step_(state, program.frozen(random.key(0)), batch)
    assert int(state.step) == 1 and all(torch.isfinite(v).all() for v in metrics.values()
                                        if isinstance(v, torch.Tensor) and v.numel() == 1)


def test_the_musubi_recipe_adapts_the_layers_musubi_tuner_adapts():
    """musubi-tuner's networks/lora_framepack.py: every nn.Linear inside a HunyuanVideoTransformerBlock or
    HunyuanVideoSingleTransformerBlock whose name has no "norm" (the token refiner's and the root's left out)."""
    from diffusers.models.transformers.transformer_hunyuan_video import (HunyuanVideoSingleTransformerBlock,
                                                                          HunyuanVideoTransformerBlock)

    config = fconfig.load_experiment(f"{EXPERIMENTS}/finetune_framepack.py:musubi_framepack_lora").models["student"]
    skeleton = config.family.architecture.skeleton(config)
    want = {f"{block_name}.{name}" for block_name, block in skeleton.named_modules()
            if isinstance(block, (HunyuanVideoTransformerBlock, HunyuanVideoSingleTransformerBlock))
            for name, part in block.named_modules() if isinstance(part, torch.nn.Linear) and "norm" not in name}
    assert set(lora.targets(skeleton, config.lora, "test")) == want and len(want) == 20 * 12 + 40 * 5
