"""Image-to-video-and-audio data (kind "i2va", fvx's): t2va's columns with i2v's first frame, read and written."""
import pyarrow.parquet as pq
import pytest
import torch

from fvx.core import random
from fvx.data import datasets as data, parquet
from fvx.data.toy_world import WorldConfig


def make_samples(count):
    """Samples with distinct values: latents [3, 2, 2, 2], their first frame, audio latents [2, 32, 5], text [3, 4]."""
    samples = []
    for i in range(count):
        k_lat, k_audio, k_txt = random.split(random.fold_in(random.key(3), i), 3)
        latents = random.normal(k_lat, (3, 2, 2, 2))
        first = torch.cat([latents[:, :1], torch.zeros_like(latents[:, 1:])], dim=1)
        samples.append({"latents": latents, "first_frame_latents": first, "text": random.normal(k_txt, (3, 4)),
                        "audio_latents": random.normal(k_audio, (2, 32, 5)), "audio_sample_rate": 16000 + i,
                        "caption": f"clip {i}"})
    return samples


def test_the_schema_is_t2vas_with_i2vs_image_columns():
    names = parquet.parquet_schema("i2va").names
    t2va, i2v = parquet.parquet_schema("t2va").names, parquet.parquet_schema("i2v").names
    assert set(names) == set(t2va) | set(i2v)
    assert names[:len(t2va) - 9] == t2va[:len(t2va) - 9]  # t2va's tensor columns first, FastVideo's metadata last


def test_written_samples_read_back_with_first_frame_audio_and_sample_rate(tmp_path):
    samples = make_samples(3)
    path = parquet.write_parquet(tmp_path / "i2va.parquet", samples, kind="i2va")
    table = pq.read_table(path)
    assert table["media_type"][0].as_py() == "video_with_audio" and table["clip_feature_bytes"][0].as_py() == b""
    batch = data.open_dataset(data.DataConfig(path=str(path), kind="i2va", text_len=4), random.key(0)).read([2, 0])
    assert batch["audio_sample_rate"].tolist() == [16002, 16000] and "image_embeds" not in batch
    for row, i in enumerate([2, 0]):
        for key in ("latents", "first_frame_latents", "audio_latents"):
            assert torch.equal(batch[key][row], samples[i][key])


def test_a_t2va_file_read_as_i2va_names_the_missing_first_frame_column(tmp_path):
    samples = [{k: v for k, v in s.items() if k != "first_frame_latents"} for s in make_samples(1)]
    path = parquet.write_parquet(tmp_path / "av.parquet", samples, kind="t2va")
    with pytest.raises(ValueError, match="av.parquet' has no column 'first_frame_latent_bytes', which kind='i2va'"):
        data.open_dataset(data.DataConfig(path=str(path), kind="i2va"), random.key(0))


def test_toy_world_and_synthetic_i2va_samples_are_i2vs_first_frame_and_t2vas_sound():
    def read(kind, **config):
        return data.open_dataset(data.DataConfig(kind=kind, text_len=4, **config), random.key(0)).read([0, 1])

    both, image, sound = (read(kind, world=WorldConfig()) for kind in ("i2va", "i2v", "t2va"))
    assert torch.equal(both["first_frame_latents"], image["first_frame_latents"])
    assert torch.equal(both["audio_latents"], sound["audio_latents"]) and torch.equal(both["latents"], image["latents"])
    synthetic = read("i2va", synthetic=data.SyntheticConfig(audio_shape=(2, 32, 3)))
    assert synthetic["audio_latents"].shape == (2, 2, 32, 3)
    assert torch.equal(synthetic["first_frame_latents"][:, :, 0], synthetic["latents"][:, :, 0])
    with pytest.raises(ValueError, match="data.synthetic.audio_shape must be set.*data.kind='i2va'"):
        read("i2va", synthetic=data.SyntheticConfig())
