"""Tiny code-stage functions for the tests (importable as ``tests.code_stages``).

Each is ``fn(inputs, params) -> dict of arrays``, the signature a code stage names. The pipeline
they are used in (:func:`config`) is ``x -> head (ONNX: h = relu(x), g = -x) -> combine (code: y =
h * factor + g)``; ``misbehave`` breaks its contract on purpose when ``x[0, 0]`` asks it to.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

NOT_CALLABLE = 3
#: What ``misbehave`` does for ``x[0, 0]`` = the key (anything else: the right answer).
MISCHIEF = {101.0: "float64", 102.0: "rank", 103.0: "missing", 104.0: "extra", 105.0: "not a dict", 106.0: "raises", 107.0: "fixed dim"}


def combine(inputs: dict[str, np.ndarray], params: dict[str, Any]) -> dict[str, np.ndarray]:
    """y = h * factor + g."""
    return {"y": inputs["h"] * np.float32(params.get("factor", 1.0)) + inputs["g"]}


def positive_rows(inputs: dict[str, np.ndarray], params: dict[str, Any]) -> dict[str, np.ndarray]:
    """The rows of x whose sum is > 0 (K x 4, K varies per request) and their count."""
    x = inputs["x"]
    rows = x[x.sum(axis=1) > 0]
    return {"rows": rows, "count": np.array([len(rows)], np.int64)}


def misbehave(inputs: dict[str, np.ndarray], params: dict[str, Any]) -> Any:
    """Like :func:`combine`, but breaks the contract as ``MISCHIEF[x[0, 0]]`` says (h = relu(x) carries x[0, 0])."""
    y = combine(inputs, params)["y"]
    mode = MISCHIEF.get(float(inputs["h"][0, 0]))
    if mode == "float64":
        return {"y": y.astype(np.float64)}
    if mode == "rank":
        return {"y": y.reshape(-1)}
    if mode == "missing":
        return {}
    if mode == "extra":
        return {"y": y, "z": y}
    if mode == "not a dict":
        return [y]
    if mode == "raises":
        raise ValueError("misbehave was asked to raise")
    if mode == "fixed dim":
        return {"y": np.zeros((y.shape[0], 5), np.float32)}
    return {"y": y}


class Holder:
    """A callable found by a dotted qualname (``tests.code_stages:Holder.double``)."""

    @staticmethod
    def double(inputs: dict[str, np.ndarray], params: dict[str, Any]) -> dict[str, np.ndarray]:
        return {"y": (inputs["h"] + inputs["g"]) * 2}


class Scaled:
    """A callable object: ``tests.code_stages:doubled`` names an instance of a class this module defines."""

    def __init__(self, factor: float) -> None:
        self.factor = np.float32(factor)

    def __call__(self, inputs: dict[str, np.ndarray], params: dict[str, Any]) -> dict[str, np.ndarray]:
        return {"y": (inputs["h"] + inputs["g"]) * self.factor}


doubled = Scaled(2)

#: Set to let :func:`gated` return; cleared by whoever closes it.
GATE = threading.Event()


def gated(inputs: dict[str, np.ndarray], params: dict[str, Any]) -> dict[str, np.ndarray]:
    """y = x, once :data:`GATE` is set (a request that cannot finish before the test says so)."""
    if not GATE.wait(30):
        raise TimeoutError("tests.code_stages.GATE was never set")
    return {"y": inputs["x"]}


def matmul_when_file(inputs: dict[str, np.ndarray], params: dict[str, Any]) -> dict[str, np.ndarray]:
    """y = x @ w @ w with w = 1/size everywhere (:func:`tests.models.slow_stage`), once the file
    ``params["path"]`` exists: a gate that also works in another process (a Ray actor). With
    ``params["entered"]``, each run first appends a byte to that file: its size counts the runs begun."""
    import os
    import time

    if "entered" in params:
        with open(params["entered"], "ab") as f:
            f.write(b".")
    deadline = time.monotonic() + 60
    while not os.path.exists(params["path"]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{params['path']} never appeared")
        time.sleep(0.01)
    x = inputs["x"]
    w = np.full((x.shape[1], x.shape[1]), 1.0 / x.shape[1], np.float32)
    return {"y": x @ w @ w}


def remember(inputs: dict[str, np.ndarray], params: dict[str, Any]) -> dict[str, np.ndarray]:
    """y = h * len(seen) after appending to the list param ``seen`` (and changing ``factor``): what a
    library that changes what it is given does; the stage must see the bundle's params every time."""
    params["seen"].append(len(params["seen"]))
    params["factor"] = -1.0
    return {"y": inputs["h"] * np.float32(len(params["seen"])) + inputs["g"]}


def config(entry: str = "tests.code_stages:combine", factor: float = 2.0, params: dict[str, Any] | None = None) -> Any:
    """``x -> head (ONNX) -> combine (code, entry) -> y``, as a PipelineConfig (params: ``{"factor": factor}`` unless given)."""
    from onnxpipe.builder import PipelineConfig
    from onnxpipe.runtime import TensorSpec
    from tests.models import stage_head

    cfg = PipelineConfig("coded")
    head = cfg.add_stage(stage_head(), "head")
    code = cfg.add_python_stage(
        entry,
        inputs=[TensorSpec("h", "float32", ("N", 4)), TensorSpec("g", "float32", ("N", 4))],
        outputs=[TensorSpec("y", "float32", ("N", 4))],
        params=params if params is not None else {"factor": factor},
        name="combine",
    )
    cfg.input("x").connect(head.input("x"))
    head.output("h").connect(code.input("h"))
    head.output("g").connect(code.input("g"))
    code.output("y").connect(cfg.output("y"))
    return cfg


