"""Experiment configuration: frozen msgspec Structs, experiment files, dotted overrides, and the resolved-config dump.

A config is a tree of frozen ``msgspec.Struct``s (subclasses of :class:`Config`). An experiment file is plain Python
that builds one and assigns it to ``config``. Command-line overrides ``a.b.c=value`` edit the builtins form of the
config (``msgspec.to_builtins``) and convert it back with ``msgspec.convert``, which is the only type check: building
a Struct in Python checks nothing, so :func:`validate` round-trips a config through the same path. Every bad input
raises :class:`ConfigError` with a message that names the culprit (override, dotted field path, or file).
"""
from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import pathlib
import re
import sys
from typing import Any, Sequence, TypeVar, Union

import msgspec
import msgspec.inspect as mi

S = TypeVar("S", bound=msgspec.Struct)
CONFIG_FILE = "config.json"


class ConfigError(ValueError):
    """Bad configuration input; the message names the culprit, so a CLI can print it without a traceback."""


class _KwOnlyByDefault(msgspec.StructMeta):
    """Makes ``kw_only=True`` the default of every subclass: msgspec inherits ``frozen`` and
    ``forbid_unknown_fields`` but not ``kw_only``. A subclass may still pass ``kw_only=False``."""

    def __new__(mcls, name, bases, namespace, **options):
        options.setdefault("kw_only", True)
        return super().__new__(mcls, name, bases, namespace, **options)


class Config(msgspec.Struct, metaclass=_KwOnlyByDefault, frozen=True, forbid_unknown_fields=True):
    """Base of every fvx config: frozen (hashable), keyword-only, and unknown fields are an error when converting.

    Variants of one role (methods, optimizers) are tagged subclasses, e.g. ``class DMD2(Config, tag="dmd2")``, and a
    field typed ``Finetune | DMD2`` is a tagged union whose tag lives in the ``"type"`` entry of the builtins form.
    """


# ---------------------------------------------------------------------------------------------------- validation


def validate(config: S) -> S:
    """``config`` converted through its builtins form, which checks every type and constraint (construction does not);
    the result equals ``config`` when it was valid, with containers normalised (a list given for a tuple field)."""
    _require_struct(config)
    try:
        return msgspec.convert(_to_builtins(config), type(config))
    except msgspec.ValidationError as error:
        raise ConfigError(f"invalid {type(config).__qualname__}: {error}") from None


def _require_struct(config: Any) -> None:
    if not isinstance(config, msgspec.Struct):
        raise TypeError(f"expected a msgspec Struct config, got {type(config).__qualname__}")


def _to_builtins(config: msgspec.Struct) -> Any:
    try:
        return msgspec.to_builtins(config)
    except TypeError as error:
        raise ConfigError(f"{type(config).__qualname__} holds a value msgspec cannot convert: {error}") from None


# ---------------------------------------------------------------------------------------------------- experiments


RECIPE_MARK = "__fvx_recipe__"


def recipe(fn: Any) -> Any:
    """Mark a function of an experiment file as a named recipe: ``python -m fvx.run file.py:name`` runs the config it
    returns instead of the file's ``config``."""
    setattr(fn, RECIPE_MARK, True)
    return fn


def split_recipe(path: str | pathlib.Path) -> tuple[pathlib.Path, str | None]:
    """``"dir/file.py:name"`` -> (the file, ``"name"``); a path without a recipe -> (the path, None)."""
    text = str(path)
    head, sep, name = text.rpartition(":")
    if sep and head.endswith(".py") and name.isidentifier():
        return pathlib.Path(head), name
    return pathlib.Path(text), None


def recipes(namespace: dict[str, Any]) -> list[str]:
    """The names of the recipe functions (:func:`recipe`) an experiment file defines, in definition order."""
    return [name for name, value in namespace.items() if callable(value) and getattr(value, RECIPE_MARK, False)]


