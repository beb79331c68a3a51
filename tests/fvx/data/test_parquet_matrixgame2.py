"""Kind "matrixgame2" (Matrix-Game 2.0's action data): FastVideo's schema column for column, a write/read round trip
without text, and the one-line errors for actions that are short or of another width."""
import numpy as np
import pyarrow as pa
import pytest
import torch

from fvx.core import random
from fvx.data import batching, datasets, parquet
from fvx.data.parquet import DataError


def triple(name):
    return [pa.field(f"{name}_bytes", pa.binary()), pa.field(f"{name}_shape", pa.list_(pa.int64())),
            pa.field(f"{name}_dtype", pa.string())]


# FastVideo's pyarrow_schema_matrixgame2 (fastvideo/dataset/dataloader/schema.py), written out by hand
FASTVIDEO_MATRIXGAME2 = pa.schema(
    [pa.field("id", pa.string())] + triple("vae_latent") + triple("clip_feature") + triple("first_frame_latent")
    + triple("mouse_cond") + triple("keyboard_cond") + triple("pil_image")
    + [pa.field("file_name", pa.string()), pa.field("caption", pa.string()), pa.field("media_type", pa.string()),
       pa.field("width", pa.int64()), pa.field("height", pa.int64()), pa.field("num_frames", pa.int64()),
       pa.field("duration_sec", pa.float64()), pa.field("fps", pa.float64())])


def sample(seed, frames=3, rows=9, keys=4, mouse=True):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(16, frames, 2, 2, generator=g)
    first = torch.zeros_like(latents)
    first[:, 0] = latents[:, 0]
    out = {"latents": latents, "first_frame_latents": first, "image_embeds": torch.randn(5, 8, generator=g),
           "keyboard": torch.eye(keys)[torch.randint(0, keys, (rows,), generator=g)],
           "pil_image": torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8, generator=g), "caption": f"clip {seed}"}
    if mouse:
        out["mouse"] = torch.randn(rows, 2, generator=g)
    return out


def open_files(path, **overrides):
    config = datasets.DataConfig(path=str(path), kind="matrixgame2", **overrides)
    return datasets.open_dataset(config, random.key(0))


def test_the_schema_is_fastvideos_column_for_column():
    assert parquet.parquet_schema("matrixgame2").equals(FASTVIDEO_MATRIXGAME2)


def test_a_round_trip_gives_the_actions_as_stored_and_no_text(tmp_path):
    samples = [sample(0), sample(1)]
    parquet.write_parquet(tmp_path / "a.parquet", samples, kind="matrixgame2")
    assert parquet.pq.read_schema(tmp_path / "a.parquet").equals(FASTVIDEO_MATRIXGAME2)
    batch = open_files(tmp_path / "a.parquet", vae_time_stride=4).read([0, 1])
    for key in ("latents", "first_frame_latents", "image_embeds", "keyboard", "mouse"):
        assert torch.equal(batch[key], torch.stack([s[key] for s in samples])), key
        assert batch[key].dtype == torch.float32
    assert batch["keyboard"].shape == (2, 9, 4) and batch["mouse"].shape == (2, 9, 2)
    assert "text" not in batch and "text_mask" not in batch
    assert batch["cfg_dropped"].tolist() == [False, False] and batch["caption"] == ["clip 0", "clip 1"]


def test_keyboard_only_action_files_have_no_mouse_and_longer_actions_are_kept(tmp_path):
    parquet.write_parquet(tmp_path / "a.parquet", [sample(0, rows=12, keys=7, mouse=False)], kind="matrixgame2")
    row = parquet.pq.read_table(tmp_path / "a.parquet").to_pylist()[0]
    assert row["mouse_cond_bytes"] == b"" and row["mouse_cond_shape"] == [] and row["keyboard_cond_shape"] == [12, 7]
    batch = open_files(tmp_path / "a.parquet", vae_time_stride=4).read([0])
    assert "mouse" not in batch and batch["keyboard"].shape == (1, 12, 7)


