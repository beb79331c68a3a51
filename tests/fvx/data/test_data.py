import gc
import itertools
import threading
import traceback

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fvx.config import ConfigError, validate
from fvx.core import random
from fvx.data import batching, datasets as data, parquet

# FastVideo's pyarrow_schema_t2v / pyarrow_schema_text_only, written out independently of fvx.data.datasets.
TENSOR = [("_bytes", pa.binary()), ("_shape", pa.list_(pa.int64())), ("_dtype", pa.string())]
FASTVIDEO_T2V = (
    [("id", pa.string())]
    + [("vae_latent" + s, t) for s, t in TENSOR]
    + [("text_embedding" + s, t) for s, t in TENSOR]
    + [("file_name", pa.string()), ("caption", pa.string()), ("media_type", pa.string()), ("width", pa.int64()),
       ("height", pa.int64()), ("num_frames", pa.int64()), ("duration_sec", pa.float64()), ("fps", pa.float64())]
)
FASTVIDEO_TEXT_ONLY = (
    [("id", pa.string())] + [("text_embedding" + s, t) for s, t in TENSOR] + [("caption", pa.string())]
)


def make_samples(seed, count, *, text_lengths=(3, 5, 7), latents=True):
    """Samples with distinct values and varying text lengths; latents [2, 1, 2, 3], text [L, 4]."""
    key = random.key(seed)
    samples = []
    for i in range(count):
        k_lat, k_txt = random.split(random.fold_in(key, i), 2)
        sample = {"text": random.normal(k_txt, (text_lengths[i % len(text_lengths)], 4)), "caption": f"clip {seed}-{i}"}
        if latents:
            sample["latents"] = random.normal(k_lat, (2, 1, 2, 3))
        samples.append(sample)
    return samples


def open_parquet(path, **fields):
    return data.open_dataset(data.DataConfig(path=str(path), **fields), random.key(0))


def expected_text(text, text_len):
    """Hand-computed padding/cropping: zeros after the stored tokens, mask 1 on min(L, text_len) tokens."""
    out, mask = torch.zeros(text_len, text.shape[1]), torch.zeros(text_len)
    n = min(text.shape[0], text_len)
    out[:n], mask[:n] = text[:n], 1.0
    return out, mask


@pytest.fixture
def t2v_folder(tmp_path):
    """Three files (one nested; several row groups each) of 7 + 5 + 4 samples -> (root, samples in path order)."""
    root = tmp_path / "dataset"
    a, b, c = make_samples(1, 7), make_samples(2, 5), make_samples(3, 4)
    parquet.write_parquet(root / "b.parquet", b, rows_per_group=2)
    parquet.write_parquet(root / "a" / "z.parquet", a, rows_per_group=3)
    parquet.write_parquet(root / "c.parquet", c, rows_per_group=4)
    return root, a + b + c  # sorted paths: a/z, b, c


# ---------------------------------------------------------------------------------------------------------- reading


def test_write_then_read_round_trip_with_padding_and_cropping(t2v_folder):
    root, samples = t2v_folder
    assert pq.ParquetFile(root / "b.parquet").metadata.num_row_groups == 3
    dataset = open_parquet(root, text_len=5)
    assert len(dataset) == 16
    indices = [15, 0, 7, 3, 11, 6, 12]  # across files and row groups, out of order
    batch = dataset.read(indices)
    assert batch["index"].tolist() == indices and batch["index"].dtype == torch.int64
    assert batch["latents"].shape == (7, 2, 1, 2, 3) and batch["latents"].dtype == torch.float32
    assert batch["text"].shape == (7, 5, 4) and batch["text_mask"].shape == (7, 5)
    assert batch["caption"] == [samples[i]["caption"] for i in indices]
    for row, i in enumerate(indices):
        assert torch.equal(batch["latents"][row], samples[i]["latents"])
        text, mask = expected_text(samples[i]["text"], 5)
        assert torch.equal(batch["text"][row], text) and torch.equal(batch["text_mask"][row], mask)


def test_num_latent_t_keeps_the_first_frames(tmp_path):
    samples = [{**sample, "latents": random.normal(random.key(i), (2, 5, 2, 3))}
               for i, sample in enumerate(make_samples(4, 3))]
    parquet.write_parquet(tmp_path / "five.parquet", samples)
    batch = open_parquet(tmp_path / "five.parquet", text_len=4, num_latent_t=3).read([2, 0])
    assert batch["latents"].shape == (2, 2, 3, 2, 3) and batch["latents"].is_contiguous()
    assert torch.equal(batch["latents"][0], samples[2]["latents"][:, :3])
    assert torch.equal(open_parquet(tmp_path / "five.parquet", text_len=4).read([1])["latents"][0],
                       samples[1]["latents"])
    with pytest.raises(ValueError, match=r"latents of 5 frames \(\[2, 5, 2, 3\]\) are fewer than data.num_latent_t=6"):
        open_parquet(tmp_path / "five.parquet", text_len=4, num_latent_t=6).read([0])


