"""Local diffusers folders, generically: reading a model's params from its pipeline components (``config.json`` +
safetensors weights, checked against the skeleton) and writing them back as a folder ``from_pretrained`` loads.
Never pickle, never a hub.

A model's params come from one or more pipeline components (``transformer/``; Wan 2.2 A14B's two experts
``transformer/`` and ``transformer_2/``), each a submodule of the skeleton whose params carry a prefix in the flat
params dict (``components``: folder name -> prefix, "" for the whole module). Every error is a ValueError that starts
with ``what`` (e.g. ``"wan load"``) and names the file and the differences.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import pathlib
import re
import shutil
import tempfile
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
FVX_CONFIG_KEY = "config_type"  # what marks fvx's own config.json (fvx.config.record), a run folder's
LIST_LIMIT = 10  # names shown per category in an error message
MAX_SHARD_BYTES = 10 * 10**9  # diffusers' default max_shard_size "10GB"
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def listed(items: list[str]) -> str:
    """The first ``LIST_LIMIT`` items joined, with how many more there are."""
    shown = ", ".join(items[:LIST_LIMIT])
    return shown + (f", ... and {len(items) - LIST_LIMIT} more" if len(items) > LIST_LIMIT else "")


def component_folder(folder: pathlib.Path, subfolder: str, what: str, kind: str) -> pathlib.Path:
    """``folder`` when it holds a config.json, else ``folder/subfolder`` (a pipeline root)."""
    if (folder / CONFIG_NAME).is_file():
        return folder
    if (folder / subfolder / CONFIG_NAME).is_file():
        return folder / subfolder
    raise ValueError(
        f"{what}: no {CONFIG_NAME} in {str(folder)!r} nor in {str(folder / subfolder)!r}; expected a diffusers "
        f"{kind} folder or a pipeline root holding one under {subfolder}/"
    )


def check_config(folder: pathlib.Path, module: nn.Module, what: str, skip: Iterable[str] = ()) -> dict[str, Any]:
    """The folder's config.json; a ValueError lists each architecture field (but ``skip``) where it differs from
    ``module.config`` (fields the file leaves out take the class's constructor defaults, as diffusers does)."""
    cls, path = type(module), folder / CONFIG_NAME
    try:
        stored = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{what}: {str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(stored, dict):
        raise ValueError(f"{what}: {str(path)!r} does not hold a JSON object")
    if FVX_CONFIG_KEY in stored and "_class_name" not in stored:  # fvx.config.record's, a run folder's config.json
        raise ValueError(f"{what}: {str(path)!r} is an fvx run's config, not a diffusers one: {str(folder)!r} is a run "
                         f"folder; export it first: python -m fvx.run export {folder} --out FOLDER, and load FOLDER")
    class_name = stored.get("_class_name", cls.__name__)
    if class_name not in getattr(cls, "stored_class_names", (cls.__name__,)):  # a class's released aliases
        raise ValueError(f"{what}: {str(path)!r} describes a {class_name}, not a {cls.__name__}")
    defaults = constructor_defaults(cls)
    skip = set(skip)
    differences = [
        f"{field}: folder has {stored.get(field, defaults.get(field))!r}, expected {expected!r}"
        for field, expected in module.config.items()
        if not field.startswith("_") and field not in skip
        and _comparable(stored.get(field, defaults.get(field))) != _comparable(expected)
    ]
    if differences:
        raise ValueError(f"{what}: {str(path)!r} does not match the model's architecture: " + "; ".join(differences))
    return stored


def constructor_defaults(cls: type) -> dict[str, Any]:
    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()}


def _comparable(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, tuple)) else value


def weight_files(folder: pathlib.Path, what: str) -> list[pathlib.Path]:
    """The safetensors files holding the weights: the single file, or the shards an index json names."""
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    index_path = folder / WEIGHTS_INDEX_NAME
    if not index_path.is_file():
        raise ValueError(f"{what}: no {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME} in {str(folder)!r} "
                         "(fvx reads safetensors only)")
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{what}: {str(index_path)!r} is not a safetensors index with a weight_map: {error}") from None
    files = [folder / name for name in sorted(set(weight_map.values()))]
    missing = [path.name for path in files if not path.is_file()]
    if missing:
        raise ValueError(f"{what}: shards named in {str(index_path)!r} are missing: {listed(missing)}")
    return files


