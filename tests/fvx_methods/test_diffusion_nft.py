"""fvx_methods.diffusion_nft: the advantage modes and the NFT loss against a hand computation of spec §2.11, a
scripted reward's ranking moving the student towards the preferred sample, the outer step's plan, and the method end
to end on the toy world (rewards logged, resume and replay bitwise, a NaN reward applying nothing, 2 processes = 1,
bad input in one line)."""
import pathlib

import types

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from fvx import run
from fvx.core import flow, random
from fvx.core.state import RoleState, TrainState
from fvx.training import replay, tracking, validation
from fvx_methods import diffusion_nft as nft
from fvx_methods.library import rl

from gloo import launch1, launch2  # noqa: E402
from run_state import final_state  # noqa: E402

EXPERIMENT = str(pathlib.Path(__file__).resolve().parents[2] / "experiments" / "diffusion_nft.py")

MODES = ("all", "positive_only", "negative_only", "one_only", "binary")


@pytest.mark.parametrize("mode, expected", [
    ("all", [-2.0, -0.5, 0.0, 0.5, 2.0]), ("positive_only", [0.0, 0.0, 0.0, 0.5, 2.0]),
    ("negative_only", [-2.0, -0.5, 0.0, 0.0, 0.0]), ("one_only", [0.0, 0.0, 0.0, 1.0, 1.0]),
    ("binary", [-1.0, -1.0, 0.0, 1.0, 1.0])])
def test_advantage_modes(mode, expected):
    advantages = torch.tensor([-7.0, -0.5, 0.0, 0.5, 3.0])
    assert nft.clipped_advantages(advantages, 2.0, mode).tolist() == expected


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="adv_mode must be one of"):
        nft.clipped_advantages(torch.zeros(2), 1.0, "best")


def reference_loss(v_theta, v_old, v_ref, x_t, x0, t, advantages, beta, clip, mode, kl_beta):
    """The formula of spec §2.11 written out per sample, in float64 throughout."""
    policies, kls = [], []
    for b in range(len(x0)):
        a = max(-clip, min(clip, float(advantages[b])))
        a = {"all": a, "positive_only": max(a, 0.0), "negative_only": min(a, 0.0), "one_only": float(a > 0),
             "binary": (a > 0) - (a < 0)}[mode]
        r = min(max(a / clip / 2 + 0.5, 0.0), 1.0)
        terms = []
        for v in (beta * v_theta[b] + (1 - beta) * v_old[b], (1 + beta) * v_old[b] - beta * v_theta[b]):
            error = x_t[b] - float(t[b]) * v - x0[b]
            weight = max(float(error.abs().mean()), 1e-5)
            terms.append(float((error ** 2 / weight).mean()))
        policies.append(clip * (r * terms[0] / beta + (1 - r) * terms[1] / beta))
        kls.append(float(((v_theta[b] - v_ref[b]) ** 2).mean()))
    return sum(policies) / len(policies) + kl_beta * sum(kls) / len(kls)


@pytest.mark.parametrize("mode", MODES)
def test_the_nft_loss_by_hand(mode):
    keys = random.split(random.key(3), 6)
    shape = (4, 3, 2, 2, 2)
    v_theta, v_old, v_ref, x0, eps = (random.normal(k, shape, dtype=torch.float64) for k in keys[:5])
    t = torch.tensor([0.1, 0.4, 0.7, 0.95], dtype=torch.float64)
    x_t = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * eps
    advantages = torch.tensor([-6.0, -0.3, 0.8, 9.0], dtype=torch.float64)
    total, aux = nft.nft_loss(v_theta, v_old, v_ref, x_t, x0, t, advantages, beta=0.1, adv_clip_max=5.0,
                              adv_mode=mode, kl_beta=1e-2)
    expected = reference_loss(v_theta, v_old, v_ref, x_t, x0, t, advantages, 0.1, 5.0, mode, 1e-2)
    assert float(total) == pytest.approx(expected, rel=1e-12)
    assert float(aux["kl_div_loss"]) == pytest.approx(float(((v_theta - v_ref) ** 2).mean()), rel=1e-12)
    assert float(aux["old_kl_div"]) == pytest.approx(float(((v_old - v_ref) ** 2).mean()), rel=1e-12)


