"""fvx_methods.library.flow_map: time pairs per sample (kinds, fractions, order, independence of the batch), the
few-step sampler on an exact flow map, and the checks."""
import types

import pytest
import torch

from fvx.core import random
from fvx_methods.library import flow_map
from fvx_models.model import Rules


def test_time_pairs_kinds_fractions_and_order():
    keys = random.fold_in(random.key(0), torch.arange(4000))
    sigma_t, sigma_r, kind = flow_map.time_pairs(keys, diagonal=0.5, endpoint=0.25, shift=3.0)
    assert (sigma_t >= sigma_r).all() and ((0 <= sigma_r) & (sigma_t < 1)).all()
    assert torch.equal(sigma_r[kind == flow_map.DIAGONAL], sigma_t[kind == flow_map.DIAGONAL])
    assert (sigma_r[kind == flow_map.ENDPOINT] == 0).all() and (sigma_r[kind == flow_map.GENERAL] > 0).all()
    for value, fraction in ((flow_map.DIAGONAL, 0.5), (flow_map.ENDPOINT, 0.25), (flow_map.GENERAL, 0.25)):
        assert (kind == value).float().mean() == pytest.approx(fraction, abs=0.03)
    # a sample draws the same wherever it falls in the batch
    again = flow_map.time_pairs(keys[1000:1010], diagonal=0.5, endpoint=0.25, shift=3.0)
    assert all(torch.equal(a, b[1000:1010]) for a, b in zip(again, (sigma_t, sigma_r, kind)))


def test_logit_normal_pairs_follow_their_density():
    keys = random.fold_in(random.key(1), torch.arange(4000))
    sigma_t, sigma_r, _ = flow_map.time_pairs(keys, diagonal=0.0, endpoint=0.0, density="logit_normal",
                                              logit_mean=-0.4)
    logits = torch.logit(torch.cat([sigma_t, sigma_r]))
    assert logits.mean() == pytest.approx(-0.4, abs=0.05) and logits.std() == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_the_sampler_lands_on_the_data_of_an_exact_flow_map(steps):
    """Data at one point a: the flow map is u(x, t, r) = (x - a) / sigma_t for every r; any number of jumps from
    noise lands on a."""
    a = torch.tensor([[0.5, -2.0]])
    model = types.SimpleNamespace(apply=lambda params, x, t, cond, r=None: (x - a) / (t / 1000)[:, None])
    noise = random.normal(random.key(2), (8, 2))
    out = flow_map.sample(model, {}, noise, flow_map.few_step_sigmas(steps, shift=3.0), None)
    assert torch.allclose(out, a.expand(8, 2), atol=1e-5)


def test_the_checks_are_one_line():
    one_time = types.SimpleNamespace(name="wan:world", rules=Rules(two_time=False, two_time_refusal=None))
    with pytest.raises(ValueError, match=r"models.student \(wan:world\) has no r input; set "
                                         r"models.student.r_embedder=\{\}"):
        flow_map.check_two_time(one_time, "student", "MeanFlow")
    with pytest.raises(ValueError, match="method.a must be in"):
        flow_map.check_fractions(-0.5, 0.0, ("a", "b"))
