"""fvx.config: Struct conventions, experiment loading, dotted overrides, validation, dump/load, describe."""
import json
import sys
import textwrap
from typing import Annotated, Literal

import msgspec
import pytest
from msgspec import Meta

from fvx import config as fconfig
from fvx.config import apply_overrides, Config, ConfigError, describe, dump, load, load_experiment, validate


class Optim(Config):
    lr: Annotated[float, Meta(gt=0)] = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)


class Model(Config):
    path: str
    dtype: Literal["bf16", "fp32"] = "bf16"
    grad_checkpointing: bool = True


class Finetune(Config, tag="finetune"):
    optim: Optim = Optim()


class DMD2(Config, tag="dmd2"):
    optim: Optim = Optim(lr=2e-6)
    fake_optim: Optim = Optim(lr=4e-6)
    guidance_scale: float = 5.0

    def __post_init__(self):
        if self.fake_optim.lr < self.optim.lr:
            raise ValueError("fake_optim.lr must be >= optim.lr")


class Distill(Config, tag="distill"):
    teacher: Model


class EMA(Config):
    decay: float = 0.999


class Run(Config):
    model: Model
    method: Finetune | DMD2 | Distill
    steps: Annotated[int, Meta(ge=1)] = 1000
    name: str = "run"
    tags: tuple[str, ...] = ()
    ema: EMA | None = None


class Weighted(Config):
    weights: dict[str, float] = {}


BASE = Run(model=Model(path="/models/wan"), method=DMD2(guidance_scale=6.0), tags=("dmd2",))
IMPORTS = f"from {Run.__module__} import Run, Model, DMD2, Finetune, Optim\n"


def write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


# ------------------------------------------------------------------------------------------------ Config conventions


def test_config_subclasses_are_frozen_keyword_only_and_forbid_unknown_fields():
    with pytest.raises(AttributeError):
        BASE.steps = 3
    with pytest.raises(TypeError):
        Optim(1e-3)  # kw_only is inherited through fvx's metaclass
    with pytest.raises(msgspec.ValidationError, match="unknown field `lrr`"):
        msgspec.convert({"lrr": 1.0}, Optim)
    assert hash(BASE) == hash(Run(model=Model(path="/models/wan"), method=DMD2(guidance_scale=6.0), tags=("dmd2",)))
    assert issubclass(ConfigError, ValueError)


def test_validate_catches_wrong_types_given_at_construction():
    bad = Run(model=Model(path="/m"), method=Finetune(optim=Optim(lr="fast")))  # construction checks nothing
    with pytest.raises(ConfigError, match=r"Expected `float`, got `str` - at `\$\.method\.optim\.lr`"):
        validate(bad)
    with pytest.raises(ConfigError, match=r"Expected `float` > 0.0 - at `\$\.lr`"):
        validate(Optim(lr=-1.0))
    assert validate(BASE) == BASE
    assert validate(Run(model=Model(path="/m"), method=Finetune(), tags=["a"])).tags == ("a",)


# ------------------------------------------------------------------------------------------------ overrides


def test_overrides_of_nested_fields_and_value_kinds():
    out = apply_overrides(BASE, [
        "method.optim.lr=1e-6",
        "method.guidance_scale=3",
        "model.grad_checkpointing=false",
        "model.dtype=fp32",
        "method.optim.betas=[0.8, 0.95]",
        'tags=["a", "b"]',
        "steps=20",
        "model.path=x=y",
        "name=123",
    ])
    assert out.method.optim == Optim(lr=1e-6, betas=(0.8, 0.95))
    assert out.method.guidance_scale == 3.0
    assert out.model == Model(path="x=y", dtype="fp32", grad_checkpointing=False)
    assert out.tags == ("a", "b") and out.steps == 20
    assert out.name == "123"  # a text field keeps a numeric-looking value as text
    assert out.method.fake_optim == BASE.method.fake_optim and BASE.method.optim.lr == 2e-6
    assert apply_overrides(BASE, ['name="quoted"']).name == "quoted"
    assert apply_overrides(BASE, []) == BASE


def test_a_bare_list_on_a_sequence_field_is_its_items_as_text_or_json():
    assert apply_overrides(BASE, ["tags=[a, b c]"]).tags == ("a", "b c")
    assert apply_overrides(BASE, ["tags=[]"]).tags == ()
    assert apply_overrides(BASE, ["method.optim.betas=[0.8, 0.95]"]).method.optim.betas == (0.8, 0.95)
    assert apply_overrides(BASE, ["name=[a, b]"]).name == "[a, b]"  # a text field keeps it as written
    with pytest.raises(ConfigError, match="betas"):
        apply_overrides(BASE, ["method.optim.betas=[x, y]"])


