"""What a model's graph fixes of its inputs' symbolic dims, and the least size a convolution takes.

Note: dims the graph fixes.
    An export often leaves a dim symbolic that its own weights fix: the corpus ViT's ``pixel_values``
    is ``[batch_size, num_channels, height, width]``, but its patch Conv's weight is ``[32, 3, 8, 8]``,
    so ``num_channels`` is 3 (in-channels x ``group``) and nothing else runs. Sample inputs (profiling,
    ``verify``, the planner, a boundary's sample run) take such a size instead of 1, and the split
    records it in the pipeline's ``input_dims`` metadata, so ``bench`` and ``verify`` of a bundle
    take it too; messages that ask for dims ask only for the others. A size given (``--dim``) goes
    over it. The graph fixes a dim of a graph input where shape inference carries the input's own
    dim name to (checked against a constant's shape):

    - a ``Conv``'s input channels (dim 1): the weight's dim 1 x ``group``; a ``ConvTranspose``'s:
      the weight's dim 0;
    - a ``MatMul``'s inner dim against a constant (``A``'s last dim: ``B``'s dim -2), a ``Gemm``'s ``K``
      (``transA`` / ``transB`` read);
    - an ``Add`` / ``Sub`` / ``Mul`` / ``Div`` with a constant that is more than 1 along the dim
      (broadcast aligned from the right), a ``Concat`` with a constant along any axis but the concatenated one.

    A dim two places fix at two sizes is fixed by neither (the model then fails whatever is given).
    This is no solver: a dim fixed through arithmetic (ViT's ``height * width / 64 = 16`` through
    its position table) is left to the user.

Note: a convolution's least input.
    A ``Conv`` whose spatial dim is a graph input's dim needs at least ``(kernel - 1) x dilation + 1
    - pads`` there (wav2vec2's first Conv has a kernel of 10 along ``sequence_length``), so a size of
    1 fails in onnxruntime with ``Invalid input shape``; the message that asks for the dim says so.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import onnx
from onnx import ModelProto, NodeProto, ValueInfoProto

from onnxpipe._errors import ConfigError
from onnxpipe.builder import tensor_spec
from onnxpipe.runtime._dims import dim_names
from onnxpipe.splitter._values import constant_shapes

__all__ = ["graph_dims", "kernel_floors", "sample_dims"]

Shape = tuple[int | str | None, ...]
_Rule = Callable[[NodeProto, Callable[[str], Shape | None], Mapping[str, tuple[int, ...]]], Iterator[tuple[str, int]]]


def graph_dims(proto: ModelProto, types: Mapping[str, ValueInfoProto]) -> dict[str, int]:
    """The sizes the graph fixes of its inputs' symbolic dims (Note: dims the graph fixes).

    Args:
        proto: The model.
        types: Its inferred types (``_extract.infer_types``).

    Returns:
        Each fixed dim's size, by name, in the order the graph reaches them.
    """
    shape_of = _shapes(types)
    names = _input_dim_names(proto, types)
    constants = constant_shapes(proto.graph)
    found: dict[str, set[int]] = defaultdict(set)
    for node in proto.graph.node:
        rule = _RULES.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        for dim, size in rule(node, shape_of, constants) if rule is not None else ():
            if dim in names and size >= 1:
                found[dim].add(size)
    return {dim: next(iter(sizes)) for dim, sizes in found.items() if len(sizes) == 1}


def sample_dims(proto: ModelProto, dims: Mapping[str, int] | None, types: Mapping[str, ValueInfoProto]) -> dict[str, int]:
    """The sizes sample inputs of ``proto`` take: those its graph fixes, ``dims`` over them."""
    return {**graph_dims(proto, types), **(dims or {})}


def kernel_floors(proto: ModelProto, types: Mapping[str, ValueInfoProto]) -> dict[str, tuple[int, str]]:
    """The least size of each input dim a ``Conv`` slides along (Note: a convolution's least
    input), with the Conv that needs it, where that is more than 1."""
    shape_of = _shapes(types)
    names = _input_dim_names(proto, types)
    constants = constant_shapes(proto.graph)
    floors: dict[str, tuple[int, str]] = {}
    for node in proto.graph.node:
        if node.op_type == "Conv" and node.domain in ("", "ai.onnx") and len(node.input) >= 2 and _attr(node, "auto_pad", b"NOTSET") == b"NOTSET":
            for dim, least in _least_inputs(shape_of(node.input[0]), constants.get(node.input[1]), node):
                if dim in names and least > floors.get(dim, (1, ""))[0]:
                    floors[dim] = (least, node.name or node.output[0])
    return floors


def _least_inputs(x: Shape | None, w: tuple[int, ...] | None, node: NodeProto) -> Iterator[tuple[str, int]]:
    """Each named spatial dim of a Conv's input ``x`` and the least size its kernel ``w`` takes there (explicit pads)."""
    if x is None or w is None or len(w) != len(x) or len(w) < 3:
        return
    spatial = len(w) - 2
    dilations = _attr(node, "dilations", [1] * spatial)
    pads = _attr(node, "pads", [0] * (2 * spatial))
    for i, dim in enumerate(x[2:]):
        if isinstance(dim, str):
            yield dim, (w[2 + i] - 1) * dilations[i] + 1 - pads[i] - pads[spatial + i]