def load_experiment(path: str | pathlib.Path) -> msgspec.Struct:
    """Run the Python file at ``path`` and return its validated ``config``, or with ``path`` of the form
    ``file.py:name`` the validated config its recipe ``name`` (:func:`recipe`) returns.

    The file runs as a module under a private name derived from its path (so ``dmd2.py`` cannot clash with another
    module), which is dropped from ``sys.modules`` afterwards unless the file defines Struct classes: msgspec resolves
    their annotations through ``sys.modules``. An exception raised by the file propagates with its own traceback and a
    note naming the file.
    """
    path, name = split_recipe(path)
    if not path.is_file():
        raise ConfigError(f"experiment file not found: {str(path)!r}")
    namespace = run_experiment(path)
    if name is not None:
        known = recipes(namespace)
        if name not in known:
            listed = f"its recipes: {', '.join(known)}" if known else "it defines no recipes (@fvx.config.recipe)"
            raise ConfigError(f"experiment file {str(path)!r} has no recipe {name!r}; {listed}")
        config, what = namespace[name](), f"recipe {name!r} of experiment file {str(path)!r}"
    elif "config" not in namespace:
        raise ConfigError(f"experiment file {str(path)!r} does not assign `config`")
    else:
        config, what = namespace["config"], f"experiment file {str(path)!r}"
    if not isinstance(config, msgspec.Struct):
        raise ConfigError(
            f"{what}: `config` is a {type(config).__qualname__}, "
            "expected a msgspec Struct (a subclass of fvx.config.Config)"
        )
    try:
        return validate(config)
    except ConfigError as error:
        raise ConfigError(f"{what}: {error}") from None


def run_experiment(path: pathlib.Path) -> dict[str, Any]:
    """Execute the file as a fresh module and return its namespace."""
    name = _module_name(path)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"experiment file {str(path)!r} is not a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        sys.modules.pop(name, None)
        raise ConfigError(f"experiment file {str(path)!r}, line {error.lineno}: {error.msg}") from None
    except Exception as error:
        sys.modules.pop(name, None)
        error.add_note(f"(raised while running experiment file {str(path)!r})")
        raise
    if not _defines_structs(module):
        sys.modules.pop(name, None)
    return vars(module)


PRIVATE = "fvx_experiment_"  # the prefix of experiment files' module names


def _module_name(path: pathlib.Path) -> str:
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", path.stem)
    return f"{PRIVATE}{stem}_{digest}"


def _defines_structs(module: Any) -> bool:
    return any(
        isinstance(value, type) and issubclass(value, msgspec.Struct) and value.__module__ == module.__name__
        for value in vars(module).values()
    )


# ---------------------------------------------------------------------------------------------------- overrides


def apply_overrides(config: S, overrides: Sequence[str]) -> S:
    """``config`` with each ``"dotted.field=value"`` applied in order (a field set twice takes the last:
    :func:`repeated` says which), then validated as a whole.

    A value is parsed as JSON when it parses (``1e-5``, ``true``, ``[1, 2]``, ``null``, ``"x"``) and kept as text
    otherwise, but ``[a, b]`` on a field that takes a sequence is a list of its items (each JSON or text); a field
    that takes text but no number or bool keeps the text as written (``name=123`` gives ``"123"``).
    On a tagged-union field, a bare tag (``method=finetune`` or ``method.type=finetune``) switches to that variant with
    its defaults, and later overrides in the list apply to it; naming the current variant keeps its values. A field
    holding ``None`` whose type allows exactly one Struct starts from that Struct's defaults when a sub-field is set.
    """
    _require_struct(config)
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'dotted.field=value' strings, not one string")
    tree = _to_builtins(config)
    root = mi.type_info(type(config))
    paths = [(override, _apply_one(tree, root, override)) for override in overrides]
    try:
        return msgspec.convert(tree, type(config))
    except msgspec.ValidationError as error:
        raise ConfigError(f"{_culprit(str(error), paths, type(config))}: {error}") from None


def repeated(overrides: Sequence[str]) -> list[str]:
    """A line for each field that more than one override sets, saying which wins: the last, as
    :func:`apply_overrides` applies them in order (for a command line to print, so that no choice is silent)."""
    given: dict[str, list[str]] = {}
    for override in overrides:
        given.setdefault(override.partition("=")[0].strip(), []).append(override)
    return [f"{field} is set {len(items)} times; the last, {items[-1]}, wins over {', '.join(items[:-1])}"
            for field, items in given.items() if len(items) > 1]


