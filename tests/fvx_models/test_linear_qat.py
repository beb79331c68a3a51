"""NVFP4 quantization-aware training of linear layers: the forward is a hand NVFP4 quantize-dequantize of activations
and weights (written here from the format: a global scale, blocks of 16 scaled to E4M3, elements rounded to E2M1),
the backward the full-precision gradient, only the curated layers change, and nothing is added to checkpoints."""
import filecmp

import msgspec
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fvx.core import random
from fvx_models import build, linear_qat
from fvx_models.kandinsky5 import Kandinsky5Config
from fvx_models.linear_qat import LinearQATConfig
from fvx_models.ltx2 import LTX2Config
from fvx_models.wan import WanConfig
from fvx_models.wan_moe import Wan22MoEConfig

from family_cases import inputs  # noqa: E402

GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1 magnitudes; codes 0..7
TINY = WanConfig(preset="tiny")
QAT = msgspec.structs.replace(TINY, linear_qat=LinearQATConfig(implementation="reference"))
# FastVideo's LTX-2 deployment set (nvfp4_config.py _LTX2_NVFP4_BLOCK_LINEAR_SUFFIXES), in diffusers' names
LTX2_SUFFIXES = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_out.0",
                 "audio_to_video_attn.to_q", "audio_to_video_attn.to_out.0", "video_to_audio_attn.to_k",
                 "video_to_audio_attn.to_v", "ff.net.0.proj", "ff.net.2")
WAN_SUFFIXES = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v",
                "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")


def e2m1_by_hand(v: float) -> float:
    """Nearest E2M1 magnitude, ties to the even code, saturating at 6; the sign kept."""
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda code: (abs(GRID[code] - a), code % 2))
    return GRID[best] if v >= 0 else -GRID[best]


def nvfp4_by_hand(x: torch.Tensor) -> torch.Tensor:
    """Two-level NVFP4 of a 2-D tensor, element by element: g = 2688 / amax; per 16 along the last dim the scale
    e4m3(block amax * g / 6); each element e2m1(x g / scale) * scale / g."""
    x = x.double()
    g = 448.0 * 6.0 / float(x.abs().max())
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        for start in range(0, x.shape[1], 16):
            block = x[row, start:start + 16]
            scale = float(torch.tensor(float(block.abs().max()) * g / 6.0).to(torch.float8_e4m3fn).double())
            if scale == 0:
                continue
            for i, value in enumerate(block.tolist()):
                out[row, start + i] = e2m1_by_hand(value * g / scale) * scale / g
    return out


def test_fake_quantize_is_the_hand_nvfp4():
    x = random.normal(random.key(0), (3, 40)) * torch.linspace(0.01, 3.0, 40)
    assert torch.allclose(linear_qat.fake_quantize_nvfp4(x).double(), nvfp4_by_hand(x), rtol=1e-6, atol=1e-9)
    largest = x.abs().argmax()
    assert linear_qat.fake_quantize_nvfp4(x).flatten()[largest] == x.flatten()[largest].sign() * x.abs().max()


def test_forward_is_hand_quantized_activations_times_hand_quantized_weights():
    x = random.normal(random.key(1), (2, 5, 32))
    weight, bias = random.normal(random.key(2), (24, 32)) * 0.2, random.normal(random.key(3), (24,))
    out = linear_qat.nvfp4_linear(x, weight, bias)
    hand = nvfp4_by_hand(x.reshape(10, 32)) @ nvfp4_by_hand(weight).T + bias.double()
    assert out.shape == (2, 5, 24)
    assert torch.allclose(out.reshape(10, 24).double(), hand, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, F.linear(x, weight, bias), atol=1e-3)  # it does quantize


def test_backward_is_the_full_precision_gradient():
    x = random.normal(random.key(1), (2, 5, 32)).requires_grad_()
    weight = (random.normal(random.key(2), (24, 32)) * 0.2).requires_grad_()
    bias = random.normal(random.key(3), (24,)).requires_grad_()
    upstream = random.normal(random.key(4), (2, 5, 24))
    linear_qat.nvfp4_linear(x, weight, bias).backward(upstream)
    flat = upstream.reshape(10, 24)
    assert torch.allclose(x.grad, (flat @ weight.detach()).reshape(2, 5, 32), atol=1e-6)
    assert torch.allclose(weight.grad, flat.T @ x.detach().reshape(10, 32), atol=1e-5)
    assert torch.allclose(bias.grad, flat.sum(0), atol=1e-6)


def test_a_bf16_call_quantizes_in_fp32_and_answers_in_bf16():
    x = random.normal(random.key(1), (4, 32)).bfloat16()
    weight = random.normal(random.key(2), (8, 32)).bfloat16()
    out = linear_qat.nvfp4_linear(x, weight)
    assert out.dtype == torch.bfloat16
    hand = (nvfp4_by_hand(x.float()) @ nvfp4_by_hand(weight.float()).T).bfloat16()
    assert torch.allclose(out.float(), hand.float(), rtol=1e-2, atol=1e-2)


def qat_layers(module: nn.Module) -> list[str]:
    return [name for name, part in module.named_modules() if isinstance(part, linear_qat.QATLinear)]


