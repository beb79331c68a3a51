"""Every installed diffusers transformer has an fvx family or a written reason (issue 45's enumeration)."""
from fvx_models import coverage


def test_every_diffusers_transformer_has_a_family_or_a_reason():
    assert coverage.uncovered() == []


def test_a_class_with_a_family_has_no_reason_left_beside_it():
    families = coverage.family_classes()
    assert "WanTransformer3DModel" in families and "CogVideoXTransformer3DModel" in families
    stale = sorted(set(families) & (set(coverage.NO_FAMILY) | set(coverage.NOT_VIDEO)))
    assert stale == []


def test_every_reason_names_a_class_diffusers_has():
    installed = set(coverage.diffusers_transformers())
    assert sorted((set(coverage.NO_FAMILY) | set(coverage.NOT_VIDEO)) - installed) == []
    assert all(reason.strip() for reason in {**coverage.NO_FAMILY, **coverage.NOT_VIDEO}.values())
