"""PipelineSpec: validation messages and the JSON round trip."""

from __future__ import annotations

import json

import pytest

from onnxpipe import ConfigError
from onnxpipe.runtime import SPEC_VERSION, Endpoint, Link, PipelineSpec, StageSpec, TensorSpec

F = "float32"


def _spec(links: list[Link] | None = None, stages: tuple[StageSpec, ...] | None = None) -> PipelineSpec:
    a = StageSpec("a", "a.onnx", (TensorSpec("x", F, ("N", 4)),), (TensorSpec("h", F, ("N", 4)),))
    b = StageSpec("b", "b.onnx", (TensorSpec("h", F, (2, 4)), TensorSpec("x", F, (2, 4))), (TensorSpec("y", F, (2, 4)),))
    default = [
        Link(Endpoint(None, "x"), Endpoint("a", "x")),
        Link(Endpoint("a", "h"), Endpoint("b", "h")),
        Link(Endpoint(None, "x"), Endpoint("b", "x")),
        Link(Endpoint("b", "y"), Endpoint(None, "y")),
    ]
    return PipelineSpec(
        inputs=(TensorSpec("x", F, (2, 4)),),
        outputs=(TensorSpec("y", F, (2, 4)),),
        stages=stages or (a, b),
        links=tuple(default if links is None else links),
    )


def test_valid_spec_round_trips_through_json() -> None:
    spec = _spec()
    spec.validate()
    again = PipelineSpec.from_json(spec.to_json())
    assert again == spec
    data = json.loads(spec.to_json())
    assert data["format"] == "onnxpipe.pipeline" and data["version"] == SPEC_VERSION == 2
    assert data["links"][0] == {"from": {"input": "x"}, "to": {"stage": "a", "tensor": "x"}}


def test_version_1_specs_still_read() -> None:
    """Bundles exported before version 2 (no code stages, no state links) load unchanged."""
    data = json.loads(_spec().to_json())
    data["version"] = 1
    assert PipelineSpec.from_dict(data) == _spec()


def test_symbolic_dims_match_fixed_ones_but_fixed_sizes_must_agree() -> None:
    assert TensorSpec("t", F, ("N", 4)).mismatch(TensorSpec("t", F, (8, 4))) is None
    assert "dim 1: 4 != 5" in (TensorSpec("t", F, (8, 4)).mismatch(TensorSpec("t", F, (8, 5))) or "")
    assert "dtype float32 != int64" in (TensorSpec("t", F).mismatch(TensorSpec("t", "int64")) or "")
    assert "rank 2 != 1" in (TensorSpec("t", F, (1, 2)).mismatch(TensorSpec("t", F, (2,))) or "")


def test_nbytes_uses_given_dims() -> None:
    t = TensorSpec("t", F, ("N", 3, None))
    assert t.nbytes() is None
    assert t.nbytes({"N": 2}, default=5) == 2 * 3 * 5 * 4


@pytest.mark.parametrize(
    ("links", "message"),
    [
        ([Link(Endpoint(None, "x"), Endpoint("a", "x")), Link(Endpoint("a", "h"), Endpoint("b", "h"))], "input 'x' of stage 'b' is not fed"),
        (
            [
                Link(Endpoint(None, "x"), Endpoint("a", "x")),
                Link(Endpoint("a", "h"), Endpoint("b", "h")),
                Link(Endpoint(None, "x"), Endpoint("b", "x")),
                Link(Endpoint("a", "h"), Endpoint("b", "x")),
                Link(Endpoint("b", "y"), Endpoint(None, "y")),
            ],
            r"b\.x is fed twice",
        ),
        (
            [
                Link(Endpoint(None, "x"), Endpoint("a", "x")),
                Link(Endpoint("a", "h"), Endpoint("b", "h")),
                Link(Endpoint(None, "x"), Endpoint("b", "x")),
            ],
            "pipeline output 'y' is not fed",
        ),
        ([Link(Endpoint("a", "nope"), Endpoint("b", "h"))], "stage 'a' has no output 'nope'; valid: 'h'"),
        ([Link(Endpoint("c", "h"), Endpoint("b", "h"))], "no stage 'c'"),
        ([Link(Endpoint(None, "q"), Endpoint("a", "x"))], "unknown pipeline input 'q'"),
    ],
)
def test_wiring_errors_name_the_problem(links: list[Link], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _spec(links).validate()


def test_cycles_and_backward_links_are_refused() -> None:
    a = StageSpec("a", "a.onnx", (TensorSpec("u", F),), (TensorSpec("v", F),))
    b = StageSpec("b", "b.onnx", (TensorSpec("v", F),), (TensorSpec("u", F),))
    cyclic = PipelineSpec((), (), (a, b), (Link(Endpoint("a", "v"), Endpoint("b", "v")), Link(Endpoint("b", "u"), Endpoint("a", "u"))))
    with pytest.raises(ConfigError, match="stages form a cycle: a -> b -> a"):
        cyclic.validate()
    c = StageSpec("c", "c.onnx", (), (TensorSpec("v", F),))
    d = StageSpec("d", "d.onnx", (TensorSpec("v", F),), ())
    backward = PipelineSpec((), (), (d, c), (Link(Endpoint("c", "v"), Endpoint("d", "v")),))
    with pytest.raises(ConfigError, match="goes backwards"):
        backward.validate()


def test_self_link_dtype_mismatch_and_duplicates() -> None:
    s = StageSpec("s", "s.onnx", (TensorSpec("i", F),), (TensorSpec("o", F),))
    with pytest.raises(ConfigError, match="connects stage 's' to itself"):
        PipelineSpec((), (), (s,), (Link(Endpoint("s", "o"), Endpoint("s", "i")),)).validate()
    with pytest.raises(ConfigError, match="dtype int64 != float32"):
        PipelineSpec((TensorSpec("x", "int64"),), (), (s,), (Link(Endpoint(None, "x"), Endpoint("s", "i")),)).validate()
    with pytest.raises(ConfigError, match="duplicate stage 's'"):
        PipelineSpec((), (), (s, s), ()).validate()
    with pytest.raises(ConfigError, match="unknown dtype 'float33'"):
        PipelineSpec((TensorSpec("x", "float33"),), (), (), ()).validate()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not valid JSON"),
        ('{"format": "other"}', "not a pipeline spec"),
        ('{"format": "onnxpipe.pipeline", "version": 99}', "version 99 is not supported; this onnxpipe reads versions 1 and 2"),
        ('{"format": "onnxpipe.pipeline", "version": 1, "inputs": []}', "pipeline spec: 'outputs' is missing"),
        (
            '{"format": "onnxpipe.pipeline", "version": 1, "inputs": [{"name": "x", "dtype": "float32", "shape": [true]}],'
            ' "outputs": [], "stages": [], "links": []}',
            "shape must be a list",
        ),
    ],
)
def test_malformed_json_is_one_config_error(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PipelineSpec.from_json(text)
