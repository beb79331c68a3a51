"""The layering the design promises, read from the sources: the core imports no model family and no method, and the
functional core nothing of the distributed or running parts; models import no method; methods reach models only
through the model interface and name no family and no family's conditioning keys; and no module but the checkpoint
manager's orbax items imports JAX, measured by importing each module in a fresh interpreter."""
import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# what methods may import of fvx_models: the model interface and what works through it for any (causal) model
MODEL_INTERFACE = {"__init__", "model", "streaming", "block_causal"}
FAMILY_MODULES = {p.stem for p in (ROOT / "fvx_models").glob("*.py")} - MODEL_INTERFACE
FAMILY_WORDS = ("wan", "hunyuan", "skyreels", "cosmos", "ltx", "kandinsky")
COND_KEYS = {"text", "text_mask", "pooled"}  # the families' cond tensors
FUNCTIONAL_CORE_MAY_IMPORT = ("fvx.core", "fvx.config")
JAX_MODULES = {"fvx.storage.orbax_items"}  # the checkpoint manager's orbax items, imported when a manager opens


def sources(package: str) -> list[pathlib.Path]:
    return sorted((ROOT / package).rglob("*.py"))


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def code_strings(tree: ast.AST) -> list[str]:
    """String constants that are not docstrings."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def relative(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", sources("fvx"), ids=relative)
def test_the_core_imports_no_family_and_no_method(path):
    imports = imported_modules(ast.parse(path.read_text()))
    assert not [m for m in imports if m.startswith(("fvx_models", "fvx_methods"))], path


@pytest.mark.parametrize("path", sources("fvx/core"), ids=relative)
def test_the_functional_core_imports_nothing_of_the_distributed_or_running_parts(path):
    imports = imported_modules(ast.parse(path.read_text()))
    outside = [m for m in imports if m.split(".")[0] == "fvx" and m != "fvx"
               and not m.startswith(FUNCTIONAL_CORE_MAY_IMPORT)]
    assert not outside, f"{relative(path)} imports {outside}"


@pytest.mark.parametrize("path", sources("fvx_models"), ids=relative)
def test_models_import_no_method(path):
    imports = imported_modules(ast.parse(path.read_text()))
    assert not [m for m in imports if m.startswith("fvx_methods")], path


@pytest.mark.parametrize("path", sources("fvx_methods"), ids=relative)
def test_methods_name_no_family_and_no_cond_key(path):
    tree = ast.parse(path.read_text())
    families = [m for m in imported_modules(tree) if m.startswith("fvx_models") and m.split(".")[-1] in FAMILY_MODULES]
    assert not families, f"{path.name} imports {families}"
    identifiers = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    identifiers |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not [i for i in identifiers if i.lower().startswith(FAMILY_WORDS)], path.name
    assert not COND_KEYS & set(code_strings(tree)), f"{path.name} names {COND_KEYS & set(code_strings(tree))}"


@pytest.mark.parametrize("name", sorted(MODEL_INTERFACE - {"__init__"}))
def test_the_model_interface_imports_no_family(name):
    imports = imported_modules(ast.parse((ROOT / "fvx_models" / f"{name}.py").read_text()))
    assert not [m for m in imports if m.startswith("fvx_models") and m.split(".")[-1] in FAMILY_MODULES], name


# Families added as one spec file each (issue 29): nothing else imports them, so adding one changed no other file of
# the package. The core changes that came with them serve contract points every family may use, not a family: the
# data kind "i2v" (fvx/data/parquet.py, FastVideo's pyarrow_schema_i2v) and the toy world's image-to-video task
# (fvx/data/toy_world.py), Model.cfg_dropout_refusal checked before weights load (fvx/training/experiment.py), and
# next-section data, kind "framepack" (fvx/data/sections.py: FramePack's sections, which Helios's chunks share), and
# for a DiT that embeds its prompt's tokens itself (Cosmos 3) the toy world's words as token ids
# (fvx/data/toy_world.py) and the family's own patch (Architecture.patch: not its constructor's patch_size).
SPEC_FILE_FAMILIES = ("cosmos", "ltx_video", "hunyuan_video15", "kandinsky5", "latte", "allegro", "easyanimate",
                      "motif_video", "kandinsky6", "sana_video", "mochi", "wan_vace", "hunyuan_framepack",
                      "helios", "cosmos3")
VARIANTS = {"wan_vace": ("fvx_models/wan_vace_moe.py",)}  # families derived from one (its two-expert form)


@pytest.mark.parametrize("family", SPEC_FILE_FAMILIES)
def test_a_spec_file_family_is_imported_by_no_module_of_the_packages(family):
    importers = [relative(path) for package in ("fvx", "fvx_models", "fvx_methods") for path in sources(package)
                 if f"fvx_models.{family}" in imported_modules(ast.parse(path.read_text()))
                 and relative(path) not in VARIANTS.get(family, ())]
    assert not importers, f"fvx_models/{family}.py is imported by {importers}"
    assert (ROOT / "fvx_models" / f"{family}.py").is_file()


# What imports JAX: every module and experiment file imported one after the other in one fresh interpreter, JAX
# looked for after each (the first to bring it is named; a module imported without it is free of it, with all it
# imports), then the checkpoint manager's orbax items, which must bring it.
PROBE = r"""
import importlib, runpy, sys
for target in sys.argv[1:]:
    before = set(sys.modules)
    try:
        runpy.run_path(target) if target.endswith(".py") else importlib.import_module(target)
    except BaseException as error:
        print(f"{target}\terror {type(error).__name__}: {error}")
        continue
    new = sorted(m for m in set(sys.modules) - before if m.startswith("fvx"))
    print(f"{target}\t{' '.join(['jax', *new]) if 'jax' in sys.modules else 'no-jax'}")
"""


def test_no_module_and_no_experiment_imports_jax_but_the_checkpoint_managers_orbax_items():
    modules = [module_name(p) for package in ("fvx", "fvx_models", "fvx_methods") for p in sources(package)]
    experiments = [str(p) for p in sorted((ROOT / "experiments").glob("*.py"))]
    order = [m for m in modules if m not in JAX_MODULES] + experiments + sorted(JAX_MODULES)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", PROBE, *order], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    answers = dict(line.split("\t", 1) for line in out.stdout.splitlines())
    assert list(answers) == order
    errors = {name: answer for name, answer in answers.items() if answer.startswith("error")}
    assert not errors, errors
    first, answer = next((name, answer) for name, answer in answers.items() if answer.startswith("jax"))
    assert first in JAX_MODULES, (f"importing {first} imports JAX, through one of {answer.split()[1:]} (only the "
                                  "checkpoint manager's orbax items may)")