def test_override_of_an_optional_struct_and_a_dict_field():
    assert apply_overrides(BASE, ["ema.decay=0.99"]).ema == EMA(decay=0.99)
    assert apply_overrides(BASE, ["ema.decay=0.99", "ema=null"]).ema is None
    assert apply_overrides(Weighted(), ["weights.mse=0.5"]).weights == {"mse": 0.5}


def test_variant_switch_gives_defaults_then_later_overrides_apply_to_it():
    out = apply_overrides(BASE, ["method=finetune", "method.optim.lr=3e-5"])
    assert out.method == Finetune(optim=Optim(lr=3e-5))
    assert apply_overrides(BASE, ["method.type=finetune"]).method == Finetune()
    assert apply_overrides(BASE, ['method="finetune"']).method == Finetune()
    assert apply_overrides(BASE, ["method=dmd2"]).method == BASE.method  # the current variant keeps its values
    out = apply_overrides(BASE, ["method=distill", "method.teacher.path=/t"])
    assert out.method == Distill(teacher=Model(path="/t"))


# ------------------------------------------------------------------------------------------------ override errors


def test_override_without_equals():
    with pytest.raises(ConfigError, match=r"override 'steps' is not of the form dotted\.field=value"):
        apply_overrides(BASE, ["steps"])


def test_unknown_field_names_the_path_and_suggests_the_nearest():
    with pytest.raises(ConfigError) as info:
        apply_overrides(BASE, ["method.optim.lrr=1e-5"])
    message = str(info.value)
    assert "unknown field 'method.optim.lrr'" in message and "did you mean 'method.optim.lr'?" in message
    with pytest.raises(ConfigError, match="unknown field 'zzz'.*fields of the config: model, method, steps"):
        apply_overrides(BASE, ["zzz=1"])
    with pytest.raises(ConfigError, match=r"'steps' holds 1000 \(int \(>= 1\)\), which has no field 'x'"):
        apply_overrides(BASE, ["steps.x=1"])


def test_wrong_type_names_the_override_and_the_path():
    with pytest.raises(ConfigError) as info:
        apply_overrides(BASE, ["steps=5", "method.optim.lr=-1"])
    assert str(info.value) == "override 'method.optim.lr=-1': Expected `float` > 0.0 - at `$.method.optim.lr`"
    with pytest.raises(ConfigError, match=r"^override 'method.optim.lr=-1'"):
        apply_overrides(BASE, ["method.optim.lr=1e-5", "method.optim.lr=-1"])  # the last of equals is named
    with pytest.raises(ConfigError, match=r"override 'steps=ten': Expected `int`, got `str` - at `\$\.steps`"):
        apply_overrides(BASE, ["steps=ten"])
    with pytest.raises(ConfigError, match=r"override 'method.optim.betas=\[0.9\]'.*at `\$\.method\.optim\.betas`"):
        apply_overrides(BASE, ["method.optim.betas=[0.9]"])
    with pytest.raises(ConfigError, match=r"override 'method.optim.lr=1e-3': fake_optim.lr must be >= optim.lr"):
        apply_overrides(BASE, ["method.optim.lr=1e-3"])  # a __post_init__ check is attributed too
    with pytest.raises(ConfigError, match=r"override 'method=distill'.*missing required field `teacher`"):
        apply_overrides(BASE, ["method=distill"])


def test_unknown_variant_lists_the_valid_tags():
    for override in ["method=sft", "method.type=sft"]:
        with pytest.raises(ConfigError, match="unknown variant 'sft' for 'method'; valid: finetune, dmd2, distill"):
            apply_overrides(BASE, [override])
    with pytest.raises(ConfigError, match="'method' is None; choose a variant first: method=<tag>, one of finetune"):
        apply_overrides(BASE, ["method=null", "method.optim.lr=1"])


# ------------------------------------------------------------------------------------------------ experiment files


def test_load_experiment_returns_the_validated_config(tmp_path):
    path = write(tmp_path, "dmd2.py", IMPORTS + 'config = Run(model=Model(path="/m"), method=DMD2(), tags=["x"])\n')
    config = load_experiment(path)
    assert config == Run(model=Model(path="/m"), method=DMD2(), tags=("x",))
    assert fconfig._module_name(path) not in sys.modules  # it defines no Struct: its module is dropped


def test_experiments_with_one_stem_or_a_stdlib_name_do_not_clash(tmp_path):
    for folder, steps in (("a", 1), ("b", 2)):
        (tmp_path / folder).mkdir()
        write(tmp_path / folder, "json.py", IMPORTS + f'config = Run(model=Model(path="/m"), method=DMD2(), steps={steps})\n')
    assert load_experiment(tmp_path / "a" / "json.py").steps == 1
    assert load_experiment(tmp_path / "b" / "json.py").steps == 2
    assert sys.modules["json"] is json


