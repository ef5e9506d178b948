"""The shape issue 37 left the code in, kept: no class over ~400 lines anywhere in onnxpipe, and no
function of the runtime (the floor every engine and front door stands on) over cyclomatic
complexity 20, as radon counts it. A part that grows past these is cut into parts, as
docs/design.md draws the runtime."""

from __future__ import annotations

import ast
from pathlib import Path

from radon.complexity import cc_visit

PACKAGE = Path(__file__).resolve().parents[1] / "onnxpipe"
MOST_CLASS_LINES = 400
MOST_COMPLEXITY = 20


def _sources(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "_proto" not in p.parts)


def test_no_class_is_over_400_lines() -> None:
    big = []
    for path in _sources(PACKAGE):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None and node.end_lineno - node.lineno + 1 > MOST_CLASS_LINES:
                big.append(f"{path.relative_to(PACKAGE.parent)}: {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not big, big


def test_no_runtime_function_is_over_complexity_20() -> None:
    tangled = set()  # radon lists a method under its class and again on its own
    for path in _sources(PACKAGE / "runtime"):
        for block in cc_visit(path.read_text(encoding="utf-8")):
            for item in [block, *getattr(block, "methods", [])]:
                if item.complexity > MOST_COMPLEXITY and not hasattr(item, "methods"):
                    tangled.add(f"{path.relative_to(PACKAGE.parent)}: {item.fullname} ({item.complexity})")
    assert not tangled, sorted(tangled)


def test_the_bounds_are_seen() -> None:
    """The walk reads real code: the runtime has classes and functions near the bounds."""
    sizes = [n.end_lineno - n.lineno + 1 for p in _sources(PACKAGE) for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
             if isinstance(n, ast.ClassDef) and n.end_lineno is not None]
    complexity = [b.complexity for p in _sources(PACKAGE / "runtime") for b in cc_visit(p.read_text(encoding="utf-8"))]
    assert max(sizes) > MOST_CLASS_LINES // 2 and max(complexity) > MOST_COMPLEXITY // 2
