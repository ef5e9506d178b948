"""What a model's graph says of its inputs' values: the tables its integer inputs index (Note: sample
values, in ``runtime/_values.py``).

Note: table bounds.
    An integer input that reaches the indices of a ``Gather`` whose data is a constant table (an
    initializer, a ``Constant``, or one of them through ``Cast`` / ``Identity`` /
    ``DequantizeLinear``) is kept within the table's rows along the gathered axis: optimum's BERT
    reads ``input_ids`` from the word table (the vocabulary) and ``token_type_ids`` from a table of
    ``type_vocab_size`` rows. The input is followed through ops that keep its values (``Cast`` to an
    integer, ``Unsqueeze``, ``Reshape``, ``Expand``, ``Slice``, ...) and ``Add`` / ``Sub`` of a
    constant, which shifts the bound (RoBERTa's positions are offset by the padding index). Where it
    reaches several tables, the values fit all of them; anything else it reaches bounds nothing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import ModelProto, numpy_helper

from onnxpipe.builder import tensor_spec
from onnxpipe.runtime import TensorSpec
from onnxpipe.runtime._values import InputValues, named_values

__all__ = ["constant_shapes", "graph_values", "table_bounds"]

#: Ops whose output at index 0 holds the values of their input 0 (some of them, or repeated).
_KEEPS_VALUES = frozenset({"Cast", "Identity", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Expand", "Transpose", "Slice", "Tile", "Concat"})
#: Ops whose output is their constant input 0 in another form: a table read through them is the table.
_TABLE_FORMS = frozenset({"Cast", "Identity", "DequantizeLinear"})
_INTEGER = frozenset({onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.INT32, onnx.TensorProto.INT64,
                      onnx.TensorProto.UINT8, onnx.TensorProto.UINT16, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64})


def graph_values(proto: ModelProto, inputs: Mapping[str, TensorSpec] | None = None) -> dict[str, InputValues]:
    """What the model's inputs' values mean: their names' rules (masks, positions), then the
    tables they index (Note: table bounds), which outrank a name's range (``token_type_ids``).

    Args:
        proto: The model.
        inputs: The inputs to say it of, by name (default: the graph's inputs that are no initializer).

    Returns:
        Each input's :class:`~onnxpipe.runtime.InputValues` where its name or the graph says one, by name.
    """
    if inputs is None:
        initializers = {t.name for t in proto.graph.initializer}
        inputs = {v.name: tensor_spec(v) for v in proto.graph.input if v.name not in initializers}
    out = named_values(list(inputs.values()))
    for name, bound in table_bounds(proto).items():
        if name in inputs and (name not in out or out[name].kind == "range"):
            out[name] = bound
    return out


def table_bounds(proto: ModelProto) -> dict[str, InputValues]:
    """The range of each integer graph input that indexes a constant table (Note: table bounds)."""
    graph = proto.graph
    tables = constant_shapes(graph)
    scalars = _scalars(graph)
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
    for node in graph.node:
        for k, name in enumerate(node.input):
            if name:
                consumers[name].append((node, k))
    initializers = {t.name for t in graph.initializer}
    out: dict[str, InputValues] = {}
    for value in graph.input:
        if value.name in initializers or value.type.tensor_type.elem_type not in _INTEGER:
            continue
        bound = _bound(value.name, consumers, tables, scalars)
        if bound is not None:
            out[value.name] = bound
    return out


def _bound(name: str, consumers: Mapping[str, list[tuple[onnx.NodeProto, int]]], tables: Mapping[str, tuple[int, ...]],
           scalars: Mapping[str, int]) -> InputValues | None:
    """The values of ``name`` that every table it reaches takes, or ``None`` when it reaches none."""
    low = 0
    high: int | None = None
    todo: list[tuple[str, int]] = [(name, 0)]
    seen: set[tuple[str, int]] = set()
    while todo:
        tensor, offset = todo.pop()
        if (tensor, offset) in seen or len(seen) > 10_000:
            continue
        seen.add((tensor, offset))
        for node, k in consumers.get(tensor, ()):
            rows = _rows(node, k, tables)
            if rows is not None:
                low, high = max(low, -offset), rows - offset if high is None else min(high, rows - offset)
                continue
            step = _follow(node, k, scalars)
            if step is not None and node.output and node.output[0]:
                todo.append((node.output[0], offset + step))
    return InputValues.range(low, high) if high is not None and low < high else None


def _rows(node: onnx.NodeProto, k: int, tables: Mapping[str, tuple[int, ...]]) -> int | None:
    """The rows of the constant table ``node`` gathers from when the tensor is its indices (input ``k``)."""
    if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or k != 1 or node.input[0] not in tables:
        return None
    shape = tables[node.input[0]]
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    axis = axis + len(shape) if axis < 0 else axis
    return shape[axis] if 0 <= axis < len(shape) else None


def _follow(node: onnx.NodeProto, k: int, scalars: Mapping[str, int]) -> int | None:
    """How ``node`` shifts the values of its input ``k`` into its output 0, or ``None`` when they do not go there whole."""
    if node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type in _KEEPS_VALUES and (k == 0 or node.op_type == "Concat"):
        if node.op_type == "Cast":
            to = next((a.i for a in node.attribute if a.name == "to"), 0)
            return 0 if to in _INTEGER else None
        return 0
    if node.op_type in ("Add", "Sub") and len(node.input) == 2:
        other = node.input[1 - k]
        if other not in scalars or (node.op_type == "Sub" and k == 1):
            return None
        return scalars[other] if node.op_type == "Add" else -scalars[other]
    return None


def constant_shapes(graph: onnx.GraphProto) -> dict[str, tuple[int, ...]]:
    """The shapes of the graph's constant tensors (initializers, ``Constant`` outputs) and their other forms (``_TABLE_FORMS``)."""
    shapes = {t.name: tuple(t.dims) for t in graph.initializer}
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Constant":
            value = next((a.t for a in node.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR), None)
            if value is not None:
                shapes[node.output[0]] = tuple(value.dims)
        elif node.op_type in _TABLE_FORMS and node.input and node.input[0] in shapes:
            shapes[node.output[0]] = shapes[node.input[0]]
    return shapes


def _scalars(graph: onnx.GraphProto) -> dict[str, int]:
    """The graph's constant integer tensors of one element, by name, and their values."""
    values: dict[str, int] = {}
    tensors = [(t.name, t) for t in graph.initializer]
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            tensors.extend((node.output[0], a.t) for a in node.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR)
    for name, tensor in tensors:
        if tensor.data_type in _INTEGER and int(np.prod(tensor.dims, dtype=np.int64)) == 1 and tensor.data_location != onnx.TensorProto.EXTERNAL:
            values[name] = int(numpy_helper.to_array(tensor).reshape(-1)[0])
    return values