def test_actions_shorter_than_the_latents_need_name_file_row_and_column(tmp_path):
    parquet.write_parquet(tmp_path / "a.parquet", [sample(0), sample(1, rows=2)], kind="matrixgame2")
    with pytest.raises(DataError, match=r"'.*a\.parquet' row 1: keyboard_cond has 2 rows .* fewer than the 3 latent"):
        open_files(tmp_path / "a.parquet").read([1])
    parquet.write_parquet(tmp_path / "b.parquet", [sample(0), sample(1, rows=5)], kind="matrixgame2")
    data = open_files(tmp_path / "b.parquet", vae_time_stride=4)  # 3 latent frames take (3 - 1) x 4 + 1 = 9 rows
    with pytest.raises(DataError, match=r"'.*b\.parquet' row 1: keyboard_cond has 5 rows .* fewer than the 9"):
        data.read([1])
    assert data.read([0])["keyboard"].shape == (1, 9, 4)
    assert open_files(tmp_path / "b.parquet", vae_time_stride=2).read([1])["keyboard"].shape == (1, 5, 4)


def test_an_action_of_another_width_than_its_files_first_row_is_named(tmp_path):
    parquet.write_parquet(tmp_path / "a.parquet", [sample(0), sample(1, keys=6)], kind="matrixgame2")
    with pytest.raises(DataError, match=r"'.*a\.parquet' row 1: keyboard_cond is \[9, 6\], 6 wide, but the file's "
                                        r"first row's is 4 wide"):
        open_files(tmp_path / "a.parquet").read([1])
    parquet.write_parquet(tmp_path / "m.parquet", [sample(0), sample(1, mouse=False)], kind="matrixgame2")
    with pytest.raises(DataError, match=r"row 1: mouse_cond is empty, but the file's first row has one"):
        open_files(tmp_path / "m.parquet").read([1])


def test_writing_refuses_text_and_needs_the_keyboard(tmp_path):
    with pytest.raises(ValueError, match="unknown field"):
        parquet.write_parquet(tmp_path / "a.parquet", [{**sample(0), "text": torch.zeros(2, 4)}], kind="matrixgame2")
    without = sample(0)
    del without["keyboard"]
    with pytest.raises(ValueError, match="sample 0 has no 'keyboard' tensor"):
        parquet.write_parquet(tmp_path / "a.parquet", [without], kind="matrixgame2")


def test_cfg_dropout_is_refused_for_data_without_text():
    with pytest.raises(ValueError, match=r"data.cfg_rate=0.1: data.kind='matrixgame2' has no text"):
        datasets.DataConfig(kind="matrixgame2", cfg_rate=0.1)


def test_collation_without_text_and_with_mixed_actions():
    base = {"latents": np.zeros((4, 2, 1, 1), np.float32), "keyboard": np.eye(4, dtype=np.float32)[:2]}
    collate = dict(text_len=4, cfg_rate=0.0, dropout_key=random.key(0), action_stride=1)
    batch = batching.collate([{**base, "where": "a"}, {**base, "where": "b"}], [3, 5], **collate)
    assert batch["index"].tolist() == [3, 5] and batch["keyboard"].shape == (2, 2, 4) and "text" not in batch
    with pytest.raises(DataError, match="b has no mouse_cond but a has"):
        batching.collate([{**base, "mouse": np.zeros((2, 2), np.float32), "where": "a"}, {**base, "where": "b"}],
                         [0, 1], **collate)


def test_synthetic_matrixgame2_has_one_hot_keys_per_video_frame():
    config = datasets.DataConfig(kind="matrixgame2", synthetic=datasets.SyntheticConfig(latent_shape=(16, 3, 4, 4)))
    batch = datasets.open_dataset(config, random.key(0)).read([0, 1])
    assert batch["keyboard"].shape == (2, 9, 4) and batch["mouse"].shape == (2, 9, 2)  # (3 - 1) x 4 + 1
    assert torch.equal(batch["keyboard"].sum(-1), torch.ones(2, 9))
    assert batch["image_embeds"].shape == (2, 4, 16) and torch.equal(batch["first_frame_latents"][:, :, 1:],
                                                                     torch.zeros(2, 16, 2, 4, 4))
    assert 0 < batch["mouse"].abs().max() < 1 and "text" not in batch
