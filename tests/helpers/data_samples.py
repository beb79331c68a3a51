"""What the fvx.data tests share: samples with distinct values, a folder of FastVideo parquet files written from them,
opening a parquet path as a dataset, and the hand-computed padding of a text embedding."""
import torch

from fvx.core import random
from fvx.data import datasets as data, parquet


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


def write_t2v_folder(tmp_path):
    """Three files (one nested; several row groups each) of 7 + 5 + 4 samples -> (root, samples in path order)."""
    root = tmp_path / "dataset"
    a, b, c = make_samples(1, 7), make_samples(2, 5), make_samples(3, 4)
    parquet.write_parquet(root / "b.parquet", b, rows_per_group=2)
    parquet.write_parquet(root / "a" / "z.parquet", a, rows_per_group=3)
    parquet.write_parquet(root / "c.parquet", c, rows_per_group=4)
    return root, a + b + c  # sorted paths: a/z, b, c
