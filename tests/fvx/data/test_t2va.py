"""Text-to-video-and-audio data (kind "t2va"): FastVideo's pyarrow_schema_t2va parquet, synthetic audio latents."""
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fvx.config import ConfigError, validate
from fvx.core import random
from fvx.data import datasets as data, parquet

# FastVideo's pyarrow_schema_t2va (fastvideo/dataset/dataloader/schema.py), written out independently of fvx.
TENSOR = [("_bytes", pa.binary()), ("_shape", pa.list_(pa.int64())), ("_dtype", pa.string())]
FASTVIDEO_T2VA = (
    [("id", pa.string())]
    + [("vae_latent" + s, t) for s, t in TENSOR]
    + [("audio_latent" + s, t) for s, t in TENSOR]
    + [("text_embedding" + s, t) for s, t in TENSOR]
    + [("file_name", pa.string()), ("caption", pa.string()), ("media_type", pa.string()), ("width", pa.int64()),
       ("height", pa.int64()), ("num_frames", pa.int64()), ("duration_sec", pa.float64()), ("fps", pa.float64()),
       ("audio_sample_rate", pa.int64())]
)


def make_samples(count, *, length=5, rate=32000):
    """Samples with distinct values: latents [3, 2, 2, 2], audio latents [2, 32, length], text [3, 4]."""
    key = random.key(7)
    samples = []
    for i in range(count):
        k_lat, k_audio, k_txt = random.split(random.fold_in(key, i), 3)
        samples.append({"latents": random.normal(k_lat, (3, 2, 2, 2)), "text": random.normal(k_txt, (3, 4)),
                        "audio_latents": random.normal(k_audio, (2, 32, length)), "audio_sample_rate": rate + i,
                        "caption": f"clip {i}"})
    return samples


def open_t2va(path, kind="t2va"):
    return data.open_dataset(data.DataConfig(path=str(path), kind=kind, text_len=4), random.key(0))


def hand_written(path, audio_bytes, audio_shapes):
    """A FastVideo-layout t2va file of len(audio_bytes) rows built with pyarrow alone (not write_parquet)."""
    rows = len(audio_bytes)
    latents, text = np.ones((3, 1, 2, 2), np.float32), np.ones((2, 4), np.float32)
    columns = {
        "id": [f"v{i}" for i in range(rows)],
        "vae_latent_bytes": [latents.tobytes()] * rows, "vae_latent_shape": [list(latents.shape)] * rows,
        "vae_latent_dtype": ["float32"] * rows,
        "audio_latent_bytes": audio_bytes, "audio_latent_shape": audio_shapes, "audio_latent_dtype": ["float32"] * rows,
        "text_embedding_bytes": [text.tobytes()] * rows, "text_embedding_shape": [list(text.shape)] * rows,
        "text_embedding_dtype": ["float32"] * rows,
        "file_name": [f"v{i}.mp4" for i in range(rows)], "caption": ["a clip"] * rows,
        "media_type": ["video_with_audio"] * rows, "width": [64] * rows, "height": [32] * rows,
        "num_frames": [5] * rows, "duration_sec": [0.2] * rows, "fps": [25.0] * rows,
        "audio_sample_rate": [32000] * rows,
    }
    schema = pa.schema([pa.field(name, kind) for name, kind in FASTVIDEO_T2VA])
    pq.write_table(pa.table(columns, schema=schema), path)
    return path


def test_write_then_read_round_trip_carries_audio_latents_and_sample_rates(tmp_path):
    samples = make_samples(5)
    path = parquet.write_parquet(tmp_path / "av.parquet", samples, kind="t2va", rows_per_group=2)
    assert [(f.name, f.type) for f in pq.read_schema(path)] == FASTVIDEO_T2VA
    table = pq.read_table(path)
    assert table["audio_latent_shape"][0].as_py() == [2, 32, 5] and table["audio_latent_dtype"][0].as_py() == "float32"
    assert table["media_type"][0].as_py() == "video_with_audio" and table["audio_sample_rate"][3].as_py() == 32003
    raw = np.frombuffer(table["audio_latent_bytes"][4].as_py(), dtype=np.float32).reshape(2, 32, 5)
    assert np.array_equal(raw, samples[4]["audio_latents"].numpy())

    indices = [4, 0, 3]
    batch = open_t2va(path).read(indices)
    assert batch["audio_latents"].shape == (3, 2, 32, 5) and batch["audio_latents"].dtype == torch.float32
    assert batch["audio_sample_rate"].tolist() == [32004, 32000, 32003]
    assert batch["audio_sample_rate"].dtype == torch.int64
    for row, i in enumerate(indices):
        assert torch.equal(batch["audio_latents"][row], samples[i]["audio_latents"])
        assert torch.equal(batch["latents"][row], samples[i]["latents"])
    assert "audio_latents" not in open_t2va(path, kind="t2v").read([0])  # the same file read as video-only data


def test_a_fastvideo_file_with_batched_rows_is_read(tmp_path):
    """A row stored as [1, 2, 32, A] (a leading batch dim) gives the same [2, 32, A] as one stored squeezed."""
    audio = [np.arange(2 * 32 * 3, dtype=np.float32).reshape(2, 32, 3) + 1000 * i for i in range(2)]
    path = hand_written(tmp_path / "hand.parquet", [a.tobytes() for a in audio], [[1, 2, 32, 3], [2, 32, 3]])
    batch = open_t2va(path).read([0, 1])
    assert batch["audio_latents"].shape == (2, 2, 32, 3)
    assert np.array_equal(batch["audio_latents"].numpy(), np.stack(audio))
    assert batch["audio_sample_rate"].tolist() == [32000, 32000]