def _apply_one(tree: dict, root: mi.StructType, override: str) -> tuple[str, ...]:
    """Edit ``tree`` in place for one override; return the encoded path it set (for error attribution)."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r} is not of the form dotted.field=value")
    names = key.split(".")
    holder, holder_type, encoded = tree, root, []
    for depth, name in enumerate(names):
        here = ".".join(names[: depth + 1])
        slot, slot_type = _lookup(holder_type, name, ".".join(names[:depth]), override)
        encoded.append(slot)
        rest = names[depth + 1 :]
        if not rest or _is_tag_switch(slot_type, rest):
            holder[slot] = _new_value(holder.get(slot), slot_type, raw, here, override)
            return tuple(encoded)
        holder, holder_type = _descend(holder, slot, slot_type, here, rest[0], override)
    raise AssertionError("unreachable")


def _lookup(holder_type: mi.Type, name: str, parent: str, override: str) -> tuple[str, mi.Type]:
    """The builtins key and the type of field ``name`` of a Struct (or key of a dict) type."""
    if isinstance(holder_type, mi.DictType):
        return name, holder_type.value_type
    fields = {field.name: field for field in holder_type.fields}
    if name in fields:
        return fields[name].encode_name, fields[name].type
    prefix = f"{parent}." if parent else ""
    close = difflib.get_close_matches(name, list(fields), n=1)
    hint = f"did you mean {prefix + close[0]!r}?" if close else f"fields of {parent or 'the config'}: {', '.join(fields)}"
    raise ConfigError(f"override {override!r}: unknown field {prefix + name!r} ({holder_type.cls.__name__}); {hint}")


def _descend(holder: dict, slot: str, slot_type: mi.Type, here: str, child: str, override: str) -> tuple[dict, mi.Type]:
    """The dict under ``holder[slot]`` and its Struct (or dict) type, materialising a ``None`` single-Struct field."""
    value = holder.get(slot)
    structs = _structs_in(slot_type)
    if structs and isinstance(value, dict):
        return value, _variant_of(value, structs)
    if structs and value is None:
        if len(structs) > 1:
            tags = ", ".join(str(s.tag) for s in structs)
            raise ConfigError(f"override {override!r}: {here!r} is None; choose a variant first: {here}=<tag>, "
                              f"one of {tags}")
        holder[slot] = {} if structs[0].tag is None else {structs[0].tag_field: structs[0].tag}
        return holder[slot], structs[0]
    dict_type = next((t for t in _members(slot_type) if isinstance(t, mi.DictType)), None)
    if dict_type is not None and isinstance(value, dict):
        return value, dict_type
    raise ConfigError(
        f"override {override!r}: {here!r} holds {value!r} ({type_name(slot_type)}), which has no field {child!r}"
    )


def _new_value(current: Any, slot_type: mi.Type, raw: str, here: str, override: str) -> Any:
    """The builtins value an override puts in a slot: parsed text, or a variant switch on a tagged-union slot."""
    if raw.strip().lower() in NON_FINITE and any(isinstance(t, mi.FloatType) for t in _members(slot_type)):
        raise ConfigError(f"override {override!r}: {here} takes a finite number; non-finite values are refused")
    value = _parse(raw, slot_type)
    literals = [v for t in _members(slot_type) if isinstance(t, mi.LiteralType) for v in t.values]
    others = [t for t in _members(slot_type) if not isinstance(t, (mi.LiteralType, mi.NoneType))]
    if literals and not others and value not in literals and value is not None:
        raise ConfigError(f"override {override!r}: {here} must be one of {', '.join(map(repr, literals))}")
    variants = {s.tag: s for s in _structs_in(slot_type) if s.tag is not None}
    if not variants or isinstance(value, (dict, bool)) or not isinstance(value, (str, int)):
        return value
    if value not in variants:
        tags = ", ".join(str(tag) for tag in variants)
        raise ConfigError(f"override {override!r}: unknown variant {value!r} for {here!r}; valid: {tags}")
    tag_field = variants[value].tag_field
    if isinstance(current, dict) and current.get(tag_field) == value:
        return current
    return {tag_field: value}


def _is_tag_switch(slot_type: mi.Type, rest: list[str]) -> bool:
    """Whether ``rest`` names the tag field of a tagged Struct slot (``method.type=...``)."""
    return len(rest) == 1 and any(s.tag is not None and s.tag_field == rest[0] for s in _structs_in(slot_type))


NON_FINITE = {"nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"}


def _parse(raw: str, slot_type: mi.Type) -> Any:
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return _bare_list(raw, slot_type)
    if isinstance(value, (bool, int, float)) and _takes_text_not_numbers(slot_type):
        return raw
    return value


def _bare_list(raw: str, slot_type: mi.Type) -> Any:
    """``[a, b]`` that is not JSON, for a field that takes a sequence: its items, each parsed as JSON when it parses
    and kept as text otherwise (``trainable=[context]``); any other text as written."""
    if not (raw.startswith("[") and raw.endswith("]") and any(
            isinstance(t, (mi.ListType, mi.VarTupleType, mi.TupleType)) for t in _members(slot_type))):
        return raw
    items = [item.strip() for item in raw[1:-1].split(",")] if raw[1:-1].strip() else []
    return [_parse(item, mi.AnyType()) for item in items]


def _takes_text_not_numbers(slot_type: mi.Type) -> bool:
    members = _members(slot_type)
    text = any(
        isinstance(t, mi.StrType) or (isinstance(t, mi.LiteralType) and all(isinstance(v, str) for v in t.values))
        for t in members
    )
    return text and not any(isinstance(t, (mi.IntType, mi.FloatType, mi.BoolType, mi.AnyType)) for t in members)


def _members(t: mi.Type) -> tuple[mi.Type, ...]:
    return t.types if isinstance(t, mi.UnionType) else (t,)


def _structs_in(t: mi.Type) -> list[mi.StructType]:
    return [member for member in _members(t) if isinstance(member, mi.StructType)]


def _variant_of(value: dict, structs: list[mi.StructType]) -> mi.StructType:
    if len(structs) == 1:
        return structs[0]
    return next((s for s in structs if value.get(s.tag_field) == s.tag), structs[0])


def _culprit(message: str, paths: list[tuple[str, tuple[str, ...]]], cls: type) -> str:
    """Which override a msgspec validation error most likely comes from, by overlap of its ``$.a.b`` path."""
    match = re.search(r"- at `\$(.*)`$", message)
    where = tuple(re.findall(r"\.([^.\[]+)|\[[^\]]*\]", match.group(1))) if match else ()
    best, best_overlap = None, 0
    for override, path in paths:
        n = min(len(path), len(where))
        if n and path[:n] == where[:n] and n >= best_overlap:
            best, best_overlap = override, n
    if best is not None:
        return f"override {best!r}"
    return f"invalid {cls.__qualname__}" + (f" after overrides {[o for o, _ in paths]}" if paths else "")


# ---------------------------------------------------------------------------------------------------- describe


def describe(config: msgspec.Struct) -> list[tuple[str, str, Any]]:
    """``(dotted_path, type, value)`` for every leaf field of ``config``, depth first in declaration order (for
    ``--help``). A tagged-union field gets its own row, typed by its tags and valued by the current variant's tag."""
    _require_struct(config)
    return list(_rows(config, mi.type_info(type(config)), ""))


