"""The benchmarks' copies of the light models (benchmarks/_models.py): seeded weights that make the
outputs depend on the input, and a batch dim that batches (what --vs-triton serves, issue 30)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from benchmarks._models import free_batch, light_copy, seeded_weights
from tests.models import light_model_path


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def test_a_light_copy_has_seeded_weights_and_a_batch_dim_that_batches(tmp_path: Path) -> None:
    path = light_copy("squeezenet", tmp_path)
    model = onnx.load(str(path))
    assert [i.name for i in model.graph.input] == ["data_0"] and model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"
    assert not any(n.op_type == "ConstantOfShape" for n in model.graph.node)
    x = np.random.default_rng(1).standard_normal((3, 3, 224, 224)).astype(np.float32)
    together = _run(path, x)
    alone = np.concatenate([_run(path, x[i : i + 1]) for i in range(3)])
    assert together.shape == (3, 1000, 1, 1) and np.isfinite(together).all()
    np.testing.assert_allclose(together, alone, atol=1e-6)
    assert np.abs(together[0] - together[1]).max() > 1e-4, "the answer should depend on the input"
    # The original's constant weights answer the same softmax for any input.
    flat = _run(light_model_path("squeezenet"), x[:1])
    assert np.ptp(flat) < 1e-6 < np.ptp(together[0])


def test_the_same_seed_gives_the_same_weights_and_another_seed_others() -> None:
    model = onnx.load(str(light_model_path("squeezenet")))

    def weights(seed: int) -> dict[str, bytes]:
        return {t.name: t.raw_data for t in seeded_weights(model, seed).graph.initializer}

    assert weights(0) == weights(0) != weights(1)


def test_a_reshape_that_fixed_the_batch_infers_it(tmp_path: Path) -> None:
    """resnet50 reshapes to [1, 2048] before its Gemm: the copy reshapes to [-1, 2048]."""
    model = free_batch(onnx.load(str(light_model_path("resnet50"))))
    shapes = {t.name: onnx.numpy_helper.to_array(t).tolist() for t in model.graph.initializer}
    reshape = next(n for n in model.graph.node if n.op_type == "Reshape")
    assert shapes[reshape.input[1]] == [-1, 2048]


def test_a_model_without_constant_weights_is_copied_unchanged() -> None:
    from tests.models import chain

    model = chain()
    assert seeded_weights(model).SerializeToString() == model.SerializeToString()
