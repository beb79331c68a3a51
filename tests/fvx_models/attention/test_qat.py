"""Attn-QAT reference: E2M1 / E4M3 roundings against hand values, NVFP4 fake quantization's block behaviour, the
fake-quantized attention's forward against a hand composition and its STE backward against the hand formulas, masks,
and (CUDA, when FastVideo's kernels are installed) the kernels against the reference."""
import math

import pytest
import torch

from fvx.core import random
from fvx_models.attention.qat import (e2m1, fake_quantize, infer_kernel_available, kernel_available,
                                      qat_attention, qat_attention_infer, qat_attention_kernel)


def identity(x, dim=-1):
    return x


def dense(q, k, v, mask=None):
    """Plain softmax attention in fp32 (the independent reference)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


def qkv(key, b=1, h=2, lq=20, lk=37, d=32):
    kq, kk, kv = random.split(key, 3)
    return random.normal(kq, (b, h, lq, d)), random.normal(kk, (b, h, lk, d)), random.normal(kv, (b, h, lk, d))


def test_e2m1_hand_values():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.8, 0.2, 0.3, 0.6, 2.6, 4.9, 5.1, 100.0, -7.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, 0.0, 0.5, 0.5, 3.0, 4.0, 6.0, 6.0, -6.0])
    assert torch.equal(e2m1(x), want)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    assert torch.equal(e2m1(grid), grid) and torch.equal(e2m1(-grid), -grid)
    assert e2m1(x.bfloat16()).dtype == torch.bfloat16 and torch.equal(e2m1(x.bfloat16()).float(), want)


def test_fake_quantize_exact_scale_block():
    # amax 3 -> scale 3 / 6 = 0.5, exact in E4M3; elements / 0.5 rounded to E2M1, times 0.5.
    x = torch.tensor([3.0, -3.0, 0.1, 0.13, 0.4, 0.6, 0.7, 0.9, 1.1, 1.3, 1.6, 2.2, 2.6, -1.9, 0.0, -0.2])
    scaled = [6, -6, 0.2, 0.26, 0.8, 1.2, 1.4, 1.8, 2.2, 2.6, 3.2, 4.4, 5.2, -3.8, 0, -0.4]
    rounded = [6, -6, 0, 0.5, 1, 1, 1.5, 2, 2, 3, 3, 4, 6, -4, 0, -0.5]
    assert [round(s, 6) for s in (x / 0.5).tolist()] == pytest.approx(scaled)
    assert torch.equal(fake_quantize(x), torch.tensor(rounded) * 0.5)


def test_fake_quantize_rounded_scale_block():
    # amax 5 -> 5 / 6 = 0.8333 is in E4M3's binade [0.5, 1) with step 2**-1 * 2**-3 = 1/16: 13.33 steps -> 13/16.
    s = 13 / 16
    x = torch.tensor([5.0, 1.0, -2.0, 3.0] + [0.0] * 12)
    # 5 / s = 6.15 -> 6, 1 / s = 1.23 -> 1, 2 / s = 2.46 -> 2, 3 / s = 3.69 -> 4
    assert torch.equal(fake_quantize(x), torch.tensor([6.0, 1.0, -2.0, 4.0] + [0.0] * 12) * s)
    # amax 81/16 -> 27/32 = 13.5/16: a tie between 13/16 (odd mantissa 101) and 14/16 (even 110) -> 14/16.
    x = torch.tensor([81 / 16] + [0.0] * 15)
    assert fake_quantize(x)[0].item() == 6 * 14 / 16
    # amax 6000 -> 1000 saturates at E4M3's 448: 6000 / 448 = 13.4 -> 6 -> 2688, 448 / 448 = 1 -> 448.
    x = torch.tensor([6000.0, 448.0] + [0.0] * 14)
    assert fake_quantize(x)[:2].tolist() == [2688.0, 448.0]
    # amax 0.01 -> 0.00167: E4M3 subnormal step 2**-9 (0.00195), 0.85 steps -> 2**-9; 0.01 / 2**-9 = 5.12 -> 6.
    x = torch.tensor([0.01] + [0.0] * 15)
    assert fake_quantize(x)[0].item() == 6 * 2 ** -9
    # amax 0.005 -> 0.00083 < half a step: the scale rounds to 0 and the block flushes to zeros (no NaN).
    x = torch.tensor([0.005, -0.003] + [0.0] * 14)
    assert torch.equal(fake_quantize(x), torch.zeros(16))


def test_fake_quantize_blocks(key):
    x = random.normal(key, (3, 4, 48)) * 3
    fq = fake_quantize(x)
    assert torch.equal(fake_quantize(torch.zeros(2, 32)), torch.zeros(2, 32))
    assert torch.equal(fake_quantize(fq), fq)  # idempotent
    assert 0 < (fq - x).abs().max() <= x.abs().max() / 6  # half the top E2M1 gap (2) times a scale <= amax/6*(1+1/16)
    # Blocks are independent: changing block 1 leaves blocks 0 and 2 alone.
    y = x.clone()
    y[..., 16:32] *= 100
    fy = fake_quantize(y)
    assert torch.equal(fy[..., :16], fq[..., :16]) and torch.equal(fy[..., 32:], fq[..., 32:])
    # Another dim: the same as moving it last; bf16 in, bf16 out.
    assert torch.equal(fake_quantize(x.transpose(1, 2), dim=1), fq.transpose(1, 2))
    assert fake_quantize(x.bfloat16()).dtype == torch.bfloat16
    # A dim that is not a multiple of 16 is padded with zeros: the same as quantizing the zero-padded tensor.
    odd = x[..., :37]
    padded = torch.cat([odd, torch.zeros(3, 4, 11)], dim=-1)
    assert torch.equal(fake_quantize(odd), fake_quantize(padded)[..., :37])


def test_fake_quantize_refuses_bad_input():
    with pytest.raises(ValueError, match="block=0"):
        fake_quantize(torch.ones(16), block=0)
    with pytest.raises(ValueError, match="dim=2"):
        fake_quantize(torch.ones(16), dim=2)
    with pytest.raises(ValueError, match="x: dtype torch.int64"):
        fake_quantize(torch.ones(16, dtype=torch.long))


def test_identity_quantizer_is_dense_attention(key):
    q, k, v = (x.requires_grad_() for x in qkv(key))
    g = random.normal(random.key(1), (1, 2, 20, 32))
    out = qat_attention(q, k, v, quantize=identity)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref = dense(q, k, v)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    assert torch.allclose(out, ref, atol=1e-6, rtol=0)
    for got, want in zip(grads, ref_grads):
        assert torch.allclose(got, want, atol=1e-6, rtol=0)


def hand(q, k, v):
    """The forward and the STE quantities composed by hand: fq q, k, v; p against the row max; fq p; / l."""
    scale = q.shape[-1] ** -0.5
    qh, kh, vh = fake_quantize(q), fake_quantize(k), fake_quantize(v)
    s = qh @ kh.transpose(-1, -2) * scale
    p = torch.exp(s - s.amax(-1, keepdim=True))
    l = p.sum(-1, keepdim=True)
    return dict(qh=qh, kh=kh, vh=vh, p=p, l=l, scale=scale, out=fake_quantize(p) @ vh / l, out_hp=p @ vh / l)


def test_forward_is_the_hand_composition(key):
    q, k, v = qkv(key)
    h = hand(q, k, v)
    out = qat_attention(q, k, v)
    assert torch.allclose(out, h["out"], atol=1e-6, rtol=0)
    assert not torch.allclose(out, h["out_hp"], atol=1e-3)  # P really is quantized
    assert qat_attention(q.bfloat16(), k.bfloat16(), v.bfloat16()).dtype == torch.bfloat16


def test_ste_gradients_are_the_hand_formulas(key):
    q, k, v = (x.requires_grad_() for x in qkv(key))
    g = random.normal(random.key(1), (1, 2, 20, 32))
    dq, dk, dv = torch.autograd.grad(qat_attention(q, k, v), (q, k, v), g)
    h = hand(q.detach(), k.detach(), v.detach())
    probs = h["p"] / h["l"]
    want_dv = fake_quantize(probs).transpose(-1, -2) @ g  # the kernel quantizes the normalised P
    delta = (g * h["out_hp"]).sum(-1, keepdim=True)  # from the high-precision output
    ds = probs * (g @ h["vh"].transpose(-1, -2) - delta)
    want_dq = ds @ h["kh"] * h["scale"]
    want_dk = ds.transpose(-1, -2) @ h["qh"] * h["scale"]
    assert torch.allclose(dv, want_dv, atol=1e-6, rtol=0)
    assert torch.allclose(dq, want_dq, atol=1e-6, rtol=0)
    assert torch.allclose(dk, want_dk, atol=1e-6, rtol=0)
    # Delta really comes from O_hp: the quantized output would give a different dq.
    ds_q = probs * (g @ h["vh"].transpose(-1, -2) - (g * h["out"]).sum(-1, keepdim=True))
    assert not torch.allclose(dq, ds_q @ h["kh"] * h["scale"], atol=1e-4)


def test_error_against_dense_is_small_but_nonzero(key):
    q, k, v = (x.requires_grad_() for x in qkv(key, b=2, h=2, lq=64, lk=64, d=64))
    g = random.normal(random.key(1), (2, 2, 64, 64))
    out, ref = qat_attention(q, k, v), dense(q, k, v)
    relative = ((out - ref).norm() / ref.norm()).item()
    assert 1e-3 < relative < 0.3, relative
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for got, want in zip(grads, ref_grads):
        assert 1e-3 < ((got - want).norm() / want.norm()).item() < 0.5


def test_bool_mask_hiding_whole_blocks_is_dropping_them(key):
    q, k, v = qkv(key, lk=48)
    g = random.normal(random.key(1), (1, 2, 20, 32))
    # The tail (keys 40..47) and an aligned block of 16 (keys 16..31): the remaining keys keep their 16-blocks.
    for keep in (torch.arange(48) < 40, (torch.arange(48) < 16) | (torch.arange(48) >= 32)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        masked = qat_attention(*leaves, attn_mask=keep)
        masked_grads = torch.autograd.grad(masked, leaves, g)
        kept = [q.clone().requires_grad_(), k[:, :, keep].clone().requires_grad_(),
                v[:, :, keep].clone().requires_grad_()]
        dropped = qat_attention(*kept)
        dropped_grads = torch.autograd.grad(dropped, kept, g)
        assert torch.allclose(masked, dropped, atol=1e-6, rtol=0)
        assert torch.allclose(masked_grads[0], dropped_grads[0], atol=1e-6, rtol=0)
        for i in (1, 2):
            assert torch.allclose(masked_grads[i][:, :, keep], dropped_grads[i], atol=1e-6, rtol=0)
            assert torch.equal(masked_grads[i][:, :, ~keep], torch.zeros_like(masked_grads[i][:, :, ~keep]))


def test_masks_without_quantization_match_dense(key):
    q, k, v = qkv(key)
    keep = random.uniform(random.key(2), (1, 1, 20, 37)) > 0.4
    keep[..., 0] = True
    additive = torch.where(keep, 0.0, float("-inf"))
    want = dense(q, k, v, keep)
    assert torch.allclose(qat_attention(q, k, v, attn_mask=keep, quantize=identity), want, atol=1e-6, rtol=0)
    assert torch.allclose(qat_attention(q, k, v, attn_mask=additive, quantize=identity), want, atol=1e-6, rtol=0)
    causal = torch.ones(20, 37, dtype=torch.bool).tril()
    assert torch.allclose(qat_attention(q, k, v, is_causal=True), qat_attention(q, k, v, attn_mask=causal), atol=0)
    # A row with nothing to attend to gives zeros (and zero gradients), not NaN.
    none = torch.ones(20, 37, dtype=torch.bool)
    none[3] = False
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = qat_attention(*leaves, attn_mask=none)
    assert torch.equal(out[:, :, 3], torch.zeros(1, 2, 32))
    assert all(torch.isfinite(grad).all() for grad in torch.autograd.grad(out.sum(), leaves))


def test_bad_input_is_refused(key):
    q, k, v = qkv(key)
    with pytest.raises(ValueError, match="attn_mask: shape"):
        qat_attention(q, k, v, attn_mask=torch.ones(20, 36, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask: dtype"):
        qat_attention(q, k, v, attn_mask=torch.ones(20, 37, dtype=torch.long))
    with pytest.raises(ValueError, match="q, k, v: shapes"):
        qat_attention(q, k[..., :16], v)
    with pytest.raises(ValueError, match="q: shape"):
        qat_attention(q[0], k, v)


def test_kernels_refuse_in_one_line_when_unavailable(key):
    q, k, v = qkv(key)
    for why, run in ((kernel_available(), qat_attention_kernel), (infer_kernel_available(), qat_attention_infer)):
        if why is None:
            continue
        assert isinstance(why, str) and "\n" not in why
        with pytest.raises(ImportError, match="not available here"):
            run(q, k, v)


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0).item()


@pytest.mark.cuda
@pytest.mark.skipif(kernel_available() is not None, reason=f"{kernel_available()}")
def test_train_kernel_matches_reference():
    shape = (1, 2, 256, 128)
    q, k, v, g = (random.normal(random.key(i), shape).cuda() for i in range(4))
    leaves = [x.bfloat16().requires_grad_() for x in (q, k, v)]
    out = qat_attention_kernel(*leaves)
    grads = torch.autograd.grad(out, leaves, g.bfloat16())
    ref_leaves = [x.bfloat16().float().requires_grad_() for x in (q, k, v)]
    ref = qat_attention(*ref_leaves)
    ref_grads = torch.autograd.grad(ref, ref_leaves, g.bfloat16().float())
    assert cosine(out, ref) > 0.99
    for got, want in zip(grads, ref_grads):
        assert cosine(got, want) > 0.99


@pytest.mark.cuda
@pytest.mark.skipif(infer_kernel_available() is not None, reason=f"{infer_kernel_available()}")
def test_infer_kernel_matches_reference():
    shape = (1, 2, 256, 128)
    q, k, v = (random.normal(random.key(i), shape).cuda().bfloat16() for i in range(3))
    assert cosine(qat_attention_infer(q, k, v), qat_attention(q, k, v)) > 0.99
