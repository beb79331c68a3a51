"""fvx_methods.rewards: frame policies, the weighted sum and its checks, the toy world's reward, and CLIPScore /
PickScore on a tiny random CLIP folder built here (equal to transformers' own logits), never a download."""
import json
import pathlib
import string

import pytest
import torch

from fvx.core import random
from fvx.data import toy_world
from fvx_methods.rewards import clip, named, reward


class Scripted:
    """A reward of the mean pixel of what it is given, recording the shapes it saw."""

    def __init__(self, frames):
        self.frames, self.seen = frames, []

    def __call__(self, media, prompts):
        self.seen.append(tuple(media.shape))
        return media.flatten(1).mean(1)


def test_each_reward_sees_the_frames_it_declares():
    videos = torch.arange(2 * 3 * 7, dtype=torch.float32).view(2, 3, 7, 1, 1).expand(2, 3, 7, 2, 2)
    assert reward.frame_indices(7, 4) == [0, 2, 4, 6] and reward.frame_indices(3, 4) == [0, 1, 2]
    first, sampled, whole = Scripted("first"), Scripted("sampled"), Scripted("whole")
    torch.testing.assert_close(reward.score(first, videos, ["a", "b"]), videos[:, :, 0].flatten(1).mean(1))
    torch.testing.assert_close(reward.score(sampled, videos, ["a", "b"]),
                               videos[:, :, [0, 2, 4, 6]].transpose(1, 2).flatten(2).mean(2).mean(1))
    torch.testing.assert_close(reward.score(whole, videos, ["a", "b"]), videos.flatten(1).mean(1))
    assert first.seen == [(2, 3, 2, 2)] and sampled.seen == [(2, 3, 2, 2)] * 4 and whole.seen == [(2, 3, 7, 2, 2)]


def test_the_weighted_sum_and_a_reward_that_misbehaves_is_named():
    videos = torch.rand(3, 3, 2, 4, 4)
    out = reward.scores({"a": Scripted("whole"), "b": Scripted("first")}, {"a": 2.0, "b": -0.5}, videos, list("xyz"))
    torch.testing.assert_close(out["avg"], 2.0 * out["a"] - 0.5 * out["b"])

    class Broken:
        frames = "whole"

        def __init__(self, value):
            self.value = value

        def __call__(self, media, prompts):
            return self.value

    for value, match in [(torch.zeros(3, 1), r"reward 'bad' returned \(3, 1\) for 3 clips"),
                         (1.0, "reward 'bad' returned float")]:
        with pytest.raises(reward.RewardError, match=match):
            reward.scores({"bad": Broken(value)}, {"bad": 1.0}, videos, list("xyz"))
    nan = reward.scores({"bad": Broken(torch.tensor([0.0, float("nan"), 1.0]))}, {"bad": 1.0}, videos, list("xyz"))
    assert nan["avg"].isnan().tolist() == [False, True, False]  # passed on: the method skips its update


@pytest.mark.parametrize("weights, match", [
    ({}, "names no reward"), ({"aesthetic": 1.0}, "unknown reward 'aesthetic'; known: clipscore, pickscore, world"),
    ({"world": float("inf")}, "world: the weight must be a finite number"), ({"world": "1"}, "finite number")])
def test_reward_weights_are_checked(weights, match):
    with pytest.raises(ValueError, match=match):
        reward.check_weights(weights, named.KNOWN)


def test_the_world_reward_is_one_on_a_true_clip_and_falls_with_the_error():
    config = toy_world.WorldConfig()
    refs = toy_world.references(config)
    scorer = named.named("world", world=config)
    prompts = [toy_world.caption(config, *config.prompts[i]) for i in (0, 3)]
    truth = torch.stack([refs[0, 0], refs[3, 1]])
    assert (scorer(truth, prompts) - 1).abs().max() < 1e-6
    noisy = (truth + 0.1 * random.normal(random.key(0), tuple(truth.shape))).clamp(0, 1)
    mse = ((noisy - truth) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(scorer(noisy, prompts), torch.exp(-mse / toy_world.HIT))  # nearest: the truth
    wrong = torch.stack([refs[1, 0], refs[2, 0]])  # another prompt's clips
    assert (scorer(noisy, prompts) < 1).all() and (scorer(wrong, prompts) < scorer(noisy, prompts)).all()
    with pytest.raises(ValueError, match="are not the world's"):
        scorer(truth, ["a cat", prompts[1]])
    with pytest.raises(ValueError, match="data must be the world"):
        named.named("world")


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    """A tiny random CLIP model with a character-level tokenizer and CLIP's preprocessing statistics."""
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    folder = tmp_path_factory.mktemp("clip")
    letters = list(string.ascii_lowercase)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    vocab.update({token: 2 + i for i, token in enumerate(letters + [c + "</w>" for c in letters])})
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt")).save_pretrained(folder)
    state = torch.get_rng_state()
    torch.manual_seed(0)
    text = dict(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)).save_pretrained(folder)
    torch.set_rng_state(state)
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_mean": [0.4815, 0.4578, 0.4082], "image_std": [0.2686, 0.2613, 0.2758],
        "size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}}))
    return folder


@pytest.mark.parametrize("name, divisor", [("clipscore", 100.0), ("pickscore", 26.0)])
def test_clip_rewards_are_the_models_own_logits(clip_folder, name, divisor):
    """CLIPScore is transformers' ``logits_per_image.diag() / 100`` and PickScore the same logits over 26, each of
    the first frame of its clip and its prompt."""
    scorer = named.named(name, path=str(clip_folder))
    videos, prompts = random.uniform(random.key(1), (2, 3, 3, 40, 56)), ["red bars", "blue bars moving up"]
    got = reward.score(scorer, videos, prompts)
    tokens = scorer.tokenizer(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = scorer.model(pixel_values=scorer.pixels(videos[:, :, 0]), input_ids=tokens["input_ids"],
                              attention_mask=tokens["attention_mask"]).logits_per_image
    torch.testing.assert_close(got, logits.diag() / divisor)
    assert scorer.frames == "first" and scorer.pixels(videos[:, :, 0]).shape == (2, 3, 32, 32)


def test_clip_folders_that_cannot_serve_are_named(clip_folder, tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        named.named("clipscore", path=str(tmp_path / "missing"))
    other = tmp_path / "wan"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel"}))
    with pytest.raises(ValueError, match="is not a CLIP model folder"):
        named.named("pickscore", path=str(other))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((pathlib.Path(clip_folder) / "config.json").read_text())
    with pytest.raises(ValueError, match="has no preprocessor_config.json"):
        clip.load(str(bare), divisor=100.0)
    with pytest.raises(ValueError, match="needs the local folder of its CLIP model"):
        named.named("pickscore")
    with pytest.raises(ValueError, match="unknown reward 'hps'"):
        named.named("hps")
