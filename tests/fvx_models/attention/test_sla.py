"""fvx_models.attention.sla and ``attention=sla``: the reference against a direct computation of its sparse and linear
parts (loops over blocks and token pairs, written here), its gradients against that computation's, the kernel
wrapper's call of FastVideo's Triton kernel (a stand-in computing from the block map it is given), what a dense
checkpoint computes under SLA (its zero ``proj_l``: the block-sparse part alone, dense only when every key block is
kept), TurboWan's ``proj_l`` loaded from a folder under its names and written back byte for byte, the refusals, and the
TurboWan recipe against FastVideo's YAML."""
import math
import pathlib
import sys
import types

import msgspec
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fvx import config as fconfig
from fvx.core import random
from fvx_models.attention import install, sla
from fvx_models.attention.config import SLAConfig
from fvx_models.lora import LoRAConfig
from fvx_models.wan import WAN, WanConfig

from family_cases import inputs  # noqa: E402

TINY = WanConfig(preset="tiny")  # head dim 48
GRID = dict(frames=8, size=16)  # latents [B, 16, 8, 16, 16]: 512 tokens, 8 key blocks of 64
PROJ = ("blocks.0.attn1.attn_impl.proj_l.weight", "blocks.0.attn1.attn_impl.proj_l.bias",
        "blocks.1.attn1.attn_impl.proj_l.weight", "blocks.1.attn1.attn_impl.proj_l.bias")
EXPERIMENT = pathlib.Path(__file__).resolve().parents[3] / "experiments" / "finetune_wan_lora.py"
PHI = {"softmax": lambda x: torch.softmax(x, -1), "elu": lambda x: torch.nn.functional.elu(x) + 1,
       "relu": torch.relu}


def sla_model(**knobs) -> WanConfig:
    return msgspec.structs.replace(TINY, attention="sla", sla=SLAConfig(implementation="reference", **knobs))


# ------------------------------------------------------------------------------------ a direct computation, by loops


def direct_selection(q, k, ratio, bq, bk):
    """Per (b, h): the set of key blocks each query block keeps, by slicing blocks and sorting scores in Python."""
    length = q.shape[2]
    qblocks = [range(s, min(s + bq, length)) for s in range(0, length, bq)]
    kblocks = [range(s, min(s + bk, length)) for s in range(0, length, bk)]
    count = min(len(kblocks), int(ratio * len(kblocks)))
    chosen = {}
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            ks = k[b, h] - k[b, h].mean(0)
            for i, qb in enumerate(qblocks):
                qm = q[b, h, list(qb)].mean(0)
                scores = [float(qm @ ks[list(kb)].mean(0)) for kb in kblocks]
                chosen[b, h, i] = set(sorted(range(len(kblocks)), key=lambda j: -scores[j])[:count])
    return chosen, qblocks, kblocks


def direct_sla(q, k, v, weight, bias, ratio, bq, bk, feature_map, scale=None):
    """SLA written out: per query token, softmax over the tokens of its block's chosen key blocks, plus the linear
    attention ``sum_j (phi(q_i).phi(k_j)) v_j / (1e-5 + sum_j phi(q_i).phi(k_j))`` over all tokens through proj_l."""
    chosen, qblocks, kblocks = direct_selection(q.detach(), k.detach(), ratio, bq, bk)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    phi = PHI[feature_map]
    rows = []
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            fk = phi(k[b, h])
            for i, qb in enumerate(qblocks):
                keys = [t for j in sorted(chosen[b, h, i]) for t in kblocks[j]]
                for t in qb:
                    weights = torch.softmax(q[b, h, t] @ k[b, h, keys].T * scale, 0)
                    sparse = weights @ v[b, h, keys]
                    similarity = fk @ phi(q[b, h, t])  # [L]
                    linear = (similarity[:, None] * v[b, h]).sum(0) / (1e-5 + similarity.sum())
                    rows.append(sparse + linear @ weight.T + bias)
    return torch.stack(rows).view(q.shape)


def qkv(key, shape, n=3):
    return [random.normal(k, shape) for k in random.split(key, n)]


def linear(weight, bias):
    """proj_l as the model holds it: an nn.Linear with these params (shared, so gradients reach them)."""
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0])
    layer.weight, layer.bias = torch.nn.Parameter(weight), torch.nn.Parameter(bias)
    return layer