def test_the_ltx2_set_is_fastvideos_deployment_set_and_audio_stays_dense():
    module = build.skeleton(LTX2Config(preset="tiny"))
    chosen = linear_qat.targets(LinearQATConfig(), module=module, family=LTX2Config.family)
    blocks = len(module.transformer_blocks)
    assert sorted(chosen) == sorted(f"transformer_blocks.{i}.{suffix}" for i in range(blocks)
                                    for suffix in LTX2_SUFFIXES)
    assert not any(part in name for name in chosen for part in (".audio_attn1.", ".audio_attn2.", ".audio_ff."))


def test_ltx2_qat_attention_runs_in_the_video_self_attention_only():
    model = msgspec.structs.replace(LTX2Config(preset="tiny"), attention="qat").build()
    skeleton = model.apply.args[1]
    wrapped = sorted(name for name, part in skeleton.named_modules()
                     if type(getattr(part, "processor", None)).__name__.startswith("Kernel"))
    assert wrapped == [f"transformer_blocks.{i}.attn1" for i in range(len(skeleton.transformer_blocks))]


def test_only_the_curated_layers_change_the_forward_and_nothing_is_added(tmp_path):
    """The QAT model equals the dense model whose curated layers (and only those) answer with the hand NVFP4 linear;
    its params and its export are the dense model's."""
    dense, model = TINY.build(), QAT.build()
    params = dense.weights.init(random.key(0))
    assert set(model.weights.init(random.key(0))) == set(params)
    x, t, cond = inputs(model, random.key(1))
    skeleton = dense.apply.args[1]
    chosen = [f"blocks.{i}.{suffix}" for i in range(len(skeleton.blocks)) for suffix in WAN_SUFFIXES]
    assert sorted(qat_layers(model.apply.args[1])) == sorted(chosen)

    def by_hand(layer, args, out):
        flat = args[0].reshape(-1, args[0].shape[-1])
        hand = (nvfp4_by_hand(flat) @ nvfp4_by_hand(layer.weight.detach()).T + layer.bias.double()).float()
        return hand.view(out.shape)
    hooks = [skeleton.get_submodule(name).register_forward_hook(by_hand) for name in chosen]
    try:
        expected = dense.apply(params, x, t, cond)
    finally:
        for hook in hooks:
            hook.remove()
    quantized = model.apply(params, x, t, cond)
    assert torch.allclose(quantized, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(quantized, dense.apply(params, x, t, cond), atol=1e-3)
    model.export.folder(params, str(tmp_path / "qat"))
    dense.export.folder(params, str(tmp_path / "dense"))
    for name in ("transformer/diffusion_pytorch_model.safetensors", "transformer/config.json"):
        assert filecmp.cmp(tmp_path / "qat" / name, tmp_path / "dense" / name, shallow=False)


def test_a_training_step_reaches_the_fp32_masters():
    model = QAT.build()
    params = {name: p.requires_grad_() for name, p in model.weights.init(random.key(0)).items()}
    x, t, cond = inputs(model, random.key(1))
    model.apply(params, x, t, cond).square().mean().backward()
    assert params["blocks.0.ffn.net.0.proj.weight"].grad.dtype == torch.float32
    assert params["blocks.0.ffn.net.0.proj.weight"].grad.abs().max() > 0
    assert all(torch.isfinite(p.grad).all() for p in params.values() if p.grad is not None)


def test_bad_sets_are_refused_in_one_line_before_any_weight():
    with pytest.raises(ValueError, match=r"wan:tiny: linear_qat.modules: 'blocks.\*.attn9.to_q' matches no linear "
                                         r"layer of the wan family; some of its layers: .*blocks.\*.attn1.to_q"):
        msgspec.structs.replace(TINY, linear_qat=LinearQATConfig(modules=("blocks.*.attn9.to_q",))).build()
    with pytest.raises(ValueError, match="the kandinsky5 family has no curated NVFP4 linear set; name the layers "
                                         "with linear_qat.modules"):
        Kandinsky5Config(preset="tiny", linear_qat=LinearQATConfig()).build()
    with pytest.raises(ValueError, match="linear_qat.modules must name at least one"):
        LinearQATConfig(modules=())
    if linear_qat.kernel_available() is not None:
        with pytest.raises(ValueError, match="linear_qat.implementation=kernel: "):
            msgspec.structs.replace(TINY, linear_qat=LinearQATConfig(implementation="kernel")).build()


def test_the_two_experts_each_take_wans_set():
    config = Wan22MoEConfig(preset="tiny", linear_qat=LinearQATConfig())
    layers = qat_layers(config.build().apply.args[1])
    assert len(layers) == 2 * config.spec.kwargs["num_layers"] * len(WAN_SUFFIXES)


def test_named_modules_take_it_on_a_family_without_a_curated_set():
    config = Kandinsky5Config(preset="tiny", linear_qat=LinearQATConfig(modules=("*.feed_forward.*",)))
    layers = qat_layers(config.build().apply.args[1])
    assert layers and all(".feed_forward." in name for name in layers)


def test_forward_mode_methods_are_refused():
    assert "linear_qat has no forward-mode derivatives" in QAT.build().rules.forward_ad_refusal


@pytest.mark.cuda
def test_kernel_matches_the_reference():
    if linear_qat.kernel_available() is not None:
        pytest.skip(linear_qat.kernel_available())
    x = random.normal(random.key(1), (256, 128)).cuda().bfloat16()
    weight = random.normal(random.key(2), (64, 128)).cuda().bfloat16()
    kernel = linear_qat.nvfp4_linear_kernel(x, weight).float()
    reference = linear_qat.nvfp4_linear(x, weight).float()
    assert ((kernel - reference).norm() / reference.norm()).item() < 2e-2
