"""A flow map on a family that takes no second time input is refused with the families that take one (issue 40: the
refusal used to suggest ``r_embedder={}``, a field LTX-2's config lacks)."""
import importlib
import pathlib

import pytest

from fvx_models import build
from fvx_models.build import ModelConfig
from fvx_methods.library import flow_map

MODULES = sorted(p.stem for p in (pathlib.Path(build.__file__).parent).glob("*.py"))


def family_configs() -> dict[str, type]:
    """Family name -> its config class, over every module of fvx_models."""
    configs = {}
    for name in MODULES:
        for value in vars(importlib.import_module(f"fvx_models.{name}")).values():
            if isinstance(value, type) and issubclass(value, ModelConfig) and value is not ModelConfig:
                configs[value.family.name] = value
    return configs


def test_the_two_time_families_named_are_those_whose_configs_take_r():
    configs = family_configs()
    assert len(configs) >= 12  # every family of the README's table
    takes_r = {name for name, cls in configs.items() if cls.two_time is not ModelConfig.two_time}
    named = {part.split(" (")[0] for part in build.TWO_TIME_FAMILIES.split(" or ")}
    assert takes_r == named == {"wan", "anyflow"}
    for name, cls in configs.items():
        # a config taking r has a family passing it
        assert (cls.family.forward.with_r is not None) or name not in takes_r


@pytest.mark.parametrize("family", ["ltx2", "wan_causal", "cosmos"])
def test_a_family_without_r_is_refused_with_the_families_that_have_it(family):
    model = family_configs()[family](preset="tiny").build()
    with pytest.raises(ValueError) as refused:
        flow_map.check_two_time(model, "student", "MeanFlow")
    assert str(refused.value) == (
        f"MeanFlow trains a flow map u(x_t, t, r), but models.student ({family}:tiny) has no r input; the {family} "
        f"family takes no second time input; a flow map trains on a two-time family: {build.TWO_TIME_FAMILIES}")
    assert "r_embedder" not in str(refused.value).split("two-time family")[0]


def test_a_wan_without_r_is_told_its_knob():
    model = family_configs()["wan"](preset="tiny").build()
    assert model.rules.two_time_refusal is None
    with pytest.raises(ValueError, match=r"has no r input; set models.student.r_embedder=\{\} "):
        flow_map.check_two_time(model, "student", "MeanFlow")
