"""Block-causal Wan by wrapping diffusers' Wan: causality, KV-cached chunks equal the full forward, one block equals
stock Wan, SkyReels-V2's own diffusion-forcing mask agrees, teacher forcing equals the cached clean history, remat
and compiled blocks change nothing, ordinary Wan folders load and export, and bad input gets one line."""
import pytest
import torch
from diffusers import SkyReelsV2Transformer3DModel, WanTransformer3DModel

from fvx.core import grad, random
from fvx_models import block_causal as bc, skyreels_v2, streaming
from fvx_models.wan import WanConfig
from fvx_models.wan_causal import WanCausalConfig

B, C, T, H, W = 2, 16, 6, 4, 4  # 3 blocks of 2 frames, 4 tokens per frame on the tiny preset


def causal(**knobs):
    return WanCausalConfig(preset="tiny", **{"num_frames_per_block": 2, **knobs}).build()


@pytest.fixture(scope="module")
def model():
    return causal()


@pytest.fixture(scope="module")
def params(model):
    return model.weights.init(random.key(0))


@pytest.fixture(scope="module")
def data():
    k = random.split(random.key(1), 4)
    x = random.normal(k[0], (B, C, T, H, W))
    t = torch.floor(random.uniform(k[1], (B, T)) * 1000)
    mask = torch.ones(B, 5)
    mask[1, 3:] = 0
    return x, t, {"text": random.normal(k[2], (B, 5, 32)), "text_mask": mask}, random.normal(k[3], (B, C, T, H, W))


def chunked(model, params, x, t, cond, cache=None):
    """The chunk-by-chunk forward with the KV cache, one block per call."""
    cache, outs = cache or model.causal.empty_cache(x.shape[2]), []
    for b in range(0, x.shape[2], 2):
        v, cache = model.causal.apply_cached(params, x[:, :, b:b + 2], t[:, b:b + 2], cond, cache)
        outs.append(v)
    return torch.cat(outs, dim=2), cache


@pytest.mark.parametrize("attention", ["prefix", "mask"])
def test_later_frames_never_change_earlier_outputs(params, data, attention):
    model = causal(block_attention=attention)
    x, t, cond, _ = data
    later = x.clone()
    later[:, :, 2:] += 1.0
    v, v_later = model.apply(params, x, t, cond), model.apply(params, later, t, cond)
    assert torch.equal(v[:, :, :2], v_later[:, :, :2])
    assert not torch.allclose(v[:, :, 2:], v_later[:, :, 2:])


@pytest.mark.parametrize("knobs", [{}, {"block_attention": "mask"}, {"local_attn_size": 4}, {"local_attn_size": 4,
                                                                                       "sink_size": 1}])
def test_kv_cached_chunks_equal_the_full_block_causal_forward(params, data, knobs):
    model = causal(**knobs)
    x, t, cond, _ = data
    got, cache = chunked(model, params, x, t, cond)
    if knobs.get("block_attention") == "mask":  # one masked SDPA over a longer key sequence sums in another order
        torch.testing.assert_close(got, model.apply(params, x, t, cond), rtol=0, atol=1e-6)
    else:
        assert torch.equal(got, model.apply(params, x, t, cond))
    window, sink = knobs.get("local_attn_size", -1), knobs.get("sink_size", 0)
    assert cache.next_frame == T and cache.frames == ((0, 1, 2, 3, 4, 5) if window == -1 else
                                                      (0, 4, 5) if sink else (4, 5))


def test_a_window_changes_what_later_blocks_see(params, data):
    x, t, cond, _ = data
    v, v_window = causal().apply(params, x, t, cond), causal(local_attn_size=2).apply(params, x, t, cond)
    assert torch.equal(v[:, :, :2], v_window[:, :, :2]) and not torch.allclose(v[:, :, 2:], v_window[:, :, 2:])


def test_one_block_spanning_all_frames_equals_stock_wan(params, data):
    x, _, cond, _ = data
    t = torch.tensor([20.0, 700.0])
    torch.testing.assert_close(causal(num_frames_per_block=T).apply(params, x, t, cond),
                               WanConfig(preset="tiny").build().apply(params, x, t, cond), rtol=0, atol=1e-6)


