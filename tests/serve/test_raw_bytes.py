"""A code stage's ``bytes`` port served (Note: raw bytes in onnxpipe/runtime/_dtypes.py): a PNG sent
as BYTES by Triton's clients reaches the code stage that decodes it as the bytes it is, over HTTP's
binary tensor data and gRPC, and raw bytes come back; JSON, which carries text, gives such a port
the text's UTF-8 and refuses raw bytes it cannot carry."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from onnxpipe.runtime import TensorSpec
from onnxpipe.serve._errors import RequestError
from onnxpipe.serve._tensors import from_binary, from_contents, from_json, port_of, to_binary, to_json
from tests import code_stages, models
from tests.serve.process import ServerProcess

pytestmark = pytest.mark.xdist_group("raw-bytes")  # one worker: its server starts once (its tests take under a second)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("raw-bytes")
    bundle = models.bundle_of(code_stages.decoded(), root / "decoded")
    with ServerProcess(f"decoded={bundle}", "--allow-code", "tests.code_stages:*") as proc:
        proc.start(root / "serve.log")
        yield proc


def _image(seed: int) -> tuple[np.ndarray, bytes]:
    pixels = np.random.default_rng(seed).integers(0, 256, (6, 9, 3), dtype=np.uint8)
    return pixels, code_stages.png(pixels)


def test_a_png_over_http_binary_data_is_decoded_by_the_code_stage(served: ServerProcess) -> None:
    client = httpclient.InferenceServerClient(served.http)
    for seed in range(3):
        pixels, image = _image(seed)
        tensor = httpclient.InferInput("image", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([image], dtype=object), binary_data=True)
        wanted = [httpclient.InferRequestedOutput(n, binary_data=True) for n in ("mean", "signature", "size")]
        result = client.infer("decoded", [tensor], outputs=wanted)
        np.testing.assert_allclose(result.as_numpy("mean"), pixels.reshape(-1, 3).mean(axis=0), rtol=1e-6)
        assert result.as_numpy("signature").tolist() == [b"\x89PNG\r\n\x1a\n"]
        assert result.as_numpy("size").tolist() == [len(image)]


def test_a_png_over_grpc_is_decoded_by_the_code_stage(served: ServerProcess) -> None:
    client = grpcclient.InferenceServerClient(served.grpc)
    pixels, image = _image(5)
    image += b"\x00\x00\x00"  # trailing zero bytes arrive too
    tensor = grpcclient.InferInput("image", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([image], dtype=object))
    result = client.infer("decoded", [tensor])
    np.testing.assert_allclose(result.as_numpy("mean"), pixels.reshape(-1, 3).mean(axis=0), rtol=1e-6)
    assert result.as_numpy("signature").tolist() == [b"\x89PNG\r\n\x1a\n"]
    assert result.as_numpy("size").tolist() == [len(image)]


def test_the_model_reports_a_bytes_port_as_bytes(served: ServerProcess) -> None:
    client = httpclient.InferenceServerClient(served.http)
    meta = client.get_model_metadata("decoded")
    assert meta["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": [1]}]
    config = client.get_model_config("decoded")
    assert {k: config["input"][0][k] for k in ("name", "data_type", "dims")} == {"name": "image", "data_type": "TYPE_STRING", "dims": [1]}


def test_raw_bytes_asked_for_as_json_are_a_400_never_replaced(served: ServerProcess) -> None:
    client = httpclient.InferenceServerClient(served.http)
    _, image = _image(1)
    tensor = httpclient.InferInput("image", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([image], dtype=object), binary_data=True)
    with pytest.raises(InferenceServerException, match=r"output 'signature': BYTES element 0 is not UTF-8 text, which JSON cannot carry; ask for it as binary"):
        client.infer("decoded", [tensor], outputs=[httpclient.InferRequestedOutput("signature", binary_data=False)])
    result = client.infer("decoded", [tensor], outputs=[httpclient.InferRequestedOutput("size", binary_data=False)])
    assert result.as_numpy("size").tolist() == [len(image)]  # the same request, asking for what JSON can carry


def test_a_json_string_reaches_a_bytes_port_as_its_utf8(served: ServerProcess) -> None:
    # decode_png refuses what is not a PNG: the stage saw the text's bytes, and said so (a 500 naming the stage).
    body = json.dumps({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": ["café"]}]}).encode()
    status, answer = served.request("POST", "/v2/models/decoded/infer", body, {"Content-Type": "application/json"})
    assert status == 500 and "stage 'decode'" in json.loads(answer)["error"] and "not a PNG" in json.loads(answer)["error"]


def test_the_wire_decoders_give_a_bytes_port_bytes_and_a_string_port_text() -> None:
    raw = port_of(TensorSpec("image", "bytes", (2,)), "input")
    text = port_of(TensorSpec("prefix", "string", (2,)), "input")
    wire = to_binary(raw, np.array([b"\x89\xff", "é".encode()], dtype=object))
    assert from_binary(raw, (2,), memoryview(wire)).tolist() == [b"\x89\xff", "é".encode()]
    with pytest.raises(RequestError, match=r"input 'prefix': BYTES element 0 is not UTF-8 text"):
        from_binary(text, (2,), memoryview(wire))
    assert from_json(raw, (2,), ["é", ""]).tolist() == ["é".encode(), b""]
    assert from_json(text, (2,), ["é", ""]).tolist() == ["é", ""]

    contents = grpcclient.service_pb2.InferTensorContents(bytes_contents=[b"\x00\x89", b"ok"])
    assert from_contents(raw, (2,), contents).tolist() == [b"\x00\x89", b"ok"]
    assert to_json(raw, np.array([b"ok", b""], dtype=object)) == ["ok", ""]
    with pytest.raises(RequestError, match=r"output 'image': BYTES element 1 is not UTF-8 text"):
        to_json(raw, np.array([b"ok", b"\xff"], dtype=object))