def add_rows(cfg: Any) -> Any:
    """Add :func:`positive_rows` to ``cfg`` as stage ``rows`` (x[N, 4] -> rows[K, 4], count[1]), fed ``x``."""
    from onnxpipe.runtime import TensorSpec

    rows = cfg.add_python_stage(
        "tests.code_stages:positive_rows",
        inputs=[TensorSpec("x", "float32", ("N", 4))],
        outputs=[TensorSpec("rows", "float32", ("K", 4)), TensorSpec("count", "int64", (1,))],
        name="rows",
    )
    cfg.input("x").connect(rows.input("x"))
    return rows


def expected(x: np.ndarray, factor: float = 2.0) -> np.ndarray:
    """What :func:`config`'s pipeline computes."""
    return np.maximum(x, 0) * np.float32(factor) - x


def label(inputs: dict[str, np.ndarray], params: dict[str, Any]) -> dict[str, np.ndarray]:
    """Text in, text out: ``label[n] = prefix[n] + sep + argmax(y[n])`` and ``score[n] = max(y[n])``."""
    y, prefix = inputs["y"], inputs["prefix"]
    sep = params.get("sep", ":")
    labels = np.array([f"{p}{sep}{int(i)}" for p, i in zip(prefix.reshape(-1), y.argmax(axis=1), strict=True)], dtype=object)
    return {"label": labels, "score": y.max(axis=1)}


def labelled() -> Any:
    """``x[N, 4], prefix[N] (string) -> head (ONNX: h = relu(x)) -> label (code) -> label[N] (string), score[N]``."""
    from onnxpipe.builder import PipelineConfig
    from onnxpipe.runtime import TensorSpec
    from tests.models import stage_head

    cfg = PipelineConfig("labelled")
    head = cfg.add_stage(stage_head(), "head")
    code = cfg.add_python_stage(
        "tests.code_stages:label",
        inputs=[TensorSpec("y", "float32", ("N", 4)), TensorSpec("prefix", "string", ("N",))],
        outputs=[TensorSpec("label", "string", ("N",)), TensorSpec("score", "float32", ("N",))],
        params={"sep": ":"},
        name="label",
    )
    cfg.add_input(TensorSpec("prefix", "string", ("N",)))
    cfg.input("x").connect(head.input("x"))
    head.output("h").connect(code.input("y"))
    cfg.input("prefix").connect(code.input("prefix"))
    code.output("label").connect(cfg.output("label"))
    code.output("score").connect(cfg.output("score"))
    return cfg


def png(pixels: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of ``pixels`` (H x W x 3 uint8), unfiltered: a real encoded image, written
    with the standard library only (its signature's 0x89 is not UTF-8)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    height, width, _ = pixels.shape
    rows = b"".join(b"\x00" + pixels[y].tobytes() for y in range(height))  # filter type 0 on every row
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def decode_png(inputs: dict[str, np.ndarray], params: dict[str, Any]) -> dict[str, np.ndarray]:
    """``image[1]`` (bytes: a PNG as :func:`png` writes it) -> ``pixels[H, W, 3]`` (uint8), the
    file's ``signature[1]`` (its first 8 bytes, raw, to travel back as BYTES) and its ``size[1]``."""
    import struct
    import zlib

    data = inputs["image"][0]
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    width, height = struct.unpack(">II", data[16:24])
    at, idat = 8, b""
    while data[at + 4 : at + 8] != b"IEND":
        (length,) = struct.unpack(">I", data[at : at + 4])
        if data[at + 4 : at + 8] == b"IDAT":
            idat += data[at + 8 : at + 8 + length]
        at += 12 + length
    rows = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, 1 + width * 3)
    signature = np.array([data[:8]], dtype=object)
    return {"pixels": rows[:, 1:].reshape(height, width, 3).copy(), "signature": signature, "size": np.array([len(data)], np.int64)}


def decoded() -> Any:
    """``image[1] (bytes) -> decode (code: decode_png) -> pixels -> mean (ONNX: per-channel mean of the
    pixels as float) -> mean[3]``, and the PNG's ``signature[1]`` (bytes) and ``size[1]`` out: Triton's ensemble front."""
    import onnx

    from onnxpipe.builder import PipelineConfig
    from onnxpipe.runtime import TensorSpec

    model = onnx.parser.parse_model(
        """<ir_version: 8, opset_import: ["" : 18]>
        mean (uint8[H, W, 3] pixels) => (float[3] mean) {
            f = Cast <to = 1> (pixels)
            axes = Constant <value = int64[2] {0, 1}> ()
            mean = ReduceMean <keepdims = 0> (f, axes)
        }"""
    )
    cfg = PipelineConfig("decoded")
    decode = cfg.add_python_stage(
        "tests.code_stages:decode_png",
        inputs=[TensorSpec("image", "bytes", (1,))],
        outputs=[TensorSpec("pixels", "uint8", ("H", "W", 3)), TensorSpec("signature", "bytes", (1,)), TensorSpec("size", "int64", (1,))],
        name="decode",
    )
    mean = cfg.add_stage(model, "mean")
    cfg.input("image").connect(decode.input("image"))
    decode.output("pixels").connect(mean.input("pixels"))
    mean.output("mean").connect(cfg.output("mean"))
    decode.output("signature").connect(cfg.output("signature"))
    decode.output("size").connect(cfg.output("size"))
    return cfg
