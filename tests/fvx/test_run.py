"""python -m fvx.run: reproducible runs, TensorBoard metrics, --help, and bad input that writes nothing."""
import pathlib
import subprocess
import sys

import pytest

from fvx import run, tracking

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXPERIMENT = str(ROOT / "experiments" / "finetune_wan.py")
QUICK = ["run.progress=false", "data.batch_size=2", "data.prefetch=1", "method.optim.warmup_steps=1"]


def train(out, *extra):
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "4", *QUICK, *extra]) == 0
    return tracking.read_scalars(out / "tb")


def test_same_seed_gives_bit_identical_logged_losses(tmp_path):
    first = train(tmp_path / "a")
    second = train(tmp_path / "b")
    assert {"loss", "grad_norm", "lr", "step_time_s", "samples_per_s"} <= set(first)
    assert [step for step, _ in first["loss"]] == [0, 1, 2, 3]
    for name in ("loss", "grad_norm", "lr"):
        assert first[name] == second[name]
    other = train(tmp_path / "c", "run.seed=1")
    assert other["loss"] != first["loss"]
    assert (tmp_path / "a" / "config.json").is_file()


def test_help_lists_fields_with_defaults(capsys):
    assert run.main([EXPERIMENT, "--help"]) == 0
    out = capsys.readouterr().out
    assert "method.optim.lr" in out and "models.student.preset" in out and "'tiny'" in out


@pytest.mark.parametrize("args, message", [
    (["method.optim.lrr=1e-3"], "did you mean 'method.optim.lr'"),
    (["method.optim.lr=fast"], "$.method.optim.lr"),
    (["models.student.preset=wan-giant"], "wan2.1-t2v-1.3b"),
    (["data.path=/nonexistent/data"], "/nonexistent/data"),
    (["data.synthetic.latent_shape=[4,1,8,8]"], "(2, 4, 1, 8, 8)"),
    (["models.student.path=/nonexistent/model"], "/nonexistent/model"),
    (["steps"], "not an override"),
])
def test_bad_input_is_one_clear_error_and_writes_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "run"
    assert run.main([EXPERIMENT, "--out", str(out), *QUICK, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fvx.run: error:") and message in err and "Traceback" not in err
    assert not out.exists()


def test_missing_experiment_file(tmp_path, capsys):
    assert run.main([str(tmp_path / "nope.py")]) == 2
    assert "experiment file not found" in capsys.readouterr().err


def test_module_entry_point_runs(tmp_path):
    result = subprocess.run([sys.executable, "-m", "fvx.run", EXPERIMENT, "--out", str(tmp_path / "r"),
                             "--steps", "2", *QUICK], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "done: 2 steps" in result.stdout


def test_validation_logs_videos_at_its_cadence(tmp_path):
    out = tmp_path / "v"
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "4", *QUICK, "validation.every=2",
                     "validation.num_prompts=1", "validation.num_steps=2"]) == 0
    images = tracking.read_images(out / "tb")
    assert [step for step, _ in images["validation/model/prompt_0"]] == [0, 2, 4]
    assert (out / "validation" / "step_4").is_dir()
    without_vae = tmp_path / "latents"
    assert run.main([EXPERIMENT, "--out", str(without_vae), "--steps", "2", *QUICK, "validation.every=2",
                     "validation.num_prompts=1", "validation.num_steps=2", "vae=null"]) == 0
    assert "validation/model/latents_0" in tracking.read_images(without_vae / "tb")


EXPERIMENTS = ROOT / "experiments"


@pytest.mark.parametrize("experiment, args, message", [
    ("dmd2.py", ["method.roles.teacher=big"],
     "method.roles.teacher names model 'big', which the experiment does not define (models: student, teacher)"),
    ("dmd2.py", ["models.teacher.preset=tiny-ti2v"],
     "roles 'student' (wan:tiny) and 'teacher' (wan:tiny-ti2v) denoise different latent spaces"),
    ("finetune_hunyuan.py", ["models.student.embedded_guidance=null"], "embeds a guidance scale: set embedded_guidance"),
    ("finetune_hunyuan.py", ["data.text_len=1"], "is not the packed [B, 1 + L, D] form"),
    ("finetune_skyreels_v2.py", ["data.synthetic.text_dim=16"], "must be [B, L, 32], got [2, 512, 16]"),
])
def test_bad_roles_models_and_cond_are_one_clear_error_and_write_nothing(tmp_path, capsys, experiment, args,
                                                                         message):
    out = tmp_path / "run"
    assert run.main([str(EXPERIMENTS / experiment), "--out", str(out), *QUICK, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fvx.run: error:") and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_a_folder_of_another_family_is_refused_naming_its_class(tmp_path, capsys):
    from fvx import random
    from fvx_models.hunyuan_video import HunyuanVideoConfig

    hunyuan = HunyuanVideoConfig().build()
    hunyuan.export(hunyuan.init(random.key(0)), str(tmp_path / "hunyuan"))
    out = tmp_path / "run"
    assert run.main([EXPERIMENT, "--out", str(out), *QUICK, f"models.student.path={tmp_path / 'hunyuan'}"]) == 2
    err = capsys.readouterr().err
    assert "describes a HunyuanVideoTransformer3DModel, not a WanTransformer3DModel" in err and not out.exists()


@pytest.mark.parametrize("experiment", sorted(p.name for p in EXPERIMENTS.glob("*.py")))
def test_every_experiment_trains_two_steps_and_validates(tmp_path, experiment):
    out = tmp_path / "run"
    assert run.main([str(EXPERIMENTS / experiment), "--out", str(out), "--steps", "2", *QUICK, "validation.every=2",
                     "validation.num_prompts=1", "validation.num_steps=2"]) == 0
    assert (out / "validation" / "step_2").is_dir() and (out / "checkpoints" / "2").is_dir()
