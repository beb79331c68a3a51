"""fvx.training.export: a trained role (or its EMA) -> a diffusers folder that from_pretrained loads bit for bit; bad
input is one clear error that writes nothing."""
import json
import pathlib

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

from fvx import run
from fvx.core import tree
from fvx.storage import checkpoint
from fvx.training import export, run_folder

from run_state import start_state  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[3]
EXPERIMENT = str(ROOT / "tests" / "helpers" / "faulty_experiment.py")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> pathlib.Path:
    """A 2-step run, plus a hand-made checkpoint 3 whose role has EMA params (fine-tuning keeps none)."""
    out = tmp_path_factory.mktemp("export") / "run"
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "2"]) == 0
    with checkpoint.Checkpoints(out / "checkpoints", checkpoint.CheckpointConfig(async_save=False)) as checkpoints:
        state = checkpoints.restore(2, start_state(run_folder.load_run(out)))
        role = state.roles["student"]
        ema = tree.map_tensors(lambda p: p * 0.5 + 0.25, role.params)
        checkpoints.save(state._replace(step=torch.tensor(3), roles={"student": role._replace(ema=ema)}),
                         config={}, meta={})
    return out


def stored(run_dir: pathlib.Path, step: int, part: str) -> dict:
    with checkpoint.Checkpoints(run_dir / "checkpoints") as checkpoints:
        return checkpoints.read(step, ("roles", "student", part))


def assert_loads_exactly(folder: pathlib.Path, params: dict) -> None:
    loaded = WanTransformer3DModel.from_pretrained(folder / "transformer").state_dict()
    assert loaded.keys() == params.keys()
    for name, tensor in params.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("args, step, part", [([], 3, "params"), (["--step", "2"], 2, "params"),
                                               (["--ema"], 3, "ema")], ids=["latest", "step", "ema"])
def test_export_round_trips_through_from_pretrained(run_dir, tmp_path, capsys, args, step, part):
    out = tmp_path / "exported"
    assert run.main(["export", str(run_dir), "--out", str(out), *args]) == 0
    assert f"at step {step} to {out} in float32 (transformer, model_index.json, scheduler/)" in capsys.readouterr().out
    assert_loads_exactly(out, stored(run_dir, step, part))
    manifest = json.loads((out / "fvx_export.json").read_text())
    assert manifest == {"run": str(run_dir), "step": step, "role": "student", "ema": part == "ema", "sampling": None,
                        "base": None, "adapters": False, "format": "diffusers", "dtype": None}
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline" and index["transformer"] == ["diffusers", "WanTransformer3DModel"]
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(out, subfolder="scheduler")
    assert scheduler.config.shift == 3.0


