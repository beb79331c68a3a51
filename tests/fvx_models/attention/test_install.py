"""A model's sparse (VSA) and fake-quantized (QAT) attention as the builder installs them: zero gates make a dense
checkpoint start as itself and travel with exports, the sparsity schedule and the dense view are what the model
computes, gradients reach the gates, and QAT trains."""
import msgspec
import pytest
import torch
from diffusers import WanTransformer3DModel

from fvx.core import random
from fvx_models.attention import install
from fvx_models.attention.config import QATConfig, VSAConfig
from fvx_models.wan import WanConfig

from family_cases import CASES, inputs  # noqa: E402

TINY = WanConfig(preset="tiny")
GRID = dict(frames=8, size=16)  # latents [B, 16, 8, 16, 16]: an (8, 8, 8) token grid of 8 tiles


def vsa(**knobs) -> WanConfig:
    return msgspec.structs.replace(TINY, attention="vsa", vsa=VSAConfig(implementation="reference", **knobs))


def test_a_dense_checkpoint_loads_with_zero_gates_and_starts_as_itself(dense_folder):
    folder, dense, dense_params = dense_folder
    model = vsa(sparsity=0.0).build()
    params = model.weights.load(str(folder))
    gates = [name for name in params if install.GATE in name]
    assert gates == ["blocks.0.to_gate_compress.weight", "blocks.0.to_gate_compress.bias",
                     "blocks.1.to_gate_compress.weight", "blocks.1.to_gate_compress.bias"]
    assert all(params[name].abs().max() == 0 for name in gates)
    x, t, cond = inputs(model, random.key(1), **GRID)
    torch.testing.assert_close(model.apply(params, x, t, cond), dense.apply(dense_params, x, t, cond),
                               rtol=1e-5, atol=1e-5)


def test_sparse_attention_changes_the_output_and_the_dense_view_does_not(dense_folder):
    folder, dense, dense_params = dense_folder
    model = vsa(sparsity=0.75).build()
    params = model.weights.load(str(folder))
    x, t, cond = inputs(model, random.key(1), **GRID)
    want = dense.apply(dense_params, x, t, cond)
    assert (model.apply(params, x, t, cond) - want).abs().max() > 1e-3
    torch.testing.assert_close(model.dense().apply(params, x, t, cond), want, rtol=1e-5, atol=1e-5)
    assert TINY.build().dense().kernels.dense_apply is None  # other kernels have no dense view: the model itself


def test_the_sparsity_schedule_ramps_from_dense_inside_training_steps(dense_folder):
    folder, dense, dense_params = dense_folder
    ramp = vsa(sparsity=0.75, decay_rate=0.25, decay_interval_steps=2).build()
    fixed = vsa(sparsity=0.5).build()
    params = ramp.weights.load(str(folder))
    x, t, cond = inputs(ramp, random.key(1), **GRID)
    want = {0: dense.apply(dense_params, x, t, cond), 2: None, 4: fixed.apply(params, x, t, cond),
            9: ramp.apply(params, x, t, cond)}  # outside a step: the target
    for step, expected in want.items():
        with ramp.kernels.attention_step(step):
            got = ramp.apply(params, x, t, cond)
        if expected is not None:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    with ramp.kernels.attention_step(0), ramp.kernels.attention_step(4):
        torch.testing.assert_close(ramp.apply(params, x, t, cond), want[4])
    torch.testing.assert_close(ramp.apply(params, x, t, cond), want[9])  # restored after the steps


def test_gradients_reach_the_gates_and_the_export_keeps_them(dense_folder, tmp_path):
    folder, _, _ = dense_folder
    model = vsa(sparsity=0.75).build()
    params = {name: p.requires_grad_() for name, p in model.weights.load(str(folder)).items()}
    x, t, cond = inputs(model, random.key(1), **GRID)
    model.apply(params, x, t, cond).square().mean().backward()
    assert params["blocks.0.to_gate_compress.weight"].grad.abs().max() > 0
    assert all(torch.isfinite(p.grad).all() for p in params.values() if p.grad is not None)
    trained = {name: p.detach() + (0.01 if install.GATE in name else 0.0) for name, p in params.items()}
    model.export.folder(trained, str(tmp_path / "vsa"))
    back = model.weights.load(str(tmp_path / "vsa"))
    assert all(torch.equal(back[name], trained[name]) for name in trained)
    with pytest.raises(ValueError, match="to_gate_compress"):
        TINY.build().weights.load(str(tmp_path / "vsa"))  # a dense model would drop trained gates: refused, named
    loaded, info = WanTransformer3DModel.from_pretrained(str(tmp_path / "vsa" / "transformer"),
                                                         output_loading_info=True)
    assert sorted(info["unexpected_keys"]) == sorted(name for name in trained if install.GATE in name)


