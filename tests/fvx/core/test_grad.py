"""fvx.core.grad: value_and_grad is pure and exact; remat recomputes with the caller's params."""
import pytest
import torch
import torch.utils.checkpoint
from diffusers import WanTransformer3DModel
from torch.func import functional_call

from fvx.core import grad as fgrad

TINY_WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32)


def tiny_wan(seed: int) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    return WanTransformer3DModel(**TINY_WAN)


@pytest.fixture(scope="module")
def wan_batch():
    g = torch.Generator().manual_seed(1)
    return dict(x=torch.randn(2, 4, 2, 8, 8, generator=g), t=torch.tensor([100.0, 700.0]),
                ctx=torch.randn(2, 6, 16, generator=g), target=torch.randn(2, 4, 2, 8, 8, generator=g))


def wan_loss(model, params, buffers, b):
    out = functional_call(model, (params, buffers), (b["x"], b["t"], b["ctx"]), {"return_dict": False})[0]
    return ((out.float() - b["target"]) ** 2).mean()


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_value_and_grad_matches_hand_computation():
    params = {"w": torch.tensor([1.0, -2.0, 3.0]), "b": torch.tensor(0.5)}
    x = torch.tensor([2.0, 1.0, -1.0])

    def f(p, x):  # (w.x + b)^2
        return (p["w"] @ x + p["b"]) ** 2

    loss, grads = fgrad.value_and_grad(f)(params, x)
    s = 1.0 * 2 - 2.0 * 1 + 3.0 * -1 + 0.5  # -2.5
    assert loss.item() == s**2
    torch.testing.assert_close(grads["w"], 2 * s * x, rtol=0, atol=0)
    torch.testing.assert_close(grads["b"], torch.tensor(2 * s), rtol=0, atol=0)
    assert fgrad.grad(f)(params, x)["b"].item() == 2 * s


def test_value_and_grad_is_pure_and_returns_no_graph():
    params = {"a": torch.randn(3, generator=torch.Generator().manual_seed(0)), "unused": torch.ones(2)}
    before = {k: v.clone() for k, v in params.items()}

    def f(p):
        return (p["a"] ** 2).sum(), {"double": p["a"] * 2, "n": 3}

    (loss, aux), grads = fgrad.value_and_grad(f, has_aux=True)(params)
    assert not loss.requires_grad and not aux["double"].requires_grad and aux["n"] == 3
    assert all(v.grad is None and not v.requires_grad for v in params.values())
    assert all(torch.equal(params[k], before[k]) for k in params)
    torch.testing.assert_close(grads["a"], 2 * params["a"])
    assert torch.equal(grads["unused"], torch.zeros(2))  # unused leaves get zeros, as in JAX
    g2, aux2 = fgrad.grad(f, has_aux=True)(params)
    assert torch.equal(g2["a"], grads["a"]) and torch.equal(aux2["double"], aux["double"])


def test_value_and_grad_errors_name_the_culprit():
    with pytest.raises(TypeError, match="'steps'.*int64"):
        fgrad.value_and_grad(lambda p: p["w"].sum())({"w": torch.ones(2), "steps": torch.zeros(1, dtype=torch.long)})
    with pytest.raises(TypeError, match="0-dim floating-point loss.*shape \\(2,\\)"):
        fgrad.value_and_grad(lambda p: p["w"] * 2)({"w": torch.ones(2)})
    with pytest.raises(TypeError, match="pair"):
        fgrad.value_and_grad(lambda p: p["w"].sum(), has_aux=True)({"w": torch.ones(2)})


@pytest.mark.parametrize("use_remat", [False, True], ids=["plain", "remat"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_value_and_grad_on_wan_equals_module_backward(wan_batch, use_remat, compiled):
    model = tiny_wan(seed=0)
    loss_ref = ((model(wan_batch["x"], wan_batch["t"], wan_batch["ctx"], return_dict=False)[0]
                 - wan_batch["target"]) ** 2).mean()
    loss_ref.backward()
    ref = {k: p.grad.clone() for k, p in model.named_parameters()}
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    buffers = dict(model.named_buffers())
    if use_remat:
        model.enable_gradient_checkpointing(fgrad.remat)

    def loss_fn(p, b):
        return wan_loss(model, p, buffers, b)

    # aot_eager: dynamo + AOTAutograd differentiate the compiled loss, as inductor would, without C++ codegen time.
    f = torch.compile(loss_fn, backend="aot_eager") if compiled else loss_fn
    loss, grads = fgrad.value_and_grad(f)(params, wan_batch)
    tol = 1e-6 if compiled else 0.0
    assert abs(loss.item() - loss_ref.item()) <= tol
    assert max_diff(grads, ref) <= (1e-6 if compiled else 1e-7)


def _diffusers_default_checkpoint(module, *args):
    return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False)


def test_remat_fixes_diffusers_checkpoint_after_functional_call(wan_batch):
    """After functional_call, diffusers' checkpoint recomputes with the module's own (stale) params: wrong grads."""
    model = tiny_wan(seed=0)
    params = {k: p.detach().clone() for k, p in tiny_wan(seed=1).named_parameters()}  # differ from model's own
    buffers = dict(model.named_buffers())

    def grads_with(checkpoint_fn):
        if checkpoint_fn is None:
            model.disable_gradient_checkpointing()
        else:
            model.enable_gradient_checkpointing(checkpoint_fn)
        return fgrad.grad(lambda p: wan_loss(model, p, buffers, wan_batch))(params)

    reference = grads_with(None)
    assert max_diff(grads_with(_diffusers_default_checkpoint), reference) > 1e-3
    assert max_diff(grads_with(fgrad.remat), reference) <= 1e-7


class _Block(torch.nn.Module):
    """A block with tensor and non-tensor args that returns a tuple holding one of its inputs unchanged."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x, extra, *, mode: str, pair: tuple):
        y = torch.tanh(self.lin(x)) * self.scale
        if mode == "shifted":
            y = y + pair[0]
        return y, extra, pair[1] * 3


def test_remat_handles_non_tensor_args_tuple_outputs_and_returned_inputs():
    block = _Block()
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(p.shape, generator=g) for k, p in block.named_parameters()}
    diff = {"params": params, "x": torch.randn(4, 3, generator=g), "extra": torch.randn(4, 3, generator=g),
            "a": torch.randn(4, 3, generator=g)}
    c = torch.randn(4, 3, generator=g)

    def loss(d, call):
        with torch.nn.utils.stateless._reparametrize_module(block, d["params"]):
            y, e, z = call(block, d["x"], d["extra"], mode="shifted", pair=(d["a"], c))
        return (y * e).sum() + z.sum()

    plain_loss, plain = fgrad.value_and_grad(loss)(diff, lambda m, *args, **kw: m(*args, **kw))
    remat_loss, rematted = fgrad.value_and_grad(loss)(diff, fgrad.remat)
    assert torch.equal(plain_loss, remat_loss)
    for name in ("x", "extra", "a"):
        assert torch.equal(plain[name], rematted[name])
    assert max_diff(plain["params"], rematted["params"]) == 0.0
    assert rematted["extra"].abs().sum() > 0  # the returned input carries gradient
