"""``--dry-run`` refuses what the run refuses, with the same line (both through ``fvx.training.config_checks.check_models``
and the method's ``check_latent_frames``), and the contradictions that trained silently are refused (or warned) in one
line by both, before the run folder exists (issue 40, item 7)."""
import pathlib

import pytest

from fvx import run

ROOT = pathlib.Path(__file__).resolve().parents[3]
EXPERIMENTS = ROOT / "experiments"

MEANFLOW_LTX2 = '''
import msgspec
from fvx.data.datasets import DataConfig
from fvx.data.toy_world import WorldConfig
from fvx.training.experiment import Experiment
from fvx_methods.meanflow import MeanFlow
from fvx_models.ltx2 import LTX2Config


class MeanFlowLTX2(Experiment):
    models: dict[str, LTX2Config] = msgspec.field(default_factory=lambda: {"student": LTX2Config()})
    method: MeanFlow = MeanFlow()


config = MeanFlowLTX2(data=DataConfig(batch_size=2, text_len=4, world=WorldConfig()))
'''

# (experiment, overrides, the line both give): each a refusal the dry run used to accept, or a contradiction
REFUSED = {
    "self_forcing_bidirectional_student": (
        "self_forcing_causal_t2v.py", ["models.student=wan", "models.student.preset=world"],
        "Self-Forcing needs a block-causal student (its rollout streams on a KV cache), but model wan:world is not "
        "one"),
    "meanflow_without_r": (
        "meanflow.py", ["models.student.r_embedder=null"],
        "MeanFlow trains a flow map u(x_t, t, r), but models.student (wan:world) has no r input; "
        "set models.student.r_embedder={} (fvx_models.wan_two_time)"),
    "meanflow_on_ltx2": (
        None, [],
        "MeanFlow trains a flow map u(x_t, t, r), but models.student (ltx2:tiny) has no r input; the ltx2 family "
        "takes no second time input; a flow map trains on a two-time family: wan (models.<name>.r_embedder={}: "
        "fvx_models.wan_two_time) or anyflow (fvx_models.anyflow)"),
    "meanflow_ad_compiled": (
        "meanflow.py", ["models.student.compile=blocks", "method.derivative=ad"],
        "method.derivative=ad runs forward-mode AD eagerly and cannot run inside a compiled model"),
    "clip_not_whole_blocks": (
        "self_forcing_causal_t2v.py", ["method.chunk_size=3", "models.student.num_frames_per_block=3"],
        "the rollout's clip: 4 latent frames are not whole blocks of method.chunk_size = 3"),
    "t2v_preset_on_i2v_data": (
        "finetune_wan_i2v.py", ["models.student.preset=tiny"],
        "data.kind=i2v gives each clip's first frame, but models.student.preset=tiny (wan:tiny) takes no image input "
        "(it would train text-to-video, the frame unread); use an image-to-video preset, models.student.preset=PRESET "
        "with PRESET one of tiny-i2v, world-i2v, wan2.1-i2v-14b-480p, wan2.1-i2v-14b-720p"),
    "t2v_config_of_a_first_frame_family_on_i2v_data": (
        "finetune_kandinsky6.py", ["data.kind=i2v"],
        "data.kind=i2v gives each clip's first frame, but models.student.preset=world (kandinsky6:world) takes no "
        "image input (it would train text-to-video, the frame unread); set models.student.first_frame=true (its "
        "image-to-video)"),
    "model_no_role_plays": (
        "meanflow.py:world_distill", ["method=meanflow"],
        "models.teacher: no role plays it (method.roles: student=student); name it in a role "
        "(method.roles.<role>=<name>) or leave it out of models"),
    "linear_qat_on_the_critic": (
        "dmd2.py", ["models.student.linear_qat.format=nvfp4"],
        "models.student.linear_qat: model 'student' plays method.roles.critic as well as the student, which must "
        "stay full precision (quantization-aware training is the student's); play it with a model entry of its own "
        "without linear_qat (models.<name> and method.roles.critic=<name>)"),
    "linear_qat_on_the_teacher": (
        "dmd2.py", ["models.teacher.linear_qat.format=nvfp4"],
        "models.teacher.linear_qat: model 'teacher' plays method.roles.teacher, which must stay full precision"),
    "linear_qat_module_the_family_lacks": (
        "finetune_wan.py", ['models.student.linear_qat.modules=["blocks.*.attn9.to_q"]'],
        "wan:world: linear_qat.modules: 'blocks.*.attn9.to_q' matches no linear layer of the wan family; some of its "
        "layers: condition_embedder.time_embedder.linear_1"),
    "own_schedule_of_a_family_without_one": (
        "finetune_sana_video.py", ["validation.schedule=model"],
        "validation.schedule=model samples on a model's own levels, but models.student (sana_video:world) has none; "
        "use validation.schedule=fvx or diffusers"),
    "context_data_for_a_model_without_context": (
        "finetune_mochi.py", ["data.kind=vace"],
        "data.kind=vace gives a control context per clip, but models.student (mochi:world) reads none (it would "
        "train without them); use a model whose cond reads them ('vace_context')"),
    "animation_data_for_a_model_without_pose": (
        "finetune_mochi.py", ["data.kind=animate"],
        "data.kind=animate gives a reference image and pose and face videos per segment, but models.student "
        "(mochi:world) reads none (it would train without them); use a model whose cond reads them ('pose_latents')"),
    "text_data_for_a_control_model": (
        "finetune_wan_vace.py", ["data.kind=t2v"],
        "models.student (wan_vace:world) reads a control context per clip, which data.kind=t2v does not give; use "
        "data.kind=vace"),
    "text_data_for_an_animation_model": (
        "finetune_wan_animate.py", ["data.kind=t2v"],
        "models.student (wan_animate:world) reads a reference image and pose and face videos per segment, which "
        "data.kind=t2v does not give; use data.kind=animate"),
    "score_window_upside_down": (
        "streaming_long_causal_t2v.py", ["method.min_timestep_ratio=0.7", "method.max_timestep_ratio=0.3"],
        "method.min_timestep_ratio = 0.7 is above method.max_timestep_ratio = 0.3: the score timesteps' window "
        "[min, max] is empty"),
}


