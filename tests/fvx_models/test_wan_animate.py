"""Wan 2.2 Animate: Wan's spec on diffusers' WanAnimateTransformer3DModel with its reference, pose and face inputs.
Its forward against the diffusers module as WanAnimatePipeline calls it (two latent frames) is the family test's
(tests/fvx_models/test_families.py, case "wan_animate"). Here: a longer segment (the face adapters over several
frames), the guidance unconditional, the inputs as the pipeline encodes them, the released preset, LoRA files, and
the one-line refusals of a missing or misshapen input."""
import inspect
import pathlib
import sys

import pytest
import torch
import transformers
from diffusers import (AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanAnimatePipeline,
                       WanAnimateTransformer3DModel)
from safetensors.torch import load_file

import encoder_checks
import tiny_wan_pipeline
from fvx.core import random, role
from fvx.distributed import memory
from fvx_models import lora, lora_files, wan, wan_animate, wan_vae
from fvx_models.wan_animate import WanAnimateConfig

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "bench"))
from activations import saved_per_group  # noqa: E402
from family_cases import CASES, animate_native, inputs, native_modules, raw_batch  # noqa: E402


def save_tiny_animate_pipeline(path):
    """A WanAnimatePipeline folder (transformer left out) of tiny random parts: the tiny Wan VAE (4x in time and
    space, 16 channels) with latent statistics of its own, UMT5 and a CLIP vision encoder."""
    torch.manual_seed(0)
    text = transformers.UMT5EncoderModel(transformers.UMT5Config(
        vocab_size=len(tiny_wan_pipeline.WORDS), d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8))
    vision = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, image_size=32, patch_size=8))
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    statistics = {"latents_mean": torch.linspace(-0.3, 0.3, 16).tolist(),
                  "latents_std": torch.linspace(0.5, 2, 16).tolist()}
    vae = AutoencoderKLWan(**{**wan_vae.PRESETS["tiny"], **statistics})
    WanAnimatePipeline(tokenizer=tiny_wan_pipeline.tiny_t5_tokenizer(), text_encoder=text, vae=vae,
                       scheduler=FlowMatchEulerDiscreteScheduler(), image_processor=processor, image_encoder=vision,
                       transformer=None).save_pretrained(path)


@pytest.fixture(scope="module")
def tiny():
    model = WanAnimateConfig().build()
    return model, model.weights.init(random.key(0))


def test_a_segment_of_four_latent_frames_equals_the_pipelines_call(tiny):
    """Three video latent frames beside the reference's: 9 face frames through the motion and face encoders, a face
    adapter after each block, the pose added to frames 1..3."""
    model, params = tiny
    x, t, cond = inputs(model, random.key(1), frames=4, size=4)
    assert cond["face_pixels"].shape == (2, 3, 9, 8, 8) and cond["pose_latents"].shape[2] == 3
    with torch.no_grad():
        want = animate_native(native_modules(CASES["wan_animate"], params), x, t, cond)
    torch.testing.assert_close(model.apply(params, x, t, cond), want, rtol=1e-5, atol=1e-5)
    moved = {**cond, "face_pixels": cond["face_pixels"].flip(2)}  # the face's motion changes the output
    assert not torch.allclose(model.apply(params, x, t, moved), want, atol=1e-4)


def test_the_face_adapters_are_a_unit_group_whose_activation_figures_match_what_one_saves():
    """``compile=blocks`` compiles each face adapter as a unit, and ``--dry-run`` counts what one saves per video
    token: its figures against saved-tensor hooks on the first (bf16; Wan's blocks are Wan's own test's)."""
    config = WanAnimateConfig()
    model = config.build()
    spec = WanAnimateConfig(compute_dtype="bf16").build().memory_spec()
    x, t, cond = inputs(model, random.key(1), frames=4, size=32, text_len=8)
    fp32, half, tokens = saved_per_group(config, x, t, cond)["face_adapter"]
    group = next(group for group in spec.groups if group.name == "face_adapter")
    assert group.count == 2 and group.saved == wan_animate.FACE_ADAPTER_ACTIVATIONS
    estimate = memory.block_activation_bytes(group, tokens, compute_bytes=2)
    assert abs(estimate - (fp32 + half)) <= 0.05 * (fp32 + half), (estimate, fp32 + half)