def _rows(value: msgspec.Struct, struct_type: mi.StructType, prefix: str):
    choices = value.field_choices() if hasattr(value, "field_choices") else {}  # e.g. a model config's presets
    for field in struct_type.fields:
        for path, kind, child in _field_rows(prefix + field.name, field.type, getattr(value, field.name)):
            if field.name in choices and path == prefix + field.name:
                kind = f"one of {', '.join(choices[field.name])}"
            yield path, kind, child


def _field_rows(path: str, field_type: mi.Type, child: Any):
    """The rows of one field: a tag row for a tagged union, then a Struct's fields (or a dict of Structs' entries,
    e.g. ``models.student.preset``), else the value itself."""
    tagged = [s for s in _structs_in(field_type) if s.tag is not None]
    optional = any(isinstance(t, mi.NoneType) for t in _members(field_type))
    if len(tagged) > 1 or (tagged and optional):
        tags = " | ".join([str(s.tag) for s in tagged] + ["None"] * optional)
        yield path, tags, None if child is None else type(child).__struct_config__.tag
    dict_type = next((t for t in _members(field_type) if isinstance(t, mi.DictType)), None)
    if isinstance(child, msgspec.Struct):
        known = next((s for s in _structs_in(field_type) if s.cls is type(child)), None)
        yield from _rows(child, known or mi.type_info(type(child)), path + ".")
    elif dict_type is not None and isinstance(child, dict) and _structs_in(dict_type.value_type):
        for key, entry in child.items():
            yield from _field_rows(f"{path}.{key}", dict_type.value_type, entry)
    elif not tagged:
        yield path, type_name(field_type), child