def test_written_files_have_fastvideo_columns_and_types(t2v_folder, tmp_path):
    root, samples = t2v_folder
    schema = pq.read_schema(root / "c.parquet")
    assert [(f.name, f.type) for f in schema] == FASTVIDEO_T2V
    table = pq.read_table(root / "c.parquet")
    assert table["vae_latent_shape"][0].as_py() == [2, 1, 2, 3] and table["vae_latent_dtype"][0].as_py() == "float32"
    raw = np.frombuffer(table["text_embedding_bytes"][1].as_py(), dtype=np.float32).reshape(5, 4)
    assert np.array_equal(raw, samples[12 + 1]["text"].numpy())
    assert table["num_frames"][0].as_py() == 1 and table["media_type"][0].as_py() == "video"

    parquet.write_parquet(tmp_path / "t.parquet", make_samples(4, 2, latents=False), kind="text_only")
    assert [(f.name, f.type) for f in pq.read_schema(tmp_path / "t.parquet")] == FASTVIDEO_TEXT_ONLY


def test_reads_a_file_built_by_hand_in_fastvideo_layout(tmp_path):
    """Independent of write_parquet: raw numpy bytes, FastVideo's column order and an id/metadata of its own."""
    latents = [np.arange(24, dtype=np.float32).reshape(2, 1, 3, 4) + 100 * i for i in range(3)]
    texts = [np.full((n, 2), i + 0.5, dtype=np.float32) for i, n in enumerate((1, 4, 2))]
    columns = {
        "id": [f"video_{i}" for i in range(3)],
        "vae_latent_bytes": [a.tobytes() for a in latents],
        "vae_latent_shape": [list(a.shape) for a in latents],
        "vae_latent_dtype": [str(a.dtype) for a in latents],
        "text_embedding_bytes": [t.tobytes() for t in texts],
        "text_embedding_shape": [list(t.shape) for t in texts],
        "text_embedding_dtype": [str(t.dtype) for t in texts],
        "file_name": [f"video_{i}.mp4" for i in range(3)],
        "caption": ["a cat", "a dog", ""],
        "media_type": ["video"] * 3,
        "width": [640] * 3, "height": [360] * 3, "num_frames": [1] * 3,
        "duration_sec": [0.1] * 3, "fps": [16.0] * 3,
    }
    schema = pa.schema([pa.field(name, kind) for name, kind in FASTVIDEO_T2V])
    pq.write_table(pa.table(columns, schema=schema), tmp_path / "hand.parquet", row_group_size=2)
    batch = open_parquet(tmp_path / "hand.parquet", text_len=3).read([2, 0, 1])
    assert batch["caption"] == ["", "a cat", "a dog"]
    for row, i in enumerate([2, 0, 1]):
        assert np.array_equal(batch["latents"][row].numpy(), latents[i])
        text, mask = expected_text(torch.from_numpy(texts[i]), 3)
        assert torch.equal(batch["text"][row], text) and torch.equal(batch["text_mask"][row], mask)

    text_only = {k: columns[k] for k, _ in FASTVIDEO_TEXT_ONLY}
    text_schema = pa.schema([pa.field(name, kind) for name, kind in FASTVIDEO_TEXT_ONLY])
    pq.write_table(pa.table(text_only, schema=text_schema), tmp_path / "text.parquet")
    batch = open_parquet(tmp_path / "text.parquet", kind="text_only", text_len=4).read([1])
    assert "latents" not in batch and torch.equal(batch["text"][0], torch.full((4, 2), 1.5))
    assert batch["text_mask"].tolist() == [[1.0, 1.0, 1.0, 1.0]]


def test_text_only_kind_reads_text_only_and_t2v_files(tmp_path, t2v_folder):
    root, samples = t2v_folder
    batch = open_parquet(root, kind="text_only", text_len=8).read([4])
    assert set(batch) == {"text", "text_mask", "cfg_dropped", "index", "caption"}
    assert torch.equal(batch["text"][0], expected_text(samples[4]["text"], 8)[0])
    text_samples = make_samples(5, 3, latents=False)
    parquet.write_parquet(tmp_path / "t.parquet", text_samples, kind="text_only")
    batch = open_parquet(tmp_path / "t.parquet", kind="text_only", text_len=6).read([0, 2])
    assert "latents" not in batch and torch.equal(batch["text"][1], expected_text(text_samples[2]["text"], 6)[0])


