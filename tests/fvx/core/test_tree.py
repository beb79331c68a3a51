"""fvx.core.tree: tensor maps, norms, casts and equinox-style partition/combine."""
import math
from typing import NamedTuple

import pytest
import torch

from fvx.core import tree


class Pair(NamedTuple):
    first: torch.Tensor
    second: object


def sample_tree():
    return {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "nested": Pair(torch.tensor([-1.0]), "tag"),
            "steps": torch.tensor(7)}


def test_map_tensors_skips_non_tensors_and_zips_trees():
    t = sample_tree()
    doubled = tree.map_tensors(lambda x: x * 2, t)
    assert doubled["nested"].second == "tag" and torch.equal(doubled["w"], t["w"] * 2)
    summed = tree.map_tensors(torch.add, t, doubled)
    assert torch.equal(summed["nested"].first, torch.tensor([-3.0]))
    assert [x.shape for x in tree.tensor_leaves(t)] == [torch.Size([1]), torch.Size([]), torch.Size([2, 2])]


def test_zeros_like_cast_and_to_device_keep_structure():
    t = sample_tree()
    z = tree.zeros_like(t)
    assert torch.equal(z["w"], torch.zeros(2, 2)) and z["steps"].dtype == torch.int64
    c = tree.cast(t, torch.bfloat16)
    assert c["w"].dtype == torch.bfloat16 and c["steps"].dtype == torch.int64  # integers keep their dtype
    moved = tree.to_device(t, "meta")
    assert moved["w"].is_meta and moved["nested"].second == "tag"


def test_global_norm_equals_hand_computation_and_ignores_integers():
    t = sample_tree()
    assert tree.global_norm(t).item() == pytest.approx(math.sqrt(1 + 4 + 9 + 16 + 1))
    assert tree.global_norm(t).dtype == torch.float32
    assert tree.global_norm({}).item() == 0.0


def test_partition_and_combine_round_trip():
    t = sample_tree()
    trainable, frozen = tree.partition(t, {"w": True, "nested": False, "steps": False})
    assert trainable["w"] is t["w"] and trainable["nested"].first is None and frozen["w"] is None
    back = tree.combine(trainable, frozen)
    assert back["w"] is t["w"] and back["nested"].second == "tag" and back["steps"] is t["steps"]
    by_fn, _ = tree.partition(t, lambda x: {"w": False, "nested": Pair(True, False), "steps": False})
    assert by_fn["nested"].first is t["nested"].first and by_fn["w"] is None


def test_partition_with_wrong_mask_structure_names_the_problem():
    with pytest.raises(ValueError, match="mask does not match"):
        tree.partition({"a": torch.ones(1)}, {"b": True})