def stored_shapes(files: Iterable[pathlib.Path], what: str = "load") -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the safetensors ``files``, read from their headers (no data)."""
    shapes = {}
    for path in files:
        with open_safetensors(path, what) as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


def shape_problems(required: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]],
                   known: Mapping[str, tuple[int, ...]] | None = None,
                   stored_as: Mapping[str, str] | None = None) -> list[str]:
    """``"missing keys (n): ..."``, ``"unexpected keys (n): ..."`` and ``"shape mismatches (n): ..."`` of ``found``
    against ``required`` (every one must be there) and ``known`` (what may be there; default ``required``); a found
    name that ``stored_as`` maps is shown as the file stores it."""
    known = required if known is None else known
    stored_as = stored_as or {}

    def shown(name: str) -> str:
        return f"{stored_as[name]} (read as {name})" if stored_as.get(name, name) != name else name

    missing = [name for name in required if name not in found]
    unexpected = [shown(name) for name in found if name not in known]
    mismatched = [f"{shown(name)}: {list(found[name])} vs expected {list(shape)}"
                  for name, shape in known.items() if name in found and tuple(found[name]) != tuple(shape)]
    return [f"{label} ({len(items)}): {listed(items)}"
            for label, items in (("missing keys", missing), ("unexpected keys", unexpected),
                                 ("shape mismatches", mismatched)) if items]


# ---------------------------------------------------------------------------------------------- a model's components


def submodule(module: nn.Module, prefix: str) -> nn.Module:
    """The component of ``module`` whose params carry ``prefix`` ("" is the module itself)."""
    return module if not prefix else module.get_submodule(prefix.removesuffix("."))


def param_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def _ignored_on_load(module: nn.Module, name: str) -> bool:
    patterns = getattr(module, "_keys_to_ignore_on_load_unexpected", None) or ()
    return any(re.search(pattern, name) for pattern in patterns)


class StoredTensor:
    """A param of a safetensors file, read on demand: :meth:`narrow` reads only the rows asked for (as fp32), so
    ``fvx.distributed.sharding.shard`` of :class:`StoredTensor` params never holds a full param: a rank reads its slices
    only."""

    dtype = torch.float32

    def __init__(self, path: pathlib.Path, name: str, shape: tuple[int, ...], what: str):
        self.path, self.name, self.shape, self.what = path, name, torch.Size(shape), what

    def detach(self) -> StoredTensor:
        return self

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        rows = tuple(slice(start, start + length) if d == dim else slice(None) for d in range(len(self.shape)))
        with open_safetensors(self.path, self.what) as f:
            try:
                return f.get_slice(self.name)[rows].to(torch.float32)
            except (SafetensorError, OSError) as error:
                raise ValueError(f"{self.what}: cannot read tensor {self.name!r} of {str(self.path)!r} (truncated?): "
                                 f"{error}") from None


StoredNames = Callable[[set[str]], Mapping[str, str] | None]
"""A family's other naming of its weights: a component's stored keys -> stored name -> skeleton name of the keys it
renames (None: the keys are not in that naming); a ValueError (one line) when they mix namings."""


def skeleton_names(stored: Iterable[str], stored_names: StoredNames | None, where: pathlib.Path,
                   what: str) -> dict[str, str]:
    """Each stored key -> the skeleton name it is read as: ``stored_names``' rename when the keys are in its
    naming, else the name as stored; a ValueError names two keys read as one name."""
    stored = set(stored)
    try:
        renames = (stored_names(stored) if stored_names is not None else None) or {}
    except ValueError as error:
        raise ValueError(f"{what}: weights in {str(where)!r}: {error}") from None
    names = {name: renames.get(name, name) for name in sorted(stored)}
    first: dict[str, str] = {}
    for name, read_as in names.items():
        if first.setdefault(read_as, name) != name:
            raise ValueError(f"{what}: weights in {str(where)!r} hold both {first[read_as]!r} and {name!r}, "
                             f"which are both {read_as!r}")
    return names


def read_params(folder: str | os.PathLike, module: nn.Module, components: Mapping[str, str],
                what: str, *, lazy: bool = False,
                derived: Mapping[str, Callable[[Mapping[str, Any]], Any]] | None = None,
                stored_names: StoredNames | None = None) -> dict[str, torch.Tensor]:
    """fp32 params of ``module`` from a local folder: a pipeline root holding each component's folder, or (for a
    model of one component) that component's folder itself. Each component's config.json must describe the
    skeleton's architecture and its weights hold exactly the skeleton's params with their shapes (but the
    ``derived`` ones, which the folder may lack: ``derived[name](params)`` makes them from the others); otherwise one
    ValueError lists every difference. ``lazy``: :class:`StoredTensor` handles instead of tensors (for a sharded
    load, each rank reading its own slices). ``stored_names``: weights in the family's other naming are read under
    the skeleton's names (:func:`skeleton_names`). Never touches a hub."""
    params: dict[str, torch.Tensor] = {}
    derived = derived or {}
    for prefix, part, where in component_folders(folder, module, components, what):
        check_config(where, part, what)
        files = weight_files(where, what)
        stored = stored_shapes(files, what)
        names = skeleton_names(stored, stored_names, where, what)
        shapes = {names[name]: shape for name, shape in stored.items() if not _ignored_on_load(part, names[name])}
        expected = param_shapes(part)
        lacking = [name for name in expected if name not in shapes and prefix + name in derived]
        if len(lacking) not in (0, len([name for name in expected if prefix + name in derived])):
            raise ValueError(f"{what}: weights in {str(where)!r} hold some but not all of {sorted(lacking)}")
        problems = shape_problems({name: shape for name, shape in expected.items() if name not in lacking}, shapes,
                                  stored_as={read_as: name for name, read_as in names.items()})
        if problems:
            raise ValueError(f"{what}: weights in {str(where)!r} do not fit the model: " + "; ".join(problems))
        loaded = {}
        for path in files:
            with open_safetensors(path, what) as f:
                for name in f.keys():
                    read_as = names[name]
                    if read_as in shapes:
                        loaded[read_as] = (StoredTensor(path, name, shapes[read_as], what) if lazy
                                           else read_tensor(f, name, path, what).to(torch.float32))
        params.update({prefix + name: loaded[name] for name in expected if name not in lacking})
    params.update({name: make(params) for name, make in derived.items() if name not in params})
    return {name: params[name] for name in param_shapes(module)}