def test_i2v_data_carries_first_frame_latents_and_the_image_embeddings_of_samples_that_have_them(tmp_path):
    """FastVideo's I2V layout: first_frame_latent (cropped as the latents by num_latent_t) and clip_feature, whose
    empty bytes (a model without an image encoder) leave image_embeds out; a batch mixing both is refused."""
    samples = [{"latents": torch.randn(4, 3, 2, 2), "text": torch.randn(3, 8),
                "first_frame_latents": torch.randn(4, 3, 2, 2), "caption": f"clip {i}"} for i in range(3)]
    samples[2]["image_embeds"] = torch.randn(5, 6)
    parquet.write_parquet(tmp_path / "i2v.parquet", samples, kind="i2v")
    schema = pq.read_schema(tmp_path / "i2v.parquet")
    assert {"first_frame_latent_bytes", "clip_feature_bytes", "clip_feature_shape"} <= set(schema.names)
    config = data.DataConfig(kind="i2v", path=str(tmp_path), text_len=4, num_latent_t=2)
    dataset = data.open_dataset(config, random.key(0))
    plain, embedded = dataset.read([0, 1]), dataset.read([2])
    cropped = torch.stack([s["first_frame_latents"][:, :2] for s in samples[:2]])
    assert torch.equal(plain["first_frame_latents"], cropped)
    assert "image_embeds" not in plain and torch.equal(embedded["image_embeds"][0], samples[2]["image_embeds"])
    with pytest.raises(parquet.DataError, match="row 1 has no clip_feature .* but .* row 2 has"):
        dataset.read([1, 2])
    with pytest.raises(ValueError, match="has no column 'first_frame_latent_bytes', which kind='i2v' needs"):
        data.open_dataset(data.DataConfig(kind="i2v", path=str(_t2v_file(tmp_path))), random.key(0))


def _t2v_file(tmp_path):
    sample = {"latents": torch.randn(4, 1, 2, 2), "text": torch.randn(3, 8)}
    return parquet.write_parquet(tmp_path / "t2v" / "a.parquet", [sample])


def test_the_toy_worlds_i2v_samples_give_the_first_frame_and_score_the_continuation():
    from fvx.data.toy_world import WorldConfig

    dataset = data.open_dataset(data.DataConfig(kind="i2v", world=WorldConfig(), text_len=4), random.key(0))
    batch = dataset.read([0, 5])
    given = batch["first_frame_latents"]
    assert torch.equal(given[:, :, :1], batch["latents"][:, :, :1]) and not given[:, :, 1:].any()
    clips = torch.stack([torch.from_numpy(dataset.clip(i)) for i in (0, 5)]) / 2 + 0.5
    scores = dataset.sample_quality(clips, [0, 5])
    assert scores["continuation_mse"] == 0.0 and scores["hit_rate"] == 1.0
    assert dataset.sample_quality(clips.flip(2), [0, 5])["continuation_mse"] > 0.05  # played backwards


def test_files_are_in_fastvideos_order_sorted_by_path_string(tmp_path):
    """FastVideo sorts the files' real-path strings ('-' 0x2d < '.' 0x2e < '/' 0x2f), not folder by folder: pathlib's
    per-component sort gives a/y, a-b/x, a, and every index after the first file would read another row."""
    root = tmp_path / "dataset"
    names = ["a-b/x.parquet", "a.parquet", "a/y.parquet"]
    parts = {name: make_samples(seed, count) for seed, (name, count) in enumerate(zip(names, (2, 3, 4)), start=1)}
    for name in reversed(names):
        parquet.write_parquet(root / name, parts[name], rows_per_group=2)
    assert [f.relative_to(root).as_posix() for f in parquet.find_parquet_files(root)] == names
    assert [p.relative_to(root).as_posix() for p in sorted(root / n for n in names)] == [names[i] for i in (2, 0, 1)]
    dataset, samples = open_parquet(root, text_len=7), [s for name in names for s in parts[name]]
    batch = dataset.read(list(range(len(samples))))
    assert batch["caption"] == [s["caption"] for s in samples]
    for i, sample in enumerate(samples):
        assert torch.equal(batch["latents"][i], sample["latents"])


def test_pickled_file_lists_are_ignored(t2v_folder):
    root, _ = t2v_folder
    (root / "map_style_cache").mkdir()
    (root / "map_style_cache" / "file_info.pkl").write_bytes(b"not a pickle")
    assert len(open_parquet(root)) == 16


# ---------------------------------------------------------------------------------------------------------- batching


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