# ------------------------------------------------------------------------------------------------------ reference


def test_topk_count_is_fastvideos_truncated_product():
    assert sla.topk_count(0.1, 488) == 48  # TurboWan's 31200 tokens: 488 key blocks of 64
    assert sla.topk_count(0.1, 8) == 0 and sla.topk_count(0.25, 8) == 2
    assert sla.topk_count(0.29, 100) == 28  # int(28.999999999999996), as FastVideo's int()
    assert sla.topk_count(1.0, 7) == 7


@pytest.mark.parametrize("feature_map", ["softmax", "elu", "relu"])
def test_reference_equals_a_direct_computation_of_its_sparse_and_linear_parts(key, feature_map):
    q, k, v = qkv(key, (2, 2, 37, 8))  # 37 tokens: partial last blocks (5 query blocks of 8, 10 key blocks of 4)
    weight, bias = qkv(random.key(3), (8, 8), n=1)[0] * 0.3, torch.linspace(-0.2, 0.2, 8)
    got = sla.sparse_linear_attention(q, k, v, linear(weight, bias), topk_ratio=0.3, block_q=8, block_k=4,
                                      feature_map=feature_map)
    want = direct_sla(q, k, v, weight, bias, 0.3, 8, 4, feature_map)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_selection_is_the_top_blocks_of_pooled_smoothed_scores(key):
    q, k = qkv(key, (1, 2, 45, 4), n=2)
    selected = sla.select_blocks(q, k, 0.5, 16, 8)  # 3 query blocks, 6 key blocks (the last of 5 tokens), 3 kept
    chosen, _, _ = direct_selection(q, k, 0.5, 16, 8)
    assert selected.shape == (1, 2, 3, 3)
    for (b, h, i), want in chosen.items():
        assert set(selected[b, h, i].tolist()) == want


def test_every_block_kept_and_a_zero_projection_is_dense_attention(key):
    q, k, v = qkv(key, (1, 2, 50, 8))
    got = sla.sparse_linear_attention(q, k, v, linear(torch.zeros(8, 8), torch.zeros(8)), topk_ratio=1.0,
                                      block_q=16, block_k=8)
    torch.testing.assert_close(got, torch.nn.functional.scaled_dot_product_attention(q, k, v), rtol=0, atol=1e-6)


def test_gradients_match_the_direct_computation_and_reach_proj_l(key):
    q, k, v = (x.requires_grad_() for x in qkv(key, (1, 2, 21, 4)))
    projection = linear(torch.zeros(4, 4), torch.zeros(4))  # FastVideo's init: it still gets gradients
    weight, bias = projection.weight, projection.bias
    up = qkv(random.key(9), (1, 2, 21, 4), n=1)[0]
    inputs_ = (q, k, v, weight, bias)
    got = torch.autograd.grad((sla.sparse_linear_attention(q, k, v, projection, 0.5, 8, 4) * up).sum(), inputs_)
    want = torch.autograd.grad((direct_sla(q, k, v, weight, bias, 0.5, 8, 4, "softmax") * up).sum(), inputs_)
    for name, g, w in zip("q k v proj_l.weight proj_l.bias".split(), got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)
    assert got[3].abs().max() > 0 and torch.allclose(got[4], up.sum((0, 1, 2)))  # d/db = upstream summed


def test_a_zero_projection_sends_no_gradient_to_keys_no_query_block_kept(key):
    q, k, v = (x.requires_grad_() for x in qkv(key, (1, 1, 64, 4)))
    out = sla.sparse_linear_attention(q, k, v, linear(torch.zeros(4, 4), torch.zeros(4)), 0.25, 32, 8)  # 2 of 8
    grad_k, grad_v = torch.autograd.grad(out.square().sum(), (k, v))
    kept = set(sla.select_blocks(q, k, 0.25, 32, 8).flatten().tolist())
    assert len(kept) < 8
    for block in range(8):
        tokens = slice(block * 8, block * 8 + 8)
        for g in (grad_k, grad_v):
            assert (g[0, 0, tokens].abs().sum() > 0) == (block in kept)


