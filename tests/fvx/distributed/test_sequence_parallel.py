"""Sequence parallelism (fvx.distributed.sequence_parallel): bad input gets one line naming what to change (in this
process), and multi-process gloo runs (tests/helpers/sp_worker.py) equal one process: 2 SP ranks (fine-tuning of the
tiny Wan eager, under remat, under remat with compiled blocks, with per-token timesteps; the block-causal Wan), SP 2 x
data-parallel 2 on 4 ranks (FSDP and HSDP meshes), and ``fvx.run --sp 2`` under a 2-process launch.

    python -m pytest -q tests/fvx/distributed/test_sequence_parallel.py            # all, the multi-process ones
    python -m pytest -q tests/fvx/distributed/test_sequence_parallel.py -m "not slow"   # the single-process ones only
"""
import math
import pathlib
import types

import pytest
import torch
from torch.func import functional_call

from fvx import run
from fvx.core import random
from fvx.distributed import processes, sequence_parallel as fsp
from fvx.training import experiment, tracking
from fvx_models import build, wan
from fvx_models.hunyuan_video import HunyuanVideoConfig

import sp_worker as worker  # noqa: E402
from gloo import COMPARED, EXPERIMENT, assert_close_rel, launch1, launch2, launch_workers  # noqa: E402

REL = 1e-6  # fp32: SP ranks differ from one process only in reduction order (token sums split over ranks)
# After AdamW steps: Adam divides by sqrt(nu), so gradient elements near zero amplify reduction-order rounding
# element by element (measured on 4 ranks: 1.5e-5 of the largest element, 2.7e-6 in norm for a text-embedder
# weight); each model's params as a whole differ by 4.5e-7.
ADAM_ELEMENT, ADAM_DISTANCE = 3e-5, 2e-6
FAKE = fsp.SPGroup("never-used", 2, 0)  # for checks that fail before any collective


# --------------------------------------------------------------------------------------------------- one process


def test_no_sequence_parallelism_is_the_identity():
    x = torch.arange(24.0).reshape(1, 4, 3, 2)
    for f in (fsp.split_tokens, fsp.gather_tokens, fsp.to_heads, fsp.to_tokens):
        assert f(x, fsp.SPGroup()) is x


def test_a_rank_takes_its_contiguous_run_of_tokens():
    x = torch.arange(12.0).reshape(1, 6, 2)
    assert torch.equal(fsp.split_tokens(x, fsp.SPGroup("g", 3, 1)), x[:, 2:4])
    assert fsp.local_tokens(8, fsp.SPGroup("g", 2, 1)) == (4, 4)


def test_heads_that_do_not_split_are_one_line_naming_the_sp_to_use():
    config = wan.WanConfig(preset="tiny-deep")  # 3 heads
    with pytest.raises(ValueError, match=r"wan:tiny-deep: .* 3 attention heads, which 2 does not divide; "
                                         r"use --sp 1 or 3$"):
        build.sequence_parallel(config, build.skeleton(config), FAKE)


def test_tokens_that_do_not_split_are_one_line_naming_what_to_change():
    config = wan.WanConfig(preset="tiny")
    module = build.skeleton(config)
    build.sequence_parallel(config, module, FAKE)
    params = config.build().weights.init(random.key(0))
    x = torch.zeros(1, 16, 1, 2, 6)  # 1 x 1 x 3 = 3 tokens
    with pytest.raises(ValueError, match=r"^sequence parallel: 3 tokens per sample do not split over --sp 2 ranks; "
                                         r"choose a video size .* or an --sp that divides 3$"):
        functional_call(module, (params, dict(module.named_buffers())), (),
                        {"hidden_states": x, "timestep": torch.tensor([1.0]),
                         "encoder_hidden_states": torch.zeros(1, 5, 32), "return_dict": False})


def test_a_run_whose_latents_do_not_split_is_refused_before_its_first_step():
    mesh = types.SimpleNamespace()
    setattr(mesh, processes._SEQUENCE, FAKE)
    built = types.SimpleNamespace(mesh=mesh, program=types.SimpleNamespace(
        model=types.SimpleNamespace(patch_size=(1, 2, 2))))
    experiment.check_sequence_parallel(built, {"latents": torch.zeros(2, 16, 2, 4, 4)})  # 8 tokens: fine
    with pytest.raises(ValueError, match=r"^latents \(1, 16, 1, 2, 6\) \(patch \(1, 2, 2\)\): sequence parallel: "
                                         r"3 tokens per sample do not split over --sp 2 ranks"):
        experiment.check_sequence_parallel(built, {"latents": torch.zeros(1, 16, 1, 2, 6)})


def test_a_family_without_sequence_parallelism_refuses_it_in_one_line():
    config = HunyuanVideoConfig(preset="tiny")
    with pytest.raises(ValueError, match=r"^hunyuan_video:tiny: the hunyuan_video family has no sequence "
                                         r"parallelism \(--sp 2\); run it with --sp 1"):
        build.sequence_parallel(config, build.skeleton(config), FAKE)


