import functools

import optree
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

from fvx.core.optim import (
    EmptyState,
    GradientTransformation,
    MaskedState,
    MultiTransformState,
    ScaleByAdamState,
    add_decayed_weights,
    adamw,
    apply_updates,
    chain,
    get_count,
    learning_rate,
    masked,
    multi_transform,
    scale_by_adam,
    scale_by_learning_rate,
    step_,
)
from fvx.core.role import clip_
from fvx.core.schedules import cosine
from fvx.core.tree import global_norm, map_tensors

BASE_LR, WD, STEPS = 1e-2, 0.1, 20


def make_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"scale": (), "bias": (7,), "weight": (5, 3), "conv": (4, 3, 2, 2)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def make_grads(params, step: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {k: scale * torch.randn(v.shape, generator=g) for k, v in params.items()}


def warmup_cosine():
    return cosine(BASE_LR, warmup_steps=5, total_steps=STEPS)


class TorchAdamW:
    """The reference: torch.optim.AdamW + LambdaLR (same lambda), optionally after clip_grad_norm_."""

    def __init__(self, params, schedule, betas, weight_decay=WD, max_norm=None, decays=lambda name: True):
        self.params = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        groups = [{"params": [p for k, p in self.params.items() if decays(k) == on],
                   "weight_decay": weight_decay if on else 0.0} for on in (True, False)]
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=BASE_LR, betas=betas, eps=1e-8)
        self.lr = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: schedule(s) / BASE_LR)
        self.max_norm = max_norm

    def step(self, grads):
        for k, p in self.params.items():
            p.grad = grads[k].clone()
        if self.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params.values(), self.max_norm)
        self.opt.step()
        self.lr.step()
        return {k: p.detach() for k, p in self.params.items()}

    def moments(self, key):
        s = self.opt.state[self.params[key]]
        return s["exp_avg"], s["exp_avg_sq"]


def clone(tree):
    return map_tensors(torch.clone, tree)


def assert_trees_equal(a, b):
    la, lb = optree.tree_leaves(a, none_is_leaf=True), optree.tree_leaves(b, none_is_leaf=True)
    assert optree.tree_structure(a, none_is_leaf=True) == optree.tree_structure(b, none_is_leaf=True)
    for x, y in zip(la, lb):
        assert (x is None and y is None) or torch.equal(x, y)


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.0, 0.999)])
def test_adamw_matches_torch_adamw_with_warmup_cosine(betas):
    params = make_params()
    ref = TorchAdamW(params, warmup_cosine(), betas)
    tx = adamw(warmup_cosine(), b1=betas[0], b2=betas[1], eps=1e-8, weight_decay=WD)
    state = tx.init(params)
    for step in range(STEPS):
        grads = make_grads(params, step)
        updates, state = tx.update(grads, state, params)
        params = apply_updates(params, updates)
        expected = ref.step(grads)
        for k in params:  # float rounding: the decay is folded into the update (max seen: 1.4e-6 at |p| = 2.2)
            torch.testing.assert_close(params[k], expected[k], atol=1e-6, rtol=1e-6)
    count = get_count(state)
    assert count.dtype == torch.int64 and count.shape == () and int(count) == STEPS
    for k in params:  # the moments run the same kernels as torch (lerp_, mul_, addcmul_): bitwise equal
        mu, nu = ref.moments(k)
        assert torch.equal(state[0].mu[k], mu) and torch.equal(state[0].nu[k], nu)


def test_the_role_clip_then_adamw_matches_torch_clip_grad_norm_then_adamw():
    params = make_params()
    ref = TorchAdamW(params, warmup_cosine(), (0.9, 0.999), max_norm=1.0)
    tx = adamw(warmup_cosine(), weight_decay=WD)
    state = tx.init(params)
    norms = []
    for step in range(STEPS):
        grads = make_grads(params, step, scale=0.05 if step % 2 else 1.0)  # norm ~0.4 (kept) or ~8.4 (clipped)
        norms.append(float(global_norm(grads)))
        updates, state = tx.update(clip_(clone(grads), global_norm(grads), 1.0), state, params)
        params = apply_updates(params, updates)
        expected = ref.step(grads)
        for k in params:
            torch.testing.assert_close(params[k], expected[k], atol=1e-6, rtol=1e-6)
    assert min(norms) < 1.0 < max(norms)


