"""WanConfig(compile="blocks" | "model"): a fine-tuning step with compiled blocks (or the whole forward compiled)
matches the eager step, in one compiled graph over several steps; the dry-run description of a Wan preset."""
import math

import pytest
import torch

from fvx.core import random, state as fstate
from fvx.core.optim_config import AdamWConfig
from fvx_methods import finetune
from fvx_models import wan, wan_causal, wan_moe

STEPS = 3


def batch(step: int) -> dict:
    k = random.split(random.key(100 + step), 2)
    return {"latents": random.normal(k[0], (2, 16, 2, 4, 4)), "sample_index": torch.arange(2 * step, 2 * step + 2),
            "cond": {"text": random.normal(k[1], (2, 8, 32)), "text_mask": torch.ones(2, 8)}}


def train(compile: str, remat: bool, backend: str = "aot_eager") -> tuple[list, fstate.TrainState, object]:
    """(per-step metrics, final state, the model) of STEPS fine-tuning steps of the tiny Wan."""
    model = wan.WanConfig(preset="tiny", remat=remat, compile=compile, compile_backend=backend).build()
    program = finetune.Finetune(optim=AdamWConfig(lr=1e-3, weight_decay=0.01)).build({"student": model},
                                                                                    total_steps=STEPS)
    state, metrics = program.init(random.key(0)), []
    for step in range(STEPS):
        state, m = program.step_(state, {}, batch(step))
        metrics.append(m)
    return metrics, state, model


def assert_same_training(got, want, rel: float = 1e-5, atol: float = 1e-6):
    (metrics, state, _), (eager_metrics, eager_state, _) = got, want
    for m, e in zip(metrics, eager_metrics):
        for name in ("loss", "grad_norm"):
            assert math.isclose(m[name].item(), e[name].item(), rel_tol=rel), name
    params, ref = state.roles["student"].params, eager_state.roles["student"].params
    for name in ref:
        torch.testing.assert_close(params[name], ref[name], rtol=rel, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("compile", ["blocks", "model"])
def test_compiled_step_matches_eager_in_one_graph(compile, remat):
    eager = train("none", remat)
    compiled = train(compile, remat)
    assert eager[2].kernels.compile_stats is None
    stats = compiled[2].kernels.compile_stats
    assert (stats.graphs, stats.recompiles) == (1, 0)  # 2 blocks (or the whole forward), 3 steps: one graph
    assert_same_training(compiled, eager)


@pytest.mark.slow
def test_whole_model_compiled_by_inductor_with_remat_matches_eager():
    """Inductor's code, not only its graph: one process with remat gives the eager gradients (on a mesh it did not,
    so compile=model is refused there)."""
    compiled = train("model", True, backend="inductor")
    assert compiled[2].kernels.compile_stats.recompiles == 0
    assert_same_training(compiled, train("none", True), rel=1e-4, atol=1e-5)  # AMD EPYC: one element 7.5e-6 off


def test_whole_model_compile_is_refused_on_a_mesh_and_where_the_forward_is_not_one_graph():
    with pytest.raises(ValueError, match="wan:tiny: compile=model compiles the whole forward in one process only"):
        wan.WanConfig(preset="tiny", compile="model").build(mesh=object())
    with pytest.raises(ValueError, match="cannot compile the wan_causal family's forward as one graph .its forward "
                                         "binds per-call state"):
        wan_causal.WanCausalConfig(preset="tiny", compile="model").build()
    with pytest.raises(ValueError, match="wan_moe family's forward as one graph .its router splits the batch"):
        wan_moe.Wan22MoEConfig(preset="tiny", compile="model").build()


def test_bad_compile_mode_names_the_field():
    import msgspec

    with pytest.raises(msgspec.ValidationError, match="compile"):
        msgspec.convert({"compile": "step"}, wan.WanConfig)


def test_memory_spec_describes_the_preset_from_its_skeleton():
    spec = wan.WanConfig(preset="wan2.1-t2v-1.3b", compute_dtype="bf16", remat=True).build().memory_spec()
    assert spec.units == tuple(f"blocks.{i}." for i in range(30)) and spec.vae_stride == (4, 8, 8)
    (blocks,) = spec.groups
    assert (spec.dim, blocks.ffn_dim, blocks.count, spec.text_len) == (1536, 8960, 30, 512)
    assert spec.compute_bytes == 2 and spec.remat and spec.frozen_bytes == 2
    assert 1.2e9 < sum(math.prod(s) for s in spec.shapes.values()) < 1.5e9
    assert spec.shapes["blocks.0.ffn.net.0.proj.weight"] == (8960, 1536)
