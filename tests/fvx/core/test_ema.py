"""fvx.core.ema: the blend formula, the start rule, donation vs purity, and clear errors."""
import pytest
import torch

from fvx.core import ema, random


def make_params(seed: int) -> dict:
    k = random.key(seed)
    a, b = random.split(k)
    return {"w": random.normal(a, (3, 4)), "b": random.normal(b, (4,)), "nested": {"s": torch.tensor(2.0)}}


def test_init_is_a_copy():
    params = make_params(0)
    shadow = ema.ema_init(params)
    assert all(torch.equal(shadow[k], params[k]) for k in ("w", "b"))
    assert shadow["w"].data_ptr() != params["w"].data_ptr()


@pytest.mark.parametrize("decay", [0.0, 0.9, 0.999, 1.0])
def test_update_follows_the_formula(decay):
    shadow, params = make_params(0), make_params(1)
    expected = {k: decay * shadow[k] + (1 - decay) * params[k] for k in ("w", "b")}
    new = ema.ema_update(shadow, params, decay)
    for k in ("w", "b"):
        torch.testing.assert_close(new[k], expected[k], rtol=0, atol=1e-6)
        assert torch.equal(new[k], torch.lerp(shadow[k], params[k], 1 - decay))  # one lerp, bit for bit
    torch.testing.assert_close(new["nested"]["s"], torch.tensor(2.0))


def test_update_is_pure_and_update__donates():
    shadow, params = make_params(0), make_params(1)
    before = ema.ema_init(shadow)
    pure = ema.ema_update(shadow, params, 0.5)
    assert torch.equal(shadow["w"], before["w"])  # the pure path leaves its input alone
    donated = ema.ema_update_(shadow, params, 0.5)
    assert donated["w"] is shadow["w"] and torch.equal(shadow["w"], pure["w"])
    assert torch.equal(params["w"], make_params(1)["w"])  # params are only read


def test_step_leaves_then_copies_then_blends():
    initial, start, decay = make_params(0), 3, 0.8
    shadow = ema.ema_init(initial)
    expected = ema.ema_init(initial)
    for step in range(6):
        params = make_params(10 + step)
        shadow = ema.ema_step_(shadow, params, step, decay=decay, start_step=start)
        if step < start:
            pass  # untouched
        elif step == start:
            expected = ema.ema_init(params)
        else:
            expected = {k: (decay * expected[k] + (1 - decay) * params[k]) if k != "nested" else expected[k]
                        for k in expected}
        for k in ("w", "b"):
            torch.testing.assert_close(shadow[k], expected[k], rtol=0, atol=1e-6)
        if step < start:
            assert torch.equal(shadow["w"], initial["w"])
        if step == start:
            assert torch.equal(shadow["w"], params["w"])


def test_errors_name_the_culprit():
    shadow = make_params(0)
    with pytest.raises(ValueError, match="decay"):
        ema.ema_update(shadow, make_params(1), 1.5)
    with pytest.raises(ValueError, match="decay"):
        ema.ema_update(shadow, make_params(1), float("nan"))
    with pytest.raises(ValueError, match="structure"):
        ema.ema_update_(shadow, {"w": shadow["w"]}, 0.5)
    bad = {**make_params(1), "w": torch.zeros(4, 3)}
    with pytest.raises(ValueError, match="shape"):
        ema.ema_update_(shadow, bad, 0.5)


def test_blend_start_keeps_the_initial_copy_then_blends_from_the_start_step():
    """``start="blend"``: untouched while ``step < start``, then ``d ema + (1 - d) params`` at every step from the
    start step on, that step included, starting from the initial copy (causal CD's EMA target)."""
    initial, start, decay = make_params(0), 2, 0.75
    shadow = ema.ema_init(initial)
    expected = {k: initial[k].clone() for k in ("w", "b")}
    for step in range(5):
        params = make_params(10 + step)
        shadow = ema.ema_step_(shadow, params, step, decay=decay, start_step=start, start="blend")
        if step >= start:
            expected = {k: decay * expected[k] + (1 - decay) * params[k] for k in expected}
        for k in ("w", "b"):
            torch.testing.assert_close(shadow[k], expected[k], rtol=0, atol=1e-6)
        if step < start:
            assert torch.equal(shadow["w"], initial["w"])
    first = ema.ema_step_(ema.ema_init(initial), make_params(12), start, decay=decay, start_step=start, start="blend")
    assert torch.equal(first["w"], torch.lerp(initial["w"], make_params(12)["w"], 1 - decay))  # no reset at the start


@pytest.mark.parametrize("start", ["reset", "blend"])
def test_the_ema_is_a_function_of_the_step_so_a_resumed_run_matches(start):
    """Steps 0..5 in one go equal steps 0..2, the shadow saved and read back, then 3..5: nothing but the step decides
    what a step does (no "started" flag to save)."""
    runs = [make_params(10 + step) for step in range(6)]

    def steps(shadow, first, last):
        for step in range(first, last):
            shadow = ema.ema_step_(shadow, runs[step], step, decay=0.6, start_step=2, start=start)
        return shadow

    whole = steps(ema.ema_init(make_params(0)), 0, 6)
    saved = {k: v.clone() for k, v in steps(ema.ema_init(make_params(0)), 0, 3).items() if k != "nested"}
    resumed = steps({**saved, "nested": {"s": torch.tensor(2.0)}}, 3, 6)
    assert all(torch.equal(resumed[k], whole[k]) for k in ("w", "b"))


def test_an_unknown_start_is_named():
    with pytest.raises(ValueError, match="EMA start must be one of 'reset', 'blend', got 'late'"):
        ema.ema_step_(make_params(0), make_params(1), 3, decay=0.5, start="late")
