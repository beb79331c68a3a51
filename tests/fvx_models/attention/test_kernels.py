"""The attention kernels as a per-model choice: ``math``, ``flex`` and ``sdpa`` give every family the same velocity,
``math`` has forward-mode derivatives, and a kernel that is unknown or not usable here is refused in one line."""
import msgspec
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from fvx.core import random
from fvx_models.attention import kernels
from fvx_models.wan import WanConfig
from fvx_models.wan_causal import WanCausalConfig

from family_cases import CASES, FAMILIES, inputs  # noqa: E402


def velocity(config, attention):
    model = msgspec.structs.replace(config, attention=attention).build()
    params = model.weights.init(random.key(0))
    x, t, cond = inputs(model, random.key(1))
    with torch.no_grad():
        return model.apply(params, x, t, cond)


@pytest.mark.parametrize("name", FAMILIES)
def test_math_and_flex_equal_sdpa_on_every_family(name):
    """Within 1e-5 of the velocity's scale (flex sums in another order: Kandinsky 5's differs by 0.99e-5 of it)."""
    config = CASES[name].config
    dense = velocity(config, "sdpa")
    for kernel in ("math", "flex"):
        error = (velocity(config, kernel) - dense).abs().max() / dense.abs().max().clamp(min=1.0)
        assert error <= 1e-5, f"{name} {kernel}: {error}"


class CountSDPA(torch.overrides.TorchFunctionMode):
    """Counts calls of torch's ``scaled_dot_product_attention`` (whatever name it is reached by)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += getattr(func, "__name__", "") == "scaled_dot_product_attention"
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", FAMILIES)
def test_an_installed_kernel_answers_every_attention_call_on_every_family(name):
    """With ``attention=math`` no attention module's call reaches torch's SDPA: processors that call diffusers'
    dispatcher, those that call ``F.scaled_dot_product_attention`` themselves (CogVideoX's, Latte's, Allegro's,
    HunyuanVideo's refiner) and Mochi's, which has no ``set_processor``, are all routed. Mochi's caption pooling
    (diffusers' ``MochiAttentionPool``: one query over the text) is no attention module and calls SDPA itself."""
    model = msgspec.structs.replace(CASES[name].config, attention="math").build()
    params = model.weights.init(random.key(0))
    x, t, cond = inputs(model, random.key(1))
    with torch.no_grad(), CountSDPA() as counted:
        model.apply(params, x, t, cond)
    assert counted.calls == (1 if name == "mochi" else 0)


@pytest.mark.parametrize("block_attention", ["prefix", "mask"])
def test_math_equals_sdpa_on_the_block_causal_wan(block_attention):
    config = WanCausalConfig(preset="tiny", num_frames_per_block=1, block_attention=block_attention)
    model_sdpa, model_math = config.build(), msgspec.structs.replace(config, attention="math").build()
    params = model_sdpa.weights.init(random.key(0))
    x, t, cond = inputs(model_sdpa, random.key(1))
    torch.testing.assert_close(model_math.apply(params, x, t, cond), model_sdpa.apply(params, x, t, cond),
                               rtol=1e-5, atol=1e-5)


def test_math_has_forward_mode_derivatives_equal_to_sdpa_s_math_backend():
    config = WanConfig(preset="tiny")
    math_model, sdpa_model = msgspec.structs.replace(config, attention="math").build(), config.build()
    params = math_model.weights.init(random.key(0))
    x, t, cond = inputs(math_model, random.key(1))
    tangent = random.normal(random.key(2), tuple(x.shape))
    _, got = torch.func.jvp(lambda x_: math_model.apply(params, x_, t, cond), (x,), (tangent,))
    with sdpa_kernel([SDPBackend.MATH]):
        _, want = torch.func.jvp(lambda x_: sdpa_model.apply(params, x_, t, cond), (x,), (tangent,))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    h = 1e-3
    finite = (math_model.apply(params, x + h * tangent, t, cond) - math_model.apply(params, x - h * tangent, t, cond))
    torch.testing.assert_close(got, finite / (2 * h), rtol=1e-2, atol=1e-2)
    assert math_model.rules.forward_ad_refusal is None
    assert "qat has no forward-mode derivatives" in msgspec.structs.replace(config, attention="qat").build() \
        .rules.forward_ad_refusal


def test_math_attention_against_a_hand_computation_with_masks():
    q, k, v = (random.normal(random.key(i), (1, 2, 3, 4)) for i in range(3))
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / 2.0
    keep = torch.tensor([[True, False, True]] * 3)
    want = scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(kernels.math_attention(q, k, v, attn_mask=keep), want)
    additive = torch.zeros(3, 3).masked_fill(~keep, -1e9)
    torch.testing.assert_close(kernels.math_attention(q, k, v, attn_mask=additive), want)
    torch.testing.assert_close(kernels.math_attention(q, k, v, is_causal=True),
                               torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    torch.testing.assert_close(kernels.flex(q, k, v, attn_mask=keep), want)


def test_unknown_and_unusable_kernels_are_refused_in_one_line():
    with pytest.raises(ValueError, match="attention='fast' is not an attention kernel; usable here: sdpa, math, flex, "
                                         "vsa, qat"):
        WanConfig(attention="fast")
    assert "flash" in kernels.dispatcher_names() and "native" not in kernels.dispatcher_names()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="attention=flash: diffusers' flash kernel is not usable here \\(needs a "
                                             "CUDA device\\)"):
            WanConfig(attention="flash").build()
        assert kernels.usable() == kernels.OWN
    with pytest.raises(ValueError, match="vsa.\\* knobs are set but attention=sdpa"):
        WanConfig(vsa=msgspec.structs.replace(WanConfig().vsa, sparsity=0.5))
    with pytest.raises(ValueError, match="qat.\\* knobs are set but attention=vsa"):
        WanConfig(attention="vsa", qat=msgspec.structs.replace(WanConfig().qat, validation="infer"))


@pytest.mark.parametrize("name, why", [("hunyuan_video", "video and text tokens together"),
                                       ("hunyuan_video15", "video and text tokens together")])
def test_vsa_is_refused_where_the_sequence_is_not_the_video_grid(name, why):
    with pytest.raises(ValueError, match=f"attention=vsa: the {name} family cannot run VSA: .*{why}"):
        msgspec.structs.replace(CASES[name].config, attention="vsa").build()
    with pytest.raises(ValueError, match="cannot run VSA: each query block attends to its own prefix"):
        WanCausalConfig(preset="tiny", attention="vsa").build()


@pytest.mark.cuda
def test_flex_trains_on_a_gpu():
    model = WanConfig(preset="tiny", attention="flex").build()
    params = {name: p.cuda().requires_grad_() for name, p in model.weights.init(random.key(0)).items()}
    x, t, cond = inputs(model, random.key(1))
    x, t, cond = x.cuda(), t.cuda(), {name: c.cuda() for name, c in cond.items()}
    model.apply(params, x, t, cond).square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in params.values() if p.grad is not None)
