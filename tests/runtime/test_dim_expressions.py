"""Dims that are formulas of other dims (issue 27), as onnxruntime's symbolic shape inference writes
them for PaddlePaddle and optimum exports: computed from the dims they name, never ``eval``-ed."""

from __future__ import annotations

import pytest

from onnxpipe.runtime import TensorSpec
from onnxpipe.runtime._dims import dim_names, dim_size

H = "p2o.DynamicDimension.1"
# PP-OCR det's strides, as sympy prints them: a 3x3 stride-2 Conv (pad 1) of H rows, and of that one.
CONV = f"floor({H}/2 - 1/2) + 1"
CONV2 = f"floor(floor({H}/2 - 1/2)/2) + 1"


@pytest.mark.parametrize(
    ("dim", "sizes", "size"),
    [
        (CONV, {H: 640}, 320),
        (CONV, {H: 641}, 321),  # as a Conv makes it: (641 + 2 - 3) // 2 + 1
        (CONV2, {H: 640}, 160),
        (f"floor(floor(floor(floor(floor({H}/2 - 1/2)/2)/2)/2)/2) + 1", {H: 640}, 20),
        ("DynamicDimension.1*2", {"DynamicDimension.1": 7}, 14),
        ("x.2*2", {"x.2": 5}, 10),  # the splitter's address of an unnamed input dim
        ("past_sequence_length + sequence_length", {"past_sequence_length": 3, "sequence_length": 4}, 7),
        ("past_sequence_length + 1", {"past_sequence_length": 3}, 4),
        ("ceil(W/32)*32", {"W": 100}, 128),
        ("ceiling(W/32)*32", {"W": 100}, 128),
        ("Max(a, b) - Min(a, b) + Mod(a, 3) + a // 3 + a % 3", {"a": 10, "b": 4}, 6 + 1 + 3 + 1),
        ("a**2", {"a": 3}, 9),
        ("-a + 2*b", {"a": 1, "b": 1}, 1),
        ("2*(a + 0.5)", {"a": 1}, 3),
    ],
)
def test_formulas_are_computed_from_the_dims_they_name(dim: str, sizes: dict[str, int], size: int) -> None:
    assert dim_size(dim, sizes) == size
    assert dim_names(dim) == frozenset(sizes)


def test_names_not_given_take_the_default() -> None:
    both = "past_sequence_length + sequence_length"
    assert dim_size(both, {"sequence_length": 4}, default=1) == 5
    assert dim_size(both, {"sequence_length": 4}) is None  # no default: the size stays unknown
    assert dim_size(both, {}, default=1) == 2  # what a run with both at 1 makes
    assert dim_size(both, {both: 9}, default=1) == 9  # a size given for the formula itself wins
    assert dim_size("batch", {"batch": 8}) == 8 and dim_size("batch", {}, default=1) == 1


@pytest.mark.parametrize(
    ("dim", "sizes"),
    [
        ("a - 5", {"a": 4}),
        ("a/3", {"a": 4}),
        ("a/(b - 2)", {"a": 4, "b": 2}),
        ("a**100", {"a": 2}),
        ("a**b", {"a": 2, "b": 1000}),
        ("a**0.5", {"a": 4}),
        ("(((((a**64)**64)**64)**64)**64)**64", {"a": 2}),  # gigabytes of integer, if computed
        ("a*" + "9" * 400 + ".5", {"a": 2}),  # issue 36, item 18: the constant reads as inf
        ("*".join(["a**16"] * 500), {"a": 1000}),  # each power small, their product 80,000 bits: str() refuses it
        ("a*" + "9" * 400, {"a": 1}),  # a 1,329-bit constant
        ("(a**64)/(a**64 + 1) + 1", {"a": 2**20}),  # a fraction of 1,281 bits on the way
    ],
)
def test_formulas_that_are_no_size_take_the_default(dim: str, sizes: dict[str, int]) -> None:
    # Negative, fractional, a division by zero, a power no dim is, a value larger than any size
    # along the way: not a size, so counted as the default.
    assert dim_names(dim) == frozenset(sizes)  # still a formula of its names
    assert dim_size(dim, sizes, default=1) == 1
    assert dim_size(dim, sizes) is None


def test_every_value_along_the_way_is_bounded_not_only_the_result() -> None:
    # Within the bound (1,024 bits) a long product is computed exactly; one bit more is no size.
    product = "*".join(["a**16"] * 63)
    assert dim_size(product, {"a": 2}) == 2 ** (16 * 63)
    assert dim_size(product + "*a**15", {"a": 2}) == 2**1023
    assert dim_size(product + "*a**16", {"a": 2}, default=1) == 1
    # A product that overflows only on the way, and comes back down, is refused as well.
    assert dim_size("(a**64*a**64)/(a**64*a**64)", {"a": 2**10}, default=1) == 1


@pytest.mark.parametrize(
    "dim",
    [
        "batch",
        "p2o.DynamicDimension.0",
        "unk__12",
        "?",
        "batch size",
        "",
        "2",
        "1e5 + a",
        "2abc + 1",
        '__import__("os").system("true") + 1',
        "a.b() + 1",
        "exp(a) + 1",
        "open(a)",
        "a if b else c",
        "a < b",
        "[a][0] + 1",
        "lambda: 1",
        "a + (b",
        "floor(a, b)",
        "mod(a)",
        "max()",
        "floor(a=1)",
        "(" * 300 + "a" + ")" * 300,
        " + ".join(["a"] * 5000),
    ],
)
def test_anything_else_is_a_plain_name(dim: str) -> None:
    assert dim_names(dim) is None
    assert dim_size(dim, {"a": 2, "b": 3, "c": 4}, default=1) == 1
    assert dim_size(dim, {dim: 6}) == 6


def test_tensor_spec_nbytes_computes_formula_dims() -> None:
    spec = TensorSpec("p2o.Add.43", "float32", ("p2o.DynamicDimension.0", 48, CONV2, f"floor(floor({H.replace('1', '2')}/2 - 1/2)/2) + 1"))
    dims = {"p2o.DynamicDimension.0": 1, H: 640, "p2o.DynamicDimension.2": 640}
    assert spec.nbytes(dims) == 4 * 48 * 160 * 160  # what onnxruntime makes at 640x640 (tests/splitter/test_inspect_exports.py)
    assert spec.nbytes() is None
    assert spec.nbytes(default=1) == 4 * 48
    assert TensorSpec("m", "int64", ("batch", "past + sequence")).nbytes({"batch": 2, "past": 3, "sequence": 1}) == 8 * 2 * 4
