import math

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from fvx.core import schedules
from fvx.core.schedules import (
    constant,
    constant_factor,
    constant_with_warmup,
    cosine,
    cosine_with_min_lr,
    cosine_with_restarts,
    get_schedule,
    linear,
    polynomial,
)

LR = 2e-3
W, N = 10, 110  # warmup steps, total steps: p = (s - 10) / 100


def check(schedule, step: int, expected: float):
    """The int step gives the formula in float64; the int64 tensor step gives it as a float32 0-dim tensor."""
    got = schedule(step)
    assert isinstance(got, float)
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-18)
    got_t = schedule(torch.tensor(step))
    assert got_t.shape == () and got_t.dtype == torch.float32
    assert got_t.item() == pytest.approx(expected, rel=1e-7, abs=1e-15)  # float32 rounding of a float64 value


def test_constant():
    for s in (0, 10, 60, 109):
        check(constant(LR), s, LR)


def test_constant_with_warmup():
    sched = constant_with_warmup(LR, warmup_steps=W)
    check(sched, 0, 0.0)
    check(sched, 5, LR * 5 / 10)
    check(sched, 10, LR)
    check(sched, 109, LR)


def test_constant_factor_is_torchs_constant_lr():
    """A third of the rate for 5 steps by default, as torch's ``ConstantLR(optimizer)`` steps it."""
    check(constant_factor(LR, warmup_steps=W, factor=0.25), 9, LR * 0.25)
    check(constant_factor(LR, warmup_steps=W, factor=0.25), 10, LR)
    weight = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([weight], lr=LR)
    torch_lr = torch.optim.lr_scheduler.ConstantLR(opt)
    ours = constant_factor(LR, warmup_steps=5)
    for step in range(8):
        assert ours(step) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12), step
        opt.step()
        torch_lr.step()


def test_linear():
    sched = linear(LR, warmup_steps=W, total_steps=N)
    check(sched, 0, 0.0)
    check(sched, 9, LR * 9 / 10)
    check(sched, 10, LR)
    check(sched, 60, LR * 50 / 100)
    check(sched, 109, LR * 1 / 100)
    check(sched, 110, 0.0)
    check(sched, 200, 0.0)  # max(0, .) past the end


def test_cosine_default_is_a_half_cosine():
    sched = cosine(LR, warmup_steps=W, total_steps=N)
    check(sched, 0, 0.0)
    check(sched, 10, LR)
    check(sched, 60, LR * 0.5)
    check(sched, 35, LR * 0.5 * (1 + math.cos(math.pi * 0.25)))
    check(sched, 109, LR * 0.5 * (1 + math.cos(math.pi * 0.99)))
    check(sched, 110, 0.0)


def test_cosine_honours_num_cycles():
    sched = cosine(LR, warmup_steps=W, total_steps=N, num_cycles=1.0)  # 0.5 (1 + cos(2 pi p))
    check(sched, 10, LR)
    check(sched, 35, LR * 0.5)
    check(sched, 60, 0.0)
    check(sched, 109, LR * 0.5 * (1 + math.cos(2 * math.pi * 0.99)))
    check(sched, 110, LR)


def test_cosine_with_min_lr_floors_and_zero_means_zero():
    sched = cosine_with_min_lr(LR, warmup_steps=W, total_steps=N, min_lr_ratio=0.1)
    check(sched, 0, 0.0)
    check(sched, 10, LR)
    check(sched, 60, LR * 0.5)
    check(sched, 100, LR * max(0.1, 0.5 * (1 + math.cos(math.pi * 0.9))))  # 0.0245 -> floored at 0.1
    check(sched, 109, LR * 0.1)
    zero = cosine_with_min_lr(LR, warmup_steps=W, total_steps=N, min_lr_ratio=0.0)  # FastVideo would use 0.5 here
    check(zero, 109, LR * 0.5 * (1 + math.cos(math.pi * 0.99)))
    check(zero, 110, 0.0)


def test_cosine_with_restarts():
    sched = cosine_with_restarts(LR, warmup_steps=W, total_steps=N, num_cycles=2)
    check(sched, 0, 0.0)
    check(sched, 10, LR)
    check(sched, 35, LR * 0.5)  # p = 0.25: half of the first cycle
    check(sched, 59, LR * 0.5 * (1 + math.cos(math.pi * ((2 * 0.49) % 1))))
    check(sched, 60, LR)  # p = 0.5: restart
    check(sched, 109, LR * 0.5 * (1 + math.cos(math.pi * ((2 * 0.99) % 1))))
    check(sched, 110, 0.0)  # p >= 1
    one = cosine_with_restarts(LR, warmup_steps=W, total_steps=N)  # default: one cycle to the end
    check(one, 60, LR * 0.5)
    check(one, 109, LR * 0.5 * (1 + math.cos(math.pi * 0.99)))


def test_polynomial():
    end = 1e-5
    sched = polynomial(LR, warmup_steps=W, total_steps=N, power=2.0, lr_end=end)
    check(sched, 0, 0.0)
    check(sched, 10, LR)
    check(sched, 60, (LR - end) * 0.5**2 + end)
    check(sched, 109, (LR - end) * 0.01**2 + end)
    check(sched, 110, end)
    check(sched, 150, end)
    flat = polynomial(LR, warmup_steps=0, total_steps=N, power=0.0, lr_end=end)  # (1 - p)^0 = 1 until the end
    check(flat, 0, LR)
    check(flat, 109, LR)
    check(flat, 111, end)


