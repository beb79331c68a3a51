"""Every model family through the generic builder (tiny presets of the real diffusers classes): apply equals the
diffusers module called as its pipeline calls it, export round-trips through from_pretrained bit for bit, remat and
compiled units change nothing, the dry run's activation figures match what units save, and fine-tuning learns."""
import json
import math
import sys

import pytest
import torch

from fvx.core import grad, random, role
from fvx.core.optim_config import AdamWConfig
from fvx.distributed import memory
from fvx_methods import finetune
from fvx_models import build

from family_cases import CASES, FAMILIES, inputs, native_modules, raw_batch  # noqa: E402

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[2] / "bench"))
from activations import saved_per_group  # noqa: E402


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return request.param, CASES[request.param]


@pytest.fixture(scope="module")
def built(case):
    name, c = case
    model = c.config.build()
    return name, c, model, model.weights.init(random.key(0))


def mse(model, x, t, cond, target):
    def loss(params):
        return ((model.apply(params, x, t, cond) - target) ** 2).mean()

    return loss


def test_apply_equals_the_diffusers_module_called_as_its_pipeline_does(built):
    name, case, model, params = built
    x, t, cond = inputs(model, random.key(1))
    if name == "wan_moe":  # samples on both sides of the 875 boundary
        x, t, cond = inputs(model, random.key(1), batch=3, t=(900.0, 100.0, 875.0))
    got = model.apply(params, x, t, cond)
    with torch.no_grad():
        want = case.native(native_modules(case, params), x, t, cond)
    assert got.dtype == torch.float32 and got.shape == x.shape
    # absolute error in units of the largest output (an epsilon family's velocity is its output over a = 0.1 here)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5 * max(1.0, float(want.abs().max())))


def test_export_loads_with_from_pretrained_bit_for_bit_and_back(built, tmp_path):
    name, case, model, params = built
    model.export.folder(params, str(tmp_path / "out"))
    folder = tmp_path / "out"
    index = json.loads((folder / "model_index.json").read_text())
    for component, prefix in case.config.family.checkpoints.components.items():
        cls = case.classes[component]
        assert index[component] == ["diffusers", cls.__name__]
        state = torch.get_rng_state()
        theirs = cls.from_pretrained(folder / component).state_dict()
        torch.set_rng_state(state)
        ours = {n[len(prefix):]: p for n, p in params.items() if n.startswith(prefix)}
        assert list(theirs) == list(ours)
        assert all(torch.equal(theirs[n], ours[n]) for n in ours), component
    back = model.weights.load(str(folder))
    assert list(back) == list(params) and all(torch.equal(back[n], params[n]) for n in params)
    assert (folder / "scheduler" / "scheduler_config.json").is_file()


def test_remat_gradients_equal_no_remat(built):
    name, case, model, params = built
    x, t, cond = inputs(model, random.key(2))
    target = random.normal(random.key(3), x.shape)
    remat = type(case.config)(**{**_fields(case.config), "remat": True}).build()
    loss, grads = grad.value_and_grad(mse(model, x, t, cond, target))(params)
    loss_r, grads_r = grad.value_and_grad(mse(remat, x, t, cond, target))(params)
    assert torch.equal(loss, loss_r)
    assert all(torch.equal(grads[n], grads_r[n]) for n in grads)


def _fields(config) -> dict:
    return {field: getattr(config, field) for field in config.__struct_fields__}


def compiled_matches_eager(case, compiled):
    """Two compiled loss-and-gradient calls equal the eager model's (loss to 1e-5, gradients to 1e-4 of their
    largest); the compiled model's compile counters."""
    eager = case.config.build()
    params = eager.weights.init(random.key(0))
    x, t, cond = inputs(eager, random.key(2))
    target = random.normal(random.key(3), x.shape)
    loss, grads = grad.value_and_grad(mse(eager, x, t, cond, target))(params)
    for _ in range(2):
        loss_c, grads_c = grad.value_and_grad(mse(compiled, x, t, cond, target))(params)
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=0)
    for n in grads:
        torch.testing.assert_close(grads_c[n], grads[n], rtol=1e-4, atol=1e-4 * grads[n].abs().max().item())
    return compiled.kernels.compile_stats


def compiled_config(case, mode: str, backend: str = "aot_eager"):
    return type(case.config)(**{**_fields(case.config), "compile": mode, "compile_backend": backend})


@pytest.mark.parametrize("name", FAMILIES)
def test_compiled_units_make_one_graph_per_group_and_match_eager(name):
    """``compile=blocks``: one graph per unit group, no recompile. What AOT autograd makes of the ops is the whole-model
    test's (the same blocks, ``aot_eager``), so units are captured by dynamo alone (backend ``eager``: a third less
    time) unless the family's forward is not one graph."""
    case = CASES[name]
    backend = "aot_eager" if case.config.family.architecture.whole_graph_refusal else "eager"
    stats = compiled_matches_eager(case, compiled_config(case, "blocks", backend).build())
    groups = build.unit_groups(case.config.family, build.skeleton(case.config))
    assert sorted(stats.signatures) == sorted(groups) and stats.recompiles == 0
    assert all(stats.graphs_of(group) == 1 for group in groups), stats


