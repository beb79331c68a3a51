"""Batches of a dataset whose samples come in several shapes (aspect-ratio buckets, images beside videos): a batch
never mixes shapes, an epoch visits every whole batch of each shape once, and the order is a function of the key."""
import torch

from fvx.core import random
from fvx.data import batching, parquet


def samples(count, shape, caption):
    g = torch.Generator().manual_seed(len(caption))
    return [{"latents": torch.randn(*shape, generator=g), "text": torch.randn(3, 4, generator=g),
             "caption": f"{caption} {i}"} for i in range(count)]


def open_mixed(tmp_path):
    parquet.write_parquet(tmp_path / "a.parquet", samples(7, (4, 2, 3, 5), "wide") + samples(5, (4, 2, 5, 3), "tall"))
    parquet.write_parquet(tmp_path / "b.parquet", samples(4, (4, 1, 3, 5), "image") + samples(3, (4, 2, 3, 5), "wide"))
    collate = lambda s, i: batching.collate(s, i, text_len=3, cfg_rate=0.0, dropout_key=random.key(0))  # noqa: E731
    return parquet.ParquetDataset(parquet.find_parquet_files(tmp_path), kind="t2v", collate=collate)


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


def test_bucketed_order_by_hand():
    order = batching.bucketed_order(random.key(0), 0, [[0, 1, 2], [3, 4, 5, 6]], 2)
    batches = order.view(-1, 2).tolist()
    assert len(batches) == 3 and sorted(sum(batches, [])) != list(range(7))
    assert all(set(b) <= {0, 1, 2} or set(b) <= {3, 4, 5, 6} for b in batches)
    assert sum(set(b) <= {0, 1, 2} for b in batches) == 1
