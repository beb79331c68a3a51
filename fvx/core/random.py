"""Explicit PRNG keys, JAX-style: counter-based Philox4x32-10 (Salmon et al. 2011, Random123) in torch integer ops.

A key is an int64 tensor of shape [2] holding two uint32 words (make one with ``key(seed)``, derive more with ``split``
and ``fold_in``; a word outside [0, 2**32) is taken mod 2**32). A draw is a pure function of (key, draw function, shape,
dtype): it never reads or advances torch's global RNG, is identical for identical keys, and traces into
``torch.compile(fullgraph=True)`` with the key as an ordinary tensor input, so a new key does not recompile. Because a
key is a plain tensor it survives ``torch.save`` / ``torch.load(weights_only=True)`` and safetensors.

Counters. Word ``j`` of a draw is word ``j % 4`` of Philox(counter=(j // 4 as 64 bits, stream, 0), key). Each draw
function has its own ``stream`` (bits, uniform, normal, randint, bernoulli, permutation, split and fold_in all differ),
so ``uniform(k, s)`` and ``normal(k, s)`` are unrelated draws. Element ``i`` of a flat draw depends only on ``i``, not
on the total size, so ``normal(k, (n,))[:m] == normal(k, (m,))`` for m <= n (integers exactly, floats up to the fast
path's rounding, see below).

Fast path. Pure-torch Philox costs about 240 small integer ops per draw: negligible for small draws, but 7-15x
``torch.randn`` for a million samples in eager mode on a CPU (measured, 2 and 1 threads). Draws of at least
``FAST_PATH_MIN_NUMEL`` elements called outside compiled code therefore run a ``torch.compile``'d copy of the same
sampler (compiled once per draw function, dtype and device, with dynamic sizes). Its integers are bitwise those of the
eager path; its floats agree to float rounding (about 1e-6 for normals, from a different log/sin/cos). Inside a compiled
region the eager code is traced instead. ``TORCHDYNAMO_DISABLE=1`` turns the fast path (with all of torch.compile) off.
"""
from __future__ import annotations

import functools
import math
import operator
from typing import Sequence

import torch

FAST_PATH_MIN_NUMEL = 1 << 16  # eager draws this large or larger run the compiled sampler

_M32 = 0xFFFFFFFF
_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
_WEYL = (0x9E3779B9, 0xBB67AE85)
_ROUNDS = 10

# Philox counter word 2 for each kind of draw: the streams never overlap.
_SPLIT, _FOLD_IN, _BITS, _UNIFORM, _NORMAL, _RANDINT, _BERNOULLI, _PERMUTATION = range(1, 9)

Shape = int | Sequence[int] | torch.Size
Word = torch.Tensor | int  # int64 tensor of uint32 values, or a Python int in [0, 2**32)


# ---------------------------------------------------------------------------------------------------------- Philox core


def _mulhilo32(a: Word, b: int) -> tuple[Word, Word]:
    """(high, low) 32-bit halves of the 64-bit product a * b, exact in int64 (no intermediate exceeds 2**49)."""
    low_part = (a & 0xFFFF) * b
    high_part = (a >> 16) * b
    low_sum = low_part + ((high_part & 0xFFFF) << 16)
    return (high_part >> 16) + (low_sum >> 32), low_sum & _M32