def type_name(t: mi.Type) -> str:
    """A short readable name of a msgspec type, with numeric bounds: ``float (> 0.0)``, ``tuple[float, float]``."""
    if isinstance(t, mi.UnionType):
        return " | ".join(type_name(member) for member in t.types)
    if isinstance(t, mi.LiteralType):
        return " | ".join(repr(v) for v in t.values)
    if isinstance(t, mi.TupleType):
        return f"tuple[{', '.join(type_name(item) for item in t.item_types)}]"
    if isinstance(t, mi.VarTupleType):
        return f"tuple[{type_name(t.item_type)}, ...]"
    if isinstance(t, mi.DictType):
        return f"dict[{type_name(t.key_type)}, {type_name(t.value_type)}]"
    if hasattr(t, "cls"):
        return t.cls.__name__
    name = {"AnyType": "Any", "NoneType": "None"}.get(type(t).__name__, type(t).__name__.removesuffix("Type").lower())
    if hasattr(t, "item_type"):
        return f"{name}[{type_name(t.item_type)}]"
    bounds = [f"{op} {getattr(t, attr)}" for attr, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
              if getattr(t, attr, None) is not None]
    return f"{name} ({', '.join(bounds)})" if bounds else name


# ---------------------------------------------------------------------------------------------------- comparing


class _Missing:
    def __repr__(self) -> str:
        return "(missing)"


MISSING = _Missing()
"""What :func:`differences` reports for a field one of two trees lacks."""