def test_bad_inputs_raise_one_line_value_errors(key):
    q, k, v = qkv(key, (1, 2, 16, 4))
    w = torch.nn.Linear(4, 4)
    cases = [dict(k=k[:, :, :8]), dict(projection=torch.nn.Linear(4, 5)), dict(projection=torch.zeros(4, 4)),
             dict(topk_ratio=0.0), dict(block_q=0),
             dict(feature_map="cosine"), dict(implementation="triton"), dict(topk_ratio=0.1)]  # 4 blocks: 0 kept
    for case in cases:
        args = dict(q=q, k=k, v=v, projection=w, topk_ratio=0.5, block_q=4, block_k=4) | case
        with pytest.raises(ValueError) as e:
            sla.sparse_linear_attention(**args)
        assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------------------- kernel


def test_the_kernel_wrapper_calls_fastvideos_kernel_as_its_backend_does(key, monkeypatch):
    """A stand-in ``_attention`` that attends by the int8 block map it is given (not by the top-k table) checks the
    wrapper's arguments: bf16 contiguous q, k, v [B, H, L, D], the map [B, H, Mq, Nk], the table [B, H, Mq, c] of the
    same blocks, c, the block sizes."""
    calls = []

    def apply(q, k, v, block_map, lut, topk, block_m, block_n):
        calls.append((q.dtype, q.is_contiguous(), tuple(block_map.shape), block_map.dtype, tuple(lut.shape), topk,
                      block_m, block_n))
        keep = block_map.bool().repeat_interleave(block_m, 2).repeat_interleave(block_n, 3)
        keep = keep[:, :, :q.shape[2], :k.shape[2]]
        assert torch.equal(torch.zeros_like(block_map).scatter(-1, lut, 1), block_map)
        return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                                attn_mask=keep).to(q.dtype)

    module = types.ModuleType(sla.KERNEL_MODULE)
    module._attention = types.SimpleNamespace(apply=apply)
    monkeypatch.setitem(sys.modules, sla.KERNEL_MODULE, module)
    monkeypatch.setattr(sla, "kernel_available", lambda: None)
    q, k, v = qkv(key, (1, 2, 300, 64))  # 5 key blocks of 64 (the last of 44 tokens), 3 query blocks of 128
    projection = linear(qkv(random.key(2), (64, 64), n=1)[0] * 0.1, torch.full((64,), 0.1))
    got = sla.sparse_linear_attention(q, k, v, projection, 0.4, 128, 64, implementation="kernel")
    assert calls == [(torch.bfloat16, True, (1, 2, 3, 5), torch.int8, (1, 2, 3, 2), 2, 128, 64)]
    want = sla.sparse_linear_attention(q, k, v, projection, 0.4, 128, 64)
    torch.testing.assert_close(got, want, rtol=0, atol=5e-2)  # bf16 inputs and linear part, as FastVideo's
    with pytest.raises(ValueError, match="block_q in \\(64, 128\\) and block_k 64"):
        sla.sparse_linear_attention(q, k, v, projection, 0.4, 32, 64, implementation="kernel")


@pytest.mark.cuda
def test_kernel_matches_reference_on_cuda(key):
    if sla.kernel_available() is not None:
        pytest.skip(sla.kernel_available())
    q, k, v = (x.cuda().requires_grad_() for x in qkv(key, (1, 2, 1000, 64)))
    projection = linear(qkv(random.key(2), (64, 64), n=1)[0] * 0.1, torch.zeros(64)).cuda()
    got = sla.sparse_linear_attention(q, k, v, projection, 0.25, 128, 64, implementation="kernel")
    want = sla.sparse_linear_attention(q, k, v, projection, 0.25, 128, 64)
    torch.testing.assert_close(got.float(), want, rtol=0, atol=3e-2)
    grads = torch.autograd.grad(got.float().square().sum(), (q, k, v))
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=5e-2)


# ---------------------------------------------------------------------------------------------------- the model


def test_a_dense_checkpoint_under_sla_computes_the_sparse_part_alone(dense_folder):
    """Its ``proj_l`` loads as zeros (FastVideo's init), so the model is block-sparse attention: not the dense model,
    unless every key block is kept (topk_ratio 1), where it is."""
    folder, dense, dense_params = dense_folder
    model = sla_model(topk_ratio=0.25).build()
    params = model.weights.load(str(folder))
    assert [name for name in params if "proj_l" in name] == list(PROJ)
    assert all(params[name].abs().max() == 0 for name in PROJ)
    x, t, cond = inputs(model, random.key(1), **GRID)
    want = dense.apply(dense_params, x, t, cond)
    assert (model.apply(params, x, t, cond) - want).abs().max() > 1e-3
    every = sla_model(topk_ratio=1.0).build()
    torch.testing.assert_close(every.apply(params, x, t, cond), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["cosmos", "kandinsky5", "ltx_video", "wan_moe"])
