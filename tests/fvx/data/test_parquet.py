"""fvx.data.parquet writes FastVideo's schemas column for column (written out here from FastVideo's
fastvideo/dataset/dataloader/schema.py: pyarrow_schema_t2v, _i2v, _t2va, _text_only) and reads back what it wrote, reads
files built by hand in FastVideo's layout (padding and cropping the text, num_latent_t, i2v's first frames), finds the
files in FastVideo's order, and names the file, column and row of what it cannot read or write."""
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fvx.core import random
from fvx.data import batching, datasets as data, parquet

from data_samples import expected_text, make_samples, open_parquet, write_t2v_folder  # noqa: E402


def triple(name):
    return [(f"{name}_bytes", pa.binary()), (f"{name}_shape", pa.list_(pa.int64())), (f"{name}_dtype", pa.string())]


META = [("file_name", pa.string()), ("caption", pa.string()), ("media_type", pa.string()), ("width", pa.int64()),
        ("height", pa.int64()), ("num_frames", pa.int64()), ("duration_sec", pa.float64()), ("fps", pa.float64())]
FASTVIDEO = {
    "t2v": [("id", pa.string())] + triple("vae_latent") + triple("text_embedding") + META,
    "i2v": [("id", pa.string())] + triple("vae_latent") + triple("text_embedding") + triple("clip_feature")
           + triple("first_frame_latent") + triple("pil_image") + META,
    "t2va": [("id", pa.string())] + triple("vae_latent") + triple("audio_latent") + triple("text_embedding") + META
            + [("audio_sample_rate", pa.int64())],
    "text_only": [("id", pa.string())] + triple("text_embedding") + [("caption", pa.string())],
}
FASTVIDEO_T2V, FASTVIDEO_TEXT_ONLY = FASTVIDEO["t2v"], FASTVIDEO["text_only"]


@pytest.mark.parametrize("kind", sorted(FASTVIDEO))
def test_the_schema_is_fastvideos_column_for_column(kind):
    assert [(f.name, f.type) for f in parquet.parquet_schema(kind)] == FASTVIDEO[kind]


def test_an_i2v_row_reads_back_exactly_and_stores_its_first_frame_as_uint8(tmp_path):
    g = torch.Generator().manual_seed(0)
    sample = {"latents": torch.randn(4, 2, 3, 3, generator=g), "text": torch.randn(5, 8, generator=g),
              "first_frame_latents": torch.randn(4, 2, 3, 3, generator=g), "image_embeds": torch.randn(6, 8, generator=g),
              "pil_image": torch.randint(0, 256, (3, 12, 12), generator=g, dtype=torch.uint8), "caption": "c"}
    path = parquet.write_parquet(tmp_path / "i2v.parquet", [sample], kind="i2v")
    row = pq.read_table(path).to_pylist()[0]
    assert row["pil_image_dtype"] == "uint8" and row["pil_image_shape"] == [3, 12, 12]
    assert np.array_equal(np.frombuffer(row["pil_image_bytes"], np.uint8).reshape(3, 12, 12), sample["pil_image"].numpy())
    assert pq.ParquetFile(path).metadata.row_group(0).column(1).compression == "ZSTD"
    collate = lambda samples, indices: batching.collate(samples, indices, text_len=5, cfg_rate=0.0,  # noqa: E731
                                                        dropout_key=random.key(0))
    batch = parquet.ParquetDataset([path], kind="i2v", collate=collate).read([0])
    for key in ("latents", "text", "first_frame_latents", "image_embeds"):
        assert torch.equal(batch[key][0], sample[key])


