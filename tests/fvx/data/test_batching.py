"""fvx.data.batching: batches of a dataset whose samples come in several shapes (aspect-ratio buckets, images beside
videos) never mix shapes, an epoch visits every whole batch of each shape once, and the order is a function of the key;
batch_at follows the epoch's permutation and its rank slices partition the global batch; cfg dropout is fixed per
index; the Prefetcher yields the synchronous batches in order ahead of the consumer, raises the worker's exception and
shuts down when abandoned."""
import gc
import itertools
import threading
import traceback

import pytest
import torch

from fvx.core import random
from fvx.data import batching, datasets as data, parquet

from data_samples import open_parquet, write_t2v_folder  # noqa: E402


def samples(count, shape, caption):
    g = torch.Generator().manual_seed(len(caption))
    return [{"latents": torch.randn(*shape, generator=g), "text": torch.randn(3, 4, generator=g),
             "caption": f"{caption} {i}"} for i in range(count)]


def open_mixed(tmp_path):
    parquet.write_parquet(tmp_path / "a.parquet", samples(7, (4, 2, 3, 5), "wide") + samples(5, (4, 2, 5, 3), "tall"))
    parquet.write_parquet(tmp_path / "b.parquet", samples(4, (4, 1, 3, 5), "image") + samples(3, (4, 2, 3, 5), "wide"))
    collate = lambda s, i: batching.collate(s, i, text_len=3, cfg_rate=0.0, dropout_key=random.key(0))  # noqa: E731
    return parquet.ParquetDataset(parquet.find_parquet_files(tmp_path), kind="t2v", collate=collate, by_shape=True)


def test_a_batch_never_mixes_shapes_and_an_epoch_visits_each_whole_batch_once(tmp_path):
    dataset = open_mixed(tmp_path)
    assert [len(g) for g in dataset.shape_groups()] == [10, 5, 4]  # wide (7 + 3), tall, image
    key = random.key(3)
    steps = 10 // 2 + 5 // 2 + 4 // 2  # whole batches of 2 per shape
    for epoch in range(2):
        seen = []
        for step in range(epoch * steps, (epoch + 1) * steps):
            batch = batching.batch_at(dataset, key, step, batch_size=2)  # collate refuses mixed shapes
            seen += batch["index"].tolist()
        assert len(seen) == len(set(seen)) == 2 * steps
    parts = [batching.batch_at(dataset, key, 4, batch_size=2, rank=r, world=2)["index"] for r in range(2)]
    assert torch.equal(torch.cat(parts), batching.batch_at(dataset, key, 4, batch_size=2)["index"])
    assert torch.equal(batching.batch_at(dataset, key, 5, batch_size=2)["index"],
                       batching.batch_at(dataset, key.clone(), 5, batch_size=2)["index"])


def test_without_batch_by_shape_a_mixed_batch_is_an_error_that_says_what_to_set(tmp_path):
    dataset = open_mixed(tmp_path)
    dataset.by_shape = False
    assert dataset.shape_groups() is None
    with pytest.raises(parquet.DataError, match=r"differ in latents shape: .* \(data of several shapes, e\.g\. "
                                                r"preprocessed with buckets: set data\.batch_by_shape=true\)"):
        for step in range(4):
            batching.batch_at(dataset, random.key(3), step, batch_size=4)


def test_bucketed_order_by_hand():
    order = batching.bucketed_order(random.key(0), 0, [[0, 1, 2], [3, 4, 5, 6]], 2)
    batches = order.view(-1, 2).tolist()
    assert len(batches) == 3 and len(set(sum(batches, []))) == 6  # 6 distinct samples: each group's remainder dropped
    assert all(set(b) <= {0, 1, 2} or set(b) <= {3, 4, 5, 6} for b in batches)
    assert sum(set(b) <= {0, 1, 2} for b in batches) == 1


# ---------------------------------------------------------------------------------------------------------- batch_at


@pytest.fixture
def t2v_folder(tmp_path):
    """Three files (one nested; several row groups each) of 7 + 5 + 4 samples -> (root, samples in path order)."""
    return write_t2v_folder(tmp_path)


def synthetic(num_samples=10, key=0, **fields):
    config = data.DataConfig(kind="text_only", text_len=3,
                             synthetic=data.SyntheticConfig(num_samples=num_samples, text_len=2, text_dim=2), **fields)
    return data.open_dataset(config, random.key(key))


def test_batch_at_is_reproducible_and_follows_the_epoch_permutation():
    dataset, key = synthetic(10), random.key(7)
    first = batching.batch_at(dataset, key, 4, batch_size=3)
    again = batching.batch_at(dataset, key.clone(), 4, batch_size=3)
    assert all(torch.equal(first[k], again[k]) for k in ("text", "index", "sample_index"))
    for epoch in range(3):  # 3 steps per epoch; the 10th sample is dropped
        order = random.permutation(random.fold_in(key, epoch), 10)
        seen = torch.cat([batching.batch_at(dataset, key, 3 * epoch + s, batch_size=3)["index"] for s in range(3)])
        assert torch.equal(seen, order[:9]) and len(set(seen.tolist())) == 9
    epochs = [torch.cat([batching.batch_at(dataset, key, 3 * e + s, batch_size=3)["index"] for s in range(3)])
              for e in range(2)]
    assert not torch.equal(epochs[0], epochs[1])
    assert not torch.equal(batching.batch_at(dataset, random.key(8), 0, batch_size=9)["index"],
                           batching.batch_at(dataset, key, 0, batch_size=9)["index"])


