"""The wire scan of stage modules: it must see every tensor a module holds, wherever ONNX lets one live.

The scanner's table of fields to follow is checked against onnx's own protobuf descriptors (the
runtime itself never imports onnx), and a module with a tensor in every such place is scanned.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from onnxpipe import BundleError
from onnxpipe.runtime._protoscan import _CHILDREN, _MAX_DEPTH, _length_field, external_locations

# onnx message -> the scanner's name for it
KINDS = {
    "onnx.ModelProto": "model",
    "onnx.TrainingInfoProto": "training",
    "onnx.GraphProto": "graph",
    "onnx.FunctionProto": "function",
    "onnx.NodeProto": "node",
    "onnx.AttributeProto": "attribute",
    "onnx.SparseTensorProto": "sparse",
    "onnx.TensorProto": "tensor",
    "onnx.StringStringEntryProto": "entry",
}


def _reachable(root: Descriptor) -> dict[str, Descriptor]:
    seen: dict[str, Descriptor] = {}
    todo = [root]
    while todo:
        message = todo.pop()
        if message.full_name not in seen:
            seen[message.full_name] = message
            todo += [f.message_type for f in message.fields if f.message_type is not None]
    return seen


def _tensor_paths() -> dict[str, dict[int, str]]:
    """message -> {field number: field's message} for every field of a message reachable from ModelProto
    through which a TensorProto can be reached, transitively (TensorProto's own fields excluded)."""
    messages = _reachable(onnx.ModelProto.DESCRIPTOR)
    holders = {onnx.TensorProto.DESCRIPTOR.full_name}
    while True:  # fixed point: a message holds a tensor when one of its message fields does
        more = {name for name, m in messages.items() if any(f.message_type is not None and f.message_type.full_name in holders for f in m.fields)}
        if more <= holders:
            break
        holders |= more
    table: dict[str, dict[int, str]] = {}
    for name, m in messages.items():
        if name in holders and name != onnx.TensorProto.DESCRIPTOR.full_name:
            fields = [f for f in m.fields if f.message_type is not None and f.message_type.full_name in holders]
            table[KINDS.get(name, name)] = {f.number: KINDS.get(f.message_type.full_name, f.message_type.full_name) for f in fields}
    return table


def test_the_scanner_follows_every_field_that_can_hold_a_tensor() -> None:
    want = _tensor_paths()
    assert "function" in want and want["function"][11] == "attribute"  # attribute defaults: issue 11
    external = onnx.TensorProto.DESCRIPTOR.fields_by_name["external_data"]
    want["tensor"] = {external.number: KINDS[external.message_type.full_name]}
    want["entry"] = {}
    assert _CHILDREN == want


def _tensor(location: str) -> onnx.TensorProto:
    t = onnx.TensorProto(name=location, data_type=onnx.TensorProto.FLOAT, dims=[1], data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", "0"), ("length", "4")):
        t.external_data.add(key=key, value=value)
    return t


def _sparse(prefix: str) -> onnx.SparseTensorProto:
    return onnx.SparseTensorProto(values=_tensor(f"{prefix}.values"), indices=_tensor(f"{prefix}.indices"), dims=[4])


def _attributes(prefix: str, depth: int) -> list[onnx.AttributeProto]:
    """An attribute of every kind that holds tensors, with subgraphs nested ``depth`` levels further."""
    attrs = [
        onnx.AttributeProto(name="t", type=onnx.AttributeProto.TENSOR, t=_tensor(f"{prefix}.t")),
        onnx.AttributeProto(name="ts", type=onnx.AttributeProto.TENSORS, tensors=[_tensor(f"{prefix}.ts0"), _tensor(f"{prefix}.ts1")]),
        onnx.AttributeProto(name="s", type=onnx.AttributeProto.SPARSE_TENSOR, sparse_tensor=_sparse(f"{prefix}.s")),
        onnx.AttributeProto(name="ss", type=onnx.AttributeProto.SPARSE_TENSORS, sparse_tensors=[_sparse(f"{prefix}.ss")]),
    ]
    if depth:
        attrs.append(onnx.AttributeProto(name="g", type=onnx.AttributeProto.GRAPH, g=_graph(f"{prefix}.g", depth - 1)))
        attrs.append(onnx.AttributeProto(name="gs", type=onnx.AttributeProto.GRAPHS, graphs=[_graph(f"{prefix}.gs", depth - 1)]))
    return attrs


def _graph(prefix: str, depth: int) -> onnx.GraphProto:
    node = onnx.NodeProto(op_type="Op", attribute=_attributes(f"{prefix}.node", depth))
    return onnx.GraphProto(name=prefix, node=[node], initializer=[_tensor(f"{prefix}.init")], sparse_initializer=[_sparse(f"{prefix}.sparse")])


def _every_place(depth: int) -> onnx.ModelProto:
    function = onnx.FunctionProto(
        name="f", domain="local", node=[onnx.NodeProto(op_type="Op", attribute=_attributes("f.node", depth))], attribute_proto=_attributes("f.default", depth)
    )
    training = onnx.TrainingInfoProto(initialization=_graph("train.init", depth), algorithm=_graph("train.algo", depth))
    return onnx.ModelProto(ir_version=10, graph=_graph("main", depth), functions=[function], training_info=[training])


def _locations(message: Message) -> list[str]:
    """Every external-data location in a parsed message, in field-number order, as onnx's own protobuf sees it."""
    found = []
    for field, value in message.ListFields():
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        for item in [value] if isinstance(value, Message) else value:
            if isinstance(item, onnx.StringStringEntryProto):
                found += [item.value] if item.key == "location" else []
            else:
                found += _locations(item)
    return found


def test_every_tensor_of_a_module_is_found_at_any_depth(tmp_path: Path) -> None:
    model = _every_place(depth=3)
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    want = _locations(model)
    assert len(want) == len(set(want)) > 300
    assert "f.default.t" in want and "f.default.g.node.gs.node.s.values" in want and "train.algo.init" in want
    assert external_locations(path) == want


def test_nesting_beyond_the_limit_is_refused(tmp_path: Path) -> None:
    # Written on the wire by hand: onnx's protobuf refuses to build a message this deep itself.
    graph = b""
    for _ in range(_MAX_DEPTH // 3 + 1):  # graph -> node -> attribute -> graph: three levels each
        graph = _length_field(1, _length_field(5, _length_field(6, graph)))
    path = tmp_path / "deep.onnx"
    path.write_bytes(_length_field(7, graph))
    with pytest.raises(BundleError, match=f"module 'deep.onnx' is not a valid ONNX file: messages nested deeper than {_MAX_DEPTH}"):
        external_locations(path, "deep.onnx")