@pytest.mark.parametrize("args, message", [
    (["--role", "critic"], "did not train role 'critic'; trained roles: student"),
    (["--step", "2", "--ema"], "role 'student' of the run in"),
    (["--step", "7"], "no checkpoint of step 7 in"),
])
def test_bad_export_is_one_clear_error_that_writes_nothing(run_dir, tmp_path, capsys, args, message):
    out = tmp_path / "exported"
    assert run.main(["export", str(run_dir), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fvx.run: error:") and message in err
    assert list(tmp_path.iterdir()) == []


def test_the_comfyui_format_writes_the_original_layout_and_says_how_to_load_it(run_dir, tmp_path, capsys):
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from safetensors.torch import load_file

    out = tmp_path / "comfy"
    assert run.main(["export", str(run_dir), "--format", "comfyui", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"at step 3 to {out} in float32: run.safetensors" in printed  # named after the run folder, runs/.../run
    assert ("load: ComfyUI: put run.safetensors in models/diffusion_models/ and load it with a Load Diffusion Model "
            f"node; musubi-tuner: wan_generate_video.py --dit {out / 'run.safetensors'}") in printed
    back = convert_wan_transformer_to_diffusers(load_file(out / "run.safetensors"))
    want = stored(run_dir, 3, "params")
    assert back.keys() == want.keys() and all(torch.equal(back[n], want[n]) for n in want)
    assert run.main(["export", str(run_dir), "--format", "comfyui", "--ema", "--out", str(tmp_path / "ema")]) == 0
    assert [p.name for p in (tmp_path / "ema").glob("*.safetensors")] == ["run_ema.safetensors"]


def test_export_refuses_a_folder_that_holds_something(run_dir, tmp_path, capsys):
    (tmp_path / "kept.txt").write_text("mine")
    assert run.main(["export", str(run_dir), "--out", str(tmp_path)]) == 2
    assert "already exists and is not an empty folder" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["kept.txt"]


def tiny_wan_base(folder: pathlib.Path) -> None:
    """A diffusers WanPipeline folder of tiny random components (VAE, UMT5 text encoder, word-level tokenizer,
    scheduler), without a transformer: a stand-in for the base model's pipeline folder."""
    from diffusers import AutoencoderKLWan
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True],
                     scale_factor_spatial=4, latents_mean=[0.0] * 16, latents_std=[1.0] * 16).save_pretrained(
        folder / "vae")
    UMT5EncoderModel(UMT5Config(vocab_size=32, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
                     ).save_pretrained(folder / "text_encoder")
    words = ["<pad>", "</s>", "<unk>"] + [f"w{i}" for i in range(29)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder / "tokenizer")
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(folder / "scheduler")
    (folder / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "vae": ["diffusers", "AutoencoderKLWan"],
        "text_encoder": ["transformers", "UMT5EncoderModel"], "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "transformer": [None, None]}))


@pytest.mark.slow
def test_a_distilled_student_exports_as_a_pipeline_that_samples_with_its_few_steps(tmp_path, capsys, world_teacher):
    """DMD2's export defaults to the student, records its few-step timesteps, and with --base loads as a whole
    WanPipeline that runs a 4-step sample; without --base it says which components to pass."""
    from diffusers import WanPipeline

    out = tmp_path / "run"
    tiny = ["models.student.preset=tiny", "models.teacher.preset=tiny-deep", "models.student.path=null",
            "models.teacher.path=null", "data.world=null", "data.text_len=8", "data.batch_size=2", "vae=null",
            "data.synthetic.latent_shape=[16,2,8,8]", "validation.every=0", "run.progress=false",
            "method.denoising_steps=[1000,750,500,250]"]
    assert run.main([str(ROOT / "experiments" / "dmd2.py"), "--out", str(out), "--steps", "1", *tiny]) == 0
    base = tmp_path / "base"
    tiny_wan_base(base)
    capsys.readouterr()
    assert run.main(["export", str(out), "--ema", "--out", str(tmp_path / "bare")]) == 0
    printed = capsys.readouterr().out
    assert "role 'student'" in printed and "vae=None, text_encoder=None, tokenizer=None" in printed
    assert '"timesteps": [1000.0, 750.0, 500.0, 250.0]' in printed
    assert run.main(["export", str(out), "--ema", "--out", str(tmp_path / "exported"), "--base", str(base)]) == 0
    manifest = json.loads((tmp_path / "exported" / "fvx_export.json").read_text())
    assert manifest["role"] == "student" and manifest["sampling"]["timesteps"] == [1000.0, 750.0, 500.0, 250.0]
    pipe = WanPipeline.from_pretrained(str(tmp_path / "exported"))
    frames = pipe("w1 w2", num_inference_steps=4, height=16, width=16, num_frames=5, guidance_scale=1.0,
                  output_type="np", generator=torch.Generator().manual_seed(0)).frames
    assert frames.shape == (1, 5, 16, 16, 3) and torch.isfinite(torch.as_tensor(frames)).all()
    assert run.main(["export", str(out), "--out", str(tmp_path / "nope"), "--base", str(tmp_path)]) == 2
    assert "is not a diffusers pipeline folder (no model_index.json)" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------------------- LoRA


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, world_teacher) -> pathlib.Path:
    """3 steps of experiments/finetune_wan_lora.py on the world teacher."""
    out = tmp_path_factory.mktemp("lora") / "run"
    assert run.main([str(ROOT / "experiments" / "finetune_wan_lora.py"), "--out", str(out), "--steps", "3",
                     "run.progress=false", "validation.every=0", "data.batch_size=2",
                     f"models.student.path={world_teacher}"]) == 0
    return out


@pytest.mark.slow
def test_a_lora_run_saves_adapters_only_and_exports_every_format(lora_run, tmp_path, capsys, world_teacher):
    """The checkpoint holds the adapters only; the PEFT, ComfyUI and musubi files load with diffusers'
    load_lora_weights onto the run's base and reproduce fvx's output; the merged export is the base at its stored
    precision plus ``(alpha / r) B A``, in fp32 to 1e-6 (in bf16 with --dtype bf16)."""
    pytest.importorskip("peft")
    from diffusers import WanPipeline

    from fvx_models import lora_files

    adapters = stored(lora_run, 3, "params")
    assert adapters and all(".lora_" in name for name in adapters)
    assert run.main(["export", str(lora_run), "--lora", "--out", str(tmp_path / "peft")]) == 0
    printed = capsys.readouterr().out
    assert f"load: pipe.load_lora_weights({str(tmp_path / 'peft')!r})" in printed
    assert "load: not for ComfyUI or musubi-tuner: they ignore PEFT keys" in printed
    for form in ("comfyui", "musubi"):
        assert run.main(["export", str(lora_run), "--lora", "--format", form, "--out", str(tmp_path / form)]) == 0
    printed = capsys.readouterr().out
    assert "load: ComfyUI: put run_lora_comfyui.safetensors in models/loras/" in printed
    musubi_file = tmp_path / "musubi" / "run_lora_musubi.safetensors"
    assert f"load: musubi-tuner: wan_generate_video.py --lora_weight {musubi_file}\n" in printed
    assert run.main(["export", str(lora_run), "--out", str(tmp_path / "merged")]) == 0  # a LoRA role exports merged
    assert run.main(["export", str(lora_run), "--dtype", "bf16", "--out", str(tmp_path / "bf16")]) == 0

    config = run_folder.load_run(lora_run)
    model = config.models["student"].build()
    params = export.role_params(config, "student", model, adapters)  # the run's base at full precision + adapters
    base = {n: p for n, p in params.items() if ".lora_" not in n}
    teacher = WanTransformer3DModel.from_pretrained(pathlib.Path(world_teacher) / "transformer").state_dict()
    assert all(torch.equal(base[n], teacher[n]) for n in teacher)  # fp32, as the folder stores it
    batch = model.batch({"latents": torch.randn(1, 192, 4, 2, 2), "text": torch.randn(1, 4, 32),
                         "text_mask": torch.ones(1, 4), "sample_index": torch.arange(1)})
    x, t = batch["latents"], torch.tensor([400.0])
    want = model.apply(params, x, t, batch["cond"])
    files = {"peft": lora_files.PEFT_FILE, "comfyui": "run_lora_comfyui.safetensors"}
    for form in files:  # diffusers reads musubi's layout only with FFN adapters: tests/fvx_models
        transformer = WanTransformer3DModel.from_pretrained(pathlib.Path(world_teacher) / "transformer")
        pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(),
                           transformer=transformer)
        pipe.load_lora_weights(str(tmp_path / form), weight_name=files[form])
        with torch.no_grad():
            got = pipe.transformer(x, t, batch["cond"]["text"], return_dict=False)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    merged = WanTransformer3DModel.from_pretrained(tmp_path / "merged" / "transformer").state_dict()
    halved = WanTransformer3DModel.from_pretrained(tmp_path / "bf16" / "transformer", torch_dtype=None).state_dict()
    scale = config.models["student"].lora.scale
    adapted = [n.removesuffix(".lora_A.weight") for n in adapters if n.endswith(".lora_A.weight")]
    for name in adapted:
        low_rank = adapters[f"{name}.lora_B.weight"] @ adapters[f"{name}.lora_A.weight"]
        exact = teacher[f"{name}.weight"] + scale * low_rank
        assert merged[f"{name}.weight"].dtype == torch.float32
        torch.testing.assert_close(merged[f"{name}.weight"], exact, rtol=0, atol=1e-6)
        assert torch.equal(halved[f"{name}.weight"], merged[f"{name}.weight"].bfloat16())
    assert all(torch.equal(merged[n], teacher[n]) for n in teacher if n.removesuffix(".weight") not in adapted)


@pytest.mark.parametrize("args, message", [
    (["--lora", "--format", "merged"], "export --format merged: the adapters of role 'student' export as peft, "
                                       "comfyui or musubi"),
    (["--format", "musubi"], "export --format musubi is for adapters: add --lora"),
    (["--lora", "--format", "diffusers"], "export --format diffusers is for whole weights: export without --lora"),
    (["--lora", "--dtype", "bf16"], "export --dtype is for whole weights (adapters are written in fp32)"),
    (["--dtype", "fp8"], "export --dtype must be one of fp32, bf16; got 'fp8'"),
    (["--format", "comfyui", "--base", "."], "export --base links a pipeline's other components beside a diffusers "
                                              "folder; it does not apply to --format comfyui"),
])
def test_bad_lora_export_is_one_clear_error_that_writes_nothing(lora_run, tmp_path, capsys, args, message):
    assert run.main(["export", str(lora_run), "--out", str(tmp_path / "out"), *args]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_lora_export_errors(run_dir, tmp_path, capsys):
    assert run.main(["export", str(run_dir), "--lora", "--out", str(tmp_path / "a")]) == 2
    assert "trains no adapters (its model config has no lora); export it without --lora" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_resuming_with_another_lora_rank_names_the_field(lora_run, capsys):
    assert run.main([str(ROOT / "experiments" / "finetune_wan_lora.py"), "--out", str(lora_run), "--resume",
                     "--steps", "4", "models.student.lora.rank=8"]) == 2
    err = capsys.readouterr().err
    assert "this launch changes models.student.lora.rank: 16 -> 8" in err
    assert "no older checkpoint" not in err and len(err.strip().splitlines()) == 1
