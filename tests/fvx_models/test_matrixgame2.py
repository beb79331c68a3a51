"""Matrix-Game 2.0 (fvx_models.matrixgame2, matrixgame2_causal, matrixgame2_actions): the action module against a
direct computation from the published design, the family without action modules against diffusers' Wan I2V, the
streaming variant against its full block-causal forward, released-layout folders, and bad input."""
import json
import math

import pytest
import torch
from msgspec.structs import replace as msgspec_replace
from diffusers import WanTransformer3DModel
from safetensors.torch import load_file, save_file

from fvx.core import random
from fvx_models import block_causal as bc, matrixgame2 as mg, matrixgame2_actions as actions, wan_i2v
from fvx_models.matrixgame2 import MatrixGame2Config
from fvx_models.matrixgame2_causal import MatrixGame2CausalConfig
from fvx_models.wan import WanConfig

B, T, H, W = 2, 4, 8, 8
F = 4 * (T - 1) + 1


def conditions(key=5, frames=F):
    return {"first_frame_latents": random.normal(random.key(key), (B, 16, T, H, W)),
            "image_embeds": random.normal(random.key(key + 1), (B, 5, 16)),
            "keyboard": random.normal(random.key(key + 2), (B, frames, 4)),
            "mouse": random.normal(random.key(key + 3), (B, frames, 2))}


def acting(params):
    """``params`` with the action modules' output projections drawn (a fresh module's start at zero, as FastVideo's
    init_weights: the actions would change nothing)."""
    return {name: random.normal(random.fold_in(random.key(7), i), tuple(p.shape)) * 0.2
            if ".proj_mouse." in name or ".proj_keyboard." in name else p for i, (name, p) in enumerate(params.items())}


@pytest.fixture(scope="module")
def model():
    m = MatrixGame2Config(preset="tiny").build()
    return m, acting(m.weights.init(random.key(0)))


def test_a_fresh_action_module_starts_as_the_identity():
    m = MatrixGame2Config(preset="tiny").build()
    params = m.weights.init(random.key(0))
    x, t, cond = random.normal(random.key(1), (B, 16, T, H, W)), torch.tensor([500.0, 500.0]), conditions()
    still = {**cond, "keyboard": torch.zeros_like(cond["keyboard"]), "mouse": torch.zeros_like(cond["mouse"])}
    assert torch.equal(m.apply(params, x, t, cond), m.apply(params, x, t, still))


# ------------------------------------------------------------------------------------------------ the action module


def reference_actions(p, x, grid, keyboard, mouse, config):
    """Matrix-Game's action module computed token by token and frame by frame from its published design."""
    frames, h, w = grid
    tokens, heads, r, win = h * w, config.heads, config.time_compression, config.windows_size
    lin = lambda v, name: v @ p[name + ".weight"].T + p.get(name + ".bias", 0)  # noqa: E731

    def rms(v, name):
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + 1e-6) * p[name + ".weight"]

    def window(acts, i):  # video frames [r (i - win), r i), clamped to frame 0
        return torch.stack([acts[:, max(j, 0)] for j in range(r * (i - win), r * i)], dim=1)

    def rope(v, pos):  # complex rotation of the first rope_dims[0] dims at position pos
        rot = config.rope_dims[0]
        pairs = torch.view_as_complex(v[..., :rot].reshape(*v.shape[:-1], rot // 2, 2).contiguous())
        angles = pos * config.rope_theta ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
        turned = torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles).to(pairs.dtype))
        return torch.cat([turned.flatten(-2), v[..., rot:]], dim=-1)

    def attention(q, k, v):  # [T, h, d] over frames
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
        return torch.einsum("hts,shd->thd", scores.softmax(-1), v)

    out = x.clone()
    m = "mouse_mlp."
    for s in range(tokens):
        rows = x[:, s::tokens]  # [B, T, C]: the frames of spatial position s
        for b in range(x.shape[0]):
            qs, ks, vs = [], [], []
            for i in range(frames):
                inp = torch.cat([rows[b, i], window(mouse, i)[b].flatten()])
                hid = lin(torch.nn.functional.gelu(lin(inp, m + "0"), approximate="tanh"), m + "2")
                hid = torch.nn.functional.layer_norm(hid, hid.shape, p[m + "3.weight"], p[m + "3.bias"])
                q, k, v = lin(hid, "t_qkv").view(3, heads, -1)
                qs.append(rope(rms(q, "img_attn_q_norm"), i))
                ks.append(rope(rms(k, "img_attn_k_norm"), i))
                vs.append(v)
            att = attention(torch.stack(qs), torch.stack(ks), torch.stack(vs))
            out[b, s::tokens] = out[b, s::tokens] + lin(att.flatten(1), "proj_mouse")
    after_mouse = out.clone()
    embedded = lin(torch.nn.functional.silu(lin(keyboard, "keyboard_embed.0")), "keyboard_embed.2")
    for b in range(x.shape[0]):
        kv = [lin(window(embedded, i)[b].flatten(), "keyboard_attn_kv").view(2, heads, -1) for i in range(frames)]
        ks = torch.stack([rope(rms(k, "key_attn_k_norm"), i) for i, (k, _) in enumerate(kv)])
        vs = torch.stack([v for _, v in kv])
        for s in range(tokens):
            q = lin(after_mouse[b, s::tokens], "mouse_attn_q").view(frames, heads, -1)
            q = torch.stack([rope(rms(q[i], "key_attn_q_norm"), i) for i in range(frames)])
            out[b, s::tokens] = out[b, s::tokens] + lin(attention(q, ks, vs).flatten(1), "proj_keyboard")
    return out


