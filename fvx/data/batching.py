"""Batches as a pure function of (key, step): collation, the step's global batch and this rank's slice, prefetching.

``batch_at(dataset, key, step, ...)`` picks the step's global batch from a per-epoch permutation drawn from
``fold_in(key, epoch)`` (drop-last) and returns this rank's contiguous slice, plus the global sample index of each row,
which methods fold into the step key for per-sample draws. Nothing is stateful, so resuming at step ``s`` needs only
``s``. :class:`Prefetcher` computes upcoming batches in a background thread so loading overlaps the step. ``collate``
stacks a dataset's samples into the batch dict ``fvx.data.datasets``' module docstring describes.
"""
from __future__ import annotations

import collections
import functools
import queue
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

import numpy as np
import torch

from fvx.core import random, tree
from fvx.data.parquet import ACTIONS, DataError


class Dataset(Protocol):
    """``len(dataset)`` samples; ``read(indices)`` returns their collated batch (see the module docstring);
    ``where(index)`` names sample ``index`` for a person (a parquet file and row)."""

    def __len__(self) -> int: ...

    def read(self, indices: Sequence[int]) -> dict[str, Any]: ...

    def where(self, index: int) -> str: ...


# ---------------------------------------------------------------------------------------------------------- collation


def collate(samples: list[dict], indices: list[int], *, text_len: int, cfg_rate: float,
             dropout_key: torch.Tensor, num_latent_t: int | None = None, text_2_len: int | None = None,
             action_stride: int | None = None) -> dict[str, Any]:
    """Stack samples (dicts of float32 arrays: latents [C,T,H,W], text [L,D]) into a batch; pad/crop text to
    ``text_len`` with its mask; zero the text of CFG-dropped samples (the mask is kept, as FastVideo). Samples without
    text (kind matrixgame2) get no ``text``/``text_mask`` and are never CFG-dropped; their actions ``keyboard``/
    ``mouse`` [F, K] are stacked as stored, with ``action_stride`` (the VAE's time stride ``r``) checked to cover the
    kept latent frames: ``F >= (T - 1) r + 1``."""
    batch: dict[str, Any] = {}
    for key in ("latents", "first_frame_latents", "vace_context", "reference_latents"):
        if samples and key in samples[0]:
            _check_same(samples, key, lambda a: a.shape, "shape",
                        " (data of several shapes, e.g. preprocessed with buckets: set data.batch_by_shape=true)")
            latents = np.stack([s[key] for s in samples])
            if num_latent_t is not None:
                if latents.shape[2] < num_latent_t:
                    raise DataError(f"{samples[0]['where']}: {key} of {latents.shape[2]} frames "
                                     f"({list(latents.shape[1:])}) are fewer than data.num_latent_t={num_latent_t}")
                latents = latents[:, :, :num_latent_t]
            batch[key] = torch.from_numpy(np.ascontiguousarray(latents))
    if samples and "audio_latents" in samples[0]:
        first = samples[0]
        for sample in samples[1:]:
            if sample["audio_latents"].shape != first["audio_latents"].shape:
                what = "length" if sample["audio_latents"].shape[:-1] == first["audio_latents"].shape[:-1] else "shape"
                raise DataError(f"samples in one batch differ in audio latent {what}: {first['where']} has "
                                 f"{list(first['audio_latents'].shape)}, {sample['where']} has "
                                 f"{list(sample['audio_latents'].shape)}")
        batch["audio_latents"] = torch.from_numpy(np.stack([s["audio_latents"] for s in samples]))
    if samples and "audio_sample_rate" in samples[0]:
        batch["audio_sample_rate"] = torch.tensor([s["audio_sample_rate"] for s in samples], dtype=torch.int64)
    having = [s for s in samples if "image_embeds" in s]
    if having and len(having) != len(samples):
        lacking = next(s for s in samples if "image_embeds" not in s)
        raise DataError(f"{lacking['where']} has no clip_feature (image embeddings) but {having[0]['where']} has: "
                         "the data mixes preprocessings")
    if having:
        _check_same(samples, "image_embeds", lambda a: a.shape, "shape")
        batch["image_embeds"] = torch.from_numpy(np.stack([s["image_embeds"] for s in samples]))
    batch.update(_animation(samples, num_latent_t))
    for key in ("framepack_history", "frame_indices"):  # kind framepack's: a section's clean history, positions
        if samples and key in samples[0]:
            _check_same(samples, key, lambda a: a.shape, "shape")
            batch[key] = torch.from_numpy(np.stack([np.asarray(s[key], dtype=np.float32) for s in samples]))
    batch.update(_actions(samples, batch, action_stride))
    texts = [s for s in samples if "text" in s]
    if len(texts) != len(samples):
        if texts:
            lacking = next(s for s in samples if "text" not in s)
            raise DataError(f"{lacking['where']} has no text embedding but {texts[0]['where']} has: the data mixes "
                             "kinds")
        batch.update(cfg_dropped=torch.zeros(len(samples), dtype=torch.bool),
                     index=torch.tensor(indices, dtype=torch.int64))
        if samples and "caption" in samples[0]:
            batch["caption"] = [s["caption"] for s in samples]
        return batch
    _check_same(samples, "text", lambda a: a.shape[1:], "embedding width")
    for sample in samples:
        if sample["text"].ndim != 2:
            raise DataError(f"{sample['where']}: text embedding must be [L, D], "
                             f"got shape {list(sample['text'].shape)}")
    width = samples[0]["text"].shape[1] if samples else 0
    text = np.zeros((len(samples), text_len, width), dtype=np.float32)
    mask = np.zeros((len(samples), text_len), dtype=np.float32)
    dropped = cfg_dropped(dropout_key, indices, cfg_rate)
    for row, (sample, blank) in enumerate(zip(samples, dropped)):
        length = min(sample["text"].shape[0], text_len)
        mask[row, :length] = 1.0
        if not blank:
            text[row, :length] = sample["text"][:length]
    batch.update(text=torch.from_numpy(text), text_mask=torch.from_numpy(mask),
                 cfg_dropped=torch.tensor(dropped, dtype=torch.bool), index=torch.tensor(indices, dtype=torch.int64))
    if text_2_len is not None and samples and "text_2" in samples[0]:
        batch.update(_second_text(samples, dropped, text_2_len))
    if samples and "caption" in samples[0]:
        batch["caption"] = [s["caption"] for s in samples]
    return batch


