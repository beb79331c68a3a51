"""fvx_methods.anyflow_pretrain: the loss against a hand computation of spec §2.7 (with the clamped difference and
fused guidance), the run on the toy world resuming bitwise, 2 processes = 1, and its checks."""
import math
import pathlib
import types

import pytest
import torch

from fvx.core import flow, random
from fvx_methods import anyflow_pretrain as af
from fvx_methods.library import flow_map
from fvx_models.model import LatentSpace, Rules

from gloo import assert_two_processes_log_as_one  # noqa: E402
from run_state import assert_one_line_errors, assert_resumes_bitwise  # noqa: E402

EXPERIMENT = str(pathlib.Path(__file__).resolve().parents[2] / "experiments" / "anyflow_pretrain.py")


def toy_model():
    """u(x, t, r) = a x (t/1000)^2 + c (r/1000) + y on 2-D points, y the cond's scalar (zero when unconditional)."""
    def apply(params, x, t, cond, r=None):
        s, q = (t / 1000)[:, None], (r / 1000)[:, None]
        return params["a"] * x * s ** 2 + params["c"] * q + cond["y"][:, None]
    return types.SimpleNamespace(normalize=LatentSpace(2).normalize, apply=apply, rules=Rules(two_time=True),
                                 uncond=lambda cond, mode, negative: {"y": torch.zeros_like(cond["y"])})


def hand_loss(params, x0, noise, sigma_t, sigma_r, kind, y, config):
    """Spec §2.7 sample by sample, in float64 Python-level arithmetic."""
    g, delta, per, diffusion = config.fuse_guidance_scale, config.epsilon, [], []
    a, c = float(params["a"]), float(params["c"])
    u_of = lambda x, t, r, y_: [a * xi * (t / 1000) ** 2 + c * r / 1000 + y_ for xi in x]
    for b in range(len(x0)):
        t, r = 1000 * float(sigma_t[b]), 1000 * float(sigma_r[b])
        v = [float(noise[b, i] - x0[b, i]) for i in range(2)]
        x_t = [float((1 - sigma_t[b]) * x0[b, i] + sigma_t[b] * noise[b, i]) for i in range(2)]
        u = [(uc - (1 - g) * uu) / g for uc, uu in zip(u_of(x_t, t, r, float(y[b])), u_of(x_t, t, r, 0.0))]
        hi, lo = min(t + delta, 1000.0), max(t - delta, 0.0)
        f_hi = u_of([xi + (hi - t) / 1000 * vi for xi, vi in zip(x_t, v)], hi, r, float(y[b]))
        f_lo = u_of([xi + (lo - t) / 1000 * vi for xi, vi in zip(x_t, v)], lo, r, float(y[b]))
        target = [vi - (t - r) * (fh - fl) / ((hi - lo) * g) for vi, fh, fl in zip(v, f_hi, f_lo)]
        s = t / 1000
        weight = s * math.sqrt(1 - s) / af.mean_weight("beta08", config.shift)
        per.append(sum((ui - ti) ** 2 for ui, ti in zip(u, target)) / 2 * weight)
        diffusion.append(int(kind[b]) == flow_map.DIAGONAL)
    mean_d = sum(p for p, d in zip(per, diffusion) if d) / sum(diffusion)
    return sum(p if d else p * mean_d / (p + 1e-5) for p, d in zip(per, diffusion)) / len(per)


@pytest.mark.parametrize("g", [1.0, 3.0])
def test_the_loss_by_hand(g):
    config = af.AnyFlowPretrain(fuse_guidance_scale=g, cfg_uncond="zero", shift=3.0, epsilon=50.0)
    params = {"a": torch.tensor(0.7), "c": torch.tensor(-0.4)}
    x0 = random.normal(random.key(0), (16, 2))
    y = random.normal(random.key(5), (16,))
    batch = {"latents": x0, "sample_index": torch.arange(16), "cond": {"y": y}}
    key = random.key(1)
    loss, aux = af.loss_fn(params, batch, key, model=toy_model(), config=config, ranks=af.role.ONE_PROCESS,
                           negative=None)
    noise, t_keys = flow.per_sample_noise(key, batch["sample_index"], (2,), x0.device)
    sigma_t, sigma_r, kind = flow_map.time_pairs(t_keys, diagonal=0.5, endpoint=0.25, shift=3.0)
    assert (kind == flow_map.DIAGONAL).any() and (sigma_t * 1000 > 950).any()  # the clamped difference is exercised
    assert float(loss) == pytest.approx(hand_loss(params, x0, noise, sigma_t, sigma_r, kind, y, config), rel=1e-5)
    assert float(aux["diffusion_fraction"]) == float((kind == flow_map.DIAGONAL).float().mean())


def test_mean_weight_is_the_weights_mean_under_the_time_density():
    u = random.uniform(random.key(3), (200_000, 2)).max(1).values
    for kind in af.WEIGHTS:
        sampled = af.train_weight(flow.shift_sigma(u, 5.0), kind).mean()
        assert af.mean_weight(kind, 5.0) == pytest.approx(float(sampled), rel=5e-3)


def quick(world_teacher, *more):
    return ["run.progress=false", "validation.every=0", "run.checkpoint.every=2", "run.checkpoint.async_save=false",
            f"models.student.path={world_teacher}", "data.batch_size=4", *more]


def test_a_run_resumes_bitwise(tmp_path, world_teacher):
    state = assert_resumes_bitwise(EXPERIMENT, tmp_path, quick(world_teacher),
                                   ("loss", "diffusion_fraction", "scale_weight_mean", "grad_norm"))
    assert any("delta_embedder" in name for name in state)


@pytest.mark.slow  # 2 + 1 processes
def test_two_processes_train_as_one(tmp_path, world_teacher):
    assert_two_processes_log_as_one(tmp_path, EXPERIMENT, (f"models.student.path={world_teacher}",
                                                           "data.batch_size=4"),
                                    ("loss", "grad_norm", "diffusion_fraction"))


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, world_teacher):
    assert_one_line_errors(EXPERIMENT, tmp_path, capsys, quick(world_teacher), [
        (["models.student.r_embedder=null"], "AnyFlow pretraining trains a flow map u(x_t, t, r), but "
                                             "models.student (wan:world) has no r input; set "
                                             "models.student.r_embedder={}"),
        (["models.student.compile=blocks", "method.derivative=ad"], "method.derivative=ad runs forward-mode AD "
                                                                    "eagerly"),
        (["method.diffusion_ratio=0.8", "method.consistency_ratio=0.5"], "method.diffusion_ratio + "
                                                                         "method.consistency_ratio = 1.3 is above 1"),
        (["method.fuse_guidance_scale=3.0"], "needs a negative-prompt cond file (method.negative_prompt_path)"),
    ])
