"""The gRPC messages are the canonical ones on the wire: every field of onnxpipe's subset has the
name, number, type and label of the same field in the protos tritonclient is generated from
(Triton's grpc_service.proto and model_config.proto), and the checked-in module is what the
.proto generates."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor

from onnxpipe.serve._proto import oip_pb2

PROTO = Path(oip_pb2.__file__).with_name("oip.proto")


def _messages(file: descriptor.FileDescriptor) -> dict[str, descriptor.Descriptor]:
    found: dict[str, descriptor.Descriptor] = {}

    def walk(d: descriptor.Descriptor, prefix: str) -> None:
        found[prefix + d.name] = d
        for nested in d.nested_types:
            walk(nested, prefix + d.name + ".")

    for d in file.message_types_by_name.values():
        walk(d, "")
    return found


def _type(field: descriptor.FieldDescriptor) -> tuple[int, bool, str]:
    """Its wire type, whether repeated, and the name of its message or enum without the package."""
    named = field.message_type or field.enum_type
    return field.type, field.is_repeated, named.full_name[len(named.file.package) + 1 :] if named is not None else ""


def test_every_field_is_the_canonical_field() -> None:
    grpc_service = pytest.importorskip("tritonclient.grpc.service_pb2", reason="the canonical descriptors come with tritonclient[grpc]")
    model_config = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    canonical = {**_messages(model_config.DESCRIPTOR), **_messages(grpc_service.DESCRIPTOR)}
    ours = _messages(oip_pb2.DESCRIPTOR)
    assert len(ours) > 30
    for name, message in ours.items():
        assert name in canonical, f"message {name} is not in the canonical protos"
        theirs = canonical[name].fields_by_name
        for field in message.fields:
            assert field.name in theirs, f"{name}.{field.name} is not a canonical field"
            assert (field.number, *_type(field)) == (theirs[field.name].number, *_type(theirs[field.name])), f"{name}.{field.name}"
        for oneof in message.oneofs:
            assert {f.name for f in oneof.fields} <= {f.name for f in canonical[name].oneofs_by_name[oneof.name].fields}, f"{name}.{oneof.name}"
    for enum in oip_pb2.DESCRIPTOR.enum_types_by_name.values():
        values = {v.name: v.number for v in model_config.DESCRIPTOR.enum_types_by_name[enum.name].values}
        assert {v.name: v.number for v in enum.values} == values, enum.name
    service = oip_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs_service = grpc_service.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for method in service.methods:
        canonical_method = theirs_service.methods_by_name[method.name]
        assert (method.input_type.name, method.output_type.name) == (canonical_method.input_type.name, canonical_method.output_type.name)


def test_the_generated_module_is_current(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="regenerating needs grpcio-tools (the dev extra)")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO.parent}", f"--python_out={tmp_path}", PROTO.name], check=True, cwd=PROTO.parent)
    # Compare the file descriptors the modules register (their text also names the protoc version).
    fresh = (tmp_path / "oip_pb2.py").read_text().split("AddSerializedFile(", 1)[1].split(")\n", 1)[0]
    assert ast.literal_eval(fresh) == oip_pb2.DESCRIPTOR.serialized_pb, "oip_pb2.py is stale: run `make protos` and commit it"
