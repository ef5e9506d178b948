"""Dynamic dims without a name: declared ``-1`` (PaddlePaddle) or with neither value nor name.

The runtime reads a negative dim as ``None`` wherever a spec is made (also from an older
pipeline.json), so no check, sample input or byte count takes it for a fixed size; sample inputs
size such a dim by input and axis (``x.0``).
"""

from __future__ import annotations

import numpy as np
import pytest

from onnxpipe import InputError
from onnxpipe.runtime import PipelineSpec, TensorSpec, check_inputs, random_inputs, sample_shapes

F = "float32"


def test_a_negative_dim_is_read_as_dynamic() -> None:
    spec = TensorSpec("x", F, (-1, 3, None, "N"))
    assert spec.shape == (None, 3, None, "N")
    assert spec.mismatch(TensorSpec("x", F, (5, 3, 7, 2))) is None and TensorSpec("x", F, (5, 3, 7, 2)).mismatch(spec) is None
    assert spec.nbytes({"N": 2}, default=1) == 4 * 3 * 2 and spec.nbytes() is None
    assert "dim 1: 3 != 4" in (spec.mismatch(TensorSpec("x", F, (-1, 4, 1, 1))) or "")


def test_an_older_pipeline_json_with_minus_one_reads_as_dynamic() -> None:
    data = {
        "format": "onnxpipe.pipeline",
        "version": 1,
        "inputs": [{"name": "x", "dtype": F, "shape": [-1, 3]}],
        "outputs": [{"name": "y", "dtype": F, "shape": [-1]}],
        "stages": [{"name": "s", "module": "s.onnx", "inputs": [{"name": "x", "dtype": F, "shape": [-1, 3]}], "outputs": [{"name": "y", "dtype": F}]}],
        "links": [{"from": {"input": "x"}, "to": {"stage": "s", "tensor": "x"}}, {"from": {"stage": "s", "tensor": "y"}, "to": {"output": "y"}}],
    }
    spec = PipelineSpec.from_dict(data)
    spec.validate()
    assert spec.inputs[0].shape == (None, 3) and spec.outputs[0].shape == (None,)
    arrays = check_inputs(spec.inputs, {"x": np.zeros((7, 3), np.float32)})
    assert arrays["x"].shape == (7, 3)


def test_check_inputs_takes_any_size_for_a_dynamic_dim_and_still_checks_fixed_ones() -> None:
    specs = [TensorSpec("x", F, (-1, 3, None, None))]
    check_inputs(specs, {"x": np.zeros((1, 3, 48, 192), np.float32)})
    with pytest.raises(InputError, match=r"input 'x' has shape \[1, 4, 48, 192\]; expected \[\?, 3, \?, \?\] \(dim 1 must be 3\)"):
        check_inputs(specs, {"x": np.zeros((1, 4, 48, 192), np.float32)})


def test_sample_inputs_size_a_dim_without_a_name_by_input_and_axis() -> None:
    specs = [TensorSpec("x", F, (-1, 3, None, None)), TensorSpec("input.1", F, ("N", None))]
    feeds, notes = random_inputs(specs, {"x.0": 2, "x.3": 5, "N": 4, "input.1.1": 6})
    assert feeds["x"].shape == (2, 3, 1, 5) and feeds["input.1"].shape == (4, 6)
    assert notes == ["input 'x': dim x.2 not given, using 1 (a dim without a name goes by input and axis: --dim x.0=N)"]
    shapes, notes = sample_shapes(specs)
    assert shapes == {"x": (1, 3, 1, 1), "input.1": (1, 1)}
    assert notes[0].startswith("input 'x': dims x.0, x.2, x.3 not given, using 1") and notes[1].startswith("input 'input.1': dims N, input.1.1 not given")


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("x.1", r"dim 'x.1': dim 1 of input 'x' is fixed at 3; only dynamic dims take a size"),
        ("x.7", r"dim 'x.7': input 'x' has rank 4 \(\[\?, 3, \?, N\]\); axes are 0..3"),
        ("x.3", r"dim 'x.3': dim 3 of input 'x' is named 'N'; give its size by that name"),
        ("z.0", r"no input has a dim named 'z.0'; closest: 'x.0'"),
    ],
)
def test_a_dims_key_that_is_no_dynamic_dim_is_refused(key: str, message: str) -> None:
    with pytest.raises(InputError, match=message):
        random_inputs([TensorSpec("x", F, (-1, 3, None, "N"))], {key: 2})


def test_a_dtype_numpy_lacks_is_an_input_error() -> None:
    with pytest.raises(InputError, match=r"input 'x' is float4e2m1: numpy has no such dtype"):
        random_inputs([TensorSpec("x", "float4e2m1", (2,))])
    with pytest.raises(InputError, match=r"input 'x' is float4e2m1: numpy has no such dtype"):
        check_inputs([TensorSpec("x", "float4e2m1", (2,))], {"x": np.zeros(2)})