def _philox(c0: Word, c1: Word, c2: Word, c3: Word, k0: Word, k1: Word) -> tuple[Word, Word, Word, Word]:
    """Philox4x32-10 on words (tensors that broadcast together, or Python ints for constant counter words)."""
    for _ in range(_ROUNDS):
        hi0, lo0 = _mulhilo32(c0, _MULTIPLIERS[0])
        hi1, lo1 = _mulhilo32(c2, _MULTIPLIERS[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _WEYL[0]) & _M32, (k1 + _WEYL[1]) & _M32
    return c0, c1, c2, c3


def philox4x32(counter: torch.Tensor, key_words: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 block function: int64 counter [..., 4] and key [..., 2] of uint32 words -> int64 [..., 4]."""
    out = _philox(*counter.unbind(-1), *key_words.unbind(-1))
    return torch.stack(torch.broadcast_tensors(*out), dim=-1)


def _blocks(key: torch.Tensor, num_blocks: int, stream: int) -> tuple[torch.Tensor, ...]:
    """The four output words, each int64 [num_blocks], of Philox at counters (i, stream, 0) for i < num_blocks."""
    index = torch.arange(num_blocks, dtype=torch.int64, device=key.device)
    return _philox(index & _M32, index >> 32, stream, 0, key[0] & _M32, key[1] & _M32)


def _interleave(parts: Sequence[torch.Tensor], n: int) -> torch.Tensor:
    """Per-block outputs p_0..p_k-1, each [num_blocks] -> [n] ordered p_0[0], p_1[0], ..., p_0[1], ..."""
    return torch.stack(list(parts), dim=-1).reshape(-1)[:n]


# ---------------------------------------------------------------------------------------------------- word transforms


def _unit_float(word: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A uint32 word -> [0, 1) on a grid of 2**-p, p = the precision of dtype (24 for float32), exact in dtype."""
    precision = 1 - round(math.log2(torch.finfo(dtype).eps))
    return (word >> (32 - precision)).to(dtype) * 2.0**-precision


def _unit_float64(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Two uint32 words -> float64 in [0, 1) on a grid of 2**-53."""
    return ((high << 21) | (low >> 11)).to(torch.float64) * 2.0**-53


def _uint63(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Two uint32 words -> a non-negative int64 in [0, 2**63)."""
    return ((high & 0x7FFFFFFF) << 32) | low


def _box_muller(u_open: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent standard normals from u in (0, 1] and v in [0, 1)."""
    radius = torch.sqrt(-2.0 * torch.log(u_open))
    angle = (2.0 * math.pi) * v
    return radius * torch.cos(angle), radius * torch.sin(angle)


# ------------------------------------------------------------ flat samplers (key, n, ...) -> [n], the fast path's units


def _bits_flat(key: torch.Tensor, n: int) -> torch.Tensor:
    return _interleave(_blocks(key, -(-n // 4), _BITS), n)


def _uniform_flat(key: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float64:
        c0, c1, c2, c3 = _blocks(key, -(-n // 2), _UNIFORM)
        return _interleave([_unit_float64(c0, c1), _unit_float64(c2, c3)], n)
    return _interleave([_unit_float(c, dtype) for c in _blocks(key, -(-n // 4), _UNIFORM)], n)


def _normal_flat(key: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float64:
        c0, c1, c2, c3 = _blocks(key, -(-n // 2), _NORMAL)
        u_open = 1.0 - _unit_float64(c0, c1)
        return _interleave(_box_muller(u_open, _unit_float64(c2, c3)), n)
    c0, c1, c2, c3 = _blocks(key, -(-n // 4), _NORMAL)
    z0, z1 = _box_muller(1.0 - _unit_float(c0, torch.float32), _unit_float(c1, torch.float32))
    z2, z3 = _box_muller(1.0 - _unit_float(c2, torch.float32), _unit_float(c3, torch.float32))
    return _interleave([z0, z1, z2, z3], n).to(dtype)


def _randint_flat(key: torch.Tensor, n: int) -> torch.Tensor:
    c0, c1, c2, c3 = _blocks(key, -(-n // 2), _RANDINT)
    return _interleave([_uint63(c0, c1), _uint63(c2, c3)], n)


def _bernoulli_flat(key: torch.Tensor, n: int) -> torch.Tensor:
    return _interleave([_unit_float(c, torch.float32) for c in _blocks(key, -(-n // 4), _BERNOULLI)], n)


def _permutation_flat(key: torch.Tensor, n: int) -> torch.Tensor:
    c0, c1, c2, c3 = _blocks(key, -(-n // 2), _PERMUTATION)
    return _interleave([_uint63(c0, c1), _uint63(c2, c3)], n)


@functools.cache
def _compiled(sampler):
    """The sampler compiled once (dynamic sizes; one graph per dtype and device)."""
    return torch.compile(sampler, dynamic=True, fullgraph=True)


def _sample(sampler, key: torch.Tensor, n: int, *args) -> torch.Tensor:
    """Run a flat sampler: eagerly for small draws, when being traced, or off CPU/CUDA; else its compiled copy."""
    if torch.compiler.is_compiling() or n < FAST_PATH_MIN_NUMEL or key.device.type not in ("cpu", "cuda"):
        return sampler(key, n, *args)
    with torch.no_grad():  # one graph whatever the caller's grad mode
        return _compiled(sampler)(key, n, *args)


# ----------------------------------------------------------------------------------------------------- validation


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return f"{type(value).__name__} {value!r}"


def _check_key(key, where: str) -> None:
    if isinstance(key, torch.Tensor) and key.dtype == torch.int64 and tuple(key.shape) == (2,):
        return
    got = _describe(key)
    if isinstance(key, torch.Tensor) and key.dtype == torch.int64 and key.dim() == 2 and key.shape[-1] == 2:
        got += " (a batch of keys: pass one of them, e.g. keys[0])"
    elif isinstance(key, int) and not isinstance(key, bool):
        got += f" (a seed, not a key: use fvx.core.random.key({key}))"
    raise TypeError(
        f"fvx.core.random.{where}: `key` must be one fvx key, an int64 tensor of shape [2] holding two uint32 words; "
        f"make one with fvx.core.random.key(seed) and derive more with fvx.core.random.split / fold_in; got {got}"
    )


def _key_on(key, device, where: str) -> torch.Tensor:
    """The checked key, moved to the draw's device (the key's own when ``device`` is None)."""
    _check_key(key, where)
    return key if device is None else key.to(device)


def _as_int(value, name: str, where: str, low: int, high: int) -> int:
    """A Python integer in [low, high), or a TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or isinstance(value, torch.Tensor):
        raise TypeError(f"fvx.core.random.{where}: `{name}` must be a Python int, got {_describe(value)}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"fvx.core.random.{where}: `{name}` must be a Python int, got {_describe(value)}") from None
    if not low <= value < high:
        raise ValueError(f"fvx.core.random.{where}: `{name}` must be in [{low}, {high}), got {value}")
    return value


def _shape(shape: Shape, where: str) -> tuple[tuple[int, ...], int]:
    """(shape as a tuple, number of elements); a bare int means a 1-d shape."""
    dims = (shape,) if isinstance(shape, (int, torch.SymInt)) and not isinstance(shape, bool) else shape
    try:
        dims = tuple(dims)
    except TypeError:
        raise TypeError(f"fvx.core.random.{where}: `shape` must be a sequence of ints, got {shape!r}") from None
    for d in dims:
        if isinstance(d, torch.SymInt):
            continue
        if isinstance(d, bool) or not isinstance(d, int):
            raise TypeError(f"fvx.core.random.{where}: `shape` must be a sequence of ints, got {shape!r}")
        if d < 0:
            raise ValueError(f"fvx.core.random.{where}: `shape` must have non-negative sizes, got {shape!r}")
    return dims, math.prod(dims)


def _check_float_dtype(dtype, where: str) -> None:
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize >= 2):
        raise TypeError(f"fvx.core.random.{where}: `dtype` must be a floating dtype of 16 bits or more, got {dtype!r}")


def _broadcasts_to(source: torch.Size, target: tuple[int, ...]) -> bool:
    try:
        return torch.broadcast_shapes(source, target) == torch.Size(target)
    except RuntimeError:
        return False


def _as_real(value, name: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"fvx.core.random.{where}: `{name}` must be a Python float, got {_describe(value)}")
    if not -math.inf < value < math.inf:  # also rejects nan; math.isfinite does not trace under dynamic=True
        raise ValueError(f"fvx.core.random.{where}: `{name}` must be finite, got {value}")
    return float(value)


# ------------------------------------------------------------------------------------------------------------- keys


def key(seed: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """A key from an integer seed in [-2**63, 2**64): int64 [2] = (low 32 bits, high 32 bits) of the seed mod 2**64."""
    seed = _as_int(seed, "seed", "key", -(2**63), 2**64) & (2**64 - 1)
    return torch.tensor([seed & _M32, seed >> 32], dtype=torch.int64, device=device)


def split(key: torch.Tensor, num: int = 2) -> torch.Tensor:
    """``num`` new keys, int64 [num, 2]; child i is Philox(counter=(i, split stream), key)'s first two words."""
    _check_key(key, "split")
    num = _as_int(num, "num", "split", 1, 2**62)
    c0, c1, _, _ = _blocks(key, num, _SPLIT)
    return torch.stack([c0, c1], dim=-1)


def fold_in(key: torch.Tensor, data: int | torch.Tensor) -> torch.Tensor:
    """A new key mixing ``data`` (64 bits) into ``key``: int64 [2], or data.shape + [2] for an integer tensor.

    Use a 0-dim int64 tensor (e.g. the step counter) inside compiled code: a Python int is a constant there, and a new
    value recompiles. Negative data is taken mod 2**64, so fold_in(k, -1) == fold_in(k, 2**64 - 1).
    """
    _check_key(key, "fold_in")
    if isinstance(data, torch.Tensor):
        if data.dtype.is_floating_point or data.dtype.is_complex or data.dtype == torch.bool:
            raise TypeError(f"fvx.core.random.fold_in: `data` must be an int or an integer tensor, got "
                            f"{_describe(data)}")
        data = data.to(device=key.device, dtype=torch.int64)
        low, high = data & _M32, (data >> 32) & _M32
    else:
        data = _as_int(data, "data", "fold_in", -(2**63), 2**64) & (2**64 - 1)
        low, high = data & _M32, data >> 32
    c0, c1, _, _ = _philox(low, high, _FOLD_IN, 0, key[0] & _M32, key[1] & _M32)
    return torch.stack(torch.broadcast_tensors(c0, c1), dim=-1)


# ------------------------------------------------------------------------------------------------------------ draws


def bits(key: torch.Tensor, shape: Shape = (), *, device: torch.device | str | None = None) -> torch.Tensor:
    """Raw uint32 random words as int64 [*shape] (values in [0, 2**32))."""
    key = _key_on(key, device, "bits")
    dims, n = _shape(shape, "bits")
    return _sample(_bits_flat, key, n).reshape(dims)


def uniform(
    key: torch.Tensor,
    shape: Shape = (),
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    minval: float = 0.0,
    maxval: float = 1.0,
) -> torch.Tensor:
    """Uniform floats in [minval, maxval), [*shape]; [0, 1) is a grid of step 2**-24 (float32), 2**-53 (float64),
    2**-11 (float16) or 2**-8 (bfloat16), and a value that rounds up to maxval is lowered to the float below it."""
    key = _key_on(key, device, "uniform")
    dims, n = _shape(shape, "uniform")
    _check_float_dtype(dtype, "uniform")
    minval, maxval = _as_real(minval, "minval", "uniform"), _as_real(maxval, "maxval", "uniform")
    if not minval < maxval:
        raise ValueError(f"fvx.core.random.uniform: need minval < maxval, got minval={minval}, maxval={maxval}")
    unit = _sample(_uniform_flat, key, n, dtype).reshape(dims)
    if (minval, maxval) == (0.0, 1.0):
        return unit
    top = torch.full((), maxval, dtype=dtype, device=key.device)
    below_top = torch.nextafter(top, torch.full((), minval, dtype=dtype, device=key.device))
    return torch.minimum(unit * (maxval - minval) + minval, below_top)  # rounding must not reach maxval


def normal(
    key: torch.Tensor,
    shape: Shape = (),
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Standard normals [*shape] by Box-Muller: in float32 for 16- and 32-bit dtypes (tails cut at 5.8 sigma, from
    24-bit uniforms), in float64 for float64 (cut at 8.6 sigma)."""
    key = _key_on(key, device, "normal")
    dims, n = _shape(shape, "normal")
    _check_float_dtype(dtype, "normal")
    return _sample(_normal_flat, key, n, dtype).reshape(dims)


def normal_each(
    keys: torch.Tensor,
    shape: Shape = (),
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """One ``normal(keys[b], shape)`` per key of ``keys [B, 2]``, stacked ``[B, *shape]`` (bitwise the loop).

    Small draws run as one ``vmap`` over the keys (eager Philox is bound by per-op overhead, so this is ~30x faster than
    the loop for 64 keys); draws large enough for the compiled fast path, which cannot run under vmap, loop.
    """
    if not isinstance(keys, torch.Tensor) or keys.dim() != 2 or keys.shape[-1] != 2:
        got = tuple(keys.shape) if isinstance(keys, torch.Tensor) else type(keys).__name__
        raise TypeError(f"fvx.core.random.normal_each: `keys` must be a batch of keys [B, 2] (e.g. fold_in(key, "
                        f"torch.arange(B))), got {got}")
    keys = keys.to(device) if device is not None else keys
    dims, n = _shape(shape, "normal_each")
    if n < FAST_PATH_MIN_NUMEL:
        return torch.vmap(lambda k: normal(k, dims, dtype=dtype))(keys)
    return torch.stack([normal(k, dims, dtype=dtype) for k in keys])


def randint(
    key: torch.Tensor,
    shape: Shape,
    low: int,
    high: int,
    *,
    dtype: torch.dtype = torch.int64,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Integers in [low, high), [*shape]: low + (63 random bits mod (high - low)).

    Bias bound: each value has probability within 2**-63 of 1 / (high - low), i.e. a relative error below
    (high - low) / 2**63 (under 2**-31 for ranges up to 2**32).
    """
    key = _key_on(key, device, "randint")
    dims, n = _shape(shape, "randint")
    if not isinstance(dtype, torch.dtype) or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"fvx.core.random.randint: `dtype` must be an integer dtype, got {dtype!r}")
    info = torch.iinfo(dtype)
    low = _as_int(low, "low", "randint", info.min, info.max + 1)
    high = _as_int(high, "high", "randint", info.min + 1, info.max + 2)
    if not low < high:
        raise ValueError(f"fvx.core.random.randint: need low < high, got low={low}, high={high}")
    if high - low >= 2**63:
        raise ValueError(f"fvx.core.random.randint: high - low must be below 2**63, got {high - low}")
    random63 = _sample(_randint_flat, key, n).reshape(dims)
    return (random63 % (high - low) + low).to(dtype)


def randint_each(keys: torch.Tensor, shape: Shape, low: int, high: int) -> torch.Tensor:
    """One ``randint(keys[b], shape, low, high)`` (int64) per key of ``keys [B, 2]``, stacked ``[B, *shape]``
    (bitwise the loop, as one ``vmap`` over the keys)."""
    if not isinstance(keys, torch.Tensor) or keys.dim() != 2 or keys.shape[-1] != 2:
        got = tuple(keys.shape) if isinstance(keys, torch.Tensor) else type(keys).__name__
        raise TypeError(f"fvx.core.random.randint_each: `keys` must be a batch of keys [B, 2], got {got}")
    dims, n = _shape(shape, "randint_each")
    if n >= FAST_PATH_MIN_NUMEL:
        return torch.stack([randint(k, dims, low, high) for k in keys])
    return torch.vmap(lambda k: randint(k, dims, low, high))(keys)


def bernoulli(
    key: torch.Tensor,
    p: float | torch.Tensor = 0.5,
    shape: Shape | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Bool [*shape], True with probability p (float, or a tensor broadcastable to shape; shape defaults to p's).

    Resolution 2**-24: p is compared with a float32 uniform. A tensor ``p`` is range-checked in eager mode only
    (one host sync), not inside compiled code.
    """
    key = _key_on(key, device, "bernoulli")
    if isinstance(p, torch.Tensor):
        if not p.dtype.is_floating_point:
            raise TypeError(f"fvx.core.random.bernoulli: `p` must be a float or a floating tensor, got {_describe(p)}")
        p = p.to(key.device)
        shape = tuple(p.shape) if shape is None else shape
        if not torch.compiler.is_compiling() and bool(((p < 0) | (p > 1) | p.isnan()).any()):
            raise ValueError("fvx.core.random.bernoulli: `p` must lie in [0, 1], got a tensor with values outside it")
    else:
        p = _as_real(p, "p", "bernoulli")
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"fvx.core.random.bernoulli: `p` must lie in [0, 1], got {p}")
        shape = () if shape is None else shape
    dims, n = _shape(shape, "bernoulli")
    if isinstance(p, torch.Tensor) and not _broadcasts_to(p.shape, dims):
        raise ValueError(f"fvx.core.random.bernoulli: `p` of shape {list(p.shape)} does not broadcast to shape "
                         f"{list(dims)}")
    return _sample(_bernoulli_flat, key, n).reshape(dims) < p


def permutation(key: torch.Tensor, n: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """A random permutation of range(n), int64 [n]: the stable argsort of n random 63-bit integers."""
    key = _key_on(key, device, "permutation")
    n = _as_int(n, "n", "permutation", 0, 2**62)
    return torch.argsort(_sample(_permutation_flat, key, n), stable=True)