def test_other_families_self_attention_runs_sla_and_keeping_every_block_is_dense(family):
    """Each family's ``self_attention`` modules get a proj_l of their head dim; with every key block kept and proj_l
    zero (a dense checkpoint's), the model is the dense one."""
    from family_cases import CASES
    dense = CASES[family].config
    model = msgspec.structs.replace(dense, attention="sla", sla=SLAConfig(topk_ratio=1.0, block_q=4, block_k=4,
                                                                         implementation="reference")).build()
    dense = dense.build()
    params = model.weights.init(random.key(0))
    assert any("attn_impl.proj_l" in name for name in params)
    x, t, cond = inputs(dense, random.key(1))
    plain = {name: p for name, p in params.items() if "proj_l" not in name}
    torch.testing.assert_close(model.apply(params, x, t, cond), dense.apply(plain, x, t, cond), rtol=1e-5, atol=1e-5)


def test_gradients_reach_proj_l_and_the_projections_through_the_model(dense_folder):
    folder, _, _ = dense_folder
    model = sla_model(topk_ratio=0.25).build()
    params = {name: p.requires_grad_() for name, p in model.weights.load(str(folder)).items()}
    x, t, cond = inputs(model, random.key(1), **GRID)
    model.apply(params, x, t, cond).square().mean().backward()
    for name in (*PROJ, "blocks.0.attn1.to_q.weight", "blocks.1.attn1.to_v.weight"):
        assert params[name].grad.abs().max() > 0, name
    assert all(torch.isfinite(p.grad).all() for p in params.values() if p.grad is not None)


def test_compiled_units_run_sla_as_eager_units_do(dense_folder):
    """``compile=blocks`` traces the selection, gathers and linear part inside each block's one graph (aot_eager)."""
    folder, _, _ = dense_folder
    eager = sla_model(topk_ratio=0.25).build()
    compiled = msgspec.structs.replace(sla_model(topk_ratio=0.25), compile="blocks",
                                       compile_backend="aot_eager").build()
    params = {name: p + 0.01 if "proj_l" in name else p for name, p in eager.weights.load(str(folder)).items()}
    x, t, cond = inputs(eager, random.key(1), **GRID)
    with torch.no_grad():
        torch.testing.assert_close(compiled.apply(params, x, t, cond), eager.apply(params, x, t, cond),
                                   rtol=1e-5, atol=1e-5)
    assert compiled.kernels.compile_stats.graphs == 1


def test_a_lora_on_proj_l_adapts_it(dense_folder):
    """The kernel calls ``proj_l`` as a module, so an adapter hooked on it (the toy recipe's) gets gradients and
    changes the output once trained; FastVideo's recipe leaves proj_l out of its targets."""
    folder, _, _ = dense_folder
    adapters = LoRAConfig(rank=4, alpha=4.0, target_modules=("to_q", "proj_l"))
    model = msgspec.structs.replace(sla_model(topk_ratio=0.25), path=str(folder), lora=adapters,
                                    frozen_dtype="fp32").build()
    base, fresh = model.weights.base(random.key(0)), model.weights.initial(random.key(1))
    lora_b = "blocks.0.attn1.attn_impl.proj_l.lora_B.weight"
    assert lora_b in fresh
    trained = {name: p.clone().requires_grad_() for name, p in fresh.items()}
    x, t, cond = inputs(model, random.key(1), **GRID)
    before = model.apply({**base, **trained}, x, t, cond)
    before.square().mean().backward()
    assert trained[lora_b].grad.abs().max() > 0
    moved = {**fresh, lora_b: torch.full_like(fresh[lora_b], 0.1)}
    assert (model.apply({**base, **moved}, x, t, cond) - before.detach()).abs().max() > 1e-4