@pytest.mark.parametrize("world", [2, 4])
def test_rank_slices_partition_the_global_batch(t2v_folder, world):
    root, _ = t2v_folder
    dataset, key = open_parquet(root, text_len=4), random.key(3)
    for step in (0, 5):
        whole = batching.batch_at(dataset, key, step, batch_size=4)
        assert whole["sample_index"].tolist() == list(range(4 * step, 4 * step + 4))
        parts = [batching.batch_at(dataset, key, step, batch_size=4, rank=r, world=world) for r in range(world)]
        for name in ("latents", "text", "text_mask", "index", "sample_index"):
            assert torch.equal(torch.cat([p[name] for p in parts]), whole[name]), name
        assert sum((p["caption"] for p in parts), []) == whole["caption"]


def test_cfg_dropout_is_fixed_per_index_at_about_the_rate():
    clean, dropped = synthetic(200, cfg_rate=0.0), synthetic(200, cfg_rate=0.3)
    indices = list(range(200))
    a, b = clean.read(indices), dropped.read(indices)
    is_zero = (b["text"] == 0).all(dim=(1, 2))
    dropout_key = random.split(random.key(0), 2)[1]
    expected = torch.tensor([bool(random.uniform(random.fold_in(dropout_key, i), ()) < 0.3) for i in indices])
    assert torch.equal(is_zero, expected)
    assert 0.2 < is_zero.float().mean() < 0.4
    assert torch.equal(b["text"][~is_zero], a["text"][~is_zero]) and torch.equal(b["text_mask"], a["text_mask"])
    reordered = dropped.read(indices[::-1][:50])  # same index, same decision, whatever the batch
    assert torch.equal((reordered["text"] == 0).all(dim=(1, 2)), is_zero.flip(0)[:50])
    assert (synthetic(5, cfg_rate=1.0).read(range(5))["text"] == 0).all()


# ------------------------------------------------------------------------------------------------------- prefetching


def prefetch_threads():
    return {t for t in threading.enumerate() if t.name == "fvx-prefetch"}


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_prefetcher_yields_in_order_the_synchronous_batches(depth):
    dataset, key = synthetic(10), random.key(1)
    fn = lambda step: batching.batch_at(dataset, key, step, batch_size=2)  # noqa: E731
    with batching.Prefetcher(fn, range(2, 9), depth=depth) as batches:
        got = list(batches)
    assert [step for step, _ in got] == list(range(2, 9))
    for step, batch in got:
        assert torch.equal(batch["text"], fn(step)["text"]) and torch.equal(batch["index"], fn(step)["index"])


def failing(step):
    if step == 3:
        raise RuntimeError("bad step 3")
    return step * 10


@pytest.mark.parametrize("depth", [0, 2])
def test_prefetcher_raises_the_workers_exception_with_its_traceback(depth):
    before = prefetch_threads()
    prefetcher = batching.Prefetcher(failing, itertools.count(), depth=depth)
    assert [next(prefetcher) for _ in range(3)] == [(0, 0), (1, 10), (2, 20)]
    with pytest.raises(RuntimeError, match="bad step 3") as error:
        next(prefetcher)
    assert "failing" in [frame.name for frame in traceback.extract_tb(error.value.__traceback__)]
    with pytest.raises(StopIteration):
        next(prefetcher)
    assert prefetch_threads() == before


def test_prefetcher_shuts_down_when_abandoned_early():
    before = prefetch_threads()
    with batching.Prefetcher(lambda step: step, itertools.count(), depth=2) as steps:
        assert len(prefetch_threads() - before) == 1
        for step, _ in steps:
            if step == 4:
                break
    assert prefetch_threads() == before

    for step, _ in batching.Prefetcher(lambda step: step, itertools.count(), depth=2):
        if step == 2:
            break  # the last reference goes away here
    gc.collect()
    assert prefetch_threads() == before


def test_prefetcher_computes_ahead_of_the_consumer():
    computed = {step: threading.Event() for step in range(4)}

    def fn(step):
        computed[step].set()
        return step

    with batching.Prefetcher(fn, range(4), depth=2) as steps:
        assert next(steps) == (0, 0)
        assert computed[1].wait(timeout=60) and computed[2].wait(timeout=60)  # before anyone asked for them
        assert list(steps) == [(1, 1), (2, 2), (3, 3)]


# ----------------------------------------------------------------------------------------------------------- errors


def test_batch_at_rejects_bad_sizes():
    dataset, key = synthetic(10), random.key(0)
    with pytest.raises(ValueError, match="batch_size 6 is not divisible by world size 4"):
        batching.batch_at(dataset, key, 0, batch_size=6, world=4)
    with pytest.raises(ValueError, match="10 samples, fewer than one batch of 12"):
        batching.batch_at(dataset, key, 0, batch_size=12)
    with pytest.raises(ValueError, match="rank"):
        batching.batch_at(dataset, key, 0, batch_size=4, rank=2, world=2)
    with pytest.raises(ValueError, match="step"):
        batching.batch_at(dataset, key, -1, batch_size=4)