@pytest.mark.parametrize("max_norm", [100.0, 0.5])  # the grads' norm is ~8.4: below and above the threshold
def test_the_role_clip_matches_clip_grad_norm_(max_norm):
    params = make_params()
    grads = make_grads(params, 0)
    clipped = clip_(clone(grads), global_norm(grads), max_norm)

    tensors = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    for k, t in tensors.items():
        t.grad = grads[k].clone()
    torch.nn.utils.clip_grad_norm_(tensors.values(), max_norm)
    for k in grads:
        assert torch.equal(clipped[k], tensors[k].grad)  # same kernels: bitwise
    assert float(global_norm(clipped)) == pytest.approx(min(max_norm, float(global_norm(grads))), rel=1e-5)


def assert_trees_close(a, b):
    """Equal to float rounding: step_'s fused AdamW (decay, then addcdiv_ into the params, as torch.optim.AdamW)
    rounds differently from the pure path, which writes the update out and adds it."""
    assert optree.tree_structure(a, none_is_leaf=True) == optree.tree_structure(b, none_is_leaf=True)
    for x, y in zip(optree.tree_leaves(a, none_is_leaf=True), optree.tree_leaves(b, none_is_leaf=True)):
        assert (x is None and y is None) or torch.allclose(x, y, rtol=1e-6, atol=1e-7)


def test_donating_step_matches_the_pure_path_and_works_in_place():
    tx = adamw(warmup_cosine(), weight_decay=WD)
    pure_params = make_params()
    pure_state = tx.init(pure_params)
    params = clone(pure_params)
    state = tx.init(params)
    param_ids = {k: id(v) for k, v in params.items()}
    moment = state[0].mu["weight"]
    for step in range(8):
        grads = make_grads(params, step, scale=0.05 if step % 2 else 1.0)
        grads_before = clone(grads)
        updates, pure_state = tx.update(grads, pure_state, pure_params)
        pure_params = apply_updates(pure_params, updates)
        assert_trees_equal(grads, grads_before)

        new_params, new_state = step_(tx, params, grads, state)
        assert new_params is params and new_state[0].mu["weight"] is moment  # updated in place
        assert {k: id(v) for k, v in params.items()} == param_ids
        assert_trees_close(params, pure_params)
        assert_trees_equal(state, pure_state)  # the moments run the same kernels in both paths: bitwise
        state = new_state


class _OutputShapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (list, tuple)) else [out]
        self.shapes += [(str(func), tuple(o.shape)) for o in outs if isinstance(o, torch.Tensor)]
        return out


def test_donating_step_allocates_no_param_sized_tensor():
    params = make_params()
    tx = adamw(warmup_cosine(), weight_decay=WD)
    state = tx.init(params)
    grads = make_grads(params, 0)
    with _OutputShapes() as log:
        step_(tx, params, grads, state)
    assert log.shapes, "the mode saw no op"
    # only 0-dim scalars (lr, bias corrections) are new tensors
    assert all(shape in ((), (len(params),)) for _, shape in log.shapes), log.shapes


@pytest.mark.parametrize("learning_rate", [warmup_cosine(), BASE_LR], ids=["tensor-lr-schedule", "float-lr"])
@pytest.mark.parametrize("max_norm", [None, 1.0], ids=["adamw", "clip+adamw"])
def test_donating_step_matches_torch_adamw_to_one_rounding(learning_rate, max_norm):
    params = make_params()
    initial = clone(params)
    schedule = learning_rate if callable(learning_rate) else (lambda s: BASE_LR)
    ref = TorchAdamW(params, schedule, (0.9, 0.999), max_norm=max_norm)
    tx = adamw(learning_rate, weight_decay=WD)
    assert tx.apply_ is not None  # step_ takes the fused path
    state = tx.init(params)
    for step in range(STEPS):
        grads = make_grads(params, step, scale=0.05 if step % 2 else 1.0)
        expected = ref.step(grads)
        donated = clone(grads) if max_norm is None else clip_(clone(grads), global_norm(grads), max_norm)
        step_(tx, params, donated, state)
        if step == 0 and callable(learning_rate):  # the warmup's lr 0 (a -inf folded scale) leaves the params alone
            assert_trees_equal(params, initial)
        for k in params:
            # torch's own arithmetic, but the bias corrections are float32 tensors (no host sync) rather than Python
            # doubles, and -bc1 / lr scales the denominator: 1 rounding off (max seen 6e-8), where the pure path is
            # up to 1.4e-6 off; about 5 % of elements differ at all (for a float lr too)
            torch.testing.assert_close(params[k], expected[k], atol=1.2e-7, rtol=0)
            mu, nu = ref.moments(k)
            assert torch.equal(state[0].mu[k], mu) and torch.equal(state[0].nu[k], nu)


