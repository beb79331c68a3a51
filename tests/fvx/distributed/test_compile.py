"""fvx.distributed.compile: every block routed through one function over a template block; compiled, one graph serves
all blocks and every step, one more per distinct input signature, and the numbers match eager."""
import pytest
import torch
from torch.func import functional_call

from fvx.core import grad, random
from fvx.distributed import compile as fvx_compile
from fvx_models import build, wan

UNITS = ["blocks.0.", "blocks.1."]
GROUPS = {"blocks": UNITS}


def skeleton(remat: bool = False) -> torch.nn.Module:
    """The tiny Wan DiT as a meta skeleton (remat through fvx.core.grad.remat)."""
    return build.skeleton(wan.WanConfig(preset="tiny", remat=remat))


def batch(frames: int = 2, key: int = 1) -> dict:
    k = random.split(random.key(key), 3)
    return dict(x=random.normal(k[0], (2, 16, frames, 4, 6)), t=torch.tensor([30.0, 910.5]),
                text=random.normal(k[1], (2, 5, 32)), target=random.normal(k[2], (2, 16, frames, 4, 6)))


@pytest.fixture(scope="module")
def params():
    return wan.WanConfig(preset="tiny").build().weights.init(random.key(0))


def forward(module, p, b):
    inputs = {"hidden_states": b["x"], "timestep": b["t"], "encoder_hidden_states": b["text"], "return_dict": False}
    return functional_call(module, (p, dict(module.named_buffers())), (), inputs)[0]


def loss_and_grads(module, params, b):
    def loss_fn(p):
        return ((forward(module, p, b) - b["target"]) ** 2).mean()

    return grad.value_and_grad(loss_fn)(params)


def assert_grads_close(got, want, rtol):
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=rtol * want[name].abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def eager(params):
    return loss_and_grads(skeleton(remat=True), params, batch())


@pytest.fixture(scope="module")
def compiled():
    """A remat skeleton whose blocks run one aot_eager-compiled function."""
    module = skeleton(remat=True)
    return module, fvx_compile.install_units(module, GROUPS, mode="blocks", backend="aot_eager")


def test_routing_without_compiling_changes_nothing(params, eager):
    module = skeleton(remat=True)
    stats = fvx_compile.install_units(module, GROUPS, mode="none")
    loss, grads = loss_and_grads(module, params, batch())
    assert fvx_compile.routed_units(module) == tuple(UNITS) and stats.graphs == 0
    assert torch.equal(loss, eager[0])
    assert_grads_close(grads, eager[1], rtol=0)


def test_one_graph_for_all_blocks_over_steps_and_compiled_matches_eager(params, eager, compiled):
    module, stats = compiled
    for _ in range(3):
        loss, grads = loss_and_grads(module, params, batch())
    assert (stats.graphs, stats.recompiles) == (1, 0)
    torch.testing.assert_close(loss, eager[0], rtol=1e-6, atol=0)
    assert_grads_close(grads, eager[1], rtol=1e-5)


def test_one_more_graph_per_distinct_signature_and_no_recompiles(params, compiled):
    module, stats = compiled
    loss_and_grads(module, params, batch())
    before = stats.graphs
    for _ in range(2):
        loss_and_grads(module, params, batch(frames=4, key=2))  # a new shape
        loss_and_grads(module, params, batch())  # the old one again
    with torch.no_grad():  # grad off: a new signature
        for _ in range(2):
            forward(module, params, batch())
    assert stats.graphs == before + 2 and stats.recompiles == 0


def test_bad_install_is_refused_with_the_culprit_named():
    module = skeleton()
    for mode in ("step", "model"):  # (a whole model compiles through whole_function)
        with pytest.raises(ValueError, match=f"mode must be 'none' or 'blocks', got '{mode}'"):
            fvx_compile.install_units(module, GROUPS, mode=mode)
    with pytest.raises(ValueError, match="'blocks.7.' names no submodule"):
        fvx_compile.install_units(module, {"blocks": ["blocks.0.", "blocks.7."]})
    with pytest.raises(ValueError, match="end with '.'"):
        fvx_compile.install_units(module, {"blocks": ["blocks.0"]})
    with pytest.raises(ValueError, match="'condition_embedder.' differs from unit 'blocks.0.' of group 'blocks'"):
        fvx_compile.install_units(module, {"blocks": ["blocks.0.", "condition_embedder."]})
    with pytest.raises(ValueError, match="unknown unit groups"):
        fvx_compile.install_units(module, GROUPS, templates={"other": torch.nn.Linear(2, 2)})
    fvx_compile.install_units(module, GROUPS)
    with pytest.raises(ValueError, match="already has routed units"):
        fvx_compile.install_units(module, GROUPS)
    with pytest.raises(ValueError, match="already routed"):
        fvx_compile.template(module, "blocks.0.")


def test_each_install_owns_its_compile_cache():
    first = fvx_compile.unit_function(torch.nn.Linear(2, 2))
    second = fvx_compile.unit_function(torch.nn.Linear(2, 2))
    assert first.__code__ is not second.__code__


@pytest.mark.slow  # inductor generates and builds C++ kernels: tens of seconds on a small CPU
def test_inductor_compiled_blocks_match_eager(params, eager):
    module = skeleton(remat=True)
    stats = fvx_compile.install_units(module, GROUPS, mode="blocks", backend="inductor")
    for _ in range(2):
        loss, grads = loss_and_grads(module, params, batch())
    assert (stats.graphs, stats.recompiles) == (1, 0)
    torch.testing.assert_close(loss, eager[0], rtol=1e-5, atol=0)
    assert_grads_close(grads, eager[1], rtol=1e-4)
