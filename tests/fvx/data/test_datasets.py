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


def test_the_toy_worlds_animate_samples_follow_a_white_pose_from_the_first_frame():
    """Kind animate: the latents are the reference (the clip's first frame) then the clip; the reference latents give
    it with mask one then a first segment's zeros; the pose is the clip's bars in white; the face the clip with each
    frame after the first held for 4; scored against the sample's own clip."""
    from fvx.data.toy_world import WorldConfig, space_to_depth

    dataset = data.open_dataset(data.DataConfig(kind="animate", world=WorldConfig(), text_len=4), random.key(0))
    batch, clip = dataset.read([3]), torch.from_numpy(dataset.clip(3))
    latents = space_to_depth(clip, 8)
    assert torch.equal(batch["latents"][0], torch.cat([latents[:, :1], latents], dim=1))
    reference = batch["reference_latents"][0]
    assert reference[:4, 0].eq(1).all() and not reference[:4, 1:].any() and not reference[4:, 1:].any()
    assert torch.equal(reference[4:, :1], latents[:, :1])
    white = torch.where((clip > -1).any(0, keepdim=True), 1.0, -1.0).expand(3, -1, -1, -1)
    assert torch.equal(batch["pose_latents"][0], space_to_depth(white, 8))
    face = batch["face_pixels"][0]
    assert face.shape == (3, 13, 16, 16) and torch.equal(face[:, 0], clip[:, 0])
    assert all(torch.equal(face[:, 4 * (t - 1) + 1 + k], clip[:, t]) for t in range(1, 4) for k in range(4))
    assert dataset.sample_quality(clip[None] / 2 + 0.5, [3])["continuation_mse"] == 0.0


def test_synthetic_animate_samples_fit_the_tiny_wan_animate():
    from fvx_models.wan_animate import WanAnimateConfig

    config = data.DataConfig(kind="animate", text_len=8, synthetic=data.SyntheticConfig(
        num_samples=4, latent_shape=(16, 3, 4, 4), image_embeds=(4, 16)))
    model = WanAnimateConfig().build()
    batch = model.batch(data.open_dataset(config, random.key(0)).read([0, 1]))
    assert batch["cond"]["face_pixels"].shape == (2, 3, 5, 8, 8)
    assert torch.equal(batch["cond"]["pose_latents"], batch["latents"][:, :, 1:])
    assert model.denormalize(batch["latents"]).shape[2] == 2  # the reference's slot is not decoded
    with pytest.raises(ValueError, match="kind 'animate' needs at least 2 latent frames"):
        data.open_dataset(data.DataConfig(kind="animate", synthetic=data.SyntheticConfig(latent_shape=(16, 1, 4, 4))),
                          random.key(0))
