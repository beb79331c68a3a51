"""fvx.core.role: the shared role update equals the hand-written sequence it replaced, bitwise; the logged lr is the
applied one after a skipped step; gradient accumulation equals the whole batch."""
import pytest
import torch

from fvx.core import grad, optim, random, role, tree
from fvx.core.optim_config import AdamWConfig
from fvx_methods import finetune
from fvx_models.wan import WanConfig


@pytest.fixture(scope="module")
def model():
    return WanConfig(preset="tiny").build()


def make_batch(seed: int = 0, size: int = 2):
    g = torch.Generator().manual_seed(seed)
    return {"latents": torch.randn(size, 16, 1, 4, 4, generator=g),
            "cond": {"text": torch.randn(size, 8, 32, generator=g), "text_mask": torch.ones(size, 8)},
            "sample_index": torch.arange(size) + 3 * seed}


def test_finetune_update_equals_the_hand_written_sequence_bitwise(model):
    """The step it replaced: grads -> global norm -> ``torch.nn.utils.clip_grad_norm_``'s scaling -> ``optim.step_``
    of AdamW -> EMA, by hand."""
    adamw = AdamWConfig(lr=1e-3, max_grad_norm=0.05, weight_decay=0.01, schedule="linear", warmup_steps=2)
    config = finetune.Finetune(optim=adamw, ema_decay=0.9)
    program = config.build({"student": model}, total_steps=6)
    state = program.init(random.key(0))
    params = tree.map_tensors(torch.clone, state.roles["student"].params)
    shadow = tree.map_tensors(torch.clone, params)
    tx = adamw.build(6)
    opt_state = tx.init(params)
    for step in range(3):
        batch = make_batch(step)
        state, metrics = program.step_(state, {}, batch)
        key = random.fold_in(state.key, step)
        value_and_grad = grad.value_and_grad(finetune.loss_fn, has_aux=True)
        (loss, _), grads = value_and_grad(params, batch, key, model=model, config=config)
        norm = tree.global_norm(grads)
        torch._foreach_mul_(tree.tensor_leaves(grads), torch.clamp(0.05 / (tree.global_norm(grads) + 1e-6), max=1.0))
        params, opt_state = optim.step_(tx, params, grads, opt_state)
        shadow = tree.map_tensors(torch.clone, params) if step == 0 else {n: torch.lerp(params[n], shadow[n], 0.9) for n in params}
        assert torch.equal(metrics["loss"], loss) and torch.equal(metrics["grad_norm"], norm)
        assert float(metrics["lr"]) == pytest.approx(float(adamw.schedule_fn(6)(step)), rel=1e-7)
        student = state.roles["student"]
        assert all(torch.equal(student.params[n], params[n]) for n in params), step
        assert all(torch.equal(student.opt_state[0].mu[n], opt_state[0].mu[n]) for n in params)
        torch.testing.assert_close(student.ema, shadow, rtol=0, atol=1e-7)


def test_the_logged_lr_is_the_applied_lr_after_a_skipped_step(model):
    """Warmup 0, 1e-4, 2e-4, ...: a good step, a non-finite one (nothing applied), then the third step applies and logs
    the schedule at count 1 (1e-4), not at step 2 (2e-4)."""
    adamw = AdamWConfig(lr=1e-3, schedule="linear", warmup_steps=10, max_grad_norm=0.0)
    program = finetune.Finetune(optim=adamw).build({"student": model}, total_steps=20)
    state, _ = program.step_(program.init(random.key(0)), {}, make_batch(0))
    bad = make_batch(1)
    bad["latents"][0, 0, 0, 0, 0] = float("nan")
    state, metrics = program.step_(state, {}, bad)
    assert metrics["nonfinite"] == 1 and int(optim.get_count(state.roles["student"].opt_state)) == 1
    before = tree.map_tensors(torch.clone, state.roles["student"].params)
    state, metrics = program.step_(state, {}, make_batch(2))
    logged = float(metrics["lr"])
    assert logged == pytest.approx(1e-4) and float(adamw.schedule_fn(20)(2)) == pytest.approx(2e-4)
    # the update applied: AdamW's second step by hand (its first, at lr 0, only filled the moments)
    adam = state.roles["student"].opt_state[0]
    for n in before:
        expected = before[n] - 1e-4 * (adam.mu[n] / (1 - 0.9 ** 2)) / ((adam.nu[n] / (1 - 0.999 ** 2)).sqrt() + 1e-8)
        torch.testing.assert_close(state.roles["student"].params[n], expected, rtol=1e-5, atol=1e-9)