def test_a_scripted_rewards_ranking_moves_the_student_towards_the_preferred_sample():
    """Two samples of one prompt, the first rewarded higher: one gradient step from the old policy moves the
    student's velocity towards the first sample's flow-matching target and away from the second's."""
    keys = random.split(random.key(5), 3)
    x0, eps, v_old = (random.normal(k, (2, 4, 2, 3, 3)) for k in keys)
    t = torch.tensor([0.5, 0.5])
    x_t = 0.5 * x0 + 0.5 * eps
    target = eps - x0  # the flow-matching velocity of each sample
    advantages = rl.group_advantages(torch.tensor([1.0, 0.2]), [0, 0])
    v_theta = v_old.clone().requires_grad_(True)
    total, _ = nft.nft_loss(v_theta, v_old, v_old, x_t, x0, t, advantages, beta=0.1, adv_clip_max=5.0,
                            adv_mode="all", kl_beta=0.0)
    (grad,) = torch.autograd.grad(total, v_theta)
    stepped = v_old - 0.01 * grad
    before = ((v_old - target) ** 2).flatten(1).sum(1)
    after = ((stepped - target) ** 2).flatten(1).sum(1)
    assert after[0] < before[0] and after[1] > before[1], (before, after)


def test_the_plan_of_fastvideos_recipe_and_of_the_toy():
    """FastVideo's recipe (4 ranks x 6 prompts, 48 batches, 25 steps, accumulation 48): T_tr = 24 columns, 48
    micro-batches, E_acc = 1152, one update per step; the toy: 3 columns, 2 micro-batches, one update."""
    from fvx.config import load_experiment

    recipe = load_experiment(f"{EXPERIMENT}:wan21_t2v_1p3b_pick_clip")
    got = nft.plan(recipe.method, recipe.data.batch_size)
    assert (len(got.sigmas), len(got.train_sigmas), got.micro_batches, got.accumulation, got.updates_per_step) == \
        (25, 24, 48, 1152, 1)
    toy = load_experiment(EXPERIMENT)
    got = nft.plan(toy.method, toy.data.batch_size)
    assert (len(got.train_sigmas), got.micro_batches, got.accumulation, got.updates_per_step) == (3, 2, 6, 1)
    assert torch.equal(got.train_sigmas, got.sigmas[:3]) and got.sigmas[0] == 1.0
    assert toy.method.sampling.spacing == "even" and torch.equal(got.sigmas, validation.many_step_sigmas(4, 3.0))
    many = nft.plan(nft.DiffusionNFT(reward_fn={"world": 1.0}, num_batches_per_epoch=2, train_batch_size=2,
                                     num_inner_epochs=2, grad_accum=5, sampling=nft.Sampling(num_steps=4)), 8)
    assert (many.micro_batches, many.accumulation, many.updates_per_step) == (8, 15, 4)  # ceil(2 x 8 x 3 / 15)