def test_agrees_with_skyreels_v2_diffusion_forcing_on_the_same_params(model, params, data):
    x, t, cond, _ = data
    state = torch.get_rng_state()
    sky = SkyReelsV2Transformer3DModel(**{**skyreels_v2.PRESETS["tiny"].kwargs, "num_frame_per_block": 2})
    torch.set_rng_state(state)
    sky.load_state_dict(params)
    with torch.no_grad():
        want = sky(x, t, cond["text"] * cond["text_mask"][..., None], enable_diffusion_forcing=True,
                   return_dict=False)[0]
    torch.testing.assert_close(model.apply(params, x, t, cond), want, rtol=0, atol=1e-5)


def test_mask_and_prefix_forms_agree(params, data):
    x, t, cond, _ = data
    torch.testing.assert_close(causal(block_attention="mask").apply(params, x, t, cond),
                               causal().apply(params, x, t, cond), rtol=0, atol=1e-6)


@pytest.mark.parametrize("attention", ["prefix", "mask"])
def test_teacher_forcing_equals_each_noisy_block_with_the_clean_history_cached(params, data, attention):
    model = causal(block_attention=attention)
    x, t, cond, clean = data
    cache, outs = model.causal.empty_cache(T), []
    for b in range(0, T, 2):
        v, _ = model.causal.apply_cached(params, x[:, :, b:b + 2], t[:, b:b + 2], cond, cache)
        outs.append(v)
        _, cache = model.causal.apply_cached(params, clean[:, :, b:b + 2], torch.zeros(B, 2), cond, cache)
    got = model.causal.apply_teacher_forced(params, x, t, cond, clean)
    torch.testing.assert_close(got, torch.cat(outs, dim=2), rtol=0, atol=1e-6)


def test_remat_gradients_equal_no_remat_for_both_forwards(model, params, data):
    x, t, cond, clean = data
    remat = causal(remat=True)

    def losses(m):
        def loss(p):
            return m.apply(p, x, t, cond).square().mean() + m.causal.apply_teacher_forced(p, x, t, cond,
                                                                                          clean).square().mean()
        return loss

    value, grads = grad.value_and_grad(losses(model))(params)
    value_r, grads_r = grad.value_and_grad(losses(remat))(params)
    assert torch.equal(value, value_r) and all(torch.equal(grads[n], grads_r[n]) for n in grads)


def rollout(model, params, x, t, cond):
    """A Self-Forcing-shaped stream: per block a no-grad call, a graded call and a context write on the cache;
    ``(outputs, gradient of their sum)``."""
    def loss(p):
        cache, outs = model.causal.empty_cache(x.shape[2]), []
        for b in range(0, x.shape[2], 2):
            with torch.no_grad():
                model.causal.apply_cached(p, x[:, :, b:b + 2], t[:, b:b + 2], cond, cache)
            v, _ = model.causal.apply_cached(p, x[:, :, b:b + 2], t[:, b:b + 2], cond, cache)
            outs.append(v)
            with torch.no_grad():
                _, cache = model.causal.apply_cached(p, x[:, :, b:b + 2].flip(-1), t[:, b:b + 2] * 0, cond, cache)
        out = torch.cat(outs, dim=2)
        return out.sum(), out.detach()

    (_, out), grads = grad.value_and_grad(loss, has_aux=True)(params)
    return out, grads


@pytest.mark.parametrize("knobs", [{}, {"local_attn_size": 4, "sink_size": 2}], ids=["global", "window"])
def test_a_compiled_rollout_of_any_length_makes_no_new_graph_at_its_second_step(params, knobs):
    """The ring cache keeps one shape for the whole stream, and a compiled model attends to it under a mask given as
    a tensor: a 7-block rollout compiles one graph per grad mode, the next makes none, and both equal eager."""
    k = random.split(random.key(5), 3)
    x, t = random.normal(k[0], (B, C, 14, H, W)), torch.floor(random.uniform(k[1], (B, 14)) * 1000)
    cond = {"text": random.normal(k[2], (B, 5, 32)), "text_mask": torch.ones(B, 5)}
    want, want_grads = rollout(causal(**knobs), params, x, t, cond)
    compiled = causal(compile="blocks", compile_backend="aot_eager", **knobs)
    for attempt in range(2):
        got, grads = rollout(compiled, params, x, t, cond)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        for name in want_grads:
            torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-5)
        if attempt == 0:
            graphs = compiled.kernels.compile_stats.graphs_of("blocks")
    stats = compiled.kernels.compile_stats
    assert graphs <= 2 and stats.graphs_of("blocks") == graphs and stats.recompiles == 0, stats


