"""Symbolic dims that are expressions of other dims, computed from the sizes of the dims they name.

Note: expression dims.
    Shape inference (onnxruntime's symbolic shape inference, which PaddlePaddle's and optimum's
    exporters run) writes a dim it can compute as a formula of the input dims, in sympy's notation:
    a stride-2 Conv of an image ``DynamicDimension.1`` high is ``floor(DynamicDimension.1/2 - 1/2) +
    1`` high, a KV cache grows to ``past_sequence_length + 1``. Such a dim has a size as soon as the
    dims it names have one, so byte counts compute it instead of counting it as 1, and a note asks
    for the names, never for the formula (``--dim`` cannot take one).

    The text is never given to ``eval``. It is split into tokens first (a dim name may hold dots,
    ``p2o.DynamicDimension.1`` or ``x.2``, which Python would read as attribute access or a float),
    each name is replaced by a placeholder, and the result is parsed with :mod:`ast`; only numbers,
    the placeholders, ``+ - * / // % **`` (a small integer power), unary ``+ -``, parentheses and the
    functions ``floor``, ``ceil`` / ``ceiling``, ``min``, ``max`` and ``mod`` (any case, as sympy
    prints ``Max`` and ``Mod``) are accepted. Arithmetic is exact (fractions), as sympy's is: ``H/2 -
    1/2`` is not rounded before ``floor``. Anything else is no expression: a dim named
    ``batch size`` or ``?`` is a plain name (one that reads as a formula, ``batch-size``, is read as
    one: no exporter names a dim so).

Note: dims counted as 1.
    Byte counts (``inspect``'s cut candidates, ``split --auto``'s crossing bytes) size a tensor's
    symbolic dims from the sizes given, a formula from the sizes of the dims it names; what is left
    counts as 1, and :func:`dim_notes` says so in two notes. The dims of the model's inputs (and
    those their formulas name) are listed whole: the user knows them and ``--dim`` sizes them, after
    which every formula of them follows. The other dims are internal: onnx's shape inference names
    a dim it cannot relate to the inputs ``unk__0, unk__1, ...`` (an optimum export has hundreds),
    which no user can size, so they are counted and a few named, with what they mean for the bytes.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction
from functools import lru_cache
from typing import Protocol

__all__ = ["dim_names", "dim_notes", "dim_size", "input_dims"]

_MAX_LENGTH = 4096  # longer text is no dim formula worth parsing
_MAX_POWER = 64
_MAX_BITS = 1024  # any value along the way at most: far past any size, far short of a tower's gigabytes
_SHOWN_INTERNAL = 3  # internal dims named in the note that counts them
_TOKEN = re.compile(
    r"\s*(?:(?P<number>\d+(?:\.\d+)?(?![A-Za-z_.]))"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*)"
    r"|(?P<op>//|\*\*|[-+*/%(),]))"
)
_BINARY: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: operator.mod,
}
_FUNCTIONS: dict[str, tuple[int | None, Callable[..., Fraction]]] = {  # name -> (arguments, None: one or more; function)
    "floor": (1, lambda a: Fraction(math.floor(a))),
    "ceil": (1, lambda a: Fraction(math.ceil(a))),
    "ceiling": (1, lambda a: Fraction(math.ceil(a))),
    "min": (None, min),
    "max": (None, max),
    "mod": (2, operator.mod),
}


class _Shaped(Protocol):
    """A ``TensorSpec`` as far as this module reads it (``_spec`` imports this module, not the other way)."""

    @property
    def shape(self) -> tuple[int | str | None, ...] | None: ...


class _NotADim(Exception):
    """The text holds something no dim formula holds, or a value no dim has (the message says which)."""


def dim_names(dim: str) -> frozenset[str] | None:
    """The dim names an expression dim is computed from (see Note: expression dims).

    Returns:
        The names (empty for a formula of numbers alone), or ``None`` when ``dim`` is no expression:
        a plain name (``batch``), or text that is no formula.
    """
    parsed = _parse(dim)
    return None if parsed is None else frozenset(parsed[1])


def dim_size(dim: str, sizes: Mapping[str, int], default: int | None = None) -> int | None:
    """The size of the symbolic dim ``dim``.

    Args:
        dim: A dim name (``batch``) or an expression of dim names (``floor(H/2 - 1/2) + 1``).
        sizes: Sizes of dims by name.
        default: The size of a dim without one, and of each name in an expression without one.

    Returns:
        ``sizes[dim]`` when given; an expression computed from the sizes of its names, those not
        given taking ``default`` (so the dims counted as 1 give what a run with them at 1 makes);
        ``default`` for a plain name not given, for a formula that does not come out a whole
        number >= 0 at these sizes, and for one that needs a size ``default`` (``None``) does not
        give.
    """
    if dim in sizes:
        return sizes[dim]
    parsed = _parse(dim)
    if parsed is None:
        return default
    tree, names = parsed
    values = [sizes.get(n, default) for n in names]
    if any(v is None for v in values):
        return default
    try:
        value = _evaluate(tree.body, [Fraction(v) for v in values if v is not None])
    except (_NotADim, ZeroDivisionError, OverflowError, RecursionError):
        return default
    return int(value) if value.denominator == 1 and value >= 0 else default


def input_dims(inputs: Iterable[_Shaped]) -> set[str]:
    """The names of the inputs' symbolic dims, and the names their formulas are computed from."""
    names: set[str] = set()
    for t in inputs:
        for d in t.shape or ():
            if isinstance(d, str):
                names |= dim_names(d) or {d}
    return names