def component_folders(folder: str | os.PathLike, module: nn.Module, components: Mapping[str, str],
                      what: str) -> list[tuple[str, nn.Module, pathlib.Path]]:
    """(prefix, submodule, folder) of each component of ``module`` in a pipeline root ``folder`` (or, for a model
    of one component, in that component's folder itself); a ValueError names a folder that is not there."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{what}: {str(folder)!r} is not a folder")
    found = []
    for component, prefix in components.items():
        part = submodule(module, prefix)
        if len(components) == 1:
            where = component_folder(folder, component, what, f"{type(part).__name__} {component}")
        else:
            where = folder / component
            if not (where / CONFIG_NAME).is_file():
                raise ValueError(f"{what}: no {CONFIG_NAME} in {str(where)!r}; expected a diffusers pipeline root "
                                 f"with the components {', '.join(f'{c}/' for c in components)}")
        found.append((prefix, part, where))
    return found


def stored_dtypes(folder: str | os.PathLike, module: nn.Module, components: Mapping[str, str],
                  what: str, stored_names: StoredNames | None = None) -> dict[str, torch.dtype]:
    """Each floating-point param's dtype as ``folder``'s safetensors files store it (read from their headers): the
    precision the model was saved in; keyed by skeleton name (``stored_names`` as :func:`read_params`)."""
    dtypes = {}
    for prefix, _, where in component_folders(folder, module, components, what):
        files = weight_files(where, what)
        names = skeleton_names(stored_shapes(files, what), stored_names, where, what)
        for path in files:
            with open_safetensors(path, what) as f:
                for name in f.keys():
                    dtype = SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())
                    if dtype is not None:
                        dtypes[prefix + names[name]] = dtype
    return dtypes


def open_safetensors(path: pathlib.Path, what: str):
    """``safe_open(path)``, or a ValueError naming the file when it is not readable (truncated, not safetensors)."""
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{what}: {str(path)!r} is not a readable safetensors file ({error})") from None


def read_tensor(f: Any, name: str, path: pathlib.Path, what: str) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{what}: cannot read tensor {name!r} of {str(path)!r} (truncated?): {error}") from None


def check_params(module: nn.Module, params: Any, what: str) -> None:
    """A ValueError unless ``params`` maps exactly ``module``'s param names to tensors of their shapes."""
    if not isinstance(params, Mapping):
        raise TypeError(f"{what}: params must be a dict of tensors, got {type(params).__name__}")
    not_tensors = [name for name, value in params.items() if not isinstance(value, torch.Tensor)]
    if not_tensors:
        raise TypeError(f"{what}: params must map names to tensors; not tensors: {listed(not_tensors)}")
    problems = shape_problems(param_shapes(module), {name: tuple(p.shape) for name, p in params.items()})
    if problems:
        raise ValueError(f"{what}: params do not fit the model: " + "; ".join(problems))