def test_zero_warmup_starts_at_base_lr():
    check(linear(LR, total_steps=N), 0, LR)
    check(cosine(LR, total_steps=N), 0, LR)


def test_float_tensor_step_keeps_its_dtype_and_device():
    got = cosine(LR, warmup_steps=W, total_steps=N)(torch.tensor(60.0, dtype=torch.float64))
    assert got.dtype == torch.float64 and got.item() == pytest.approx(LR * 0.5, rel=1e-12)


def test_compiled_schedule_takes_the_step_as_data():
    sched = cosine_with_restarts(LR, warmup_steps=W, total_steps=N, num_cycles=2)
    counter = CompileCounter()
    compiled = torch.compile(sched, backend=counter, fullgraph=True)
    for s in (0, 5, 10, 35, 60, 109, 110):
        assert compiled(torch.tensor(s)).item() == pytest.approx(sched(s), rel=1e-6, abs=1e-12)
    assert counter.frame_count == 1


def test_get_schedule_by_name():
    kwargs = dict(base_lr=LR, warmup_steps=W, total_steps=N, num_cycles=None, min_lr_ratio=0.1, power=2.0, lr_end=1e-5,
                  factor=0.5)
    assert set(schedules.SCHEDULES) == {
        "constant", "constant_with_warmup", "constant_factor", "linear", "cosine", "cosine_with_min_lr",
        "cosine_with_restarts", "polynomial",
    }
    direct = {
        "constant": constant(LR),
        "constant_with_warmup": constant_with_warmup(LR, warmup_steps=W),
        "constant_factor": constant_factor(LR, warmup_steps=W, factor=0.5),
        "linear": linear(LR, warmup_steps=W, total_steps=N),
        "cosine": cosine(LR, warmup_steps=W, total_steps=N),
        "cosine_with_min_lr": cosine_with_min_lr(LR, warmup_steps=W, total_steps=N, min_lr_ratio=0.1),
        "cosine_with_restarts": cosine_with_restarts(LR, warmup_steps=W, total_steps=N),
        "polynomial": polynomial(LR, warmup_steps=W, total_steps=N, power=2.0, lr_end=1e-5),
    }
    for name, ref in direct.items():
        by_name = get_schedule(name, **kwargs)
        assert [by_name(s) for s in (0, 5, 10, 35, 60, 100, 109)] == [ref(s) for s in (0, 5, 10, 35, 60, 100, 109)]
    cyc = get_schedule("cosine", base_lr=LR, warmup_steps=W, total_steps=N, num_cycles=1.0)
    assert cyc(60) == pytest.approx(0.0, abs=1e-18)


@pytest.mark.parametrize("name", ["constant_with_warmup", "linear", "cosine", "cosine_with_min_lr",
                                  "cosine_with_restarts", "polynomial"])
def test_a_warmup_longer_than_the_run_is_legal_and_never_finishes(name):
    """As in every schedule library: the run ends before the lr reaches base_lr (12 steps of a 30-step warmup)."""
    schedule = get_schedule(name, base_lr=LR, warmup_steps=30, total_steps=12)
    assert [schedule(s) for s in range(12)] == pytest.approx([LR * s / 30 for s in range(12)])


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown schedule 'cosin'.*cosine_with_min_lr.*polynomial"):
        get_schedule("cosin", base_lr=LR)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: linear(LR, warmup_steps=-1, total_steps=N), "warmup_steps must be >= 0"),
        (lambda: cosine(LR, total_steps=0), "total_steps must be >= 1"),
        (lambda: get_schedule("linear", base_lr=LR), "total_steps is required"),
        (lambda: cosine_with_min_lr(LR, total_steps=N, min_lr_ratio=-0.1), "min_lr_ratio must be >= 0"),
        (lambda: cosine_with_min_lr(LR, total_steps=N, min_lr_ratio=1.5), "min_lr_ratio must be <= 1"),
        (lambda: cosine(LR, total_steps=N, num_cycles=0), "num_cycles must be > 0"),
        (lambda: cosine_with_restarts(LR, total_steps=N, num_cycles=-1), "num_cycles must be > 0"),
        (lambda: polynomial(LR, total_steps=N, lr_end=1.0), r"lr_end \(1.0\) must be <= base_lr"),
        (lambda: polynomial(LR, total_steps=N, power=-1.0), "power must be >= 0"),
        (lambda: constant(-1e-3), "base_lr must be >= 0"),
        (lambda: constant(float("nan")), "base_lr must be finite"),
        (lambda: constant(LR)(-1), "step must be >= 0"),
        (lambda: constant_factor(LR, factor=1.5), "factor must be <= 1"),
        (lambda: constant(LR)(torch.zeros(2)), "step must be a 0-dim tensor"),
    ],
)
def test_bad_arguments_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: linear(LR, warmup_steps=1.5, total_steps=N), "warmup_steps must be an int"),
        (lambda: linear(LR, warmup_steps=True, total_steps=N), "warmup_steps must be an int"),
        (lambda: constant("1e-3"), "base_lr must be a real number"),
        (lambda: constant(LR)(1.0), "step must be an int or a 0-dim tensor"),
    ],
)
def test_bad_types_raise_type_error(make, match):
    with pytest.raises(TypeError, match=match):
        make()
