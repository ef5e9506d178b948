"""onnxruntime's words said short (issue 39, item 7; onnxpipe/_errors.py, Note: onnxruntime's words,
said short): the strings are made here by real sessions of the onnxruntime installed, and the same
wording reaches the CLI's one-line errors of run, verify, bench and export."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxpipe._errors import ort_message
from tests.cli.helpers import assert_user_error, ok, run

NOISE = ("[ONNXRuntimeError]", "Status Message", "Non-zero status code", "_nchwc", "onnxruntime_src", "Please fix")
CHANNELS = "Input channels C is not equal to kernel channels * group. C: 5 kernel channels: 3 group: 1"


def _conv(then: str = "Abs") -> onnx.ModelProto:
    """A torch-named ``x[N, C, H, W] -Conv(3 channels)-> -then-> -Sigmoid-> y``: onnxruntime runs the
    Conv as an NCHWc node named after its output (fused with a Relu ``then``, the Relu's)."""
    weight = numpy_helper.from_array(np.random.default_rng(0).random((4, 3, 3, 3)).astype(np.float32), "W")
    nodes = [helper.make_node("Conv", ["x", "W"], ["/conv/Conv_output_0"], name="/conv/Conv", pads=[1, 1, 1, 1]),
             helper.make_node(then, ["/conv/Conv_output_0"], [f"/act/{then}_output_0"], name=f"/act/{then}"),
             helper.make_node("Sigmoid", [f"/act/{then}_output_0"], ["y"], name="/out/Sigmoid")]
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "C", "H", "W"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _raised(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> Exception:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    with pytest.raises(Exception) as e:  # onnxruntime's own types
        session.run(None, dict(feeds))
    return e.value


def _parsed(text: str) -> onnx.ModelProto:
    return onnx.parser.parse_model('<ir_version: 8, opset_import: ["" : 17]>\n' + text)


@pytest.mark.parametrize(("then", "node"), [("Abs", "Conv node '/conv/Conv'"), ("Relu", "Conv node making '/act/Relu_output_0'")])
def test_a_conv_refusing_its_channels_names_the_node_as_the_model_does(then: str, node: str) -> None:
    error = _raised(_conv(then), {"x": np.zeros((1, 5, 8, 8), np.float32)})
    assert "_nchwc' Status Message:" in str(error)  # what onnxruntime says
    assert ort_message(error) == f"{node}: {CHANNELS}"


def test_source_and_the_check_that_failed_are_cut() -> None:
    reshape = helper.make_model(helper.make_graph(
        [helper.make_node("Reshape", ["x", "s"], ["y"], name="/model/Reshape")], "r", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(np.array([3, 4], np.int64), "s")]),
        opset_imports=[helper.make_opsetid("", 17)])
    error = _raised(reshape, {"x": np.zeros(5, np.float32)})
    assert "reshape_helper.h:" in str(error) and "was false" in str(error)
    assert ort_message(error) == ("Reshape node '/model/Reshape': The input tensor cannot be reshaped to the requested shape. "
                                  "Input shape:{5}, requested shape:{3,4}")


def test_an_unnamed_node_and_a_bare_function_name() -> None:
    matmul = _parsed("m (float[N,K] a, float[K2,M] b) => (float[N,M] y) { y = MatMul(a, b) }")
    error = _raised(matmul, {"a": np.zeros((2, 3), np.float32), "b": np.zeros((4, 2), np.float32)})
    assert ort_message(error) == "MatMul node: MatMul dimension mismatch"


def test_a_refused_input_keeps_every_line_but_the_advice() -> None:
    error = _raised(_parsed("i (float[1,4] x) => (float[1,4] y) { y = Relu(x) }"), {"x": np.zeros((2, 4), np.float32)})
    assert "INVALID_ARGUMENT" in str(error) and "\n" in str(error)
    assert ort_message(error) == "Got invalid dimensions for input: x for the following indices index: 0 Got: 2 Expected: 1"


def test_an_invalid_model_and_other_errors() -> None:
    with pytest.raises(Exception) as e:  # onnxruntime's InvalidProtobuf
        ort.InferenceSession(b"not a model", providers=["CPUExecutionProvider"])
    assert ort_message(e.value) == "Failed to load model because protobuf parsing failed."
    assert ort_message(ValueError("a stage's own words\nkept")) == "a stage's own words\nkept"


# -- the CLI ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def conv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``conv.onnx`` (:func:`_conv`, ``C`` symbolic so that nothing but onnxruntime refuses 5
    channels), split after its Conv, built, exported as ``b.onnxpipe``; ``x.npz`` has 5 channels."""
    folder = tmp_path_factory.mktemp("conv")
    onnx.save(_conv(), folder / "conv.onnx")
    ok("split", folder / "conv.onnx", "-o", folder / "split", "--at", "/act/Abs_output_0")
    ok("build", folder / "split", "-o", folder / "built")
    ok("export", folder / "built", "-o", folder / "b.onnxpipe")
    np.savez(folder / "x.npz", x=np.zeros((1, 5, 8, 8), np.float32))
    return folder


@pytest.mark.parametrize(("command", "said"), [
    (["verify", "{f}/split", "--model", "{f}/conv.onnx", "--dim", "C=5", "--dim", "N=1", "--dim", "H=8", "--dim", "W=8"],
     "error: the whole model fails on input set 0 (x[1, 5, 8, 8]): Conv node '/conv/Conv': " + CHANNELS),
    (["run", "{f}/b.onnxpipe", "--inputs", "{f}/x.npz", "--outputs", "{f}/y.npz"],
     "error: inputs file '{f}/x.npz': stage 'stage0' failed on request 0: Conv node '/conv/Conv': " + CHANNELS + "; no output file was written"),
    (["bench", "{f}/b.onnxpipe", "--inputs", "{f}/x.npz"], "error: stage 'stage0' failed on request 0: Conv node '/conv/Conv': " + CHANNELS),
    (["export", "{f}/built", "-o", "{f}/c.onnxpipe", "--reference", "1", "--dim", "C=5", "--dim", "N=1", "--dim", "H=8", "--dim", "W=8"],
     "error: stage 'stage0' failed: Conv node '/conv/Conv': " + CHANNELS),
], ids=["verify", "run", "bench", "export"])
def test_the_cli_says_onnxruntimes_refusal_in_one_short_line(conv: Path, command: list[str], said: str, capfd: pytest.CaptureFixture[str]) -> None:
    result = run(*(part.format(f=conv) for part in command))
    assert_user_error(result)
    assert result.stderr.strip() == said.format(f=conv)
    assert not any(noise in result.output for noise in NOISE)
    assert not capfd.readouterr().err  # nor a line of onnxruntime's own log
