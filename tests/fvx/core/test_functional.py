"""fvx.core.functional.call: torch's strict functional_call without the per-call walks; the module is left as it was,
gradients reach the given tensors, a changed module is found again, and tied weights go through torch's."""
import pytest
import torch
from torch import nn
from torch.func import functional_call

from fvx.core import functional


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).eval()


def given(module: nn.Module):
    params = {n: torch.randn_like(p, requires_grad=True) for n, p in module.named_parameters()}
    buffers = {n: b.clone() + (1.0 if b.is_floating_point() else 0) for n, b in module.named_buffers()}
    return params, buffers


def test_equals_torch_functional_call_and_leaves_the_module_as_it_was():
    module, x = net(), torch.randn(3, 4)
    own = {n: t for n, t in module.state_dict(keep_vars=True).items()}
    params, buffers = given(module)
    out = functional.call(module, params, buffers, (x,))
    assert torch.equal(out, functional_call(module, (params, buffers), (x,), strict=True))
    assert all(t is own[n] for n, t in module.state_dict(keep_vars=True).items())
    out.sum().backward()
    assert all(p.grad is not None for p in params.values())
    assert all(p.grad is None for p in module.parameters())


def test_held_gives_the_tensors_of_an_enclosing_call():
    module = net()
    params, buffers = given(module)
    seen = {}
    module[3].register_forward_pre_hook(lambda m, args: seen.update(zip(("params", "buffers"), functional.held(m))))
    functional.call(module, params, buffers, (torch.randn(3, 4),))
    assert seen["params"]["weight"] is params["3.weight"] and seen["buffers"] == {}
    assert functional.held(module)[0]["3.weight"] is module[3].weight


def test_a_changed_module_is_found_again_and_bad_names_get_torchs_error():
    module, x = net(), torch.randn(3, 4)
    functional.call(module, *given(module), (x,))
    module.append(nn.Linear(2, 2))
    params, buffers = given(module)
    assert torch.equal(functional.call(module, params, buffers, (x,)),
                       functional_call(module, (params, buffers), (x,), strict=True))
    with pytest.raises(RuntimeError, match="Missing key"):
        functional.call(module, {n: p for n, p in params.items() if n != "4.bias"}, buffers, (x,))


def test_tied_weights_go_through_torchs_functional_call():
    shared = nn.Linear(3, 3)
    module = nn.Sequential(shared, shared)
    assert functional.slots(module) is None
    params = {"0.weight": torch.eye(3), "0.bias": torch.zeros(3)}
    x = torch.randn(2, 3)
    assert torch.equal(functional.call(module, params, {}, (x,)), x)