def test_an_sp_that_does_not_divide_the_processes_is_one_line(tmp_path, capsys):
    assert run.main([EXPERIMENT, "--out", str(tmp_path / "run"), "--sp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("fvx.run: error: --sp 2 must divide the number of processes, 1 here (launch with torchrun "
                   "--nproc_per_node a multiple of 2, or choose --sp among 1)"), err
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------ more processes


def launch(out: pathlib.Path, world: int) -> dict:
    """``world`` gloo ranks of sp_worker.py, one thread each; what rank 0 saved."""
    return launch_workers(worker.__file__, out, world)


@pytest.fixture(scope="module")
def sp2(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("sp2"), 2)


@pytest.fixture(scope="module")
def sp2_dp2(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("sp2dp2"), 4)


@pytest.fixture(scope="module")
def one_process():
    """The single-process fine-tuning runs, by variant (computed once)."""
    return {}


def single(one_process: dict, name: str) -> dict:
    if name not in one_process:
        one_process[name] = worker.finetune_run(worker.VARIANTS[name])
    return one_process[name]


def assert_fine_tuning_equal(got: dict, want: dict):
    """Loss and gradients at the initial params to ``REL``; every logged metric of the steps to ``REL``; the params
    after the steps within the AdamW bounds."""
    assert math.isclose(got["loss"], want["loss"], rel_tol=REL)
    assert_close_rel(got["grads"], want["grads"])
    for step, (g, w) in enumerate(zip(got["metrics"], want["metrics"], strict=True)):
        assert g.keys() == w.keys()
        for name in w:
            assert math.isclose(g[name], w[name], rel_tol=REL, abs_tol=1e-12), (step, name, g[name], w[name])
    assert want["metrics"][0]["grad_norm"] > 0.5  # the clip bites, so the global norm matters
    params, expected = got["params"], want["params"]
    scale = max(w.abs().max() for w in expected.values())
    assert max((params[n] - expected[n]).abs().max() for n in expected) <= ADAM_ELEMENT * scale
    distance = math.sqrt(sum(float(((params[n] - expected[n]) ** 2).sum()) for n in expected))
    assert distance <= ADAM_DISTANCE * math.sqrt(sum(float((w ** 2).sum()) for w in expected.values()))


@pytest.mark.slow  # one launch of 2 processes for all the 2-rank tests: about 40 s on 2 idle cores
@pytest.mark.parametrize("variant", list(worker.VARIANTS))
def test_two_sp_ranks_fine_tune_as_one_process(sp2, one_process, variant):
    assert_fine_tuning_equal(sp2["finetune"][variant], single(one_process, variant))


@pytest.mark.slow
def test_two_sp_ranks_each_hold_half_the_tokens_and_half_the_state(sp2, one_process):
    assert sp2["tokens_per_rank"] == 4  # of the 8 tokens per sample one process's blocks see
    shard_name, shard_size, _, replicate_size, _, sp_size = sp2["group"]
    assert (shard_size, replicate_size, sp_size) == (2, 1, 2)
    whole = sum(p.numel() * 4 for p in single(one_process, "eager")["params"].values()) * 3  # params, mu, nu
    assert abs(2 * sp2["finetune"]["eager"]["state_bytes"] - whole) <= 0.01 * whole


@pytest.mark.slow
@pytest.mark.parametrize("case", worker.CAUSAL, ids=lambda case: f"{case[0]}-remat{case[1]}")
def test_block_causal_wan_under_sp_equals_one_process(sp2, case):
    """Its per-frame, teacher-forced and KV-cached forwards (the cache holding each rank's heads)."""
    loss, grads = sp2["causal"][case]
    want_loss, want_grads = worker.causal_run(*case)
    assert math.isclose(loss, want_loss, rel_tol=REL)
    assert_close_rel(grads, want_grads)


@pytest.mark.slow  # one launch of 4 processes on 2 cores: about 60 s (imports dominate)
@pytest.mark.parametrize("mesh", ["fsdp", "hsdp"])
def test_sp2_by_dp2_on_four_ranks_fine_tunes_as_one_process(sp2_dp2, one_process, mesh):
    """SP groups {0, 1} and {2, 3} read the two halves of the batch; params shard over all 4 ranks (fsdp) or over 2
    with 2 replicas (hsdp)."""
    _, shard_size, _, replicate_size, _, sp_size = sp2_dp2[mesh]["group"]
    assert (shard_size, replicate_size, sp_size) == ((4, 1, 2) if mesh == "fsdp" else (2, 2, 2))
    for variant in worker.QUICK:
        assert_fine_tuning_equal(sp2_dp2[mesh][variant], single(one_process, variant))


@pytest.mark.slow  # a 2-process and a 1-process run of fvx.run
def test_fvx_run_with_sp_logs_the_losses_of_one_process(tmp_path):
    outputs = launch2(tmp_path / "sp", "--sp", "2")
    assert "sequence parallel over 2" in outputs[0]
    launch1(tmp_path / "one")
    two, one = (tracking.read_scalars(tmp_path / name / "tb") for name in ("sp", "one"))
    for name in COMPARED:
        assert [s for s, _ in two[name]] == [0, 1, 2], name
        for (_, got), (_, want) in zip(two[name], one[name]):
            assert math.isclose(got, want, rel_tol=REL, abs_tol=1e-9), (name, two[name], one[name])