def test_chain_is_fused_only_when_its_last_transformation_is():
    params = make_params()
    tx = chain(adamw(1e-3), scale_by_learning_rate(0.5))  # no apply_ last, so step_ adds the scaled update
    assert tx.apply_ is None and masked(adamw(1e-3), FROZEN).apply_ is None
    pure_params, donated = clone(params), clone(params)
    updates, _ = tx.update(make_grads(params, 0), tx.init(params), params)
    step_(tx, donated, make_grads(params, 0), tx.init(params))
    assert_trees_equal(donated, apply_updates(pure_params, updates))


def test_compiled_donating_step_agrees_and_takes_lr_and_step_as_data():
    tx = adamw(warmup_cosine(), weight_decay=WD)
    eager_params = make_params()
    eager_state = tx.init(eager_params)
    params = clone(eager_params)
    state = tx.init(params)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(functools.partial(step_, tx), backend=counter, fullgraph=True)
    lrs = set()
    for step in range(7):  # the warmup changes lr every step
        lrs.add(float(warmup_cosine()(step)))
        grads = make_grads(params, step)
        step_(tx, eager_params, clone(grads), eager_state)
        compiled(params, grads, state)
        # aot_eager runs the same ATen kernels (functionalized) as the eager step_: bitwise equal
        assert_trees_equal(params, eager_params)
        assert_trees_equal(state, eager_state)
    assert len(lrs) == 7 and int(get_count(state)) == 7
    assert counter.frame_count == 1


FROZEN = {"scale": False, "bias": True, "weight": True, "conv": False}


@pytest.mark.parametrize("mask", [FROZEN, lambda p: {k: FROZEN[k] for k in p}], ids=["tree", "function"])
def test_masked_transforms_its_leaves_passes_the_others_through_and_holds_no_state_for_them(mask):
    """optax's masked: selected leaves get the inner update, the others come out as they went in."""
    params = make_params()
    trainable = {k: v for k, v in params.items() if FROZEN[k]}
    ref = TorchAdamW(trainable, warmup_cosine(), (0.9, 0.999))
    tx = masked(adamw(warmup_cosine(), weight_decay=WD), mask)
    state = tx.init(params)
    assert isinstance(state, MaskedState)
    adam_state = state.inner_state[0]
    assert isinstance(adam_state, ScaleByAdamState)
    for k, m in FROZEN.items():
        assert (adam_state.mu[k] is None) == (not m) and (adam_state.nu[k] is None) == (not m)
    assert len(optree.tree_leaves(state)) == 2 + 2 * 2  # two counts + two moments of the two trainable leaves
    for step in range(5):
        grads = make_grads(params, step)
        updates, state = tx.update(grads, state, params)
        for k in params:
            if not FROZEN[k]:
                assert torch.equal(updates[k], grads[k])  # passed through unchanged
        trained = {k: params[k] + updates[k] for k in trainable}
        expected = ref.step({k: grads[k] for k in trainable})
        for k in trainable:
            torch.testing.assert_close(trained[k], expected[k], atol=1e-6, rtol=1e-6)
        params = {**params, **trained}


def test_two_masked_optimizers_chained_train_two_groups_with_their_own_lr():
    """chain(masked(adamw(a), m), masked(adamw(b), not m)) updates both groups, each as its own AdamW would."""
    params = make_params()
    other = {k: not v for k, v in FROZEN.items()}
    tx = chain(masked(adamw(1e-1), FROZEN), masked(adamw(1e-2), other))
    refs = {lr: TorchAdamW({k: v for k, v in params.items() if group[k]}, lambda s, lr=lr: lr, (0.9, 0.999),
                           weight_decay=0.0) for lr, group in ((1e-1, FROZEN), (1e-2, other))}
    donated, state = clone(params), tx.init(params)
    for step in range(4):
        grads = make_grads(params, step)
        step_(tx, donated, clone(grads), state)
        for lr, group in ((1e-1, FROZEN), (1e-2, other)):
            expected = refs[lr].step({k: g for k, g in grads.items() if group[k]})
            for k in expected:
                torch.testing.assert_close(donated[k], expected[k], atol=1e-6, rtol=1e-6)
    assert all(not torch.equal(donated[k], params[k]) for k in params)


