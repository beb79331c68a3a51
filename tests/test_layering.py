"""The layering the design promises, read from the sources: the core imports no model family and no method; methods
reach models only through the model interface and name no family and no family's conditioning keys."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# what methods may import of fvx_models: the model interface and what works through it for any (causal) model
MODEL_INTERFACE = {"__init__", "model", "streaming", "block_causal"}
FAMILY_MODULES = {p.stem for p in (ROOT / "fvx_models").glob("*.py")} - MODEL_INTERFACE
FAMILY_WORDS = ("wan", "hunyuan", "skyreels", "cosmos", "ltx", "kandinsky")
COND_KEYS = {"text", "text_mask", "pooled"}  # the families' cond tensors


def sources(package: str) -> list[pathlib.Path]:
    return sorted((ROOT / package).glob("*.py"))


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


@pytest.mark.parametrize("path", sources("fvx"), ids=lambda p: p.name)
def test_the_core_imports_no_family_and_no_method(path):
    imports = imported_modules(ast.parse(path.read_text()))
    assert not [m for m in imports if m.startswith(("fvx_models", "fvx_methods"))], path


@pytest.mark.parametrize("path", sources("fvx_methods"), ids=lambda p: p.name)
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