def set_timesteps(shift, steps):
    """diffusers' scheduler after ``set_timesteps(steps)``: what FastVideo's RL sampler steps along."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(steps)
    return scheduler


def test_fastvideos_recipe_samples_trains_and_validates_on_the_schedulers_levels():
    """FastVideo's sampler steps along FlowMatchEulerDiscreteScheduler(shift=8).set_timesteps(25); its student
    trains on the first int(25 x 0.99) = 24 timesteps (the model sees the timestep, the noising uses t = timestep /
    1000: both bitwise), every sample on each once per inner epoch; validation steps along set_timesteps(40)."""
    from fvx.config import load_experiment

    recipe = load_experiment(f"{EXPERIMENT}:wan21_t2v_1p3b_pick_clip")
    got = nft.plan(recipe.method, recipe.data.batch_size)
    sampler = set_timesteps(8.0, 25)
    assert torch.equal(got.sigmas, sampler.sigmas[:-1]) and round(got.sigmas[-1].item(), 3) == 0.060
    assert torch.equal(got.train_sigmas * 1000, sampler.timesteps[:24])  # micro_loss's model timestep t * 1000
    assert torch.equal(got.train_sigmas, sampler.timesteps[:24] / 1000)  # FastVideo's noising t
    seen: dict[int, list[float]] = {i: [] for i in range(4)}
    inner = nft.Plan(got.sigmas, got.train_sigmas, micro_batches=2, accumulation=24, updates_per_step=1)
    for rows, t, _ in nft.micro_steps(torch.zeros(4, 1, 1, 1, 1), torch.arange(4), random.key(0), inner, 0):
        for row, level in zip(rows.tolist(), t.tolist()):
            seen[row].append(level)
    assert all(sorted(levels, reverse=True) == got.train_sigmas.tolist() for levels in seen.values())
    state = TrainState(step=torch.zeros((), dtype=torch.int64), key=random.key(0),
                       roles={nft.STUDENT: RoleState(params={}, opt_state=None)})
    roles = types.SimpleNamespace(student=types.SimpleNamespace(apply=None), rewards={}, weights={})
    (validated,) = nft.validate(state, {}, recipe.validation, roles=roles, config=recipe.method)
    assert torch.equal(validated.sigmas, set_timesteps(8.0, 40).sigmas[:-1])


def test_the_spacing_knob():
    """``set_timesteps`` (the default, FastVideo's) against ``even`` (shift(1 - k / K)), and explicit sigmas as
    given."""
    assert torch.equal(nft.Sampling().schedule(8.0), flow.scheduler_sigmas(8.0, 25))
    assert torch.equal(nft.Sampling(spacing="even").schedule(8.0), validation.many_step_sigmas(25, 8.0))
    assert torch.equal(nft.Sampling(spacing="even", flow_shift=3.0).levels(4, 3.0), torch.tensor([1.0, 0.9, 0.75, 0.5]))
    assert nft.Sampling(sigmas=(1.0, 0.5)).schedule(8.0).tolist() == [1.0, 0.5]


def test_one_copy_of_each_prompt_with_one_batch_per_step_is_refused(tmp_path, capsys):
    """With one sampling batch per step and one copy per prompt, every group is one sample: every advantage is 0
    in every adv_mode (so r = 1/2 and the policy loss only pulls towards the old policy). With several batches a
    group holds the copies of its prompt the step's batches draw: on the toy's 8 prompts, 4 batches of 8 draw every
    prompt 4 times, which trains, and is kept."""
    out = tmp_path / "run"
    assert run.main([EXPERIMENT, "--out", str(out), "method.num_video_per_prompt=1",
                     "method.num_batches_per_epoch=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "method.num_video_per_prompt=1 with method.num_batches_per_epoch=1" in err[0], err
    assert not out.exists()
    for mode in MODES:
        assert not nft.clipped_advantages(rl.group_advantages(torch.tensor([0.3, 0.9]), [0, 1]), 5.0, mode).any()
    nft.DiffusionNFT(reward_fn={"world": 1.0}, num_video_per_prompt=1, num_batches_per_epoch=4)
    step = rl.k_repeat_batch_at(Rows(8), random.key(0), 0, batch_size=8, rank=0, world=1, repeats=1, batches=4)
    assert sorted(step["index"].tolist()) == sorted(list(range(8)) * 4)


class Rows:
    """A dataset of ``n`` rows that reads back which rows it was asked for."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def read(self, indices):
        return {"index": torch.tensor(list(indices))}


def test_k_repeat_batches_are_groups_disjoint_over_ranks_and_the_same_for_any_world():
    key = random.key(7)
    one = rl.k_repeat_batch_at(Rows(10), key, 3, batch_size=8, rank=0, world=1, repeats=4, batches=2)
    halves = [rl.k_repeat_batch_at(Rows(10), key, 3, batch_size=8, rank=r, world=2, repeats=4, batches=2)
              for r in range(2)]
    for b in range(2):  # each sampling batch: 2 rows, 4 copies each, over all ranks
        rows = one["index"][b * 8:(b + 1) * 8].tolist()
        assert sorted(rows.count(r) for r in set(rows)) == [4, 4]
        assert sorted(rows) == sorted(halves[0]["index"][b * 4:(b + 1) * 4].tolist()
                                      + halves[1]["index"][b * 4:(b + 1) * 4].tolist())
    assert one["sample_index"].tolist() == list(range(48, 64))  # step 3 of 2 batches of 8
    assert torch.cat([h["sample_index"] for h in halves]).sort().values.tolist() == list(range(48, 64))
    again = rl.k_repeat_batch_at(Rows(10), key, 3, batch_size=8, rank=0, world=1, repeats=4, batches=2)
    assert torch.equal(again["index"], one["index"])
    other = rl.k_repeat_batch_at(Rows(10), key, 4, batch_size=8, rank=0, world=1, repeats=4, batches=2)
    assert not torch.equal(other["index"], one["index"])


def test_rollouts_are_the_samplers_with_noise_per_sample():
    apply = lambda params, x, t, cond: x * params  # noqa: E731  a linear field
    index = torch.tensor([5, 9])
    sigmas = torch.tensor([1.0, 0.5])
    both = rl.rollout(apply, 0.5, None, (3,), index, random.key(1), sigmas)
    alone = rl.rollout(apply, 0.5, None, (3,), index[1:], random.key(1), sigmas)
    assert torch.equal(both[1:], alone)  # a sample's draws are its own
    noise = random.normal_each(random.fold_in(random.split(random.key(1))[0], index), (3,))
    x = noise + (0.5 - 1.0) * 0.5 * noise  # Euler at 1.0 -> 0.5
    torch.testing.assert_close(both, x + (0.0 - 0.5) * 0.5 * x)
    sde = rl.rollout(apply, 0.5, None, (3,), index, random.key(1), sigmas, "sde_reflow")
    assert not torch.equal(sde, both)


# ------------------------------------------------------------------------------------------------------ end to end


def quick(world_teacher, *more):
    return ["run.progress=false", "validation.every=0", "run.checkpoint.every=2", "run.checkpoint.async_save=false",
            f"models.student.path={world_teacher}", "method.num_batches_per_epoch=1", *more]


def test_a_run_logs_rewards_and_resumes_and_replays_bitwise(tmp_path, world_teacher, capsys):
    """3 steps whole, and 2 resumed to 3: the same logged metrics and final state (the old policy included); a replay
    of step 2 from checkpoint 2 matches the log bitwise; the rewards and the NFT figures are logged."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert run.main([EXPERIMENT, "--out", str(whole), "--steps", "3", *quick(world_teacher)]) == 0
    assert run.main([EXPERIMENT, "--out", str(resumed), "--steps", "2", *quick(world_teacher)]) == 0
    assert run.main([EXPERIMENT, "--out", str(resumed), "--steps", "3", "--resume", *quick(world_teacher)]) == 0
    expected, logged = tracking.read_scalars(whole / "tb"), tracking.read_scalars(resumed / "tb")
    for name in ("reward/avg", "reward/world", "total_loss", "policy_loss", "kl_div_loss", "grad_norm/student",
                 "zero_std_ratio", "mean_reward_50", "nft/optimizer_steps", "nft/old_decay"):
        assert logged[name] == expected[name], name
    assert [v for _, v in expected["nft/optimizer_steps"]] == [1, 1, 1]
    assert [v for _, v in expected["nft/old_decay"]] == pytest.approx([0.001, 0.002, 0.003])
    assert [v for _, v in expected["nft/num_sampled"]] == [8, 8, 8] and expected["group_size"][0][1] == 4
    state, expected_state = final_state(resumed), final_state(whole)
    assert state.keys() == expected_state.keys() and any(name.startswith("roles.old.params.") for name in state)
    assert all(torch.equal(tensor, expected_state[name]) for name, tensor in state.items())
    replayed = replay.replay(whole, 2)
    rows = replay.compare(replayed.metrics, replay.logged_metrics(whole, 2))
    assert replayed.from_checkpoint == 2 and all(row.same for row in rows if row.logged is not None), rows


def test_a_nan_reward_applies_nothing(world_teacher):
    """A reward that returns NaN for one sample: the step is skipped (the state unchanged but for the step count)
    and its metrics name the reward."""
    from fvx.config import apply_overrides, load_experiment
    from fvx.core import state as fstate
    from fvx.data.toy_world import Codec
    from fvx.training import experiment

    class Poisoned:
        frames = "whole"

        def __call__(self, videos, prompts):
            return torch.tensor([float("nan")] + [0.0] * (len(prompts) - 1))

    config = apply_overrides(load_experiment(EXPERIMENT), [f"models.student.path={world_teacher}",
                                                           "method.num_batches_per_epoch=1"])
    built = experiment.setup(config)
    batch = experiment.batch_fn(config, built)(0)
    start, frozen = experiment.initial_state(built, batch), experiment.frozen_params(built)
    roles = nft.Roles(built.models["student"], built.models["reference"], config.method.optim.role(3),
                      {"world": Poisoned()}, {"world": 1.0}, Codec(8).decode)
    plan_ = nft.plan(config.method, config.data.batch_size)
    after, metrics = nft.step_(fstate.copy(start), frozen, batch, roles=roles, config=config.method, plan_=plan_)
    assert metrics[fstate.NONFINITE] == 1 and torch.isnan(metrics["reward/world"])
    assert int(after.step) == 1
    for name in ("student", "old"):
        assert all(torch.equal(after.roles[name].params[k], v) for k, v in start.roles[name].params.items())


@pytest.mark.slow  # 2 + 1 processes
def test_two_processes_train_as_one(tmp_path, world_teacher):
    """2 steps on 2 gloo processes (each samples half of every group, the rewards gathered for the advantages) log
    what 1 process logs."""
    knobs = (f"models.student.path={world_teacher}", "method.num_batches_per_epoch=1", "data.batch_size=8",
             "method.train_batch_size=8")
    launch2(tmp_path / "two", *knobs, experiment=EXPERIMENT)
    launch1(tmp_path / "one", *knobs, experiment=EXPERIMENT)
    two, one = (tracking.read_scalars(tmp_path / name / "tb") for name in ("two", "one"))
    for name in ("reward/avg", "total_loss", "policy_loss", "grad_norm/student", "reward_std_mean"):
        assert len(two[name]) == 3, name
        for (_, got), (_, want) in zip(two[name], one[name]):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-7), (name, two[name], one[name])


def test_bad_input_from_the_cli_is_one_line_and_writes_nothing(tmp_path, capsys, world_teacher):
    clip = 'method.reward_fn={"clipscore": 1.0}'
    for overrides, message in [
            (["data.batch_size=6"], "data.batch_size 6 (a sampling batch, all ranks) is not a multiple of "
                                    "method.num_video_per_prompt 4"),
            (['method.reward_fn={"aesthetic": 1.0}'], "unknown reward 'aesthetic'; known: clipscore, pickscore, world"),
            (["method.reward_fn.world=nan"], "method.reward_fn.world takes a finite number"),
            ([clip], "clipscore needs the local folder of its CLIP model"),
            (['method.reward_models={"clipscore": {"path": "/nonexistent"}}'], "is not a reward of method.reward_fn"),
            ([clip, 'method.reward_models={"clipscore": {"path": "/nonexistent"}}'],
             "method.reward_models.clipscore: '/nonexistent' is not a folder"),
            (["run.on_nonfinite=skip", "method.grad_accum=1"],
             "run.on_nonfinite=skip cannot skip a step of DiffusionNFT: it applies 2"),
    ]:
        out = tmp_path / "run"
        assert run.main([EXPERIMENT, "--out", str(out), f"models.student.path={world_teacher}", *overrides]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (overrides, err)
        assert not out.exists()


def test_the_dry_run_shows_each_roles_holding(capsys):
    """FastVideo's recipe on 4 ranks: the student with AdamW and EMA, the old policy's params alone, the reference
    frozen in bf16."""
    assert run.main([f"{EXPERIMENT}:wan21_t2v_1p3b_pick_clip", "--dry-run", "--world", "4"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines() if line.strip()}
    student, old, reference = (list(map(float, rows[name])) for name in ("student", "old", "reference"))
    assert old[0] == student[0] and old[1:4] == [0.0, 0.0, 0.0] and student[2] == 2 * student[0]
    assert reference[0] == pytest.approx(student[0] / 2, rel=1e-3) and reference[1:4] == [0.0, 0.0, 0.0]


def test_a_lora_student_holds_three_roles_on_one_base(world_teacher):
    """LoRA: the student and the old policy hold adapters only, the reference is the shared base with zero adapters,
    and a step moves the student's adapters and the old policy to ``d old + (1 - d) student``."""
    from fvx.config import apply_overrides, load_experiment
    from fvx.training import experiment

    config = apply_overrides(load_experiment(f"{EXPERIMENT}:world_lora"), [
        f"models.student.path={world_teacher}", "method.num_batches_per_epoch=1"])
    built = experiment.setup(config)
    batch = experiment.batch_fn(config, built)(0)
    state, frozen = experiment.initial_state(built, batch), experiment.frozen_params(built)
    adapters = set(state.roles["student"].params)
    assert adapters and all("lora_" in name for name in adapters) and set(state.roles["old"].params) == adapters
    assert state.roles["old"].opt_state is None
    assert frozen["student"] is not frozen["reference"] and all(
        frozen["reference"][name] is tensor for name, tensor in frozen["student"].items())  # one base in memory
    assert all(not frozen["reference"][name].any() for name in adapters)
    start = {name: tensor.clone() for name, tensor in state.roles["student"].params.items()}
    state, metrics = built.program.step_(state, frozen, batch)
    assert metrics["nft/optimizer_steps"] == 1
    moved = [name for name in adapters if not torch.equal(state.roles["student"].params[name], start[name])]
    assert moved and all(torch.allclose(state.roles["old"].params[name], 0.001 * start[name]  # d = 0.001 at it 1
                                        + 0.999 * state.roles["student"].params[name]) for name in adapters)