def _animation(samples: list[dict], num_latent_t: int | None) -> dict[str, torch.Tensor]:
    """Kind animate's pose latents ``[B, C, T, H, W]`` and face video ``[B, 3, 4 (T - 1) + 1, S, S]`` (``T`` one less
    than the latents' frames: the reference's slot), cut to ``num_latent_t - 1`` latent frames when given."""
    out = {}
    for key in ("pose_latents", "face_pixels"):
        if samples and key in samples[0]:
            _check_same(samples, key, lambda a: a.shape, "shape")
            stacked = np.stack([s[key] for s in samples])
            if num_latent_t is not None:
                stacked = stacked[:, :, :num_latent_t - 1 if key == "pose_latents" else 4 * (num_latent_t - 2) + 1]
            out[key] = torch.from_numpy(np.ascontiguousarray(stacked, dtype=np.float32))
    return out


def _actions(samples: list[dict], batch: dict[str, Any], stride: int | None) -> dict[str, torch.Tensor]:
    """``keyboard``/``mouse`` [B, F, K] float32 of samples that have them (all or none, one shape), each checked,
    with ``stride``, to hold the ``(T - 1) stride + 1`` video frames of the batch's ``T`` latent frames."""
    out = {}
    frames = batch["latents"].shape[2] if "latents" in batch else None
    for column, key in ACTIONS:
        having = [s for s in samples if key in s]
        if not having:
            continue
        if len(having) != len(samples):
            lacking = next(s for s in samples if key not in s)
            raise DataError(f"{lacking['where']} has no {column} but {having[0]['where']} has: the data mixes "
                             "action files with and without it")
        if stride is not None and frames is not None:
            need = (frames - 1) * stride + 1
            for sample in samples:
                if sample[key].shape[0] < need:
                    raise DataError(f"{sample['where']}: {column} has {sample[key].shape[0]} rows (video frames), "
                                     f"fewer than the {need} that {frames} latent frames take ((T - 1) x {stride} + 1)")
        _check_same(samples, key, lambda a: a.shape, "shape (actions of one batch must have one length and width)")
        out[key] = torch.from_numpy(np.stack([np.asarray(s[key], dtype=np.float32) for s in samples]))
    return out