def test_the_unconditional_blanks_the_face_and_keeps_pose_reference_and_image(tiny):
    """As WanAnimatePipeline guides: the negative prompt (or zero text) with the face every pixel -1."""
    model, _ = tiny
    _, _, cond = inputs(model, random.key(1))
    for mode, negative in (("zero", None), ("negative_prompt", {"text": torch.ones(1, 5, 32),
                                                                 "text_mask": torch.ones(1, 5)})):
        uncond = model.uncond(cond, mode, negative)
        assert torch.equal(uncond["face_pixels"], torch.full_like(cond["face_pixels"], -1.0))
        for name in ("image_embeds", "reference_latents", "pose_latents"):
            assert torch.equal(uncond[name], cond[name])
        assert not torch.equal(uncond["text"], cond["text"])
    assert model.uncond(cond, "keep") == cond


def test_the_inputs_are_the_pipelines_reference_segment_and_pose_latents(tmp_path):
    """A WanAnimatePipeline folder opens with the family's encoders; a reference image, a pose video, the previous
    segment's last frame and a face video encode to exactly what the pipeline's prepare_* methods build (the tiny
    Wan VAE: 4x in time and space, the mask's 4 channels), and the reference's raw latent is the one vae_latent holds
    as frame 0."""
    save_tiny_animate_pipeline(tmp_path)
    opened = wan_animate.ENCODERS.open(tmp_path, ["text", "video", "animation", "image"])
    assert type(opened.pipe) is WanAnimatePipeline
    reference = encoder_checks.random_clip((3, 1, 16, 16), seed=1)[:, 0]
    pose = encoder_checks.random_clip((3, 5, 16, 16), seed=2)
    previous = encoder_checks.random_clip((3, 1, 16, 16), seed=3)
    face = torch.randint(0, 256, (3, 5, 8, 8), dtype=torch.uint8)
    pipe = opened.pipe
    for given, start in ((None, 0), (previous, 4)):
        out = opened.encode_animation(reference, pose, face, given)
        want_reference = pipe.prepare_reference_image_latents(reference[None], 1, device="cpu")
        want_segment = pipe.prepare_prev_segment_cond_latents(
            None if given is None else given[None], batch_size=1, segment_frame_length=5, start_frame=start,
            height=16, width=16, prev_segment_cond_frames=1, task="animate", device="cpu")
        want = torch.cat([want_reference, want_segment], dim=2)[0]
        assert out["reference_latents"].shape == (4 + 16, 1 + 2, 4, 4)
        torch.testing.assert_close(out["reference_latents"], want, rtol=0, atol=1e-5)
        assert out["reference_latents"][:4, 1:].sum() == (0 if given is None else 4 * 16)  # the given frame's mask
    torch.testing.assert_close(out["pose_latents"], pipe.prepare_pose_latents(pose[None], 1, device="cpu")[0],
                               rtol=0, atol=1e-5)
    background = encoder_checks.random_clip((3, 5, 16, 16), seed=4)
    mask = (torch.rand(1, 5, 16, 16, generator=torch.Generator().manual_seed(5)) > 0.5).float()  # 1: to be made
    for given, start in ((None, 0), (previous, 4)):  # the replace mode: the background behind, its mask kept
        got = opened.encode_animation(reference, pose, face, given, background, mask)["reference_latents"]
        want = pipe.prepare_prev_segment_cond_latents(
            None if given is None else given[None], background_video=background[None], mask_video=mask[None],
            batch_size=1, segment_frame_length=5, start_frame=start, height=16, width=16, prev_segment_cond_frames=1,
            task="replace", device="cpu")[0]
        torch.testing.assert_close(got[:, 1:], want, rtol=0, atol=1e-5)
    assert out["face_pixels"] is face or torch.equal(out["face_pixels"], face)
    mean = torch.tensor(pipe.vae.config.latents_mean).view(-1, 1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std).view(-1, 1, 1, 1)
    torch.testing.assert_close((out["reference"] - mean) / std, out["reference_latents"][4:, :1], rtol=0, atol=1e-5)


def test_the_released_preset_is_wan_animate_14bs_config():
    """Wan-AI/Wan2.2-Animate-14B-Diffusers' transformer config (diffusers' convert_wan_to_diffusers.py): Wan 2.1 I2V
    14B with 16 latent channels, a 512-pixel motion encoder and a face adapter every 5th block."""
    signature = [name for name in inspect.signature(WanAnimateTransformer3DModel.__init__).parameters if name != "self"]
    k = WanAnimateConfig(preset="wan2.2-animate-14b").spec.kwargs
    assert sorted(k) == sorted(signature)
    assert (k["num_layers"], k["num_attention_heads"], k["in_channels"], k["latent_channels"]) == (40, 40, 36, 16)
    assert (k["image_dim"], k["added_kv_proj_dim"], k["motion_encoder_size"], k["inject_face_latents_blocks"]) == (
        1280, 5120, 512, 5)
    assert (k["motion_style_dim"], k["motion_dim"], k["motion_encoder_dim"], k["face_encoder_hidden_dim"],
            k["face_encoder_num_heads"]) == (512, 20, 512, 1024, 4)
    assert WanAnimateConfig(preset="wan2.2-animate-14b").spec.options["flow_shift"] == 5.0


