"""The package's public faces: implementation lives in private modules, each package exports a
deliberate list, and imports run one way only (cli -> planner -> splitter -> builder -> runtime)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import types
from pathlib import Path

import pytest

import onnxpipe

PACKAGES = [
    "onnxpipe",
    "onnxpipe.runtime",
    "onnxpipe.runtime.bundle",
    "onnxpipe.builder",
    "onnxpipe.splitter",
    "onnxpipe.planner",
    "onnxpipe.serve",
    "onnxpipe.cli",
]
ROOT = Path(onnxpipe.__file__).parent
# Which layers each layer may import (besides itself and the top-level error family).
ALLOWED = {
    "runtime": set(),
    "builder": {"runtime"},
    "splitter": {"runtime", "builder"},
    "planner": {"runtime", "builder", "splitter"},  # it cuts, builds and runs the plans it measures; none of them imports it
    "serve": {"runtime"},  # the deployment host's front door: nothing of the build side
    "cli": {"runtime", "builder", "splitter", "planner", "serve"},
}


def test_implementation_modules_are_private() -> None:
    # A module is private when any part of its path is (generated code in serve/_proto/ too).
    public = [
        m.name
        for m in pkgutil.walk_packages([str(ROOT)], "onnxpipe.")
        if not m.ispkg and not any(part.startswith("_") for part in m.name.split(".")[1:])
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


def _imports_within(package: Path, name: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, anywhere in its file (also inside
    functions and ``if TYPE_CHECKING:``: a module's imports should read top-down either way)."""
    modules = {p.stem for p in package.glob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == name:
                # ``from package import _module`` depends on that module, ``from package import name`` on __init__.
                targets = [a.name if a.name in modules else "__init__" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"{name}."):
                targets = [(node.module or "")[len(name) + 1 :].split(".")[0]]
            elif isinstance(node, ast.Import):
                targets = [a.name[len(name) + 1 :].split(".")[0] for a in node.names if a.name.startswith(f"{name}.")]
            else:
                continue
            graph[path.stem].update(t for t in targets if t in modules and t != path.stem)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for nxt in sorted(graph[module]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], module, nxt] if nxt in path else [module, nxt]
            if nxt not in state and (found := visit(nxt, [*path, module])):
                return found
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module, [])):
            return found
    return None


@pytest.mark.parametrize("name", PACKAGES)
def test_no_import_cycle_within_a_package(name: str) -> None:
    package = ROOT.parent / name.replace(".", "/")
    cycle = _cycle(_imports_within(package, name))
    assert cycle is None, f"{name}: import cycle {' -> '.join(cycle)}"


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