@pytest.mark.parametrize("scale", [None, 3.0], ids=["unguided", "guided"])
def test_streaming_sampling_equals_denoising_each_block_after_its_clean_history(model, params, data, scale):
    noise, _, cond, _ = data
    sigmas = torch.tensor([1.0, 0.6, 0.0])
    uncond = {name: torch.zeros_like(c) for name, c in cond.items()}
    guidance = None if scale is None else (lambda c: uncond, scale)
    got = streaming.sample(model.causal, params, noise, sigmas, cond, guidance=guidance)
    history = noise[:, :, :0]
    for b in range(0, T, 2):  # the plain block-causal forward over [clean history | noisy block], per CFG branch
        x = noise[:, :, b:b + 2]
        for i in range(len(sigmas) - 1):
            t = torch.cat([torch.zeros(B, b), torch.full((B, 2), float(sigmas[i]) * 1000)], dim=1)
            v = model.apply(params, torch.cat([history, x], dim=2), t, cond)[:, :, b:]
            if scale is not None:
                v_u = model.apply(params, torch.cat([history, x], dim=2), t, uncond)[:, :, b:]
                v = v_u + scale * (v - v_u)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
        history = torch.cat([history, x], dim=2)
    torch.testing.assert_close(got, history, rtol=0, atol=1e-5)


@pytest.mark.slow  # compiles the tiny model's blocks (aot_eager)
def test_streaming_a_clip_three_times_the_window_compiles_once_and_starts_as_the_short_clip(params, data):
    """Long streaming validation: a window of 4 frames (sink 2) streams 12 frames on a ring that keeps its shape, so
    the compiled model makes its graphs on the first clip and none on the second; the first window equals sampling
    the window's frames alone."""
    knobs = dict(local_attn_size=4, sink_size=2)
    eager, compiled = causal(**knobs), causal(**knobs, compile="blocks", compile_backend="aot_eager")
    _, _, cond, _ = data
    sigmas, key = torch.tensor([1.0, 0.5, 0.0]), random.key(3)
    noise = random.normal(random.key(2), (B, C, 12, H, W))
    long = streaming.sample(eager.causal, params, noise, sigmas, cond, key, sampler="sde", context_noise=100.0)
    short = streaming.sample(eager.causal, params, noise[:, :, :4], sigmas, cond, key, sampler="sde",
                             context_noise=100.0)
    assert torch.equal(long[:, :, :4], short)
    for attempt in range(2):
        got = streaming.sample(compiled.causal, params, noise, sigmas, cond, key, sampler="sde", context_noise=100.0)
        torch.testing.assert_close(got, long, rtol=0, atol=1e-5)
        if attempt == 0:
            graphs = compiled.kernels.compile_stats.graphs_of("blocks")
    stats = compiled.kernels.compile_stats
    assert graphs <= 2 and stats.graphs_of("blocks") == graphs and stats.recompiles == 0, stats


def test_streaming_sde_and_context_noise_draw_from_the_key(model, params, data):
    noise, _, cond, _ = data
    sigmas = torch.tensor([1.0, 0.5, 0.0])
    draw = streaming.draw(model.causal, sigmas, sampler="sde", context_noise=50.0)
    a, b = draw(params, noise, cond, random.key(3)), draw(params, noise, cond, random.key(3))
    assert torch.equal(a, b) and not torch.equal(a, draw(params, noise, cond, random.key(4)))
    with pytest.raises(ValueError, match="need a key"):
        streaming.sample(model.causal, params, noise, sigmas, cond, sampler="sde")


def test_loads_an_ordinary_wan_folder_and_exports_one_back(model, params, tmp_path):
    WanConfig(preset="tiny").build().export.folder(params, str(tmp_path / "wan"))
    loaded = model.weights.load(str(tmp_path / "wan"))
    assert all(torch.equal(loaded[n], params[n]) for n in params)
    model.export.folder(params, str(tmp_path / "back"))
    state = torch.get_rng_state()
    theirs = WanTransformer3DModel.from_pretrained(tmp_path / "back" / "transformer").state_dict()
    torch.set_rng_state(state)
    assert all(torch.equal(theirs[n], params[n]) for n in params)


