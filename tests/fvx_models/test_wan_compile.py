"""WanConfig(compile="blocks"): a fine-tuning step with compiled blocks matches the eager step, and all blocks share one
compiled graph over several steps; the dry-run description of a Wan preset."""
import math

import pytest
import torch

from fvx import random
from fvx import state as fstate
from fvx.optim_config import AdamWConfig
from fvx_methods import finetune
from fvx_models import wan

STEPS = 3


def batch(step: int) -> dict:
    k = random.split(random.key(100 + step), 2)
    return {"latents": random.normal(k[0], (2, 16, 2, 4, 4)), "sample_index": torch.arange(2 * step, 2 * step + 2),
            "cond": {"text": random.normal(k[1], (2, 8, 32)), "text_mask": torch.ones(2, 8)}}


def train(compile: str, remat: bool) -> tuple[list, fstate.TrainState, object]:
    """(per-step metrics, final state, the model) of STEPS fine-tuning steps of the tiny Wan."""
    model = wan.WanConfig(preset="tiny", remat=remat, compile=compile, compile_backend="aot_eager").build()
    program = finetune.Finetune(optim=AdamWConfig(lr=1e-3, weight_decay=0.01)).build({"student": model},
                                                                                    total_steps=STEPS)
    state, metrics = program.init(random.key(0)), []
    for step in range(STEPS):
        state, m = program.step_(state, {}, batch(step))
        metrics.append(m)
    return metrics, state, model


@pytest.mark.parametrize("remat", [False, True])
def test_compiled_blocks_step_matches_eager_with_one_graph_for_all_blocks(remat):
    eager_metrics, eager_state, eager_model = train("none", remat)
    metrics, state, model = train("blocks", remat)
    assert eager_model.compile_stats is None
    assert (model.compile_stats.graphs, model.compile_stats.recompiles) == (1, 0)  # 2 blocks, 3 steps: one graph
    for got, want in zip(metrics, eager_metrics):
        for name in ("loss", "grad_norm"):
            assert math.isclose(got[name].item(), want[name].item(), rel_tol=1e-5), name
    params, want = state.roles["student"].params, eager_state.roles["student"].params
    for name in want:
        torch.testing.assert_close(params[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


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
