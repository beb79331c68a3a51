"""The warmup warning of an optimizer's knobs: said exactly when the learning rate never reaches ``lr`` in the run."""
import pytest

from fvx.core.optim_config import AdamWConfig


@pytest.mark.parametrize("schedule", ["linear", "cosine", "constant_with_warmup"])
def test_a_warmup_that_does_not_end_in_the_run_is_warned_and_never_reaches_lr(schedule):
    updates = 10
    for warmup in (9, 10, 11):
        optim = AdamWConfig(lr=1e-3, schedule=schedule, warmup_steps=warmup)
        lrs = [optim.schedule_fn(updates)(s) for s in range(updates)]  # the lr of each update of the run
        reaches = max(lrs) == pytest.approx(1e-3)
        warning = optim.warmup_warning("method.optim", updates)
        assert (warning is None) == reaches, (warmup, lrs)
    assert warning == ("method.optim.warmup_steps = 11 is not shorter than the run's 10 optimizer updates "
                       "(run.steps): the learning rate never reaches method.optim.lr = 0.001 (legal: a run resumed "
                       "with a larger run.steps finishes the warmup)")


def test_a_constant_schedule_has_no_warmup_to_warn_of():
    assert AdamWConfig(schedule="constant", warmup_steps=50).warmup_warning("method.optim", 10) is None
    assert AdamWConfig(schedule="constant", warmup_steps=50).schedule_fn(10)(0) == pytest.approx(1e-5)
