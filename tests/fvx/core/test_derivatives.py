"""fvx.core.derivatives: forward-mode derivatives of a tiny Wan against a double-backward reference."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from fvx.core import derivatives, random
from fvx_models.wan import WanConfig


@pytest.fixture(scope="module")
def wan():
    model = WanConfig(preset="tiny").build()
    params = model.weights.init(random.key(0))
    x = random.normal(random.key(1), (2, 16, 2, 8, 8))
    t = torch.tensor([300.0, 700.0])
    cond = {"text": random.normal(random.key(2), (2, 8, 32)), "text_mask": torch.ones(2, 8)}
    v = random.normal(random.key(3), x.shape)
    return (lambda x, t: model.apply(params, x, t, cond)), x, t, v


def double_backward(fn, x, t, v, dt):
    """J (v, dt) by reverse mode twice: the gradient of <w, J^T-product> in w."""
    with sdpa_kernel([SDPBackend.MATH]):
        x, t = x.clone().requires_grad_(), t.clone().requires_grad_()
        out = fn(x, t)
        w = torch.zeros_like(out, requires_grad=True)
        gx, gt = torch.autograd.grad(out, (x, t), w, create_graph=True)
        return torch.autograd.grad((gx * v).sum() + (gt * dt).sum(), w)[0]


@pytest.mark.parametrize("mode", ["ad", "dual"])
def test_forward_mode_equals_double_backward(wan, mode):
    fn, x, t, v = wan
    dt = torch.tensor([1000.0, 1000.0])
    reference = double_backward(fn, x, t, v, dt)
    with torch.no_grad():
        got = derivatives.directional(fn, (x, t), (v, dt), mode=mode)
    assert torch.allclose(got, reference, atol=1e-5 * reference.abs().max())


def test_finite_difference_near_exact(wan):
    """Central differences at h = 1e-4 along (v, 1000) (t moves 0.1): within 5e-3 of the exact derivative, relative to
    its size. Random weights keep the sinusoidal time embedding's fast frequencies: at h = 1e-3 the error is 0.13."""
    fn, x, t, v = wan
    dt = torch.tensor([1000.0, 1000.0])
    with torch.no_grad():
        exact = derivatives.directional(fn, (x, t), (v, dt), mode="ad")
        approx = derivatives.directional(fn, (x, t), (v, dt), mode="finite_difference", step=1e-4)
    assert (approx - exact).abs().max() < 5e-3 * exact.abs().max()


def test_gradients_flow_through_the_derivative():
    """d/dw of <1, J(w) v> for f(x) = w x^2 is 2 x v, by each mode."""
    w = torch.tensor(3.0, requires_grad=True)
    x, v = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0])
    for mode in derivatives.MODES:
        (grad,) = torch.autograd.grad(derivatives.directional(lambda x: w * x ** 2, (x,), (v,), mode=mode).sum(), w)
        assert torch.allclose(grad, (2 * x * v).sum(), atol=1e-4), mode


def test_bad_input():
    with pytest.raises(ValueError, match="unknown derivative mode 'jvp'"):
        derivatives.directional(torch.sin, (torch.ones(1),), (torch.ones(1),), mode="jvp")
    with pytest.raises(ValueError, match="method.derivative=ad runs forward-mode AD eagerly.*finite_difference"):
        derivatives.check_mode("ad", compiled=True, sharded=False, who="method.derivative")
    with pytest.raises(ValueError, match="method.derivative=ad .* sharded over processes; use method.derivative=dual"):
        derivatives.check_mode("ad", compiled=False, sharded=True, who="method.derivative")
    derivatives.check_mode("dual", compiled=False, sharded=True, who="method.derivative")
    derivatives.check_mode("finite_difference", compiled=True, sharded=True, who="method.derivative")