def one_line(error):
    message = str(error.value)
    assert "\n" not in message
    return message


def test_a_video_only_file_is_refused_naming_the_file(tmp_path):
    path = parquet.write_parquet(tmp_path / "video.parquet", [{k: v for k, v in make_samples(1)[0].items()
                                                             if k not in ("audio_latents", "audio_sample_rate")}])
    with pytest.raises(parquet.DataError, match="video.parquet' has no column 'audio_latent_bytes'") as error:
        open_t2va(path)
    assert "use kind='t2v'" in one_line(error)


def test_empty_audio_bytes_are_refused_naming_the_file_and_row(tmp_path):
    audio = np.zeros((2, 32, 3), np.float32)
    path = hand_written(tmp_path / "gap.parquet", [audio.tobytes(), b"", audio.tobytes()], [[2, 32, 3], [], [2, 32, 3]])
    dataset = open_t2va(path)
    assert dataset.read([0, 2])["audio_latents"].shape == (2, 2, 32, 3)
    with pytest.raises(parquet.DataError, match="gap.parquet' row 1: audio_latent_bytes is empty") as error:
        dataset.read([1])
    one_line(error)


def test_audio_latents_of_different_lengths_in_one_batch_are_refused_naming_both_rows(tmp_path):
    parquet.write_parquet(tmp_path / "a.parquet", make_samples(2, length=5), kind="t2va")
    parquet.write_parquet(tmp_path / "b.parquet", make_samples(2, length=7), kind="t2va")
    dataset = open_t2va(tmp_path)
    assert dataset.read([2, 3])["audio_latents"].shape == (2, 2, 32, 7)
    with pytest.raises(parquet.DataError, match=r"differ in audio latent length: .*a.parquet' row 1 has \[2, 32, 5\], "
                                             r".*b.parquet' row 0 has \[2, 32, 7\]") as error:
        dataset.read([1, 2])
    one_line(error)


def test_writing_t2va_needs_audio_latents_and_a_positive_sample_rate(tmp_path):
    sample = make_samples(1)[0]
    with pytest.raises(ValueError, match="sample 0 has no 'audio_latents' tensor"):
        parquet.write_parquet(tmp_path / "x.parquet", [{k: v for k, v in sample.items() if k != "audio_latents"}],
                           kind="t2va")
    for rate in (None, 0, 16000.0, True):
        with pytest.raises(ValueError, match="sample 0: audio_sample_rate must be a positive int"):
            parquet.write_parquet(tmp_path / "x.parquet", [{**sample, "audio_sample_rate": rate}], kind="t2va")
    with pytest.raises(ValueError, match=r"'audio_latents' must have 3 dims, got shape \[2, 32\]"):
        parquet.write_parquet(tmp_path / "x.parquet", [{**sample, "audio_latents": torch.zeros(2, 32)}], kind="t2va")
    assert not (tmp_path / "x.parquet").exists()


def test_synthetic_t2va_samples_are_functions_of_key_and_index():
    synthetic = data.SyntheticConfig(num_samples=6, latent_shape=(3, 1, 2, 2), text_len=2, text_dim=4,
                                     audio_shape=(2, 32, 4))
    config = data.DataConfig(kind="t2va", text_len=2, synthetic=synthetic)
    first, again = data.open_dataset(config, random.key(3)), data.open_dataset(config, random.key(3))
    batch = first.read([5, 1, 3])
    assert batch["audio_latents"].shape == (3, 2, 32, 4) and "audio_sample_rate" not in batch
    assert torch.equal(again.read([3])["audio_latents"][0], batch["audio_latents"][2])  # order and company: no matter
    assert not torch.equal(batch["audio_latents"][0], batch["audio_latents"][1])
    assert abs(float(batch["audio_latents"].std()) - 1.0) < 0.15  # standard normal draws
    # the video and text draws are kind t2v's: audio is drawn from a key of its own
    video_config = data.DataConfig(kind="t2v", text_len=2, synthetic=synthetic)
    video = data.open_dataset(video_config, random.key(3)).read([5, 1, 3])
    assert torch.equal(video["latents"], batch["latents"]) and torch.equal(video["text"], batch["text"])
    assert not torch.equal(data.open_dataset(config, random.key(4)).read([3])["audio_latents"][0],
                           batch["audio_latents"][2])


def test_t2va_configs_validate_and_synthetic_t2va_needs_an_audio_shape():
    assert validate(data.DataConfig(kind="t2va")).kind == "t2va"
    with pytest.raises(ConfigError, match="kind"):
        validate(data.DataConfig(kind="t2vaa"))
    with pytest.raises(ConfigError, match="audio_shape"):
        validate(data.DataConfig(synthetic=data.SyntheticConfig(audio_shape=(2, 0, 4))))
    with pytest.raises(ValueError, match="data.synthetic.audio_shape must be set") as error:
        data.open_dataset(data.DataConfig(kind="t2va"), random.key(0))
    one_line(error)