def dim_notes(defaulted: Iterable[str], sizes: Mapping[str, int], inputs: Iterable[_Shaped]) -> list[str]:
    """What byte counts assumed of dims without a size (see Note: dims counted as 1).

    Args:
        defaulted: The symbolic dims (names and formulas) of the sized tensors that ``sizes`` has no key for.
        sizes: The sizes given.
        inputs: The model's inputs.

    Returns:
        A note listing the inputs' dims to give, and one counting the internal dims, each when there are any.
    """
    unsized: set[str] = set()
    formulas: dict[str, frozenset[str]] = {}
    for d in defaulted:
        names = dim_names(d)
        if names is None:
            unsized.add(d)
        else:
            formulas[d] = names
            unsized.update(n for n in names if n not in sizes)
    asked = input_dims(inputs) & unsized
    internal = sorted(unsized - asked, key=_natural)
    notes = []
    if asked:
        follow = sorted((d for d, names in formulas.items() if names & asked), key=lambda d: (len(d), d))
        then = f" ({len(follow)} dim(s) computed from them, e.g. '{follow[0]}', follow)" if follow else ""
        notes.append(f"input dim(s) {', '.join(sorted(asked, key=_natural))} counted as 1{then}; give sizes with dims / --dim NAME=VALUE")
    if internal:
        shown = ", ".join(internal[:_SHOWN_INTERNAL]) + (", ..." if len(internal) > _SHOWN_INTERNAL else "")
        notes.append(
            f"{len(internal)} internal dim(s) that no input has ({shown}: shape inference could not relate them to the inputs) counted as 1; "
            "the bytes of tensors that have them may be low"
        )
    return notes