def test_turbowan_proj_l_loads_under_its_names_and_exports_byte_for_byte(dense_folder, tmp_path):
    """A TurboWan-style folder: the dense weights plus ``blocks.N.attn1.attn_impl.proj_l.*`` written here with
    safetensors (FastVideo's converter's names) -> loaded as those tensors, exported back under the same names with
    the same bytes; a dense model refuses the folder naming them."""
    folder, _, _ = dense_folder
    turbo = tmp_path / "turbo"
    (turbo / "transformer").mkdir(parents=True)
    (turbo / "transformer" / "config.json").write_bytes((folder / "transformer" / "config.json").read_bytes())
    weights = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    proj = {name: random.normal(random.key(i), (48, 48) if name.endswith("weight") else (48,))
            for i, name in enumerate(PROJ)}
    save_file({**weights, **proj}, turbo / "transformer" / "diffusion_pytorch_model.safetensors")
    model = msgspec.structs.replace(sla_model(topk_ratio=0.25), path=str(turbo)).build()
    params = model.weights.load(str(turbo))
    for name, tensor in proj.items():
        assert torch.equal(params[name], tensor), name
    model.export.folder(params, str(tmp_path / "out"))
    written = tmp_path / "out" / "transformer" / "diffusion_pytorch_model.safetensors"
    with safe_open(written, framework="pt") as f:
        assert set(PROJ) <= set(f.keys())
        for name, tensor in proj.items():
            stored = f.get_tensor(name)
            assert stored.dtype == tensor.dtype and stored.numpy().tobytes() == tensor.numpy().tobytes()
    again = tmp_path / "again"
    model.export.folder(model.weights.load(str(tmp_path / "out")), str(again))
    assert (again / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() == written.read_bytes()
    with pytest.raises(ValueError, match="proj_l"):
        TINY.build().weights.load(str(turbo))


# ------------------------------------------------------------------------------------------------------ refusals


class NoSelfAttentionWan(WanConfig, tag="wan_no_self_attention_test"):
    family = WAN.variant(name="wan_no_self_attention", architecture={"self_attention": ()})


def test_refusals_are_one_line_value_errors_before_any_weight_loads(dense_folder):
    with pytest.raises(ValueError, match="attention=sla: the wan_no_self_attention family declares no "
                                         "self-attention over the video tokens to run SLA on"):
        NoSelfAttentionWan(attention="sla").build()
    from family_cases import CASES
    with pytest.raises(ValueError, match="attention=sla: the hunyuan_video family cannot run SLA \\(nor VSA\\): its "
                                         "self-attention runs over the video and text tokens together"):
        msgspec.structs.replace(CASES["hunyuan_video"].config, attention="sla").build()
    with pytest.raises(ValueError, match="attention=sla: fvx runs SLA without sequence parallelism; run with --sp 1"):
        install.check(sla_model(), "wan:tiny", sequence_parallel=True)
    with pytest.raises(ValueError, match="sla.implementation=kernel on wan:tiny: the SLA kernel takes head dims "
                                         "\\(64, 128\\), not 48"):
        msgspec.structs.replace(TINY, attention="sla", sla=SLAConfig(implementation="kernel")).build()
    with pytest.raises(ValueError, match="sla.\\* knobs are set but attention=sdpa"):
        WanConfig(sla=SLAConfig(topk_ratio=0.5))
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"topk_ratio": 0.0}, SLAConfig)
    folder, _, _ = dense_folder
    model = sla_model().build()  # topk_ratio 0.1: 8 key blocks keep int(0.8) = 0
    params = model.weights.load(str(folder))
    x, t, cond = inputs(model, random.key(1), **GRID)
    with pytest.raises(ValueError, match="runs over 512 tokens, 8 key blocks of sla.block_k=64, and "
                                         "sla.topk_ratio=0.1 keeps int\\(0.1 \\* 8\\) = 0"):
        model.apply(params, x, t, cond)
    q = torch.zeros(1, 2, 512, 48)
    projection = torch.nn.Linear(48, 48)
    with pytest.raises(ValueError, match="attention=sla takes unmasked self-attention"):
        install._sparse_linear(sla_model(topk_ratio=0.5), projection, q, q, q, attn_mask=torch.ones(512, 512).bool())


# -------------------------------------------------------------------------------------------------------- recipes

