"""fvx.data.parquet writes FastVideo's schemas column for column (written out here from FastVideo's
fastvideo/dataset/dataloader/schema.py: pyarrow_schema_t2v, _i2v, _t2va, _text_only) and reads back what it wrote."""
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fvx.core import random
from fvx.data import batching, parquet


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