def test_accumulate_is_the_mean_over_micro_batches():
    weights = {"w": torch.randn(3, generator=torch.Generator().manual_seed(0))}
    batch = {"x": torch.randn(4, 3, generator=torch.Generator().manual_seed(1)), "sample_index": torch.arange(4),
             "cond": {"c": torch.arange(4.0)}}

    def loss_fn(params, micro):
        per_sample = (micro["x"] @ params["w"] - micro["cond"]["c"]) ** 2
        return per_sample.mean(), {"first": micro["x"][:, 0].mean()}

    value_and_grad = grad.value_and_grad(loss_fn, has_aux=True)
    (whole, aux), g = role.accumulate(value_and_grad, weights, batch, 1)
    (halves, aux2), g2 = role.accumulate(value_and_grad, weights, batch, 2)
    torch.testing.assert_close(halves, whole)
    torch.testing.assert_close(g2["w"], g["w"])
    torch.testing.assert_close(aux2["first"], aux["first"])
    assert [len(m["sample_index"]) for m in role.micro_batches(batch, 4)] == [1] * 4
    with pytest.raises(ValueError, match="grad_accum = 3 does not divide this rank's batch of 4"):
        role.micro_batches(batch, 3)


def test_clip_uses_the_measured_norm_and_an_unclipped_role_keeps_its_gradients():
    params = {"w": torch.zeros(4)}
    grads = {"w": torch.tensor([3.0, 4.0, 0.0, 0.0])}
    seen = []
    clipped = role.RoleOptimizer(optim.adamw(0.1), max_grad_norm=1.0)
    state = role.init(clipped, params)
    measured = role.measure(clipped, state, tree.map_tensors(torch.clone, grads))
    assert float(measured.norm) == 5.0 and role.metrics(measured, "x") == {"grad_norm/x": measured.norm,
                                                                            "lr/x": measured.lr}
    role.update_(clipped, state, measured, 0, before=lambda name, g, p: seen.append((name, g["w"].clone())),
                 name="x")
    torch.testing.assert_close(seen[0][1], grads["w"] / (5.0 + 1e-6))
    free = role.RoleOptimizer(optim.adamw(0.1))
    state = role.init(free, params)
    role.update_(free, state, role.measure(free, state, tree.map_tensors(torch.clone, grads)), 0,
                 before=lambda name, g, p: seen.append((name, g["w"].clone())))
    assert torch.equal(seen[1][1], grads["w"])


@pytest.mark.parametrize("start", ["reset", "blend"])
def test_the_ema_start_rule_counts_updates_from_one_as_fastvideos_iteration(start):
    """Update ``n = step + 1`` (FastVideo's 1-based iteration) with ``ema_start_step`` 3: ``reset`` copies the params
    after update 3 and blends after 4, 5 (its EMACallback); ``blend`` keeps the initial copy through updates 1, 2 and
    blends after every update ``n >= 3`` (causal CD's ``it >= ema_start_step``)."""
    opt = AdamWConfig(lr=0.1, max_grad_norm=0.0).role(10, ema_decay=0.5, ema_start_step=3, ema_start=start)
    state = role.init(opt, {"w": torch.zeros(3)})
    expected = torch.zeros(3)
    for step in range(5):
        grads = {"w": torch.tensor([1.0, -2.0, 0.5]) * (step + 1)}
        state = role.update_(opt, state, role.measure(opt, state, grads), step)
        update = step + 1
        if update == 3 and start == "reset":
            expected = state.params["w"].clone()
        elif update >= 3:
            expected = 0.5 * expected + 0.5 * state.params["w"]
        torch.testing.assert_close(state.ema["w"], expected, rtol=0, atol=1e-7)
        if update < 3:
            assert torch.equal(state.ema["w"], torch.zeros(3)), step


def test_init_starts_the_ema_from_given_params_or_a_copy():
    opt = role.RoleOptimizer(optim.adamw(0.1), ema_decay=0.9)
    params, other = {"w": torch.ones(2)}, {"w": torch.full((2,), 3.0)}
    assert role.init(opt, params, other).ema is other
    copied = role.init(opt, params).ema
    assert torch.equal(copied["w"], params["w"]) and copied["w"] is not params["w"]
    assert role.init(role.RoleOptimizer(optim.adamw(0.1)), params, other).ema is None