# FastVideo's examples/train/configs/fine_tuning/wan/turbo_t2v_lora_sla.yaml, written down
TURBO_YAML = dict(init_from="loayrashid/TurboWan2.1-T2V-1.3B-Diffusers", lora_rank=16, lora_alpha=32,
                  target_modules=["to_q", "to_k", "to_v", "to_out"], dit_precision="bf16", num_gpus=1, sp_size=1,
                  data_path="data/crush-smol_processed_t2v/combined_parquet_dataset", train_batch_size=1,
                  training_cfg_rate=0.0, seed=42, num_latent_t=20, num_height=480, num_width=832, num_frames=77,
                  learning_rate=1.0e-5, betas=[0.9, 0.999], weight_decay=0.01, lr_scheduler="constant",
                  lr_warmup_steps=0, max_train_steps=10, gradient_accumulation_steps=5,
                  output_dir="outputs/turbo_wan_t2v_lora_sla", training_state_checkpointing_steps=5,
                  checkpoints_total_limit=2, enable_gradient_checkpointing_type="full", max_grad_norm=1.0,
                  every_steps=5, sampling_steps=[4], guidance_scale=1.0, flow_shift=3)
# FastVideo's SLAAttentionImpl defaults (the training entrypoint picks SLA_ATTN for a turbowan path; no metadata
# overrides topk_ratio in training: fastvideo/train/models/wan/wan.py sets attn_metadata None)
SLA_DEFAULTS = dict(topk_ratio=0.1, BLKQ=128, BLKK=64, feature_map="softmax")


def test_the_turbowan_recipe_reproduces_the_yaml():
    config = fconfig.load_experiment(f"{EXPERIMENT}:turbowan21_t2v_1p3b_lora_sla")
    y = TURBO_YAML
    student = config.models["student"]
    assert student.preset == "wan2.1-t2v-1.3b" and student.path == "models/" + y["init_from"].split("/")[1]
    assert student.lora.rank == y["lora_rank"] and student.lora.alpha == y["lora_alpha"]
    assert list(student.lora.target_modules) == y["target_modules"]
    assert student.compute_dtype == y["dit_precision"] and student.remat == (y["enable_gradient_checkpointing_type"]
                                                                             == "full")
    assert student.attention == "sla"
    assert (student.sla.topk_ratio, student.sla.block_q, student.sla.block_k, student.sla.feature_map) == \
        tuple(SLA_DEFAULTS.values())
    data, run, method, optim = config.data, config.run, config.method, config.method.optim
    assert data.path == y["data_path"] and data.cfg_rate == y["training_cfg_rate"]
    assert data.batch_size == y["train_batch_size"] * y["num_gpus"] * y["gradient_accumulation_steps"]
    assert method.grad_accum == y["gradient_accumulation_steps"]
    assert data.num_latent_t == y["num_latent_t"]
    pre = data.preprocess
    assert (pre.num_frames, pre.max_height, pre.max_width) == (y["num_frames"], y["num_height"], y["num_width"])
    assert run.seed == y["seed"] and run.steps == y["max_train_steps"] and run.output_dir == y["output_dir"]
    assert run.checkpoint.every == y["training_state_checkpointing_steps"]
    assert run.checkpoint.keep_latest == y["checkpoints_total_limit"]
    assert optim.lr == y["learning_rate"] and list(optim.betas) == y["betas"]
    assert optim.weight_decay == y["weight_decay"] and optim.schedule == y["lr_scheduler"]
    assert optim.warmup_steps == y["lr_warmup_steps"] and optim.max_grad_norm == y["max_grad_norm"]
    assert method.flow_shift == y["flow_shift"]
    validation = config.validation
    assert validation.every == y["every_steps"] and [validation.num_steps] == y["sampling_steps"]
    assert validation.guidance_scale == y["guidance_scale"] and validation.flow_shift == y["flow_shift"]
    assert validation.at_start  # the callback's run_at_start default
    # TurboWan's tokens fit SLA's blocks: 20 x 30 x 52 tokens, 488 key blocks, 48 kept by each query block
    tokens = y["num_latent_t"] * (y["num_height"] // 16) * (y["num_width"] // 16)
    assert sla.topk_count(student.sla.topk_ratio, math.ceil(tokens / student.sla.block_k)) == 48


def test_the_toy_recipe_fits_its_clips_into_sla_blocks():
    config = fconfig.load_experiment(f"{EXPERIMENT}:world_lora_sla")
    student, world = config.models["student"], config.data.world
    assert student.preset == "world" and student.attention == "sla" and "proj_l" in student.lora.target_modules
    tokens = world.frames * (world.size // world.factor) ** 2
    assert tokens == 512 and sla.topk_count(student.sla.topk_ratio, tokens // student.sla.block_k) == 2