def test_a_second_text_stream_is_written_after_fastvideos_columns_and_read_back_padded(tmp_path):
    g = torch.Generator().manual_seed(1)
    rows = [{"latents": torch.randn(4, 1, 2, 2, generator=g), "text": torch.randn(3, 8, generator=g),
             "text_2": torch.randn(n, 6, generator=g)} for n in (2, 0, 5)]
    path = parquet.write_parquet(tmp_path / "two.parquet", rows)
    names = pq.read_schema(path).names
    assert names[:len(FASTVIDEO["t2v"])] == [name for name, _ in FASTVIDEO["t2v"]]
    assert names[len(FASTVIDEO["t2v"]):] == ["text_embedding_2_bytes", "text_embedding_2_shape", "text_embedding_2_dtype"]
    collate = lambda samples, indices: batching.collate(samples, indices, text_len=3, cfg_rate=0.5,  # noqa: E731
                                                        dropout_key=random.key(0), text_2_len=4)
    batch = parquet.ParquetDataset([path], kind="t2v", collate=collate, second_text=True).read([0, 1, 2])
    assert batch["text_2"].shape == (3, 4, 6)
    for row, (sample, dropped) in enumerate(zip(rows, batch["cfg_dropped"].tolist())):
        kept = 0 if dropped else min(len(sample["text_2"]), 4)
        assert batch["text_mask_2"][row].tolist() == [1.0] * kept + [0.0] * (4 - kept)
        assert torch.equal(batch["text_2"][row, :kept], sample["text_2"][:kept]) and not batch["text_2"][row, kept:].any()
    assert batch["cfg_dropped"].any() and not batch["cfg_dropped"].all()  # both cases seen with this key
    parquet.write_parquet(tmp_path / "one.parquet", [{k: v for k, v in rows[0].items() if k != "text_2"}])
    with pytest.raises(ValueError, match="one.parquet' has no column 'text_embedding_2_bytes'"):
        parquet.ParquetDataset([tmp_path / "one.parquet"], kind="t2v", collate=collate, second_text=True)
    with pytest.raises(ValueError, match="sample 1 has no 'text_2' but sample 0 has"):
        parquet.write_parquet(tmp_path / "mixed.parquet", [rows[0], {k: v for k, v in rows[1].items() if k != "text_2"}])


@pytest.fixture
def t2v_folder(tmp_path):
    """Three files (one nested; several row groups each) of 7 + 5 + 4 samples -> (root, samples in path order)."""
    return write_t2v_folder(tmp_path)


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


def test_an_animate_row_stores_its_face_video_as_uint8_and_cuts_every_input_with_num_latent_t(tmp_path):
    """Kind animate: the face pixels are uint8 bytes read as float32 in [-1, 1]; ``num_latent_t`` keeps the latents'
    and reference's first frames, the pose's one fewer and the face's ``4 (T - 2) + 1``."""
    g = torch.Generator().manual_seed(0)
    sample = {"latents": torch.randn(4, 4, 2, 2, generator=g), "text": torch.randn(5, 8, generator=g),
              "image_embeds": torch.randn(3, 8, generator=g),
              "reference_latents": torch.randn(8, 4, 2, 2, generator=g),
              "pose_latents": torch.randn(4, 3, 2, 2, generator=g),
              "face_pixels": torch.randint(0, 256, (3, 9, 8, 8), generator=g, dtype=torch.uint8)}
    path = parquet.write_parquet(tmp_path / "animate.parquet", [sample], kind="animate")
    row = pq.read_table(path).to_pylist()[0]
    assert row["face_pixels_dtype"] == "uint8" and len(row["face_pixels_bytes"]) == 3 * 9 * 8 * 8
    batch = parquet.ParquetDataset([path], kind="animate", collate=lambda samples, indices: batching.collate(
        samples, indices, text_len=5, cfg_rate=0.0, dropout_key=random.key(0))).read([0])
    for key in ("latents", "image_embeds", "reference_latents", "pose_latents"):
        assert torch.equal(batch[key][0], sample[key])
    assert torch.equal(batch["face_pixels"][0], sample["face_pixels"].float() / 127.5 - 1)
    cut = parquet.ParquetDataset([path], kind="animate", collate=lambda samples, indices: batching.collate(
        samples, indices, text_len=5, cfg_rate=0.0, dropout_key=random.key(0), num_latent_t=3)).read([0])
    assert [tuple(cut[k].shape[2:3]) for k in ("latents", "reference_latents", "pose_latents", "face_pixels")] == [
        (3,), (3,), (2,), (5,)]
    with pytest.raises(TypeError, match=r"sample 0: 'face_pixels' must be a uint8 tensor \[3, F, S, S\]"):
        parquet.write_parquet(tmp_path / "float.parquet", [{**sample, "face_pixels": sample["face_pixels"].float()}],
                              kind="animate")
