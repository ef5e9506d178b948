"""The package's public faces: implementation lives in private modules, each package exports a
deliberate list, and imports run one way only (cli -> splitter -> builder -> runtime)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import types
from pathlib import Path

import pytest

import onnxpipe

PACKAGES = ["onnxpipe", "onnxpipe.runtime", "onnxpipe.builder", "onnxpipe.splitter", "onnxpipe.cli"]
ROOT = Path(onnxpipe.__file__).parent
# Which layers each layer may import (besides itself and the top-level error family).
ALLOWED = {
    "runtime": set(),
    "builder": {"runtime"},
    "splitter": {"runtime", "builder"},
    "cli": {"runtime", "builder", "splitter"},
}


def test_implementation_modules_are_private() -> None:
    public = [
        m.name
        for m in pkgutil.walk_packages([str(ROOT)], "onnxpipe.")
        if not m.ispkg and not m.name.rsplit(".", 1)[1].startswith("_")
    ]
    assert public == [], f"modules with public names (use _name.py and re-export): {public}"


@pytest.mark.parametrize("name", PACKAGES)
def test_every_public_name_is_exported_on_purpose(name: str) -> None:
    package = importlib.import_module(name)
    exported = set(package.__all__)
    missing = [n for n in exported if not hasattr(package, n)]
    assert not missing, f"{name}.__all__ lists names it does not have: {missing}"
    stray = [
        n
        for n, value in vars(package).items()
        if not n.startswith("_") and n not in exported and not isinstance(value, types.ModuleType) and n != "annotations"
    ]
    assert not stray, f"{name} has public names not in __all__: {stray}"


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_imports_run_one_way(layer: str) -> None:
    bad = []
    for path in (ROOT / layer).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for mod in names:
                parts = mod.split(".")
                if parts[0] == "onnxpipe" and len(parts) > 1 and parts[1] in ALLOWED and parts[1] != layer and parts[1] not in ALLOWED[layer]:
                    bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, bad


def test_runtime_does_not_import_onnx_anywhere() -> None:
    for path in (ROOT / "runtime").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] not in {"onnx", "networkx", "click", "rich"} for a in node.names), path
            if isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] not in {"onnx", "networkx", "click", "rich"}, path


def test_license_is_an_spdx_expression() -> None:
    # A TOML table ({text = ...}) makes every `pip install` print setuptools' deprecation warning.
    import tomllib

    project = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
