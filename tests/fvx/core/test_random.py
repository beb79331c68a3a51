"""fvx.core.random: Philox known answers, key algebra, determinism, statistics, compile behaviour, errors on bad
input."""
import io
import math

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from fvx.core import random

M32 = 0xFFFFFFFF
SMALL = 50_000  # below FAST_PATH_MIN_NUMEL: the eager sampler, no compile


def draw_all(key):
    """One small draw of every kind, as a dict."""
    return {
        "bits": random.bits(key, (3, 5)),
        "uniform": random.uniform(key, (3, 5)),
        "normal": random.normal(key, (3, 5)),
        "randint": random.randint(key, (3, 5), -7, 100),
        "bernoulli": random.bernoulli(key, 0.5, (3, 5)),
        "permutation": random.permutation(key, 15),
    }


# --------------------------------------------------------------------------------------------------- Philox core


def test_philox_matches_random123_known_answers():
    counters = torch.tensor([[0, 0, 0, 0], [M32] * 4, [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]])
    keys = torch.tensor([[0, 0], [M32, M32], [0xA4093822, 0x299F31D0]])
    expected = torch.tensor(
        [
            [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8],
            [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD],
            [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
        ]
    )
    assert torch.equal(random.philox4x32(counters, keys), expected)


def test_bits_are_philox_outputs_in_counter_order(key):
    # word j is word j % 4 of Philox(counter=(j // 4, 0, stream, 0), key); the bits stream is 3
    counters = torch.tensor([[0, 0, 3, 0], [1, 0, 3, 0]])
    expected = random.philox4x32(counters, key.expand(2, 2)).reshape(-1)
    assert torch.equal(random.bits(key, (8,)), expected)


# ----------------------------------------------------------------------------------------------------------- keys


def test_key_holds_the_seed_as_two_words():
    assert torch.equal(random.key(0x1234_5678_9ABC_DEF0), torch.tensor([0x9ABC_DEF0, 0x1234_5678]))
    assert random.key(7).dtype == torch.int64 and random.key(7).shape == (2,)
    assert torch.equal(random.key(-1), torch.tensor([M32, M32]))
    assert torch.equal(random.key(2**64 - 1), random.key(-1))
    # a hand-made key's words are taken mod 2**32
    wrapped = torch.tensor([5 + 2**32, 7 - 2**32])
    assert torch.equal(random.normal(wrapped, (4,)), random.normal(torch.tensor([5, 7]), (4,)))
    assert torch.equal(random.fold_in(wrapped, 1), random.fold_in(torch.tensor([5, 7]), 1))


def test_split_children_differ_from_each_other_and_from_parent(key):
    children = random.split(key, 5)
    assert children.shape == (5, 2) and children.dtype == torch.int64
    rows = {tuple(k.tolist()) for k in children} | {tuple(key.tolist())}
    assert len(rows) == 6
    assert ((children >= 0) & (children <= M32)).all()
    first, second = random.split(key)
    assert not torch.equal(random.normal(first, (8,)), random.normal(second, (8,)))
    assert not torch.equal(random.normal(first, (8,)), random.normal(key, (8,)))


def test_fold_in_is_distinct_for_0_to_100_and_from_split(key):
    folded = torch.stack([random.fold_in(key, i) for i in range(101)])
    assert len({tuple(k.tolist()) for k in folded}) == 101
    assert not any(torch.equal(child, k) for child in random.split(key, 101) for k in folded)
    normals = torch.stack([random.normal(k, (4,)) for k in folded])
    assert len({tuple(z.tolist()) for z in normals}) == 101


def test_fold_in_takes_tensors_and_all_64_bits(key):
    by_int = torch.stack([random.fold_in(key, i) for i in range(10)])
    assert torch.equal(random.fold_in(key, torch.arange(10)), by_int)
    assert torch.equal(random.fold_in(key, torch.tensor(3)), by_int[3])
    assert torch.equal(random.fold_in(key, torch.tensor(3, dtype=torch.int32)), by_int[3])
    assert not torch.equal(random.fold_in(key, 2**32), random.fold_in(key, 0))
    assert not torch.equal(random.fold_in(key, 2**63), random.fold_in(key, 0))
    assert torch.equal(random.fold_in(key, -1), random.fold_in(key, 2**64 - 1))
    assert torch.equal(random.fold_in(key, torch.tensor(-1)), random.fold_in(key, 2**64 - 1))


# ---------------------------------------------------------------------------------------------------------- draws


def test_draws_are_deterministic_and_do_not_touch_global_rng(key):
    state = torch.get_rng_state()
    first, second = draw_all(key), draw_all(key.clone())
    random.split(key, 3), random.fold_in(key, 5), random.key(3)
    assert torch.equal(torch.get_rng_state(), state)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_draws_differ_across_keys_and_kinds(key):
    a, b = draw_all(random.fold_in(key, 1)), draw_all(random.fold_in(key, 2))
    for name in a:
        assert not torch.equal(a[name], b[name]), name
    # each kind has its own Philox stream: uniform is not the bits stream rescaled
    assert not torch.equal((random.bits(key, (64,)) >> 8).float(), random.uniform(key, (64,)) * 2**24)


def test_draws_have_requested_shapes_and_dtypes(key):
    assert random.normal(key, (2, 3, 4)).shape == (2, 3, 4)
    assert random.normal(key).shape == ()
    assert random.normal(key, 5).shape == (5,)
    assert random.normal(key, (0, 3)).shape == (0, 3)
    assert random.normal(key, (2,), dtype=torch.bfloat16).dtype == torch.bfloat16
    assert random.uniform(key, (2,), dtype=torch.float64).dtype == torch.float64
    assert random.randint(key, (2,), 0, 9, dtype=torch.int32).dtype == torch.int32
    assert random.bernoulli(key, 0.5, (2,)).dtype == torch.bool
    assert random.permutation(key, 4).dtype == torch.int64


def test_elements_do_not_depend_on_draw_size_or_shape(key):
    assert torch.equal(random.normal(key, (37,)), random.normal(key, (100,))[:37])
    assert torch.equal(random.normal(key, (4, 25)).flatten(), random.normal(key, (100,)))
    assert torch.equal(random.bits(key, (5,)), random.bits(key, (9,))[:5])
    assert torch.equal(random.randint(key, (3,), 0, 10), random.randint(key, (7,), 0, 10)[:3])


@pytest.mark.slow  # compiles the fast-path sampler (seconds on a small CPU)
def test_normal_statistics(key):
    z = random.normal(key, (10**6,))  # fast path
    assert abs(z.mean().item()) < 5e-3  # standard error 1e-3
    assert abs(z.std().item() - 1) < 5e-3
    assert abs((z.abs() > 1).float().mean().item() - 0.31731) < 3e-3
    assert z.abs().max().item() < math.sqrt(2 * 24 * math.log(2)) + 1e-5  # float32 Box-Muller tail cut
    z64 = random.normal(key, (SMALL,), dtype=torch.float64)
    assert abs(z64.mean().item()) < 0.03 and abs(z64.std().item() - 1) < 0.03


@pytest.mark.parametrize(
    "dtype, precision", [(torch.float32, 24), (torch.float64, 53), (torch.float16, 11), (torch.bfloat16, 8)]
)
def test_uniform_lies_in_unit_interval_on_its_grid(key, dtype, precision):
    u = random.uniform(key, (SMALL,), dtype=dtype)
    assert u.min() >= 0 and u.max() < 1
    scaled = u.double() * 2.0**precision
    assert torch.equal(scaled, scaled.floor())
    assert abs(u.double().mean().item() - 0.5) < 0.01
    if dtype == torch.float64:
        assert (scaled % 2**24 != 0).any()  # more than 24 bits are used


def test_uniform_range_excludes_maxval_after_rounding(key):
    u = random.uniform(key, (SMALL,), minval=-3, maxval=5)
    assert u.min() >= -3 and u.max() < 5 and u.max() > 4.9
    top = 1.0 + 2.0**-20  # u * 2**-20 + 1 rounds up to maxval for about 6 % of draws
    u = random.uniform(key, (SMALL,), minval=1.0, maxval=top)
    assert u.min() >= 1.0 and u.max() < top


def test_randint_range_and_rough_uniformity(key):
    r = random.randint(key, (SMALL,), -3, 7)
    assert r.min() == -3 and r.max() == 6
    counts = torch.bincount(r + 3, minlength=10).double()
    expected = SMALL / 10
    assert (counts - expected).abs().max() < 5 * math.sqrt(expected)
    wide = random.randint(key, (1000,), 0, 2**62)
    assert (wide >= 2**32).any() and wide.min() >= 0
    assert random.randint(key, (SMALL,), 0, 256, dtype=torch.uint8).max() == 255


def test_batched_draws_equal_one_draw_per_key(key):
    keys = random.fold_in(key, torch.arange(7) * 11)
    assert torch.equal(random.randint_each(keys, (), 0, 1000),
                       torch.stack([random.randint(k, (), 0, 1000) for k in keys]))
    assert torch.equal(random.randint_each(keys, (3,), -5, 5), torch.stack([random.randint(k, (3,), -5, 5) for k in keys]))
    assert torch.equal(random.normal_each(keys, (2, 3)), torch.stack([random.normal(k, (2, 3)) for k in keys]))
    with pytest.raises(TypeError, match=r"randint_each: `keys` must be a batch of keys \[B, 2\]"):
        random.randint_each(key, (), 0, 3)


def test_bernoulli_rates(key):
    b = random.bernoulli(key, 0.3, (SMALL,))
    assert abs(b.float().mean().item() - 0.3) < 5 * math.sqrt(0.3 * 0.7 / SMALL)
    assert not random.bernoulli(key, 0.0, (1000,)).any()
    assert random.bernoulli(key, 1.0, (1000,)).all()
    p = torch.tensor([[0.0], [0.25], [0.75], [1.0]])
    rates = random.bernoulli(key, p, (4, 10_000)).float().mean(dim=1)
    assert torch.allclose(rates, p.squeeze(1), atol=0.025)
    assert random.bernoulli(key, torch.full((3, 2), 0.5)).shape == (3, 2)


def test_permutation_is_a_permutation(key):
    perm = random.permutation(key, 1000)
    assert torch.equal(perm.sort().values, torch.arange(1000))
    assert not torch.equal(perm, torch.arange(1000))
    assert not torch.equal(perm, random.permutation(random.fold_in(key, 1), 1000))
    assert random.permutation(key, 0).shape == (0,)


# -------------------------------------------------------------------------------------------------------- compile


def test_compiled_draws_do_not_recompile_for_new_keys_or_steps(key):
    counter = CompileCounter()

    def step_draws(run_key, step):
        step_key = random.fold_in(run_key, step)
        noise_key, time_key, mask_key, perm_key = random.split(step_key, 4)
        return (
            step_key,
            random.normal(noise_key, (2, 3)),
            random.uniform(time_key, (2,), minval=0.1, maxval=0.9),
            random.bernoulli(mask_key, 0.25, (2,)),
            random.randint(perm_key, (2,), 0, 5),
            random.permutation(perm_key, 6),
        )

    compiled = torch.compile(step_draws, backend=counter, fullgraph=True)
    for seed in range(3):
        run_key, step = random.key(seed), torch.tensor(10 + seed)
        for got, want in zip(compiled(run_key, step), step_draws(run_key, step)):
            assert torch.equal(got, want)
    assert counter.frame_count == 1


@pytest.mark.slow  # compiles the fast-path sampler (seconds on a small CPU)
def test_compiled_sampler_matches_eager(key):
    """Large eager draws run the sampler compiled by inductor (fullgraph): same integers, normals to float rounding.

    This is also the suite's inductor-versus-eager check (each inductor compile costs seconds on a small CPU).
    """
    n = random.FAST_PATH_MIN_NUMEL + 3
    state = torch.get_rng_state()
    fast_bits = random.bits(key, (n,))
    fast_normal = random.normal(key, (n,))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(fast_bits, random._bits_flat(key, n))
    torch.testing.assert_close(fast_normal, random._normal_flat(key, n, torch.float32), atol=1e-6, rtol=1e-6)
    assert torch.equal(random.normal(key, (n,)), fast_normal)


# ----------------------------------------------------------------------------------------------- keys as state


def test_key_round_trips_through_torch_save(key):
    child = random.split(key, 3)[2]
    buffer = io.BytesIO()
    torch.save({"key": child}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["key"]
    assert loaded.dtype == torch.int64 and torch.equal(loaded, child)
    assert torch.equal(random.normal(loaded, (5,)), random.normal(child, (5,)))


def test_key_round_trips_through_safetensors(key):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    child = random.fold_in(key, 2**40 + 3)
    loaded = safetensors_torch.load(safetensors_torch.save({"key": child}))["key"]
    assert torch.equal(loaded, child)


@pytest.mark.cuda
def test_cpu_key_draws_on_cuda(key):
    assert torch.equal(random.bits(key, (100,), device="cuda").cpu(), random.bits(key, (100,)))
    torch.testing.assert_close(random.normal(key, (100,), device="cuda").cpu(), random.normal(key, (100,)))
    assert random.uniform(key, (3,), device="cuda").device.type == "cuda"


# ------------------------------------------------------------------------------------------------------- bad input

DRAWS = {
    "bits": lambda k: random.bits(k, (2,)),
    "uniform": lambda k: random.uniform(k, (2,)),
    "normal": lambda k: random.normal(k, (2,)),
    "randint": lambda k: random.randint(k, (2,), 0, 3),
    "bernoulli": lambda k: random.bernoulli(k, 0.5, (2,)),
    "permutation": lambda k: random.permutation(k, 3),
    "split": lambda k: random.split(k),
    "fold_in": lambda k: random.fold_in(k, 1),
}
BAD_KEYS = {
    "int32": lambda k: k.to(torch.int32),
    "float": lambda k: k.float(),
    "batch": lambda k: random.split(k, 3),
    "one_word": lambda k: k[:1],
    "seed": lambda k: 3,
    "list": lambda k: k.tolist(),
}


@pytest.mark.parametrize("draw", DRAWS)
@pytest.mark.parametrize("bad", BAD_KEYS)
def test_bad_key_names_the_key_and_how_to_make_one(key, draw, bad):
    with pytest.raises(TypeError, match=rf"fvx\.core\.random\.{draw}: `key` must be one fvx key"
                                        rf".*fvx\.core\.random\.key\(seed\)"):
        DRAWS[draw](BAD_KEYS[bad](key))


def test_bad_key_messages_say_what_was_passed(key):
    with pytest.raises(TypeError, match=r"shape \[3, 2\] \(a batch of keys: pass one of them"):
        random.normal(random.split(key, 3), (2,))
    with pytest.raises(TypeError, match=r"use fvx\.core\.random\.key\(3\)"):
        random.normal(3, (2,))


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda k: random.normal(k, (2, -1)), ValueError, "non-negative"),
        (lambda k: random.normal(k, (2.0,)), TypeError, "`shape`"),
        (lambda k: random.normal(k, (2,), dtype=torch.int64), TypeError, "`dtype`"),
        (lambda k: random.uniform(k, (2,), minval=1.0, maxval=1.0), ValueError, "minval < maxval"),
        (lambda k: random.uniform(k, (2,), maxval=math.inf), ValueError, "`maxval`"),
        (lambda k: random.randint(k, (2,), 5, 5), ValueError, "low < high"),
        (lambda k: random.randint(k, (2,), 0, 300, dtype=torch.uint8), ValueError, "`high`"),
        (lambda k: random.randint(k, (2,), -(2**63), 2**63 - 1), ValueError, "below 2\\*\\*63"),
        (lambda k: random.randint(k, (2,), 0.0, 3), TypeError, "`low`"),
        (lambda k: random.bernoulli(k, 1.5, (2,)), ValueError, "`p`"),
        (lambda k: random.bernoulli(k, "0.5", (2,)), TypeError, "`p`"),
        (lambda k: random.bernoulli(k, torch.tensor([0.5, 2.0])), ValueError, "`p`"),
        (lambda k: random.bernoulli(k, torch.tensor([0.5, 0.5]), (3,)), ValueError, "does not broadcast"),
        (lambda k: random.bernoulli(k, torch.tensor([1, 0])), TypeError, "`p`"),
        (lambda k: random.permutation(k, -1), ValueError, "`n`"),
        (lambda k: random.split(k, 0), ValueError, "`num`"),
        (lambda k: random.fold_in(k, 2**64), ValueError, "`data`"),
        (lambda k: random.fold_in(k, 1.0), TypeError, "`data`"),
        (lambda k: random.fold_in(k, torch.tensor(1.0)), TypeError, "`data`"),
        (lambda k: random.key(True), TypeError, "`seed`"),
        (lambda k: random.key(2**64), ValueError, "`seed`"),
    ],
)
def test_bad_arguments_get_clear_errors(key, call, error, message):
    with pytest.raises(error, match=message):
        call(key)
