"""python -m fvx.run: reproducible runs, TensorBoard metrics, --help, and bad input that writes nothing."""
import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch

from fvx import config as fconfig, run
from fvx.data import parquet
from fvx.training import tracking

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
    assert "method.optim.lr" in out and "models.student.preset" in out and "'world'" in out


def test_help_read_by_a_pipe_that_stops_early_is_no_error():
    """``--help | head -1``: the listing stops quietly (exit 0, no BrokenPipeError traceback)."""
    command = f"set -o pipefail; {sys.executable} -m fvx.run {EXPERIMENT} --help | head -1"
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("usage:") and "Traceback" not in done.stderr, done.stderr


def test_a_field_set_twice_takes_the_last_and_says_so(tmp_path, capsys):
    out = tmp_path / "run"
    assert run.main([EXPERIMENT, "--out", str(out), *QUICK, "run.steps=3", "validation.every=0", "run.steps=1"]) == 0
    captured = capsys.readouterr()
    assert "note: run.steps is set 2 times; the last, run.steps=1, wins over run.steps=3" in captured.err
    assert "done: 1 steps" in captured.out


@pytest.mark.parametrize("args, message", [
    (["method.optim.lrr=1e-3"], "did you mean 'method.optim.lr'"),
    (["method.optim.lr=fast"], "$.method.optim.lr"),
    (["models.student.preset=wan-giant"], "wan2.1-t2v-1.3b"),
    (["data.path=/nonexistent/data"], "/nonexistent/data"),
    (["models.student.preset=tiny"], "batch latents of shape (2, 192, 4, 2, 2) do not fit model wan:tiny"),
    (["models.student.path=/nonexistent/model"], "/nonexistent/model"),
    (["steps"], "not an override"),
    (["--steps", "5", "run.steps=7"], "--steps 5 and run.steps=7 both set run.steps: give one"),
    (["run.output_dir=elsewhere"], "and run.output_dir=elsewhere both set run.output_dir: give one"),
    (["--steps", "0"], "Expected `int` >= 1 - at `$.run.steps`"),
    (["--dry-run", "--resume"], "--dry-run estimates a run before it starts from its config; it takes no --resume"),
])
def test_bad_input_is_one_clear_error_and_writes_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "run"
    assert run.main([EXPERIMENT, "--out", str(out), *QUICK, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fvx.run: error:") and message in err and "Traceback" not in err
    assert not out.exists()


def test_a_folder_no_folder_can_be_made_in_is_one_line(capsys):
    assert run.main([EXPERIMENT, "--out", "/proc/fvx-run", *QUICK]) == 2
    err = capsys.readouterr().err
    assert "run.output_dir '/proc/fvx-run': no folder can be made in '/proc'" in err
    assert len(err.strip().splitlines()) == 1 and not pathlib.Path("/proc/fvx-run").exists()


def test_a_run_that_loses_the_race_for_its_folder_is_one_line(tmp_path, capsys, monkeypatch):
    """Two runs started at once on one folder both pass the check before building; the one that does not get the lock
    stops there, in one line, with the holder named."""
    from fvx.training import run_lock

    out = tmp_path / "run"
    out.mkdir()
    (out / run_lock.LOCK_FILE).write_text(f'{{"pid": {os.getppid()}, "host": "{socket.gethostname()}", '
                                          '"started": "just now"}')
    monkeypatch.setattr(run_lock, "check", lambda run_dir: None)  # as if the other run took it after the check
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "2", *QUICK]) == 2
    err = capsys.readouterr().err
    assert f"is in use by pid {os.getppid()}" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == [run_lock.LOCK_FILE]