def experiment_path(name: str | None, tmp_path: pathlib.Path) -> str:
    if name is not None:
        return str(EXPERIMENTS / name)
    path = tmp_path / "meanflow_ltx2.py"  # MeanFlow on LTX-2: no experiment file pairs them
    path.write_text(MEANFLOW_LTX2)
    return str(path)


@pytest.mark.parametrize("case", list(REFUSED))
def test_the_dry_run_and_the_run_refuse_with_the_same_line(case, tmp_path, capsys):
    name, overrides, line = REFUSED[case]
    experiment, out = experiment_path(name, tmp_path), tmp_path / "run"
    errors = []
    for mode in (["--dry-run"], []):
        assert run.main([experiment, "--out", str(out), "validation.every=0", *overrides, *mode]) == 2, mode
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and line in err, err
        errors.append(err)
        assert not out.exists()  # found before the run folder (checkpoints, TensorBoard) is made
    assert errors[0] == errors[1]


def test_a_dry_run_video_that_is_not_whole_blocks_is_refused(capsys):
    """``--video`` gives the clip the dry run estimates: 5 latent frames (the toy world's codec keeps every frame) in
    blocks of 3 is what DFSFT refuses of its data."""
    experiment = str(EXPERIMENTS / "dfsft_causal_t2v.py")
    args = [experiment, "--dry-run", "models.student.num_frames_per_block=3", "method.chunk_size=3"]
    assert run.main([*args, "--video", "5x64x64"]) == 2
    assert "batch latents have 5 latent frames, not a whole number of method.chunk_size = 3" in capsys.readouterr().err
    assert run.main([*args, "--video", "6x64x64"]) == 0  # two blocks


def test_a_warmup_longer_than_the_run_is_one_warning_line(capsys):
    experiment = str(EXPERIMENTS / "finetune_wan.py")
    args = [experiment, "--dry-run", "--steps", "10", "method.optim.schedule=cosine"]
    assert run.main([*args, "method.optim.warmup_steps=10"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warned == ["warning: method.optim.warmup_steps = 10 is not shorter than the run's 10 optimizer updates "
                      "(run.steps): the learning rate never reaches method.optim.lr = 0.003 (legal: a run resumed "
                      "with a larger run.steps finishes the warmup)"]
    assert run.main([*args, "method.optim.warmup_steps=9"]) == 0
    assert "warning:" not in capsys.readouterr().err