def test_the_action_module_equals_a_direct_computation_of_its_design():
    config = actions.ActionConfig(blocks=(0,), hidden_size=8, keyboard_hidden_dim=32, mouse_hidden_dim=32, heads=2,
                                  rope_dims=(4, 6, 6), windows_size=2, time_compression=2)
    dim, frames, h, w = 12, 3, 2, 2
    module = actions.ActionModule(config, dim).double()
    params = {n: random.normal(random.fold_in(random.key(9), i), tuple(t.shape)).double() * 0.3
              for i, (n, t) in enumerate(module.named_parameters())}
    module.load_state_dict(params)
    video_frames = config.video_frames(frames)
    x = random.normal(random.key(1), (2, frames * h * w, dim)).double()
    keyboard = random.normal(random.key(2), (2, video_frames, 4)).double()
    mouse = random.normal(random.key(3), (2, video_frames, 2)).double()
    with torch.no_grad():
        got = actions.apply_actions(module, x, (frames, h, w), keyboard, mouse)
        want = reference_actions(params, x, (frames, h, w), keyboard, mouse, config)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # RoPE and the LayerNorm run in fp32, as released


def test_without_action_modules_the_family_is_diffusers_wan_i2v_exactly(model):
    m, params = model
    kwargs = {**mg.PRESETS["tiny"].kwargs, "action_config": {}}
    ours = mg.MatrixGame2WanModel(**kwargs).eval()
    theirs = WanTransformer3DModel(**{k: v for k, v in kwargs.items() if k != "action_config"}).eval()
    state = {n: p for n, p in params.items() if "action_model" not in n}
    ours.load_state_dict(state)
    plain = {n.replace("patch_embedding.proj.", "patch_embedding."): p for n, p in state.items()}
    theirs.load_state_dict(plain, strict=False)  # its text projection is unused: no text tokens
    x, t, cond = random.normal(random.key(1), (B, 16, T, H, W)), torch.tensor([700.0, 100.0]), conditions()
    config = MatrixGame2Config(preset="tiny")
    with torch.no_grad():
        got = ours(x, t, cond["first_frame_latents"], cond["image_embeds"], cond["keyboard"], cond["mouse"])[0]
        want = theirs(wan_i2v.concat_input(config, x, cond), t, torch.zeros(B, 0, 0),
                      encoder_hidden_states_image=cond["image_embeds"], return_dict=False)[0]
    assert torch.equal(got, want)