def _shapes(types: Mapping[str, ValueInfoProto]) -> Callable[[str], Shape | None]:
    """A tensor's inferred shape by name (``None`` where unknown)."""

    def shape_of(name: str) -> Shape | None:
        value = types.get(name)
        if value is None or not value.type.HasField("tensor_type"):
            return None
        try:
            return tensor_spec(value).shape
        except ConfigError:
            return None

    return shape_of


def _input_dim_names(proto: ModelProto, types: Mapping[str, ValueInfoProto]) -> set[str]:
    """The plain names of the graph inputs' symbolic dims (a formula is computed, never fixed)."""
    initializers = {t.name for t in proto.graph.initializer}
    names: set[str] = set()
    for value in proto.graph.input:
        typed = types.get(value.name, value)
        if value.name in initializers or not typed.type.HasField("tensor_type"):
            continue
        names.update(d.dim_param for d in typed.type.tensor_type.shape.dim if d.dim_param and dim_names(d.dim_param) is None)
    return names


def _attr(node: NodeProto, name: str, default: Any) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _conv(node: NodeProto, shape_of: Callable[[str], Shape | None], constants: Mapping[str, tuple[int, ...]]) -> Iterator[tuple[str, int]]:
    x, w = shape_of(node.input[0]), constants.get(node.input[1]) if len(node.input) > 1 else None
    if x is not None and w is not None and len(x) >= 2 and len(w) >= 2 and isinstance(x[1], str):
        group = _attr(node, "group", 1)
        yield x[1], w[0] if node.op_type == "ConvTranspose" else w[1] * int(group)


def _matmul(node: NodeProto, shape_of: Callable[[str], Shape | None], constants: Mapping[str, tuple[int, ...]]) -> Iterator[tuple[str, int]]:
    a, b = shape_of(node.input[0]), constants.get(node.input[1])
    if a and b and isinstance(a[-1], str):
        yield a[-1], b[-2] if len(b) >= 2 else b[0]
    b_shape, a_const = shape_of(node.input[1]), constants.get(node.input[0])
    if b_shape is not None and len(b_shape) >= 2 and a_const and isinstance(b_shape[-2], str):
        yield b_shape[-2], a_const[-1]


def _gemm(node: NodeProto, shape_of: Callable[[str], Shape | None], constants: Mapping[str, tuple[int, ...]]) -> Iterator[tuple[str, int]]:
    a, b = shape_of(node.input[0]), constants.get(node.input[1])
    if a is not None and b is not None and len(a) == 2 and len(b) == 2:
        k = a[0 if _attr(node, "transA", 0) else 1]
        if isinstance(k, str):
            yield k, b[1 if _attr(node, "transB", 0) else 0]


def _broadcast(node: NodeProto, shape_of: Callable[[str], Shape | None], constants: Mapping[str, tuple[int, ...]]) -> Iterator[tuple[str, int]]:
    for c in (constants[n] for n in node.input if n in constants):
        for x in (shape_of(n) for n in node.input if n not in constants):
            for d, size in zip(reversed(x or ()), reversed(c), strict=False):
                if isinstance(d, str) and size > 1:
                    yield d, size


def _concat(node: NodeProto, shape_of: Callable[[str], Shape | None], constants: Mapping[str, tuple[int, ...]]) -> Iterator[tuple[str, int]]:
    axis = int(_attr(node, "axis", 0))
    for c in (constants[n] for n in node.input if n in constants):
        for x in (shape_of(n) for n in node.input if n not in constants):
            if x is None or len(x) != len(c):
                continue
            for k, (d, size) in enumerate(zip(x, c, strict=True)):
                if k != axis % len(c) and isinstance(d, str):
                    yield d, size


_RULES: dict[str, _Rule] = {
    "Conv": _conv,
    "ConvTranspose": _conv,
    "MatMul": _matmul,
    "Gemm": _gemm,
    "Add": _broadcast,
    "Sub": _broadcast,
    "Mul": _broadcast,
    "Div": _broadcast,
    "Concat": _concat,
}