def test_experiment_defining_its_own_structs_with_postponed_annotations(tmp_path):
    path = write(tmp_path, "own.py", """\
        from __future__ import annotations
        from fvx.config import Config

        class Inner(Config):
            a: int = 1

        class Outer(Config):
            inner: Inner = Inner()

        config = Outer()
        """)
    config = load_experiment(path)
    assert apply_overrides(config, ["inner.a=2"]).inner.a == 2
    assert describe(config) == [("inner.a", "int", 1)]


def test_missing_experiment_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match="experiment file not found: .*nope.py"):
        load_experiment(tmp_path / "nope.py")


def test_experiment_without_config_names_the_file(tmp_path):
    path = write(tmp_path, "empty.py", "x = 1\n")
    with pytest.raises(ConfigError, match=r"empty\.py' does not assign `config`"):
        load_experiment(path)


def test_experiment_config_that_is_not_a_struct(tmp_path):
    path = write(tmp_path, "plain.py", "config = {'steps': 1}\n")
    with pytest.raises(ConfigError, match=r"plain\.py': `config` is a dict, expected a msgspec Struct"):
        load_experiment(path)


def test_invalid_experiment_config_names_the_file_and_the_path(tmp_path):
    path = write(tmp_path, "bad.py", IMPORTS + 'config = Run(model=Model(path="/m"), method=DMD2(), steps=0)\n')
    with pytest.raises(ConfigError, match=r"bad\.py': invalid Run: Expected `int` >= 1 - at `\$\.steps`"):
        load_experiment(path)


def test_error_inside_the_experiment_keeps_its_traceback_and_names_the_file(tmp_path):
    path = write(tmp_path, "boom.py", "x = 1\nraise RuntimeError('boom')\n")
    with pytest.raises(RuntimeError, match="boom") as info:
        load_experiment(path)
    assert any(str(path) in note for note in info.value.__notes__)
    assert any(str(entry.path) == str(path) and entry.lineno == 1 for entry in info.traceback)  # 0-based line 2
    assert not any(name.startswith("fvx_experiment_boom") for name in sys.modules)


# ------------------------------------------------------------------------------------------------ dump / load / describe


def test_dump_then_load_gives_an_equal_config(tmp_path):
    config = apply_overrides(BASE, ["ema.decay=0.5", "method.optim.lr=3e-6"])
    path = dump(config, tmp_path / "run")
    record = json.loads(path.read_text())
    assert record["config_type"] == f"{Run.__module__}:Run"
    assert record["config"]["method"]["type"] == "dmd2" and "\n  " in path.read_text()
    assert load(tmp_path / "run") == config
    assert load(tmp_path / "run", type=Run) == config


def test_dump_refuses_an_invalid_config_and_load_reports_bad_folders(tmp_path):
    with pytest.raises(ConfigError, match=r"at `\$\.steps`"):
        dump(Run(model=Model(path="/m"), method=Finetune(), steps="many"), tmp_path / "x")
    with pytest.raises(ConfigError, match="no config.json in"):
        load(tmp_path / "missing")
    dump(BASE, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"does not hold a valid Optim: Object contains unknown field `model`"):
        load(tmp_path / "run", type=Optim)
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    record["config_type"] = "no_such_module_xyz:Run"
    del record["types"]  # a dump from before types were recorded: typed by config_type alone
    (tmp_path / "run" / "config.json").write_text(json.dumps(record))
    with pytest.raises(ConfigError, match="'no_such_module_xyz:Run', which cannot be imported .*pass type="):
        load(tmp_path / "run")
    assert load(tmp_path / "run", type=Run) == BASE


def test_describe_lists_nested_fields_with_types_and_values():
    assert describe(BASE) == [
        ("model.path", "str", "/models/wan"),
        ("model.dtype", "'bf16' | 'fp32'", "bf16"),
        ("model.grad_checkpointing", "bool", True),
        ("method", "finetune | dmd2 | distill", "dmd2"),
        ("method.optim.lr", "float (> 0)", 2e-6),
        ("method.optim.betas", "tuple[float, float]", (0.9, 0.999)),
        ("method.fake_optim.lr", "float (> 0)", 4e-6),
        ("method.fake_optim.betas", "tuple[float, float]", (0.9, 0.999)),
        ("method.guidance_scale", "float", 6.0),
        ("steps", "int (>= 1)", 1000),
        ("name", "str", "run"),
        ("tags", "tuple[str, ...]", ("dmd2",)),
        ("ema", "EMA | None", None),
    ]
    assert describe(Weighted()) == [("weights", "dict[str, float]", {})]
