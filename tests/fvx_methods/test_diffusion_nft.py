"""fvx_methods.diffusion_nft: the advantage modes and the NFT loss against a hand computation of spec §2.11, and a
scripted reward's ranking moving the student towards the preferred sample."""
import pytest
import torch

from fvx.core import random
from fvx_methods import diffusion_nft as nft
from fvx_methods.library import rl

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