def _second_text(samples: list[dict], dropped: list[bool], length: int) -> dict[str, torch.Tensor]:
    """``text_2 [B, length, D2]`` and ``text_mask_2``: each sample's second stream padded or cropped; a CFG-dropped
    sample's is empty (zeros, mask 0), as the pipelines encode a prompt with nothing in that stream."""
    _check_same(samples, "text_2", lambda a: a.shape[1:], "second-stream width")
    text = np.zeros((len(samples), length, samples[0]["text_2"].shape[1]), dtype=np.float32)
    mask = np.zeros((len(samples), length), dtype=np.float32)
    for row, (sample, blank) in enumerate(zip(samples, dropped)):
        count = 0 if blank else min(sample["text_2"].shape[0], length)
        text[row, :count], mask[row, :count] = sample["text_2"][:count], 1.0
    return {"text_2": torch.from_numpy(text), "text_mask_2": torch.from_numpy(mask)}


def _check_same(samples: list[dict], key: str, part: Callable[[np.ndarray], tuple], what: str,
                hint: str = "") -> None:
    first = samples[0] if samples else None
    for sample in samples[1:]:
        if part(sample[key]) != part(first[key]):
            raise DataError(f"samples in one batch differ in {key} {what}: {first['where']} has "
                             f"{list(first[key].shape)}, {sample['where']} has {list(sample[key].shape)}{hint}")


def suspects(batch: Mapping[str, Any], dataset: Any) -> tuple[list[str], bool]:
    """The samples of ``batch`` (its dataset ``index``) named by ``dataset.where``: those whose tensors hold a NaN or
    Inf, and True; or every one of them, and False, when the batch's data is finite."""
    index = batch.get("index")
    if not isinstance(index, torch.Tensor) or index.dim() != 1:
        return [], False
    rows = len(index)
    bad = torch.zeros(rows, dtype=torch.bool)
    for leaf in tree.tensor_leaves(dict(batch)):
        if leaf.is_floating_point() and leaf.dim() >= 1 and leaf.shape[0] == rows:
            bad |= ~torch.isfinite(leaf.detach().reshape(rows, -1).float()).all(dim=1)
    where = getattr(dataset, "where", lambda i: f"dataset sample {i}")
    chosen = bad if bool(bad.any()) else torch.ones(rows, dtype=torch.bool)
    return [where(int(i)) for i in index[chosen]], bool(bad.any())


def cfg_dropped(dropout_key: torch.Tensor, indices: Sequence[int], cfg_rate: float) -> list[bool]:
    """Whether each dataset index has its text dropped: ``uniform(fold_in(dropout_key, i)) < cfg_rate``."""
    if cfg_rate <= 0.0:
        return [False] * len(indices)
    return [bool(random.uniform(random.fold_in(dropout_key, i), ()) < cfg_rate) for i in indices]


# ---------------------------------------------------------------------------------------------------------- batching


