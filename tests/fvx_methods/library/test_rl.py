"""fvx_methods.library.rl: K-repeat prompt sampling across ranks, group advantages and reward figures by hand, and
the old policy's decay schedules (spec §2.11)."""
import collections

import pytest
import torch

from fvx.core import random
from fvx_methods.library import rl


def test_k_repeat_rows_are_groups_of_k_split_across_ranks_and_the_same_for_any_world():
    """8 prompts of 3 copies over world x batch = 24 samples: each rank's slice of one shuffled global list, so 1, 2,
    3 and 4 ranks together draw the same rows, each prompt exactly K times; the same key draws the same rows."""
    key = random.key(7)
    whole = rl.k_repeat_rows(key, dataset_length=20, batch_size=24, repeats=3, world=1, rank=0)
    assert whole.unique_prompts == 8 and len(whole.local_rows) == 24
    counts = collections.Counter(whole.local_rows)
    assert len(counts) == 8 and set(counts.values()) == {3} and all(0 <= r < 20 for r in counts)
    for world in (2, 3, 4):
        parts = [rl.k_repeat_rows(key, dataset_length=20, batch_size=24 // world, repeats=3, world=world,
                                  rank=rank).local_rows for rank in range(world)]
        assert sum(parts, []) == whole.local_rows
    assert rl.k_repeat_rows(key, dataset_length=20, batch_size=24, repeats=3, world=1, rank=0) == whole
    other = rl.k_repeat_rows(random.key(8), dataset_length=20, batch_size=24, repeats=3, world=1, rank=0)
    assert other.local_rows != whole.local_rows


@pytest.mark.parametrize("knobs, match", [
    ({"batch_size": 5, "world": 2}, "10 samples are not groups of 4"),
    ({"dataset_length": 1}, "needs 2 distinct prompts, the dataset has 1 rows"),
    ({"rank": 2}, r"rank must be in \[0, 2\)"),
    ({"repeats": 0}, "repeats must be positive"),
])
def test_k_repeat_refusals(knobs, match):
    knobs = {"dataset_length": 10, "batch_size": 4, "repeats": 4, "world": 2, "rank": 0, **knobs}
    with pytest.raises(ValueError, match=match):
        rl.k_repeat_rows(random.key(0), **knobs)


def test_group_advantages_by_hand():
    """Groups [1, 3] (mean 2, biased std 1), [5] (alone: 0) and [2, 2, 8] (mean 4, std sqrt(8))."""
    rewards = torch.tensor([1.0, 5.0, 2.0, 3.0, 2.0, 8.0])
    ids = [7, 4, 9, 7, 9, 9]
    s = 8 ** 0.5 + 1e-4
    expected = torch.tensor([-1 / 1.0001, 0.0, -2 / s, 1 / 1.0001, -2 / s, 4 / s])
    torch.testing.assert_close(rl.group_advantages(rewards, ids), expected)
    with pytest.raises(ValueError, match="6 rewards but 5 group ids"):
        rl.group_advantages(rewards, ids[:5])


def test_reward_diagnostics_by_hand():
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0, 4.0, 8.0, 12.0])
    figures = rl.reward_diagnostics(rewards, [0, 0, 1, 1, 2, 2, 2, 2])
    assert figures["group_size"] == pytest.approx(8 / 3)
    assert figures["zero_std_ratio"] == pytest.approx(1 / 3)
    stds = torch.tensor([1.0, 0.0, torch.tensor([0.0, 4.0, 8.0, 12.0]).std(unbiased=False)])
    assert figures["reward_std_mean"] == pytest.approx(float(stds.mean()))
    assert figures["mean_reward_100"] == pytest.approx((2 + 2 + 6) / 3)
    # the top half: at or above each group's median-quantile (0.5): [3], [2, 2], [8, 12]
    assert figures["mean_reward_50"] == pytest.approx((3 + 2 + 10) / 3)


@pytest.mark.parametrize("decay_type, iterations, expected", [
    (0, (1, 100, 10_000), (0.0, 0.0, 0.0)),
    (1, (1, 250, 500, 501, 10_000), (0.001, 0.25, 0.5, 0.5, 0.5)),
    (2, (1, 74, 75, 76, 100, 208, 209, 10_000), (0.0, 0.0, 0.0, 0.0075, 0.1875, 0.9975, 0.999, 0.999)),
])
def test_old_policy_decay_at_the_listed_iterations(decay_type, iterations, expected):
    assert [rl.old_policy_decay(i, decay_type) for i in iterations] == pytest.approx(list(expected))


def test_an_unknown_decay_type_is_refused():
    with pytest.raises(ValueError, match="decay_type must be 0, 1 or 2, got 3"):
        rl.old_policy_decay(1, 3)