@pytest.mark.parametrize("name", FAMILIES)
def test_a_whole_model_compiles_to_one_graph_and_matches_eager(name):
    """``compile=model``: one graph (no recompile on the second call) equal to eager, or the family's one-line
    refusal (a forward that is not one graph)."""
    case = CASES[name]
    config = compiled_config(case, "model")
    if case.config.family.architecture.whole_graph_refusal:
        with pytest.raises(ValueError, match=case.config.family.architecture.whole_graph_refusal.split("(")[0][:40]):
            config.build()
        return
    stats = compiled_matches_eager(case, config.build())
    assert stats.graphs_of("model") == 1 and stats.recompiles == 0, stats


ONE_SIZE = {"cogvideox-i2v": ("its position table holds one video size (CogVideoX 1.0 I2V's); its blocks are "
                              "cogvideox's")}


@pytest.mark.parametrize("name", FAMILIES)
def test_dry_run_activation_figures_match_what_each_unit_group_saves(name):
    """The family's figures against saved-tensor hooks on the first unit of each group (bf16): per video token, the
    growth from a 16 x 16 to a 32 x 32 latent video (what a unit saves once per sample, such as the keys of an image
    embedding's cross-attention, cancels out; HunyuanVideo 1.5's [B, 1, S, S] mask grows by its pair term); a group
    over the text tokens, at its text length."""
    if name in ONE_SIZE:
        pytest.skip(ONE_SIZE[name])
    config = CASES[name].config
    model = config.build()
    spec = type(config)(**{**_fields(config), "compute_dtype": "bf16"}).build().memory_spec()
    frames = 2 if name == "latte" else 4  # Latte's tiny temporal table holds 2 frames
    small, large = ((x.shape[0], saved_per_group(config, x, t, cond)) for x, t, cond in (
        inputs(model, random.key(1), frames=frames, size=size, text_len=8) for size in (16, 32)))
    batch = small[0]

    def estimated(group, tokens):  # of the batch's samples, each of tokens / batch
        return batch * memory.block_activation_bytes(group, tokens // batch, compute_bytes=2)

    for group in spec.groups:
        (fp32, half, tokens), (fp32_l, half_l, tokens_l) = small[1][group.name], large[1][group.name]
        if group.text_tokens:
            estimate, measured = estimated(group, tokens), fp32 + half
        else:
            measured = (fp32_l + half_l - fp32 - half) / (tokens_l - tokens)
            estimate = (estimated(group, tokens_l) - estimated(group, tokens)) / (tokens_l - tokens)
        assert abs(estimate - measured) <= 0.05 * measured, (group.name, estimate, measured)


@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_fine_tuning_lowers_a_fixed_key_eval_loss(name):
    config = CASES[name].config
    model = config.build()
    method = finetune.Finetune(optim=AdamWConfig(lr=2e-3, weight_decay=0.0))
    program = method.build({"student": model}, total_steps=16)
    state, frozen = program.init(random.key(0)), program.frozen(random.key(0))  # frozen: params a mode leaves unused
    batches = [model.batch(raw_batch(model, random.key(10 + i % 2), first=2 * i)) for i in range(16)]
    program.check(batches[0])

    def eval_loss(params):
        params = role.with_trained(frozen.get("student", {}), params)
        losses = [finetune.loss_fn(params, b, random.key(99), model=model, config=method)[0] for b in batches[:2]]
        return float(torch.stack(losses).mean())

    before = eval_loss(state.roles["student"].params)
    for batch in batches:
        state, metrics = program.step_(state, frozen, batch)
        assert math.isfinite(float(metrics["loss"]))
    after = eval_loss(state.roles["student"].params)
    # LTX-2 draws its own noise levels (a 32-token clip sits at low noise, where a tiny model gains less per step)
    assert after < (0.95 if name == "ltx2" else 0.9) * before, (before, after)


def test_a_batch_missing_a_cond_tensor_names_it_and_the_family():
    model = CASES["hunyuan_video"].config.build()
    raw = raw_batch(model, random.key(0))
    del raw["text_mask"]
    with pytest.raises(ValueError, match="hunyuan_video needs the batch tensor 'text_mask'"):
        model.batch(raw)
    narrow = {**raw_batch(model, random.key(0)), "text": torch.zeros(2, 1, 32)}
    with pytest.raises(ValueError, match=r"hunyuan_video: the batch's text embedding \[2, 1, 32\] is not the packed"):
        model.batch(narrow)
    wan_model = CASES["wan"].config.build()
    wide = {**raw_batch(wan_model, random.key(0)), "text": torch.zeros(2, 5, 31)}
    with pytest.raises(ValueError, match=r"wan: the batch's cond\['text'\] must be \[B, L, 32\], got \[2, 5, 31\]"):
        wan_model.batch(wide)


def test_memory_spec_names_every_group_with_its_widths():
    spec = CASES["hunyuan_video"].config.build().memory_spec()
    assert [(g.name, g.count, g.dim, g.ffn_dim, g.text_tokens) for g in spec.groups] == [
        ("transformer_blocks", 1, 64, 128, False), ("single_transformer_blocks", 2, 64, 128, False),
        ("token_refiner", 1, 64, 256, True)]
    assert len(spec.units) == 4 and spec.vae_stride == (4, 8, 8) and spec.patch == (1, 2, 2)