def batch_at(dataset: Dataset, key: torch.Tensor, step: int, *, batch_size: int, rank: int = 0,
             world: int = 1) -> dict[str, Any]:
    """This rank's part of global batch ``step``: a pure function of (dataset, key, step).

    Epoch e = step // (len // batch_size) visits ``permutation(fold_in(key, e), len)`` in slices of ``batch_size``
    (the remainder is dropped); rank r takes rows [r*b, (r+1)*b) of the slice, b = batch_size // world. Adds
    ``sample_index`` [b] int64 = step * batch_size + r * b + arange(b), the same whatever the world size. A dataset
    batched by shape (``shape_groups()`` not None: ``data.batch_by_shape``, for aspect-ratio buckets or images beside
    videos) whose samples come in several shapes is batched by :func:`bucketed_order` instead, so a batch never mixes
    shapes.
    """
    for name, value, low in (("step", step, 0), ("batch_size", batch_size, 1), ("world", world, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"batch_at: {name} must be an int >= {low}, got {value!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"batch_at: rank must be an int in [0, {world}), got {rank!r}")
    if batch_size % world:
        raise ValueError(f"batch_at: batch_size {batch_size} is not divisible by world size {world}")
    groups = getattr(dataset, "shape_groups", lambda: None)()
    usable = len(dataset) if not groups or len(groups) == 1 else sum(len(g) - len(g) % batch_size for g in groups)
    steps_per_epoch = usable // batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"batch_at: the dataset has {len(dataset)} samples, fewer than one batch of {batch_size}"
                         + (" in any one shape" if usable < len(dataset) else ""))
    epoch, position = divmod(step, steps_per_epoch)
    local = batch_size // world
    start = position * batch_size + rank * local
    key_words = tuple(key.tolist())
    order = (_epoch_order(key_words, epoch, len(dataset)) if not groups or len(groups) == 1
             else _bucketed(key_words, epoch, groups, batch_size))
    batch = dataset.read(order[start:start + local].tolist())
    first = step * batch_size + rank * local
    batch["sample_index"] = torch.arange(first, first + local, dtype=torch.int64)
    return batch


@functools.lru_cache(maxsize=2)
def _epoch_order(key_words: tuple[int, int], epoch: int, length: int) -> torch.Tensor:
    """The epoch's sample order, int64 [length] (memoised: every step of an epoch uses it; do not modify)."""
    return random.permutation(random.fold_in(torch.tensor(key_words, dtype=torch.int64), epoch), length)


_BUCKETED: collections.OrderedDict = collections.OrderedDict()  # the last epochs' bucketed orders


def _bucketed(key_words: tuple[int, int], epoch: int, groups: Sequence[Sequence[int]],
              batch_size: int) -> torch.Tensor:
    """:func:`bucketed_order`, memoised for the dataset's (cached, unchanging) ``groups`` object by identity: hashing
    every index at every step would cost O(samples) a step."""
    cache_key = (key_words, epoch, id(groups), batch_size)
    hit = _BUCKETED.get(cache_key)
    if hit is None or hit[0] is not groups:
        hit = (groups, bucketed_order(torch.tensor(key_words, dtype=torch.int64), epoch, groups, batch_size))
        _BUCKETED[cache_key] = hit
        while len(_BUCKETED) > 2:
            _BUCKETED.popitem(last=False)
    return hit[1]


def bucketed_order(key: torch.Tensor, epoch: int, groups: Sequence[Sequence[int]], batch_size: int) -> torch.Tensor:
    """An epoch's sample order, int64, whose every run of ``batch_size`` holds one group's samples: each group
    (dataset indices of one shape) shuffled by ``fold_in(epoch key, g)`` and cut into whole batches (the remainder
    dropped), then the batches of all groups shuffled by ``fold_in(epoch key, len(groups))``."""
    epoch_key = random.fold_in(key, epoch)
    batches = []
    for number, group in enumerate(groups):
        members = torch.tensor(list(group), dtype=torch.int64)
        shuffled = members[random.permutation(random.fold_in(epoch_key, number), len(members))]
        whole = len(members) - len(members) % batch_size
        batches += list(shuffled[:whole].view(-1, batch_size))
    if not batches:
        return torch.zeros(0, dtype=torch.int64)
    order = random.permutation(random.fold_in(epoch_key, len(groups)), len(batches))
    return torch.cat([batches[int(i)] for i in order])


# ------------------------------------------------------------------------------------------------------ prefetching


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


_DONE = object()
_POLL_S = 0.05  # how often a blocked worker checks for close()


class Prefetcher:
    """Iterate ``(step, fn(step))`` for ``step`` in ``steps``, computing up to ``depth`` results ahead in a background
    thread (``depth=0``: computed on demand in the caller's thread).

    An exception in ``fn`` is raised to the consumer, with its original traceback, when it reaches that step.
    ``close()`` (or leaving a ``with`` block, or dropping the last reference) stops the worker and joins it.
    """

    def __init__(self, fn: Callable[[int], Any], steps: Iterable[int], depth: int = 2):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"Prefetcher: depth must be an int >= 0, got {depth!r}")
        self._fn, self._steps, self._closed = fn, iter(steps), False
        self._thread: threading.Thread | None = None
        if depth:
            self._queue: queue.Queue = queue.Queue(maxsize=depth)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=_produce, args=(fn, self._steps, self._queue, self._stop),
                                            name="fvx-prefetch", daemon=True)
            self._thread.start()

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return self

    def __next__(self) -> tuple[int, Any]:
        if self._closed:
            raise StopIteration
        if self._thread is None:
            try:
                step = next(self._steps)
                return step, self._fn(step)
            except BaseException:
                self.close()
                raise
        item = self._queue.get()
        if item is _DONE:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def close(self) -> None:
        """Stop the worker, drop computed results and wait for the worker to finish its current step."""
        self._closed = True
        if self._thread is None:
            return
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_thread", None) is not None:
            self.close()


def _produce(fn: Callable[[int], Any], steps: Iterator[int], out: queue.Queue, stop: threading.Event) -> None:
    """The worker: put (step, fn(step)) for each step, then _DONE, or a _Failure; return early once ``stop`` is set."""
    try:
        for step in steps:
            if stop.is_set() or not _put(out, (step, fn(step)), stop):
                return
    except BaseException as error:  # handed to the consumer, who re-raises it
        _put(out, _Failure(error), stop)
        return
    _put(out, _DONE, stop)


def _put(out: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put ``item``, waiting for room; False if ``stop`` was set first."""
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False

