"""fvx.core.flow on a joint model's dicts of modalities (issue 31): per-modality noise, levels, targets and sampling."""
import pytest
import torch

from fvx.core import flow, random


def test_per_sample_noise_draws_each_modality_from_its_own_fold_of_the_sample_key():
    key, index = random.key(3), torch.tensor([5, 9])
    noise, t_keys = flow.per_sample_noise(key, index, {"video": (2, 1, 2, 2), "audio": (2, 4, 3)}, torch.device("cpu"))
    video_only, video_t_keys = flow.per_sample_noise(key, index, (2, 1, 2, 2), torch.device("cpu"))
    assert torch.equal(t_keys, video_t_keys)  # the levels a sample draws do not depend on its modalities
    for b, i in enumerate(index.tolist()):
        noise_key = random.split(random.fold_in(key, i))[0]
        assert torch.equal(noise["video"][b], random.normal(random.fold_in(noise_key, 0), (2, 1, 2, 2)))
        assert torch.equal(noise["audio"][b], random.normal(random.fold_in(noise_key, 1), (2, 4, 3)))
    assert not torch.equal(noise["video"], video_only)


def test_noising_and_targets_apply_modality_by_modality():
    g = torch.Generator().manual_seed(0)
    x0 = {"video": torch.randn(2, 3, 1, 2, 2, generator=g), "audio": torch.randn(2, 2, 4, 3, generator=g)}
    noise = {name: torch.randn(x.shape, generator=g) for name, x in x0.items()}
    sigma = {"video": torch.tensor([0.2, 0.9]), "audio": torch.tensor([0.5, 0.1])}
    x_t = flow.add_noise(x0, noise, sigma)
    for name in x0:
        assert torch.equal(x_t[name], flow.add_noise(x0[name], noise[name], sigma[name]))
        assert torch.equal(flow.velocity_target(x0, noise)[name], noise[name] - x0[name])
        v = flow.velocity_target(x0, noise)
        torch.testing.assert_close(flow.x0_from_velocity(x_t, v, sigma)[name], x0[name])
    same = flow.add_noise(x0, noise, 0.25)  # one level for every modality
    assert torch.equal(same["audio"], flow.add_noise(x0["audio"], noise["audio"], 0.25))
    with pytest.raises(ValueError, match="keyed alike"):
        flow.add_noise(x0, noise["video"], sigma)


def test_joint_euler_steps_each_modality_along_its_own_levels():
    """A constant velocity c_m moves modality m by -(sigma_m[0] - 0) c_m over its schedule, whatever the steps."""
    noise = {"video": torch.zeros(1, 1, 1, 1, 1), "audio": torch.zeros(1, 1, 1, 2)}
    levels = {"video": torch.tensor([1.0, 0.6, 0.2]), "audio": torch.tensor([0.5, 0.3, 0.1])}
    seen = []

    def apply(params, x, t, cond):
        seen.append({name: float(value[0]) for name, value in t.items()})
        return {"video": torch.full_like(x["video"], 2.0), "audio": torch.full_like(x["audio"], -1.0)}

    out = flow.sample(apply, None, noise, levels)
    assert torch.allclose(out["video"], torch.full_like(noise["video"], -2.0))  # 0 + (0 - 1) * 2
    assert torch.allclose(out["audio"], torch.full_like(noise["audio"], 0.5))  # 0 + (0 - 0.5) * -1
    assert seen[0] == pytest.approx({"video": 1000.0, "audio": 500.0}) and len(seen) == 3
    with pytest.raises(ValueError, match="sampler='ode' only"):
        flow.sample(apply, None, noise, levels, random.key(0), sampler="sde")
    with pytest.raises(ValueError, match="one schedule per modality"):
        flow.sample(apply, None, noise, levels["video"])


def test_guidance_applies_modality_by_modality():
    cond = {"video": torch.tensor([1.0]), "audio": torch.tensor([3.0])}
    uncond = {"video": torch.tensor([0.0]), "audio": torch.tensor([1.0])}
    assert flow.cfg(cond, uncond, 2.0) == {"video": torch.tensor([2.0]), "audio": torch.tensor([5.0])}