def write_folder(params: Mapping[str, torch.Tensor], folder: str | os.PathLike, module: nn.Module,
                 components: Mapping[str, str], what: str, *, dtype_of: Callable[[str], torch.dtype | None],
                 pipeline_files: Callable[[pathlib.Path], None] | None = None,
                 max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write ``params`` (whole tensors) as a diffusers pipeline folder: one folder per component (config.json +
    safetensors, sharded with an index json above ``max_shard_bytes``) that the component class's
    ``from_pretrained`` loads, and ``pipeline_files`` (model_index.json, scheduler/). ``dtype_of(name)`` casts a
    floating-point param (None: keep). Written as :func:`staged` writes."""
    if max_shard_bytes <= 0:
        raise ValueError(f"{what}: max_shard_bytes must be positive, got {max_shard_bytes}")
    check_params(module, params, what)
    with staged(folder, what) as staging:
        for component, prefix in components.items():
            part = submodule(module, prefix)
            tensors = {name: exported(params[prefix + name], dtype_of(prefix + name)) for name in param_shapes(part)}
            part.save_config(staging / component)
            write_weights(tensors, staging / component, max_shard_bytes)
        if pipeline_files is not None:
            pipeline_files(staging)


@contextlib.contextmanager
def staged(folder: str | os.PathLike, what: str) -> Iterator[pathlib.Path]:
    """A folder to write into that becomes ``folder`` when the block ends (renamed into place, files world-readable),
    so an error leaves nothing half-written; an existing non-empty ``folder`` is an error."""
    folder = pathlib.Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"{what}: {str(folder)!r} already exists and is not an empty folder")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{folder.name}.partial-", dir=folder.parent))
    try:
        yield staging
        for path in [staging, *staging.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def exported(param: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``param`` as a file holds it: on the CPU, contiguous, a floating-point one in ``dtype`` (None: its own)."""
    param = param.detach().to("cpu")
    if dtype is not None and param.is_floating_point():
        param = param.to(dtype)
    return param.contiguous()


def write_weights(tensors: dict[str, torch.Tensor], folder: pathlib.Path, max_shard_bytes: int) -> None:
    """One safetensors file, or numbered shards of at most ``max_shard_bytes`` (a bigger tensor gets its own) plus
    diffusers' index json."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], folder / WEIGHTS_NAME, metadata=metadata)
        return
    stem = WEIGHTS_NAME.removesuffix(".safetensors")
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        filename = f"{stem}-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / filename, metadata=metadata)
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_model_index(folder: pathlib.Path, pipeline_class: str, components: Mapping[str, tuple[str, str]],
                      **fields: Any) -> None:
    """diffusers' ``model_index.json``: the pipeline class, each component's (library, class), and extra fields."""
    import diffusers

    index = {"_class_name": pipeline_class, "_diffusers_version": diffusers.__version__, **fields,
             **{name: list(where) for name, where in components.items()}}
    (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