def test_actions_steer_the_output_and_every_frame_reads_its_window(model):
    m, params = model
    x, t, cond = random.normal(random.key(1), (B, 16, T, H, W)), torch.tensor([500.0, 500.0]), conditions()
    base = m.apply(params, x, t, cond)
    for name in ("keyboard", "mouse"):
        moved = {**cond, name: cond[name].clone()}
        moved[name][:, 5] += 1.0  # video frame 5: in the windows of latent frames 2 and 3
        change = (m.apply(params, x, t, moved) - base).abs().amax(dim=(0, 1, 3, 4))
        assert (change > 1e-4).all(), name  # bidirectional: every frame attends the changed ones


# ------------------------------------------------------------------------------------------------- the causal variant


@pytest.mark.parametrize("knobs", [dict(block_attention="prefix"), dict(block_attention="mask"),
                                   dict(local_attn_size=2, sink_size=1, block_attention="prefix")])
def test_streamed_chunks_equal_the_full_block_causal_forward_actions_included(knobs):
    config = MatrixGame2CausalConfig(preset="tiny", num_frames_per_block=1, **knobs)
    m = config.build()
    params = acting(m.weights.init(random.key(0)))
    x, cond = random.normal(random.key(1), (B, 16, T, H, W)), conditions()
    t = torch.tensor([[900.0, 700.0, 400.0, 100.0]] * B)
    full = m.apply(params, x, t, cond)
    cache, chunks = m.causal.empty_cache(T), []
    for i in range(T):
        v, cache = m.causal.apply_cached(params, x[:, :, i:i + 1], t[:, i:i + 1], cond, cache)
        chunks.append(v)
    torch.testing.assert_close(torch.cat(chunks, dim=2), full, rtol=1e-5, atol=1e-5)
    slots = bc.ring_slots(T, frames_per_block=1, window=config.local_attn_size, sink=config.sink_size)
    per_frame = (H // 2) * (W // 2)
    assert len(cache.keys) == 2 + 2 and all(k.shape[1] == slots * per_frame for k in cache.keys)


def test_later_actions_never_change_earlier_frames_of_the_causal_model():
    m = MatrixGame2CausalConfig(preset="tiny", num_frames_per_block=2).build()
    params = acting(m.weights.init(random.key(0)))
    x, t, cond = random.normal(random.key(1), (B, 16, T, H, W)), torch.tensor([500.0, 500.0]), conditions()
    moved = {**cond, "keyboard": cond["keyboard"].clone()}
    moved["keyboard"][:, 5:] += 1.0
    change = (m.apply(params, x, t, moved) - m.apply(params, x, t, cond)).abs().amax(dim=(0, 1, 3, 4))
    assert torch.equal(change[:2], torch.zeros(2)) and (change[2:] > 1e-4).all()


def test_a_long_stream_keeps_the_action_cache_within_its_window():
    config = MatrixGame2CausalConfig(preset="tiny", num_frames_per_block=1, local_attn_size=2, sink_size=1)
    m = config.build()
    params = m.weights.init(random.key(0))
    frames = 9
    cond = {**conditions(frames=4 * (frames - 1) + 1),
            "first_frame_latents": random.normal(random.key(3), (B, 16, frames, H, W))}
    cache = m.causal.empty_cache(frames)
    for i in range(frames):
        x = random.normal(random.fold_in(random.key(4), i), (B, 16, 1, H, W))
        _, cache = m.causal.apply_cached(params, x, torch.tensor([500.0, 500.0]), cond, cache)
    assert len(cache.slots) == 2 and all(k.shape[1] == 2 * 16 for k in cache.keys)


# ------------------------------------------------------------------------------------------------- folders, bad input


def released_folder(path, params, class_name="MatrixGameWanModel"):
    """A tiny folder as the released ones are: Matrix-Game's key names, FastVideo's config fields."""
    kwargs = mg.PRESETS["tiny"].kwargs
    config = {"_class_name": class_name, **{k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()},
              "num_frames_per_block": 3, "local_attn_size": -1, "sink_size": 0}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({n: p.contiguous() for n, p in params.items()}, str(path / "diffusion_pytorch_model.safetensors"))


def test_a_released_layout_folder_loads_and_exports_back_identically(model, tmp_path):
    m, params = model
    released_folder(tmp_path / "released", params)
    loaded = m.weights.load(str(tmp_path / "released"))
    m.export.folder(loaded, str(tmp_path / "out"))
    before = load_file(str(tmp_path / "released" / "diffusion_pytorch_model.safetensors"))
    after = load_file(str(tmp_path / "out" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert sorted(before) == sorted(after) and all(torch.equal(before[n], after[n]) for n in before)
    assert any(n.startswith("blocks.1.action_model.") for n in after) and "patch_embedding.proj.weight" in after
    causal = MatrixGame2CausalConfig(preset="tiny").build()  # the streaming model loads the same folder
    assert all(torch.equal(causal.weights.load(str(tmp_path / "out"))[n], loaded[n]) for n in loaded)


def test_bad_input_gets_one_line(model, tmp_path):
    m, params = model
    x, t = random.normal(random.key(1), (B, 16, T, H, W)), torch.tensor([500.0, 500.0])
    for name, bad, said in (("keyboard", torch.zeros(B, F, 6), "cond['keyboard'] must be [B, F, 4], got [2, 13, 6]"),
                            ("mouse", torch.zeros(B, F - 4, 2), "keyboard actions are [2, 9, 4]; 4 latent frames "
                                                                "take [B, 13, 4] (keyboard [T, 4] per video frame")):
        with pytest.raises(ValueError) as error:
            short = {**conditions(), "keyboard": torch.zeros(B, F - 4, 4)} if name == "mouse" else conditions()
            m.apply(params, x, t, {**short, name: bad})
        assert said in str(error.value) and "\n" not in str(error.value)
    released_folder(tmp_path / "mg", params)
    with pytest.raises(ValueError, match="describes a MatrixGameWanModel, not a WanTransformer3DModel"):
        WanConfig(preset="tiny-i2v").build().weights.load(str(tmp_path / "mg"))
    wan = WanConfig(preset="tiny").build()
    wan.export.folder(wan.weights.init(random.key(0)), str(tmp_path / "wan"))
    with pytest.raises(ValueError, match="describes a WanTransformer3DModel, not a MatrixGame2WanModel"):
        m.weights.load(str(tmp_path / "wan"))
    causal = MatrixGame2CausalConfig(preset="tiny").build()
    with pytest.raises(ValueError, match="teacher forcing is not supported"):
        causal.causal.apply_teacher_forced(params, x, t, conditions(), x)


def test_compiled_units_equal_eager_with_one_graph_per_kind_of_block(model):
    m, params = model
    x, t, cond = random.normal(random.key(1), (B, 16, T, H, W)), torch.tensor([500.0, 200.0]), conditions()
    compiled = MatrixGame2Config(preset="tiny", compile="blocks", compile_backend="aot_eager").build()
    torch.testing.assert_close(compiled.apply(params, x, t, cond), m.apply(params, x, t, cond), rtol=1e-5,
                               atol=1e-5)
    stats = compiled.kernels.compile_stats
    assert stats.graphs_of("blocks") == 1 and stats.graphs_of("blocks[1]") == 1


def test_a_keyboard_only_model_streams_as_its_full_forward(monkeypatch):
    """Temple Run's layout (no mouse branch): the cache keeps an empty mouse pair, the stream equals the full forward."""
    keys_only = msgspec_replace(mg.TINY_ACTIONS, mouse_dim=0)
    monkeypatch.setitem(mg.PRESETS, "tiny-keys", mg._preset({**mg.wan.TINY, "in_channels": 36, "image_dim": 16},
                                                             keys_only, mg.wan.TINY_VAE, 5.0))
    m = MatrixGame2CausalConfig(preset="tiny-keys", num_frames_per_block=1).build()
    params = acting(m.weights.init(random.key(0)))
    x, cond = random.normal(random.key(1), (B, 16, T, H, W)), conditions()
    cond.pop("mouse")
    t = torch.tensor([[900.0, 700.0, 400.0, 100.0]] * B)
    cache, chunks = m.causal.empty_cache(T), []
    for i in range(T):
        v, cache = m.causal.apply_cached(params, x[:, :, i:i + 1], t[:, i:i + 1], cond, cache)
        chunks.append(v)
    torch.testing.assert_close(torch.cat(chunks, dim=2), m.apply(params, x, t, cond), rtol=1e-5, atol=1e-5)