def test_synthetic_samples_are_a_function_of_key_and_index():
    config = data.DataConfig(text_len=4, synthetic=data.SyntheticConfig(num_samples=6, latent_shape=(2, 1, 2, 2),
                                                                        text_len=3, text_dim=5))
    one, two = data.open_dataset(config, random.key(1)), data.open_dataset(config, random.key(1))
    batch = one.read([4, 1])
    assert torch.equal(batch["latents"], two.read([4, 1])["latents"])
    assert torch.equal(batch["latents"][1], one.read([1])["latents"][0])
    samples_key = random.split(random.key(1), 2)[0]
    latents_key, text_key = random.split(random.fold_in(samples_key, 4), 2)
    assert torch.equal(batch["latents"][0], random.normal(latents_key, (2, 1, 2, 2)))
    assert torch.equal(batch["text"][0], expected_text(random.normal(text_key, (3, 5)), 4)[0])
    other = data.open_dataset(config, random.key(2)).read([4, 1])
    assert not torch.equal(batch["latents"], other["latents"])


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


# ----------------------------------------------------------------------------------------------------------- errors


def test_bad_paths_are_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        open_parquet(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="empty.*no \\*.parquet"):
        open_parquet(tmp_path / "empty")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="junk.parquet.*not a readable parquet"):
        open_parquet(tmp_path / "junk.parquet")


def test_missing_column_names_the_column_and_the_file(tmp_path):
    table = pq.read_table(parquet.write_parquet(tmp_path / "full.parquet", make_samples(0, 2)))
    pq.write_table(table.drop_columns(["text_embedding_shape"]), tmp_path / "cut.parquet")
    with pytest.raises(ValueError, match="cut.parquet.*'text_embedding_shape'"):
        open_parquet(tmp_path / "cut.parquet")


def test_text_only_data_asked_for_latents_says_so(tmp_path):
    parquet.write_parquet(tmp_path / "t.parquet", make_samples(0, 2, latents=False), kind="text_only")
    with pytest.raises(ValueError, match="t.parquet.*'vae_latent_bytes'.*kind='text_only'"):
        open_parquet(tmp_path, kind="t2v")


def test_bytes_not_matching_the_shape_name_file_and_row(tmp_path):
    table = pq.read_table(parquet.write_parquet(tmp_path / "ok.parquet", make_samples(0, 3)))
    shapes = table["vae_latent_shape"].to_pylist()
    shapes[2] = [2, 1, 2, 4]
    table = table.set_column(table.schema.get_field_index("vae_latent_shape"), "vae_latent_shape",
                             pa.array(shapes, pa.list_(pa.int64())))
    pq.write_table(table, tmp_path / "bad.parquet")
    dataset = open_parquet(tmp_path / "bad.parquet")
    dataset.read([0, 1])
    with pytest.raises(ValueError, match="bad.parquet' row 2: vae_latent_bytes holds 48 bytes.*needs 64"):
        dataset.read([2])


def test_write_parquet_rejects_kind_mismatches_without_writing(tmp_path):
    good, target = make_samples(0, 3), tmp_path / "out.parquet"
    with pytest.raises(ValueError, match="sample 0 has latents.*text_only"):
        parquet.write_parquet(target, good, kind="text_only")
    with pytest.raises(ValueError, match="sample 1 has no 'latents'"):
        parquet.write_parquet(target, [good[0], {"text": good[1]["text"]}])
    with pytest.raises(ValueError, match="kind must be one of"):
        parquet.write_parquet(target, good, kind="v2v")
    with pytest.raises(ValueError, match="sample 0 has no 'first_frame_latents' tensor"):
        parquet.write_parquet(target, good, kind="i2v")
    with pytest.raises(ValueError, match="sample 2: 'text' must have 2 dims"):
        parquet.write_parquet(target, good[:2] + [{**good[2], "text": torch.zeros(3)}])
    with pytest.raises(ValueError, match="sample 0 has unknown field"):
        parquet.write_parquet(target, [{**good[0], "prompt": "x"}])
    assert list(tmp_path.iterdir()) == []


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


@pytest.mark.parametrize("field, value", [("batch_size", 0), ("cfg_rate", 1.5), ("prefetch", -1), ("text_len", 0),
                                          ("kind", "video")])
def test_config_ranges_are_checked(field, value):
    with pytest.raises(ConfigError, match=field):
        validate(data.DataConfig(**{field: value}))
    with pytest.raises(ConfigError, match="latent_shape"):
        validate(data.DataConfig(synthetic=data.SyntheticConfig(latent_shape=(16, 0, 8, 8))))


def test_prefetcher_computes_ahead_of_the_consumer():
    computed = {step: threading.Event() for step in range(4)}

    def fn(step):
        computed[step].set()
        return step

    with batching.Prefetcher(fn, range(4), depth=2) as steps:
        assert next(steps) == (0, 0)
        assert computed[1].wait(timeout=60) and computed[2].wait(timeout=60)  # before anyone asked for them
        assert list(steps) == [(1, 1), (2, 2), (3, 3)]