@pytest.mark.parametrize("form", ["peft", "comfyui"])
def test_adapters_load_with_its_pipelines_load_lora_weights(tmp_path, form):
    """PEFT's file (the face adapters' too) and ComfyUI's (the blocks', by Wan's original names: ComfyUI's Wan-Animate
    model is its Wan model's subclass) load with WanAnimatePipeline.load_lora_weights, whose transformer then computes
    fvx's LoRA model."""
    pytest.importorskip("peft")
    targets = wan.DIFFSYNTH_LORA_TARGETS if form == "comfyui" else lora.DEFAULT_TARGETS  # PEFT: face too
    adapted = WanAnimateConfig(frozen_dtype="fp32", lora=lora.LoRAConfig(rank=4, alpha=8.0,
                                                                         target_modules=targets)).build()
    assert any(name.startswith("face_adapter.") for name in adapted.weights.trained_names) == (form == "peft")
    base = adapted.weights.base(random.key(0))
    adapters = {name: random.normal(random.fold_in(random.key(1), i), p.shape) * 0.1
                for i, (name, p) in enumerate(adapted.weights.initial(random.key(1)).items())}
    written = adapted.export.adapters(adapters, str(tmp_path), form, stem="dance")
    assert adapted.export.adapter_formats == ("peft", "comfyui")
    name = lora_files.PEFT_FILE if form == "peft" else "dance_lora_comfyui.safetensors"
    assert written.files == {"transformer": tmp_path / name}
    if form == "comfyui":
        assert "diffusion_model.blocks.1.self_attn.q.lora_down.weight" in load_file(written.files["transformer"])
    (transformer,) = native_modules(CASES["wan_animate"], base).values()
    pipe = WanAnimatePipeline(tokenizer=None, text_encoder=None, vae=None, image_encoder=None, image_processor=None,
                              transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler())
    pipe.load_lora_weights(str(tmp_path), weight_name=name)
    x, t, cond = inputs(adapted, random.key(2), frames=3)
    with torch.no_grad():
        loaded = animate_native({"transformer": pipe.transformer}, x, t, cond)
    torch.testing.assert_close(loaded, adapted.apply(role.with_trained(base, adapters), x, t, cond),
                               rtol=1e-5, atol=1e-5)


def test_a_lora_on_the_face_adapter_has_no_comfyui_name_and_says_so(tmp_path):
    adapted = WanAnimateConfig(lora=lora.LoRAConfig(rank=2, target_modules=("face_adapter.0.to_q",))).build()
    adapters = adapted.weights.initial(random.key(1))
    with pytest.raises(ValueError, match=r"module 'face_adapter.0.to_q' has no name in the original wan_animate "
                                         r"layout; use --format peft"):
        adapted.export.adapters(adapters, str(tmp_path), "comfyui")


def test_a_missing_or_misshapen_input_is_one_line_naming_the_column_and_its_shape(tiny):
    model, _ = tiny
    batch = raw_batch(model, random.key(0), frames=3)
    assert model.batch(batch)["cond"]["face_pixels"].shape == (2, 3, 5, 8, 8)
    with pytest.raises(ValueError, match=r"needs the batch tensor 'pose_latents' \(the reference image's CLIP "
                                         r"features \(column clip_feature\) and the animation inputs"):
        model.batch({k: v for k, v in batch.items() if k != "pose_latents"})
    bad = {"pose_latents": (batch["pose_latents"][:, :, :1], r"\[2, 16, 2, 4, 4\] \(one latent frame per video"),
           "face_pixels": (batch["face_pixels"][:, :, :4],
                           r"\[2, 3, 5, 8, 8\] \(4 \(T - 1\) \+ 1 face frames of 8 x 8"),
           "reference_latents": (batch["reference_latents"][:, :16], r"\[2, 20, 3, 4, 4\] \(the mask, then")}
    for name, (tensor, message) in bad.items():
        with pytest.raises(ValueError, match=rf"wan_animate:tiny: column {name} is .*, but it must be {message}"):
            model.batch({**batch, name: tensor})