def test_bad_input_gets_one_line(model, params, data):
    x, t, cond, clean = data
    with pytest.raises(ValueError, match=r"5 latent frames are not whole blocks of num_frames_per_block=2 "
                                         r"\(FastVideo's Self-Forcing puts a remainder in the first block"):
        model.apply(params, x[:, :, :5], t[:, :5], cond)
    with pytest.raises(ValueError, match=r"t must be a tensor of shape \[2\] .* or \[2, 6\]: one per latent frame"):
        model.apply(params, x, t[:, :3], cond)
    _, cache = model.causal.apply_cached(params, x[:, :, :2], t[:, :2], cond, model.causal.empty_cache(T))
    with pytest.raises(ValueError, match=r"KV cache of layer 0 is \(2, 24, 2, 48\), but a batch of 1"):
        model.causal.apply_cached(params, x[:1, :, 2:4], t[:1, 2:4], {k: v[:1] for k, v in cond.items()}, cache)
    with pytest.raises(ValueError, match="teacher forcing needs clean frames of the noisy frames' shape"):
        model.causal.apply_teacher_forced(params, x, t, cond, clean[:, :, :4])
    with pytest.raises(ValueError, match="teacher forcing needs global attention .* got local_attn_size=4"):
        causal(local_attn_size=4).causal.apply_teacher_forced(params, x, t, cond, clean)
    with pytest.raises(ValueError, match="exceed the RoPE table of rope_max_seq_len=32 frames"):
        model.causal.apply_cached(params, x[:, :, :2], t[:, :2], cond, bc.KVCache(next_frame=32))
    with pytest.raises(ValueError, match="local_attn_size must be -1 .* at least num_frames_per_block=3"):
        WanCausalConfig(num_frames_per_block=3, local_attn_size=2)
    with pytest.raises(ValueError, match="sink_size 4 must be below local_attn_size 4"):
        WanCausalConfig(num_frames_per_block=2, local_attn_size=4, sink_size=4)


def test_image_to_video_streams_with_the_first_frame_cut_per_chunk_and_one_block_is_stock_wan_i2v():
    """The I2V preset: streamed chunks equal the full block-causal forward; one block over every frame is diffusers'
    Wan I2V on ``[x | mask | first frame]``; the given frame steers later chunks through the cache."""
    model = WanCausalConfig(preset="tiny-i2v", num_frames_per_block=2).build()
    params = model.weights.init(random.key(0))
    k = random.split(random.key(2), 5)
    x, t = random.normal(k[0], (B, C, T, H, W)), torch.floor(random.uniform(k[1], (B, T)) * 1000)
    given = torch.zeros(B, C, T, H, W)
    given[:, :, 0] = random.normal(k[2], (B, C, H, W))
    cond = {"text": random.normal(k[3], (B, 5, 32)), "text_mask": torch.ones(B, 5),
            "first_frame_latents": given, "image_embeds": random.normal(k[4], (B, 3, 16))}
    got, cache = chunked(model, params, x, t, cond)
    torch.testing.assert_close(got, model.apply(params, x, t, cond), rtol=0, atol=1e-5)
    assert cache.next_frame == T
    other = {**cond, "first_frame_latents": given.roll(1, dims=0)}
    assert not torch.allclose(chunked(model, params, x, t, other)[0][:, :, 4:], got[:, :, 4:])

    whole = WanCausalConfig(preset="tiny-i2v", num_frames_per_block=T).build()
    stock = WanTransformer3DModel(**WanConfig(preset="tiny-i2v").spec.kwargs)
    stock.load_state_dict(params)
    mask = torch.zeros(B, 4, T, H, W)
    mask[:, :, 0] = 1
    text = torch.nn.functional.pad(cond["text"], (0, 0, 0, 512 - 5))
    with torch.no_grad():
        ref = stock(torch.cat([x, mask, given], dim=1), t[:, 0], text, cond["image_embeds"], return_dict=False)[0]
    torch.testing.assert_close(whole.apply(params, x, t[:, 0], cond), ref, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="teacher forcing of an image-to-video model is not supported"):
        model.causal.apply_teacher_forced(params, x, t, cond, x)
    with pytest.raises(ValueError, match=r"first_frame_latents \[2, 16, 6, 4, 4\] do not cover latent frames 6..7"):
        model.causal.apply_cached(params, x[:, :, :2], t[:, :2], cond, bc.KVCache(next_frame=6))