def _natural(name: str) -> list[tuple[int, int | str]]:
    """Sort key: ``unk__2`` before ``unk__10``."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part]


@lru_cache(maxsize=4096)
def _parse(dim: str) -> tuple[ast.Expression, tuple[str, ...]] | None:
    """The checked syntax tree, its placeholders ``_0, _1, ...`` standing for the names in order,
    or ``None`` when ``dim`` is a plain name or no formula."""
    if len(dim) > _MAX_LENGTH:
        return None
    names: list[str] = []
    parts: list[str] = []
    pos, end = 0, len(dim.rstrip())
    while pos < end:
        m = _TOKEN.match(dim, pos)
        if m is None:
            return None
        pos = m.end()
        name = m.group("name")
        if name is None:
            parts.append(m.group(0).strip())
        elif dim[pos:].lstrip().startswith("("):
            if name.lower() not in _FUNCTIONS:
                return None
            parts.append(name.lower())
        else:
            if name not in names:
                names.append(name)
            parts.append(f"_{names.index(name)}")
    if len(parts) < 2:  # one name (a plain dim) or one number
        return None
    try:
        tree = ast.parse(" ".join(parts), mode="eval")
        _check(tree.body, len(names))
    except (SyntaxError, ValueError, RecursionError, MemoryError, _NotADim):
        return None
    return tree, tuple(names)


def _check(node: ast.expr, count: int) -> None:
    """Refuse every node outside the grammar of Note: expression dims."""
    for operand in _operands(node, count):
        _check(operand, count)


def _operands(node: ast.expr, count: int) -> list[ast.expr]:
    """The operands of a node of the grammar, for :func:`_check` to check in turn (none for a
    number or a placeholder); :class:`_NotADim` for a node outside it."""
    if isinstance(node, ast.Constant | ast.Name):
        if not _is_leaf(node, count):
            raise _NotADim
        return []
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        return [node.operand]
    if isinstance(node, ast.BinOp) and (type(node.op) in _BINARY or isinstance(node.op, ast.Pow)):
        return [node.left, node.right]
    if isinstance(node, ast.Call):
        return _arguments(node)
    raise _NotADim


def _is_leaf(node: ast.Constant | ast.Name, count: int) -> bool:
    """Whether ``node`` is a number (no bool, no string), or one of the ``count`` placeholders."""
    if isinstance(node, ast.Constant):
        return not isinstance(node.value, bool) and isinstance(node.value, int | float)
    return node.id.startswith("_") and node.id[1:].isdigit() and int(node.id[1:]) < count


def _arguments(call: ast.Call) -> list[ast.expr]:
    """The arguments of a call of one of the functions, as many as it takes; :class:`_NotADim` for
    any other call."""
    if not (isinstance(call.func, ast.Name) and call.func.id in _FUNCTIONS and not call.keywords):
        raise _NotADim
    arity, _ = _FUNCTIONS[call.func.id]
    if not call.args or (arity is not None and len(call.args) != arity):
        raise _NotADim
    if any(isinstance(arg, ast.Starred) for arg in call.args):
        raise _NotADim
    return call.args


def _evaluate(node: ast.expr, values: list[Fraction]) -> Fraction:
    """The value of a tree :func:`_check` accepted, with placeholder ``_k`` worth ``values[k]``."""
    return _bounded(_value(node, values))


def _value(node: ast.expr, values: list[Fraction]) -> Fraction:
    """One node's value, its operands evaluated (and bounded) by :func:`_evaluate`."""
    if isinstance(node, ast.Constant):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise _NotADim(f"the constant {ast.unparse(node)!r} is too large for a float")  # 400 nines and a fraction: inf
        return Fraction(str(node.value))
    if isinstance(node, ast.Name):
        return values[int(node.id[1:])]
    if isinstance(node, ast.UnaryOp):
        operand = _evaluate(node.operand, values)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left, values), _evaluate(node.right, values)
        if isinstance(node.op, ast.Pow):
            bits = max(left.numerator.bit_length(), left.denominator.bit_length())
            if right.denominator != 1 or not 0 <= right <= _MAX_POWER or bits * right > _MAX_BITS:
                # a dim is never a root, nor a tower of powers (whose size would be the attack)
                raise _NotADim(f"a dim's power is a whole number from 0 to {_MAX_POWER} whose result holds at most {_MAX_BITS} bits")
            return left ** int(right)
        return _BINARY[type(node.op)](left, right)
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    _, function = _FUNCTIONS[node.func.id]
    return function(*(_evaluate(arg, values) for arg in node.args))


def _bounded(value: Fraction) -> Fraction:
    """``value``, or :class:`_NotADim` when it holds more than ``_MAX_BITS`` bits (see Note: expression dims)."""
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > _MAX_BITS:
        raise _NotADim(f"a value along the way holds over {_MAX_BITS} bits; no dim is that large")
    return value