def test_a_resume_that_changes_a_models_preset_names_it(tmp_path, capsys):
    out = tmp_path / "run"
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "2", *QUICK]) == 0
    capsys.readouterr()
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "3", "--resume", "models.student.preset=tiny"]) == 2
    err = capsys.readouterr().err
    assert "this launch changes models.student.preset: 'world' -> 'tiny'" in err and len(err.strip().splitlines()) == 1


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
     "roles 'student' (wan:world) and 'teacher' (wan:tiny-ti2v) denoise different latent spaces"),
    ("finetune_hunyuan.py", ["models.student.embedded_guidance=null"], "embeds a guidance scale: set embedded_guidance"),
    ("finetune_hunyuan.py", ["data.text_len=1"], "is not the packed [B, 1 + L, D] form"),
    ("finetune_skyreels_v2.py", ["data.synthetic.text_dim=16"], "must be [B, L, 32], got [2, 512, 16]"),
    ("finetune_wan_i2v.py", ["data.kind=t2v"], "models.student (wan:world-i2v) is image-to-video: it needs each clip's "
                                               "first frame, which data.kind=t2v does not give; use data.kind=i2v"),
    ("worldmodel_matrixgame2.py", ["data.kind=i2v"], "models.student (matrixgame2:world) reads actions and the first "
                                                     "frame of each clip, which data.kind=i2v does not give"),
    ("finetune_wan_i2v.py", ["data.kind=matrixgame2"], "data.kind=matrixgame2 gives actions per video frame, but "
                                                       "models.student (wan:world-i2v) has no action modules"),
    ("finetune_wan_i2v.py", ["models.student.preset=tiny-i2v", "data.world=null", "data.text_len=8",
                             "data.synthetic.latent_shape=[16,2,4,4]"], "parquet column clip_feature"),
    ("finetune_wan_i2v.py", ["models.student.preset=tiny-i2v", "data.world=null", "data.text_len=8",
                             "data.synthetic.latent_shape=[16,2,4,4]", "data.synthetic.image_embeds=[3,8]"],
     "cond['image_embeds'] must be [B, N, 16], got [2, 3, 8]"),
    ("finetune_wan.py", ["models.student.first_frame=true"], "wan preset 'world' has no per-token timesteps"),
    ("finetune_wan.py", ["models.student.attention=fast"],
     "attention='fast' is not an attention kernel; usable here: sdpa, math, flex, vsa, qat"),
    ("finetune_wan.py", ["models.student.attention=vsa", "models.student.vsa.sparsity=1.0"],
     "Expected `float` < 1.0 - at `$.models[...].vsa.sparsity`"),
    ("finetune_wan.py", ["models.student.vsa.sparsity=0.5"], "vsa.* knobs are set but attention=sdpa"),
    ("finetune_hunyuan.py", ["models.student.attention=vsa"],
     "attention=vsa: the hunyuan_video family cannot run VSA: its self-attention runs over the video and text"),
    ("dmd2.py", ["models.student.attention=qat"], "models.student.attention=qat: model 'student' plays "
                                                  "method.roles.critic as well as the student, which must stay full "
                                                  "precision"),
    ("meanflow.py", ["models.student.attention=qat", "method.derivative=dual"],
     "method.derivative=dual needs forward-mode derivatives, but attention=qat has no forward-mode derivatives"),
    ("finetune_ltx2.py", ["models.student.train_audio=true"], "ltx2 train_audio=True is not supported: LTX-2 trains "
                                                                "video-only here, as in FastVideo"),
    ("finetune_ltx2.py", ["method.weighting_scheme=logit_normal"],
     "model ltx2:world draws its training noise levels with its own sampler"),
    ("finetune_ltx2.py", ["data.cfg_rate=0.1"], "takes no CFG dropout (CFG dropout zeroes the post-connector text"),
    ("finetune_ltx2.py", ["data.world.text_dim=16"], "LTX-2.0 data stores the connector's 3840-wide embeddings"),
    ("finetune_minimax_h3.py", ["method.grad_accum=2", "data.cfg_rate=0.1"],
     "MiniMax-H3 training defines no zero-text branch"),
    ("finetune_minimax_h3.py", ["method.grad_accum=2", "data.kind=t2v"],
     "minimax_h3 trains video and audio together and needs the batch tensor 'audio_latents'"),
    ("finetune_minimax_h3.py", ["method.grad_accum=2", "models.student.preset=minimax-h3", "vae=null",
                                "audio_vae=null", "data.world=null", "data.synthetic.latent_shape=[24,2,4,4]",
                                "data.synthetic.audio_shape=[2,32,9]", "data.synthetic.text_dim=5120",
                                "data.text_len=4"],
     "audio latents have 9 frames but video latents of 2 frames come from a clip with 8 audio latents"),
])
def test_bad_roles_models_and_cond_are_one_clear_error_and_write_nothing(tmp_path, capsys, experiment, args,
                                                                         message):
    out = tmp_path / "run"
    assert run.main([str(EXPERIMENTS / experiment), "--out", str(out), *QUICK, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fvx.run: error:") and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs these kernels")
@pytest.mark.parametrize("args, message", [
    (["models.student.attention=flash"], "attention=flash: diffusers' flash kernel is not usable here (needs a CUDA "
                                         "device); usable here: sdpa, math, flex, vsa, qat"),
    (["models.student.attention=flex"], "models.student.attention=flex: flex-attention has no backward on a CPU"),
    (["models.student.attention=qat", "models.student.qat.validation=infer"], "qat.validation=infer: "),
])
def test_kernels_this_machine_cannot_run_are_one_clear_error(tmp_path, capsys, args, message):
    out = tmp_path / "run"
    assert run.main([EXPERIMENT, "--out", str(out), *QUICK, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not out.exists(), err


def test_a_folder_of_another_family_is_refused_naming_its_class(tmp_path, capsys):
    from fvx.core import random
    from fvx_models.hunyuan_video import HunyuanVideoConfig

    hunyuan = HunyuanVideoConfig().build()
    hunyuan.export.folder(hunyuan.weights.init(random.key(0)), str(tmp_path / "hunyuan"))
    out = tmp_path / "run"
    assert run.main([EXPERIMENT, "--out", str(out), *QUICK, f"models.student.path={tmp_path / 'hunyuan'}"]) == 2
    err = capsys.readouterr().err
    assert "describes a HunyuanVideoTransformer3DModel, not a WanTransformer3DModel" in err and not out.exists()


@pytest.mark.parametrize("experiment", sorted(p.name for p in EXPERIMENTS.glob("*.py")))
def test_every_experiment_trains_two_steps_and_validates(tmp_path, experiment, world_teacher):
    out = tmp_path / "run"
    config = fconfig.load_experiment(str(EXPERIMENTS / experiment))
    export = world_teacher
    if experiment == "dmd2_kandinsky5.py":  # its stage 1 is a Kandinsky 5 export (the tiny preset's)
        from fvx.core import random
        from fvx_models.kandinsky5 import Kandinsky5Config

        stage1 = Kandinsky5Config(preset="tiny").build()
        export = tmp_path / "kandinsky5"
        stage1.export.folder(stage1.weights.init(random.key(0)), str(export))
    teacher = [f"models.{name}.path={export}" for name, model in config.models.items()  # README runs' exports
               if str(getattr(model, "path", None) or "").startswith("runs/")]
    if experiment.startswith("kd_"):  # KD trains on its teacher's trajectory cache: build a tiny one first
        from fvx.training.experiment import load_config
        from fvx_methods import trajectory_cache

        teacher = [*teacher, f"method.cache={tmp_path / 'cache'}", "data.world.num_samples=4", "method.teacher_steps=2"]
        trajectory_cache.build(load_config(str(EXPERIMENTS / experiment), teacher), batch=4)
    if experiment == "diffusion_nft.py":  # groups of 2 in the batch of 2, one sampling batch a step
        teacher = [*teacher, "method.num_video_per_prompt=2", "method.num_batches_per_epoch=1"]
    if experiment in ("finetune_minimax_h3.py", "finetune_framepack.py", "finetune_cosmos3.py"):  # micro-batches of
        teacher = [*teacher, "method.grad_accum=2"]  # one, as many as QUICK's batch of 2
    assert run.main([str(EXPERIMENTS / experiment), "--out", str(out), "--steps", "2", *QUICK, "validation.every=2",
                     "validation.num_prompts=1", "validation.num_steps=2", *teacher]) == 0
    assert (out / "validation" / "step_2").is_dir() and (out / "checkpoints" / "2").is_dir()


def test_late_failures_are_found_before_anything_is_written(tmp_path, capsys):
    """Each of these used to fail after the run folder (or a step-0 validation) was written: now exit 2, one line
    naming the culprit, nothing written."""
    from fvx.core import random
    from fvx_models.wan import WanConfig

    model = WanConfig(preset="world").build()
    model.export.folder(model.weights.init(random.key(0)), str(tmp_path / "model"))
    weights = next((tmp_path / "model" / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    (tmp_path / "a_file").write_text("")
    (tmp_path / "broken.py").write_text("import msgspec\nconfig = (\n")
    cases = [
        ([EXPERIMENT, "validation.prompts_file=/nonexistent/prompts.safetensors", "validation.every=2"],
         "validation.prompts_file '/nonexistent/prompts.safetensors' does not exist"),
        ([EXPERIMENT, f"models.student.path={tmp_path / 'model'}"], f"{weights}' is not a readable safetensors file"),
        ([str(tmp_path / "broken.py")], "broken.py', line 2: '(' was never closed"),
        ([EXPERIMENT, "models.student.path=runs/never_made"],
         "models.student.path = 'runs/never_made' does not exist; when it is an earlier run's export"),
    ]
    for args, message in cases:
        out = tmp_path / "run"
        assert run.main([*args, "--out", str(out), *QUICK]) == 2, message
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
    assert run.main([EXPERIMENT, "--out", str(tmp_path / "a_file" / "run"), *QUICK]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("fault", ["shape", "nan"])
def test_a_bad_sample_met_mid_run_stops_with_one_line_naming_step_file_and_row(tmp_path, capsys, fault):
    """A row whose stored shape does not fit its bytes, or whose latents are NaN, stops the run at the step that reads
    it with one line naming that step, the file and the row; the checkpoints saved before are kept."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fvx.data import datasets as data
    from fvx.data.toy_world import WorldConfig
    from fvx.storage import checkpoint
    from fvx.training import experiment, run_folder

    world = data.open_dataset(data.DataConfig(text_len=4, world=WorldConfig(num_samples=8)), random_key())
    samples = [{"latents": world.read([i])["latents"][0], "text": world.read([i])["text"][0], "caption": f"clip {i}"}
               for i in range(8)]
    path = tmp_path / "data.parquet"
    parquet.write_parquet(path, samples, rows_per_group=2)
    out = tmp_path / "run"
    args = [EXPERIMENT, "--out", str(out), "--steps", "8", *QUICK, f"data.path={path}", "data.world=null",
            "run.checkpoint.every=1", "run.checkpoint.async_save=false", "validation.every=0"]
    config = run.resolve_config(run.parse_args(args))
    batches = experiment.batch_fn(config, experiment.setup(config))
    first = set(batches(0)["index"].tolist())
    bad = next(i for i in range(8) if i not in first)  # met after the first step, not in the check before it
    step = next(s for s in range(1, 8) if bad in batches(s)["index"].tolist())
    table = pq.read_table(path)
    if fault == "shape":
        column, values = "vae_latent_shape", table.column("vae_latent_shape").to_pylist()
        values[bad] = [1, 2, 3]  # its stored shape no longer matches its bytes
    else:
        column, values = "vae_latent_bytes", table.column("vae_latent_bytes").to_pylist()
        values[bad] = np.full(len(values[bad]) // 4, np.nan, dtype=np.float32).tobytes()
    table = table.set_column(table.schema.get_field_index(column), column,
                             pa.array(values, type=table.schema.field(column).type))
    pq.write_table(table, path, row_group_size=2)
    assert run.main(args) == 1
    err = capsys.readouterr().err
    if fault == "shape":
        assert f"step {step}: '{path}' row {bad}: vae_latent_bytes holds" in err
        assert "checkpoints saved before are intact" in err
    else:
        assert f"step {step}: non-finite loss or gradient" in err
        assert f"; non-finite data in '{path}' row {bad}; the run halted" in err
        assert json.loads((out / run_folder.NONFINITE_FILE).read_text())["samples"] == [f"'{path}' row {bad}"]
    assert len(err.strip().splitlines()) == 1
    with checkpoint.Checkpoints(out / run_folder.CHECKPOINTS) as saved:
        assert saved.steps() and max(saved.steps()) <= step


def random_key():
    from fvx.core import random

    return random.key(0)


def test_feedback_names_values_presets_and_what_a_launch_does(tmp_path, capsys):
    assert run.main([EXPERIMENT, "method.optim.lr=nan"]) == 2
    assert "method.optim.lr takes a finite number; non-finite values are refused" in capsys.readouterr().err
    assert run.main([EXPERIMENT, "method.weighting_scheme=gauss"]) == 2
    assert "method.weighting_scheme must be one of 'logit_normal', 'mode', 'uniform'" in capsys.readouterr().err
    assert run.main([EXPERIMENT, "--help"]) == 0
    assert "(one of tiny, tiny-deep, tiny-ti2v, world, wan2.1-t2v-1.3b" in capsys.readouterr().out
    assert run.main([EXPERIMENT, "--dry-run", "--device-memory", "24", "--video", "4x16x16"]) == 0
    assert "fits in 24.0 GiB" in (printed := capsys.readouterr().out) and "a device of 24 GiB" in printed
    assert run.main([EXPERIMENT, "--dry-run"]) == 0  # the samples the experiment trains on, not a full-size video
    printed = capsys.readouterr().out
    assert "the experiment's latents 4x2x2 = 16 tokens" in printed and "fits in" in printed
    assert run.main([str(EXPERIMENTS / "dmd2.py") + ":wan21_t2v_1p3b", "--dry-run", "--world", "4"]) == 0
    assert "video 81x480x832 -> latent 21x60x104 = 32760 tokens" in (printed := capsys.readouterr().out)
    assert "(its data cannot be read here: --video FRAMESxHEIGHTxWIDTH to choose)" in printed
    assert run.main([EXPERIMENT, "--out", str(tmp_path / "r"), "--steps", "1", *QUICK, "--replicate", "2",
                     "validation.every=0"]) == 0
    captured = capsys.readouterr()
    assert "--replicate 2 has no effect in a single process" in captured.err
    assert f"finetune_wan.py -> {tmp_path / 'r'} (1 process); models: wan:world (student);" in captured.out
