"""A code stage's ``bytes`` port (Note: raw bytes in onnxpipe/runtime/_dtypes.py): an encoded image
goes in as the bytes it is and is decoded by the code stage, as in Triton's usual ensemble front."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from onnxpipe import ConfigError, InputError
from onnxpipe.builder import PipelineConfig
from onnxpipe.runtime import Pipeline, StageSpec, TensorSpec, load
from tests import code_stages, models

ALLOW = ["tests.code_stages:*"]


def _pixels(seed: int, height: int = 5, width: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def decoded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.bundle_of(code_stages.decoded(), tmp_path_factory.mktemp("decoded"))


@pytest.fixture(scope="module")
def pipe(decoded: Path) -> Pipeline:
    with load(decoded, allow_code=ALLOW) as p:
        yield p


def test_a_png_goes_in_as_bytes_and_is_decoded_by_the_code_stage(pipe: Pipeline) -> None:
    for seed, (h, w) in enumerate([(5, 7), (1, 1), (32, 3)]):
        pixels = _pixels(seed, h, w)
        image = code_stages.png(pixels)
        assert image[0] == 0x89  # not UTF-8: a string port could not take it
        out = pipe({"image": np.array([image], dtype=object)})
        np.testing.assert_allclose(out["mean"], pixels.reshape(-1, 3).mean(axis=0), rtol=1e-6)
        assert out["signature"].dtype == object and out["signature"].tolist() == [image[:8]]


def test_bytes_ending_in_zero_bytes_arrive_whole(pipe: Pipeline) -> None:
    # A PNG's last chunk (IEND's CRC) may end in zero bytes; numpy's own bytes arrays would drop them,
    # so they are refused, and an object array carries them as they are.
    image = code_stages.png(_pixels(3)) + b"\x00\x00"
    assert pipe({"image": np.array([image], dtype=object)})["size"].tolist() == [len(image)]
    with pytest.raises(InputError, match=r"input 'image' has dtype \|S\d+; expected bytes .*numpy's own bytes arrays drop trailing zero bytes"):
        pipe({"image": np.array([image])})


def test_text_for_a_bytes_port_is_refused_naming_the_element(pipe: Pipeline) -> None:
    image = code_stages.png(_pixels(0))
    with pytest.raises(InputError, match=r"input 'image' is bytes, but element 0 is str; encode it \(str.encode\) or declare the port 'string'"):
        pipe({"image": np.array(["not bytes"], dtype=object)})
    with pytest.raises(InputError, match="expected bytes"):
        pipe({"image": np.array([1.0])})
    assert pipe({"image": np.array([image], dtype=object)})["mean"].shape == (3,)  # nothing was lost


def test_the_drop_in_session_reports_a_bytes_input_as_a_string_tensor(pipe: Pipeline) -> None:
    (image,) = pipe.get_inputs()
    assert (image.name, image.type, image.shape) == ("image", "tensor(string)", [1])
    pixels = _pixels(4)
    mean, signature, _ = pipe.run(None, {"image": np.array([code_stages.png(pixels)], dtype=object)})
    np.testing.assert_allclose(mean, pixels.reshape(-1, 3).mean(axis=0), rtol=1e-6)
    assert signature[0] == b"\x89PNG\r\n\x1a\n"


def test_only_code_stages_ports_may_be_bytes() -> None:
    spec = StageSpec("head", "head.onnx", [TensorSpec("x", "bytes", (1,))], [TensorSpec("y", "float32", (1,))])
    with pytest.raises(ConfigError, match=r"stage 'head': tensor 'x' is bytes, which only code stages' ports may be \(raw bytes; ONNX's text tensors are"):
        spec.check()


def test_a_bytes_output_cannot_feed_an_onnx_string_input() -> None:
    import onnx

    text = onnx.parser.parse_model(
        """<ir_version: 8, opset_import: ["" : 18]>
        upper (string[1] s) => (string[1] t) { t = StringNormalizer <case_change_action = "UPPER"> (s) }"""
    )
    cfg = PipelineConfig("mismatch")
    decode = cfg.add_python_stage(
        "tests.code_stages:decode_png",
        inputs=[TensorSpec("image", "bytes", (1,))],
        outputs=[TensorSpec("pixels", "uint8", ("H", "W", 3)), TensorSpec("signature", "bytes", (1,)), TensorSpec("size", "int64", (1,))],
        name="decode",
    )
    upper = cfg.add_stage(text, "upper")
    with pytest.raises(ConfigError, match="dtype bytes != string"):
        decode.output("signature").connect(upper.input("s"))