def test_multi_transform_equals_two_separate_optimizers():
    params = make_params()
    labels = {"scale": "head", "bias": "body", "weight": "body", "conv": "head"}
    tx = multi_transform({"body": adamw(1e-2, weight_decay=WD), "head": adamw(3e-2, b1=0.0)}, labels)
    own = {"body": adamw(1e-2, weight_decay=WD), "head": adamw(3e-2, b1=0.0)}
    for fused in (False, True):  # the pure update path, and the donating fused step of each group
        parts = {name: {k: v.clone() for k, v in params.items() if labels[k] == name} for name in own}
        states = {name: own[name].init(parts[name]) for name in own}
        current, state = clone(params), tx.init(params)
        assert isinstance(state, MultiTransformState) and set(state.inner_states) == {"body", "head"}
        for step in range(3):
            grads = make_grads(params, step)
            if fused:
                step_(tx, current, clone(grads), state)
            else:
                updates, state = tx.update(grads, state, current)
                current = apply_updates(current, updates)
            for name in own:
                group_grads = {k: grads[k].clone() for k in parts[name]}
                if fused:
                    step_(own[name], parts[name], group_grads, states[name])
                else:
                    updates, states[name] = own[name].update(group_grads, states[name], parts[name])
                    parts[name] = apply_updates(parts[name], updates)
        for name in own:
            for k, v in parts[name].items():
                assert torch.equal(current[k], v), (fused, k)
        assert int(get_count(state)) == 3


def test_weight_decay_mask_leaves_masked_params_undecayed():
    """With zero gradients AdamW's only change is the decay: the masked-out params keep their values."""
    params = make_params()
    decays = lambda p: {k: v.dim() >= 2 for k, v in p.items()}  # noqa: E731 - matrices only: not norms, biases
    for pure in (True, False):
        tx = adamw(1e-1, weight_decay=0.5, weight_decay_mask=decays)
        state, current = tx.init(params), clone(params)
        zeros = {k: torch.zeros_like(v) for k, v in params.items()}
        if pure:
            updates, _ = tx.update(zeros, state, current)
            current = apply_updates(current, updates)
        else:
            step_(tx, current, zeros, state)
        for k, v in params.items():
            if v.dim() >= 2:
                torch.testing.assert_close(current[k], v * (1 - 1e-1 * 0.5))
            else:
                assert torch.equal(current[k], v), k


def test_masks_and_labels_that_select_nothing_are_named():
    params = make_params()
    with pytest.raises(ValueError, match="masked: the mask selects no parameter"):
        masked(adamw(1e-3), {k: False for k in params}).init(params)
    with pytest.raises(ValueError, match="the label 'head' selects no parameter"):
        multi_transform({"body": adamw(1e-3), "head": adamw(1e-3)}, "body").init(params)
    with pytest.raises(ValueError, match=r"labelled \['tail'\], which have no transformation"):
        multi_transform({"body": adamw(1e-3)}, {"scale": "tail", "bias": "body", "weight": "body",
                                                 "conv": "body"}).init(params)
    with pytest.raises(ValueError, match="holds no learning-rate schedule"):
        get_count(add_decayed_weights(0.1).init(params))


def test_optimizer_states_round_trip_torch_save_and_a_weights_only_load(tmp_path):
    params = make_params()
    tx = chain(add_decayed_weights(0.1), masked(adamw(1e-3), FROZEN), multi_transform({"a": adamw(1e-3)}, "a"))
    state = tx.init(params)
    step_(tx, clone(params), make_grads(params, 0), state)
    torch.save(state, tmp_path / "state.pt")
    back = torch.load(tmp_path / "state.pt", weights_only=True)
    assert type(back[0]) is EmptyState and type(back[1]) is MaskedState and type(back[2]) is MultiTransformState
    assert_trees_equal(back, state)


def test_a_transformation_with_only_a_pure_update_works_in_the_donating_path():
    def halve_and_count() -> GradientTransformation:
        def init(params):
            return (torch.zeros((), dtype=torch.int64),)

        def update(updates, state, params=None):
            return map_tensors(lambda u: 0.5 * u, updates), (state[0] + 1,)

        return GradientTransformation(init, update)

    tx = chain(halve_and_count(), adamw(1e-3))
    pure_params = make_params()
    pure_state = tx.init(pure_params)
    params = clone(pure_params)
    state = tx.init(params)
    counter = state[0][0]
    for step in range(3):
        grads = make_grads(params, step)
        updates, pure_state = tx.update(grads, pure_state, pure_params)
        pure_params = apply_updates(pure_params, updates)
        step_(tx, params, grads, state)
    assert counter is state[0][0] and int(counter) == 3  # the new state was copied into the donated one
    assert_trees_close(params, pure_params)  # adamw, last in the chain, applies itself: rounding differs
    assert_trees_equal(state, pure_state)