def differences(old: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """``(dotted path, old value, new value)`` for each leaf where two builtins trees (nested dicts, as config.json
    and JSON records hold configs) differ, in sorted key order; a side that lacks the leaf gives :data:`MISSING`."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [row for key in sorted(set(old) | set(new), key=str)
                for row in differences(old.get(key, MISSING), new.get(key, MISSING), f"{prefix}{key}.")]
    return [] if old == new else [(prefix.removesuffix("."), old, new)]


# ---------------------------------------------------------------------------------------------------- dump / load


TRUSTED = ("fvx", "fvx_models", "fvx_methods")
"""The packages whose config classes ``config.json`` may name: :func:`load` imports nothing else."""

MOVED = {
    "fvx.loop:RunConfig": "fvx.training.experiment:RunConfig",
    "fvx.loop:Experiment": "fvx.training.experiment:Experiment",
    "fvx.checkpoint:CheckpointConfig": "fvx.storage.checkpoint_config:CheckpointConfig",
    "fvx.data:DataConfig": "fvx.data.datasets:DataConfig",
    "fvx.data:SyntheticConfig": "fvx.data.datasets:SyntheticConfig",
    "fvx.world:WorldConfig": "fvx.data.toy_world:WorldConfig",
    "fvx.world:SpaceToDepth": "fvx.data.toy_world:SpaceToDepth",
    "fvx.optim_config:AdamWConfig": "fvx.core.optim_config:AdamWConfig",
    "fvx.validation:ValidationConfig": "fvx.training.validation:ValidationConfig",
    "fvx.wandb_mirror:WandbConfig": "fvx.training.wandb_mirror:WandbConfig",
}
"""Where the config classes that run folders of fvx 0.1 name live now (``config.json`` records ``module:QualName``)."""


def record(config: msgspec.Struct) -> dict[str, Any]:
    """The config as ``config.json`` holds it: its type as ``"module:QualName"``, its builtins form, and ``types``:
    the class of every Struct in it (:func:`type_tree`), so that :func:`load` can type it without the file that made
    it."""
    _require_struct(config)
    return {"config_type": _spec(type(config)), "types": type_tree(config),
            "config": msgspec.to_builtins(validate(config))}


def dump(config: msgspec.Struct, folder: str | pathlib.Path) -> pathlib.Path:
    """Validate ``config`` and write ``folder/config.json`` (pretty, :func:`record`); return the file's path.
    ``load(folder)`` rebuilds an equal config."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / CONFIG_FILE
    path.write_bytes(msgspec.json.format(msgspec.json.encode(record(config)), indent=2) + b"\n")
    return path


def type_tree(value: Any) -> dict[str, Any] | None:
    """``{"class": "module:QualName", "fields": {name: subtree}}`` for a Struct (with ``"base"``, its nearest class
    in a :data:`TRUSTED` package, when it is not in one), ``{"dict": {key: subtree}}`` for a dict holding Structs,
    None for anything else."""
    if isinstance(value, msgspec.Struct):
        cls = type(value)
        fields = {name: tree for name in cls.__struct_fields__ if (tree := type_tree(getattr(value, name))) is not None}
        node: dict[str, Any] = {"class": _spec(cls), "fields": fields}
        if not _trusted(cls):
            node["base"] = _spec(next(base for base in cls.__mro__ if _trusted(base) or base is msgspec.Struct))
        return node
    if isinstance(value, dict) and any(isinstance(v, msgspec.Struct) for v in value.values()):
        return {"dict": {str(k): type_tree(v) for k, v in value.items()}}
    return None


def foreign_classes(config: msgspec.Struct) -> list[str]:
    """The classes of ``config`` that no :data:`TRUSTED` package defines (an experiment file's), as
    ``"module:QualName"``: what a run folder alone rebuilds as values without their code."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if not isinstance(node, dict):
            return
        if "class" in node and "base" in node:
            found.append(node["class"])
        for child in (node.get("fields") or node.get("dict") or {}).values():
            walk(child)

    walk(type_tree(config))
    return found


class Loaded(msgspec.Struct, frozen=True):
    """A config read back from ``config.json`` and where each of its classes came from."""

    config: Any
    sources: tuple[str, ...]  # e.g. "method: FaultyFinetune from the experiment file '...'"


def load(folder: str | pathlib.Path, type: type[S] | None = None) -> S:
    """The config :func:`dump` wrote to ``folder``: as ``type`` when given, else typed from the file's ``types``
    (:func:`load_typed`)."""
    if type is not None:
        return _convert(_read_record(folder), type, pathlib.Path(folder) / CONFIG_FILE)
    return load_typed(folder).config


def load_typed(folder: str | pathlib.Path, classes: Any = None) -> Loaded:
    """The config in ``folder/config.json`` typed from its ``types``: classes of the :data:`TRUSTED` packages are
    imported (and those of modules already imported); any other class (one an experiment file defined) is
    ``classes(spec)`` when that gives one, else rebuilt from its recorded fields on its trusted base, which keeps its
    values but not its code. ``sources`` says, for
    each class not imported from fvx, which way it went."""
    return from_record(_read_record(folder), classes, pathlib.Path(folder) / CONFIG_FILE)


def from_record(record: dict[str, Any], classes: Any = None, path: str | pathlib.Path = CONFIG_FILE) -> Loaded:
    """A :func:`record` typed as :func:`load_typed` says (``path`` names where it was read, in errors)."""
    path = pathlib.Path(path)
    if not isinstance(record, dict) or "config" not in record:
        raise ConfigError(f"{str(path)!r} is not an fvx config record (no 'config' entry)")
    if "types" not in record:  # written before types were recorded
        return Loaded(_convert(record, _import_type(record.get("config_type"), path), path), ())
    sources: list[str] = []
    cls = _resolve(record["types"], record["config"], "config", path, classes, sources)
    return Loaded(_convert(record, cls, path), tuple(sources))


def _read_record(folder: str | pathlib.Path) -> dict[str, Any]:
    path = pathlib.Path(folder) / CONFIG_FILE
    try:
        record = msgspec.json.decode(path.read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"no {CONFIG_FILE} in {str(folder)!r}") from None
    except msgspec.DecodeError as error:
        raise ConfigError(f"{str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(record, dict) or "config" not in record:
        raise ConfigError(f"{str(path)!r} is not an fvx config dump (no 'config' entry)")
    return record


def _convert(record: dict[str, Any], cls: type, path: pathlib.Path) -> Any:
    try:
        return msgspec.convert(record["config"], cls)
    except msgspec.ValidationError as error:
        raise ConfigError(f"{str(path)!r} does not hold a valid {cls.__qualname__}: {error}") from None


def _spec(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _trusted(cls: type) -> bool:
    return cls.__module__.split(".")[0] in TRUSTED


def _resolve(node: Any, values: Any, where: str, path: pathlib.Path, classes: Any, sources: list[str]) -> Any:
    """The type a ``types`` subtree describes (``values``: its builtins form, for the fields it does not type)."""
    if not isinstance(node, dict) or not ("class" in node or "dict" in node):
        raise ConfigError(f"{str(path)!r}: malformed types entry at {where}")
    if "dict" in node:
        kinds = {(child or {}).get("class") for child in node["dict"].values()}
        entries = list({id(cls): cls for cls in (_resolve(child, values.get(key), f"{where}.{key}", path, classes,
                                                          sources)
                                                 for key, child in node["dict"].items() if child is not None)}.values())
        if None in kinds or not entries:
            raise ConfigError(f"{str(path)!r}: malformed types entry at {where}")
        if len(entries) > 1 and not all(_tag_field(cls) for cls in entries):
            raise ConfigError(f"{str(path)!r}: {where} holds entries of several config classes ({sorted(map(str, kinds))}"
                              ") without tags; a dict of several classes needs tagged ones")
        return dict[str, entries[0] if len(entries) == 1 else Union[tuple(entries)]]
    spec = node["class"]
    module_name, _, qualname = spec.partition(":")
    if module_name.split(".")[0] in TRUSTED or (module_name in sys.modules and not module_name.startswith(PRIVATE)):
        return _import_type(spec, path)  # fvx's, or a module this process has imported (nothing new runs)
    cls = classes(spec) if classes is not None else None
    if cls is not None:
        sources.append(f"{where}: {qualname} from the experiment file")
        return cls
    base = _import_type(node.get("base", ""), path) if node.get("base", "").split(".")[0] in TRUSTED else Config
    fields = [(name, _resolve(node["fields"][name], values[name], f"{where}.{name}", path, classes, sources)
               if name in node["fields"] else Any) for name in values if name != _tag_field(base)]
    sources.append(f"{where}: {qualname} rebuilt from config.json on {base.__qualname__} (its values, not its code)")
    options = base.__struct_config__
    tag = values.get(options.tag_field) if options.tag_field else None
    namespace = {"__annotations__": dict(fields), "__module__": "fvx_rebuilt"}
    return type(base)(qualname.rpartition(".")[2], (base,), namespace, kw_only=True,
                      **({"tag": tag, "tag_field": options.tag_field} if tag is not None else {}))


def _tag_field(cls: type) -> str | None:
    return getattr(cls, "__struct_config__").tag_field if hasattr(cls, "__struct_config__") else None


def _import_type(spec: Any, path: pathlib.Path) -> type:
    """The class named ``"module:QualName"``."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"{str(path)!r} records no config_type; pass type= to load")
    spec = MOVED.get(spec, spec)
    module_name, _, qualname = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for attr in qualname.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as error:
        raise ConfigError(f"{str(path)!r} records config_type {spec!r}, which cannot be imported ({error}); "
                          "pass type= to load") from None
    if not (isinstance(obj, type) and issubclass(obj, msgspec.Struct)):
        raise ConfigError(f"{str(path)!r} records config_type {spec!r}, which is not a msgspec Struct")
    return obj