def test_kernels_this_machine_cannot_run_are_refused_at_build():
    if torch.cuda.is_available():
        pytest.skip("the kernel may be installed")
    with pytest.raises(ValueError, match="vsa.implementation=kernel: fastvideo-kernel's VSA kernel needs a CUDA"):
        msgspec.structs.replace(vsa(), vsa=VSAConfig(implementation="kernel")).build()
    with pytest.raises(ValueError, match="qat.validation=infer: "):
        msgspec.structs.replace(TINY, attention="qat", qat=QATConfig(validation="infer")).build()


def test_qat_runs_fake_quantized_attention_in_every_attention_module_and_trains():
    model = msgspec.structs.replace(TINY, attention="qat").build()
    params = model.weights.init(random.key(0))
    x, t, cond = inputs(model, random.key(1))
    calls = []

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "scaled_dot_product_attention":  # torch's, whichever name reached it
                calls.append(1)
            return func(*args, **(kwargs or {}))
    with Count():
        quantized = model.apply(params, x, t, cond)
    assert not calls  # self- and cross-attention both answered by the QAT kernel
    dense = TINY.build().apply(params, x, t, cond)
    error = ((quantized - dense).norm() / dense.norm()).item()
    assert 1e-4 < error < 0.2
    trainable = {name: p.requires_grad_() for name, p in params.items()}
    model.apply(trainable, x, t, cond).square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in trainable.values() if p.grad is not None)
    assert trainable["blocks.0.attn1.to_q.weight"].grad.abs().max() > 0


@pytest.mark.parametrize("attention", ["math", "qat", "vsa"])
def test_compiled_units_run_the_kernel_as_eager_units_do(attention):
    """``compile=blocks`` traces the kernel inside each block's graph (aot_eager: the numerics without codegen)."""
    knobs = {"vsa": VSAConfig(implementation="reference", sparsity=0.5)} if attention == "vsa" else {}
    eager = msgspec.structs.replace(TINY, attention=attention, **knobs).build()
    compiled = msgspec.structs.replace(TINY, attention=attention, compile="blocks", compile_backend="aot_eager",
                                       **knobs).build()
    params = eager.weights.init(random.key(0))
    x, t, cond = inputs(eager, random.key(1), **GRID)
    with torch.no_grad():
        torch.testing.assert_close(compiled.apply(params, x, t, cond), eager.apply(params, x, t, cond),
                                   rtol=1e-5, atol=1e-5)
    assert compiled.kernels.compile_stats.graphs == 1


def test_a_kernel_in_a_processor_calling_torchs_sdpa_itself_compiles_into_one_graph_a_group():
    """Latte's processors call ``F.scaled_dot_product_attention`` themselves: ``qat`` answers them in compiled units
    as in eager ones, each unit group one graph (aot_eager)."""
    config = CASES["latte"].config
    eager = msgspec.structs.replace(config, attention="qat").build()
    compiled = msgspec.structs.replace(config, attention="qat", compile="blocks", compile_backend="aot_eager").build()
    params = eager.weights.init(random.key(0))
    x, t, cond = inputs(eager, random.key(1))
    with torch.no_grad():
        quantized = eager.apply(params, x, t, cond)
        torch.testing.assert_close(compiled.apply(params, x, t, cond), quantized, rtol=1e-5,
                                   atol=1e-5 * float(quantized.abs().max()))
        assert not torch.equal(quantized, msgspec.structs.replace(config).build().apply(params, x, t, cond))
    assert compiled.kernels.compile_stats.graphs == 2 and compiled.kernels.compile_stats.recompiles == 0