def test_adamw_without_weight_decay_needs_no_params():
    params = make_params()
    tx = adamw(1e-3)
    updates, state = tx.update(make_grads(params, 0), tx.init(params))
    # first Adam step: m_hat = g, v_hat = g^2, so the update is -lr * g / (|g| + eps) = -lr * sign(g)
    for k, u in updates.items():
        torch.testing.assert_close(u, -1e-3 * torch.sign(make_grads(params, 0)[k]), atol=1e-9, rtol=1e-5)
    assert all(isinstance(x, torch.Tensor) for x in optree.tree_leaves(state))


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: adamw(-1e-3), ValueError, "learning_rate must be >= 0"),
        (lambda: adamw(1e-3, b1=1.0), ValueError, "b1 must be >= 0.0 and < 1.0"),
        (lambda: adamw(1e-3, b2=-0.1), ValueError, "b2 must be >= 0.0"),
        (lambda: adamw(1e-3, eps=-1.0), ValueError, "eps must be >= 0"),
        (lambda: adamw(1e-3, weight_decay=float("inf")), ValueError, "weight_decay must be finite"),
        (lambda: adamw("fast"), TypeError, "learning_rate must be a real number"),
        (lambda: chain(adamw(1e-3), "adamw"), TypeError, "chain argument 1"),
        (lambda: masked(lambda g: g, FROZEN), TypeError, "masked needs a GradientTransformation"),
    ],
)
def test_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_bad_calls():
    params = make_params()
    grads = make_grads(params, 0)
    tx = adamw(1e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(grads, tx.init(params))
    with pytest.raises(ValueError, match="mu does not have the structure of the updates"):
        tx.update({**grads, "extra": torch.ones(1)}, tx.init(params), params)
    with pytest.raises(ValueError, match="mu has no tensor for some leaf"):
        tx.update(grads, masked(tx, FROZEN).init(params).inner_state, params)  # state lacks the frozen leaves
    with pytest.raises(ValueError, match="not a tuple of 2"):
        chain(add_decayed_weights(0.1), tx).update(grads, tx.init(params), params)


@pytest.mark.parametrize("decay_mask", [None, {"scale": False, "bias": False, "weight": True, "conv": True}],
                         ids=["all-decay", "masked-decay"])
def test_adamw_is_its_chain_and_its_fused_step_is_torch_adamw(decay_mask):
    """adamw == chain(scale_by_adam, add_decayed_weights(mask), scale_by_learning_rate) bitwise on the pure path; its
    fused step_ equals torch.optim.AdamW (masked-out params in a group without decay) to one rounding."""
    params = make_params()
    composed = chain(scale_by_adam(0.9, 0.999, 1e-8), add_decayed_weights(WD, decay_mask),
                     scale_by_learning_rate(warmup_cosine()))
    tx = adamw(warmup_cosine(), weight_decay=WD, weight_decay_mask=decay_mask)
    decays = (lambda k: True) if decay_mask is None else decay_mask.__getitem__
    ref = TorchAdamW(params, warmup_cosine(), (0.9, 0.999), decays=decays)
    pure, fused = clone(params), clone(params)
    composed_state, pure_state, fused_state = composed.init(params), tx.init(params), tx.init(params)
    for step in range(STEPS):
        grads = make_grads(params, step)
        assert float(learning_rate(tx, fused_state)) == pytest.approx(warmup_cosine()(step), rel=1e-6)
        updates, pure_state = tx.update(grads, pure_state, pure)
        composed_updates, composed_state = composed.update(grads, composed_state, pure)
        assert_trees_equal(updates, composed_updates)
        pure = apply_updates(pure, updates)
        step_(tx, fused, clone(grads), fused_state)
        expected = ref.step(grads)
        for k in params:
            torch.testing.assert_close(fused[k], expected[k], atol=1.2e-7, rtol=0)
            torch.testing.assert_close(pure[k], expected[k], atol=1e-6, rtol=1e-6)
    assert_trees_equal(pure_state, composed_state)
    assert int(get_count(fused_state)) == STEPS and int(fused_state[0].count) == STEPS
