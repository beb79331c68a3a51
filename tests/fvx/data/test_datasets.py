"""fvx.data.datasets: DataConfig's ranges are checked, synthetic samples are a function of the key and the index, and
open_dataset gives the toy world's i2v samples with their first frame."""
import pytest
import torch

from fvx.config import ConfigError, validate
from fvx.core import random
from fvx.data import datasets as data

from data_samples import expected_text  # noqa: E402


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


@pytest.mark.parametrize("field, value", [("batch_size", 0), ("cfg_rate", 1.5), ("prefetch", -1), ("text_len", 0),
                                          ("kind", "video")])
def test_config_ranges_are_checked(field, value):
    with pytest.raises(ConfigError, match=field):
        validate(data.DataConfig(**{field: value}))
    with pytest.raises(ConfigError, match="latent_shape"):
        validate(data.DataConfig(synthetic=data.SyntheticConfig(latent_shape=(16, 0, 8, 8))))
