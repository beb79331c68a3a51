"""fvx_methods.finetune: the loss against a hand computation of spec §2.1, determinism, accumulation, overfitting."""
import math

import numpy as np
import pytest
import torch

from fvx.core import flow, random, role, state as fstate
from fvx.core.optim_config import AdamWConfig
from fvx.training.validation import ValidationConfig
from fvx_methods import finetune

SHIFT = 3.0


def make_batch(seed: int = 0, size: int = 2):
    g = torch.Generator().manual_seed(seed)
    return {"latents": torch.randn(size, 16, 1, 4, 4, generator=g), "sample_index": torch.arange(5, 5 + 4 * size, 4),
            "cond": {"text": torch.randn(size, 8, 32, generator=g), "text_mask": torch.ones(size, 8)}}


def hand_u(t_key, density, config):
    """The density draw of spec §3.1, from the per-sample timestep key."""
    if density == "logit_normal":
        z = random.normal(t_key, ()).item()
        return 1 / (1 + math.exp(-(z * config.logit_std + config.logit_mean)))
    u = random.uniform(t_key, ()).item()
    if density == "mode":
        return 1 - u - config.mode_scale * (math.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def hand_loss(model, params, batch, key, config):
    x0 = batch["latents"]
    losses = []
    for b in range(x0.shape[0]):
        noise_key, t_key = random.split(random.fold_in(key, int(batch["sample_index"][b])))
        noise = random.normal(noise_key, x0.shape[1:])
        i = min(math.floor(hand_u(t_key, config.weighting_scheme, config) * 1000), 999)
        u_grid = (1000 - i) / 1000
        sigma = SHIFT * u_grid / (1 + (SHIFT - 1) * u_grid)
        x_t = (1 - sigma) * x0[b] + sigma * noise
        cond = {name: t[b:b + 1] for name, t in batch["cond"].items()}
        v = model.apply(params, x_t[None], torch.tensor([1000 * sigma], dtype=torch.float32), cond)[0]
        residual = (x_t - sigma * v - x0[b]) if config.precondition_outputs else (v - (noise - x0[b]))
        weight = 1.0
        if config.loss_weighting == "bell":  # DiffSynth-Studio's weight of level i (the test below checks the table)
            weight = float(finetune.bell_weight(torch.tensor([sigma], dtype=torch.float32),
                                                flow.training_sigmas(SHIFT))[0])
        losses.append(weight * residual.pow(2).mean())
    return torch.stack(losses).mean()


@pytest.mark.parametrize("precondition", [False, True], ids=["velocity", "precondition"])
@pytest.mark.parametrize("density", ["uniform", "logit_normal", "mode"])
def test_loss_equals_hand_computation(model, params, density, precondition):
    config = finetune.Finetune(weighting_scheme=density, precondition_outputs=precondition, logit_mean=0.3,
                               logit_std=0.8, flow_shift=SHIFT)
    batch, key = make_batch(), random.key(11)
    loss, aux = finetune.loss_fn(params, batch, key, model=model, config=config)
    expected = hand_loss(model, params, batch, key, config)
    torch.testing.assert_close(loss, expected, rtol=2e-6, atol=0)
    assert aux["sigma"].shape == ()


def test_the_bell_weighted_loss_equals_hand_computation(model, params):
    config = finetune.Finetune(flow_shift=SHIFT, loss_weighting="bell")
    batch, key = make_batch(), random.key(12)
    loss, _ = finetune.loss_fn(params, batch, key, model=model, config=config)
    torch.testing.assert_close(loss, hand_loss(model, params, batch, key, config), rtol=2e-6, atol=0)


def test_loss_is_a_function_of_the_key(model, params):
    config = finetune.Finetune()
    batch = make_batch()
    a = finetune.loss_fn(params, batch, random.key(1), model=model, config=config)[0]
    b = finetune.loss_fn(params, batch, random.key(1), model=model, config=config)[0]
    c = finetune.loss_fn(params, batch, random.key(2), model=model, config=config)[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_per_sample_draws_do_not_depend_on_batch_composition(model, params):
    """Sample 9's loss term is the same alone or next to sample 5: keys come from the global sample index."""
    config = finetune.Finetune()
    batch, key = make_batch(), random.key(3)
    both = finetune.loss_fn(params, batch, key, model=model, config=config)[0]
    halves = [finetune.loss_fn(params, mb, key, model=model, config=config)[0]
              for mb in role.micro_batches(batch, 2)]
    torch.testing.assert_close(both, torch.stack(halves).mean(), rtol=1e-6, atol=0)


def test_grad_accumulation_matches_one_big_batch(model):
    batch = make_batch(size=4)
    results = []
    for accum in (1, 2):
        program = finetune.Finetune(grad_accum=accum, optim=AdamWConfig(lr=1e-3)).build({"student": model}, total_steps=10)
        state, metrics = program.step_(program.init(random.key(0)), {}, batch)
        results.append((state.roles["student"].params, metrics))
    (p1, m1), (p2, m2) = results
    torch.testing.assert_close(m1["loss"], m2["loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(m1["grad_norm"], m2["grad_norm"], rtol=1e-5, atol=0)
    for name in p1:
        torch.testing.assert_close(p1[name], p2[name], rtol=0, atol=1e-5)  # 1% of one Adam step (lr)


def test_step_metrics_and_purity(model):
    program = finetune.Finetune(optim=AdamWConfig(lr=2e-3, schedule="linear", warmup_steps=2)).build(
        {"student": model}, total_steps=4)
    state = program.init(random.key(0))
    before = fstate.copy(state)
    new, metrics = fstate.step(program, state, {}, make_batch())
    assert all(torch.equal(a, b) for a, b in zip(fstate.tree.tensor_leaves(state), fstate.tree.tensor_leaves(before)))
    assert int(new.step) == 1 and metrics["lr"].item() == 0.0  # warmup: lr(0) = 0
    _, metrics = fstate.step(program, new, {}, make_batch())
    assert metrics["lr"].item() == pytest.approx(1e-3)
    assert set(metrics) == {"loss", "grad_norm", "lr"} and metrics["grad_norm"] > 0


def test_overfitting_one_batch_halves_the_loss(model):
    config = finetune.Finetune(optim=AdamWConfig(lr=3e-3, weight_decay=0.0), weighting_scheme="logit_normal")
    program = config.build({"student": model}, total_steps=150)
    batch, eval_key = make_batch(size=2), random.key(123)
    state = program.init(random.key(0))

    def eval_loss(s):
        return finetune.loss_fn(s.roles["student"].params, batch, eval_key, model=model, config=config)[0].item()

    start = eval_loss(state)
    for _ in range(150):
        state, _ = program.step_(state, {}, batch)
    assert eval_loss(state) <= 0.5 * start


def test_bad_batches_and_config_are_named(model):
    check = finetune.Finetune().build({"student": model}, total_steps=1).check
    wrong = make_batch()
    wrong["latents"] = torch.zeros(2, 4, 1, 4, 4)
    with pytest.raises(ValueError, match=r"\(2, 4, 1, 4, 4\).*C = 16"):
        check(wrong)
    del wrong["latents"]
    with pytest.raises(ValueError, match="fine-tuning needs latents"):
        check(wrong)
    with pytest.raises(ValueError, match="optim.lr > 0"):
        finetune.Finetune(optim=AdamWConfig(lr=0.0))


def test_ema_follows_its_formula_from_its_start_step(model):
    decay, start = 0.9, 2
    program = finetune.Finetune(optim=AdamWConfig(lr=1e-3), ema_decay=decay, ema_start_step=start).build(
        {"student": model}, total_steps=10)
    state = program.init(random.key(0))
    initial = {k: v.clone() for k, v in state.roles["student"].params.items()}
    expected = None
    for step in range(4):
        state, _ = program.step_(state, {}, make_batch())
        params = state.roles["student"].params
        updates = step + 1
        if updates < start:
            assert all(torch.equal(state.roles["student"].ema[k], initial[k]) for k in initial)
        elif updates == start:
            expected = {k: v.clone() for k, v in params.items()}
        else:
            expected = {k: decay * expected[k] + (1 - decay) * params[k] for k in expected}
        if expected is not None:
            for k in expected:
                torch.testing.assert_close(state.roles["student"].ema[k], expected[k], rtol=1e-6, atol=1e-7)
    samplers = program.validate(state, {}, ValidationConfig(num_steps=3))
    assert [s.tag for s in samplers] == ["model_ema"] and samplers[0].params is state.roles["student"].ema


def test_a_frozen_expert_is_a_frozen_argument_never_trained_or_saved():
    """Wan 2.2 A14B with only the low-noise expert trained: the high-noise one is the step's frozen argument (in
    the frozen dtype), bit-identical after training; the state, the optimizer and the EMA hold only the trained
    expert; validation samples with both."""
    from fvx_models.wan_moe import Wan22MoEConfig

    model = Wan22MoEConfig(trainable=("transformer_2",)).build()
    program = finetune.Finetune(optim=AdamWConfig(lr=1e-3), ema_decay=0.9).build({"student": model}, total_steps=3)
    state, frozen = program.init(random.key(0)), program.frozen(random.key(0))
    base = frozen["student"]
    kept = {k: v.clone() for k, v in base.items()}
    before = {k: v.clone() for k, v in state.roles["student"].params.items()}
    assert kept and all(n.startswith("transformer.") for n in kept)
    assert before and all(n.startswith("transformer_2.") for n in before)
    assert base["transformer.proj_out.weight"].dtype == torch.bfloat16  # frozen_dtype
    for seed in range(3):
        state, metrics = program.step_(state, frozen, make_batch(seed, size=4))
    role = state.roles["student"]
    assert all(torch.equal(base[n], kept[n]) for n in kept)
    assert any(not torch.equal(role.params[n], before[n]) for n in before)
    assert sorted(role.params) == sorted(role.opt_state[0].mu) == sorted(role.ema) == sorted(before)
    (sampler,) = program.validate(state, frozen, ValidationConfig(num_steps=2))
    assert sorted(sampler.params) == sorted([*kept, *before])
    assert sampler.params["transformer.proj_out.weight"] is base["transformer.proj_out.weight"]


def test_the_bell_loss_weight_is_diffsynth_studios_training_weight():
    """``loss_weighting=bell``: DiffSynth-Studio's ``set_training_weight`` on its Wan training grid (1000 levels,
    ``linspace(1, 0, 1001)[:-1]`` shifted by 5), computed here in numpy: the weight of each level, mean one."""
    grid = flow.training_sigmas(5.0)
    u = np.linspace(1, 0, 1001)[:-1]
    sigmas = 5 * u / (1 + 4 * u)
    y = np.exp(-2 * ((sigmas * 1000 - 500) / 1000) ** 2)
    want = (y - y.min()) * (1000 / (y - y.min()).sum())
    levels = torch.tensor([0, 1, 250, 500, 999])
    got = finetune.bell_weight(grid[levels], grid)
    np.testing.assert_allclose(got.numpy(), want[levels.numpy()], rtol=1e-5, atol=1e-6)
    assert abs(float(finetune.bell_weight(grid, grid).mean()) - 1.0) < 1e-5
