"""Copies of the onnx wheel's light models that serve like real ones, for the benchmarks that
compare servers: seeded random weights and a free batch dim.

Note: why the copies.
    The light models' weights are ``ConstantOfShape`` nodes, one value everywhere (0.02): their
    outputs are flat (squeezenet answers 0.001 for any input), so two servers that disagree
    would still print the same numbers. :func:`seeded_weights` replaces each with an initializer
    of seeded random values, scaled so that activations stay in range through 50 layers: He's
    scaling for weights, variances near 1, and BatchNormalization's scale near 0.5, since its
    statistics are random, not the data's, and resnet50's activations grew 1.5x a residual block
    at 1 (its logits reached 9000: a one-hot softmax, the same for any input); at 0.5 its logits
    are about 2 and its softmax peaks near 0.2. Their dim 0 is 1, so
    neither Triton's dynamic batcher nor onnxpipe's ``max_batch`` could stack requests:
    :func:`free_batch` names it ``N`` on every input and output, and lets a ``Reshape`` whose
    target starts with that 1 infer it (-1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import ModelProto, numpy_helper

from tests.models import light_model_path


def _random(shape: tuple[int, ...], op: str, index: int, trans_b: bool, rng: np.random.Generator) -> np.ndarray:
    """Values for input ``index`` of an ``op`` node, of ``shape``, that keep activations finite."""
    if op == "BatchNormalization":  # scale, bias, mean, var
        if index == 1:  # about 0.5: each residual block then adds a little, not 1.5x (see Note: why the copies)
            return rng.uniform(0.4, 0.6, shape).astype(np.float32)
        if index == 4:
            return rng.uniform(0.8, 1.2, shape).astype(np.float32)
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if len(shape) >= 2:  # a Conv's or Gemm's weight: He's scaling by the fan-in
        fan_in = int(np.prod(shape[1:])) if op == "Conv" else shape[1] if trans_b else shape[0]
        return (np.sqrt(2.0 / fan_in) * rng.standard_normal(shape)).astype(np.float32)
    return (0.01 * rng.standard_normal(shape)).astype(np.float32)  # a bias


def seeded_weights(model: ModelProto, seed: int = 0) -> ModelProto:
    """A copy of ``model`` whose ``ConstantOfShape`` weights (of constant shape) are initializers
    of seeded random values (see Note: why the copies).

    Args:
        model: A light model of the onnx wheel (or any model whose weights are ``ConstantOfShape``).
        seed: The generator's seed: the same seed gives the same weights.

    Returns:
        The copy; ``model`` is not changed.
    """
    copy = ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    rng = np.random.default_rng(seed)
    shapes = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    users: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    kept = []
    for node in graph.node:
        shape = shapes.get(node.input[0]) if node.op_type == "ConstantOfShape" and node.input else None
        if shape is None:
            kept.append(node)
            continue
        user = users[node.output[0]][0]
        trans_b = any(a.name == "transB" and a.i for a in user.attribute)
        value = _random(tuple(int(d) for d in shape), user.op_type, list(user.input).index(node.output[0]), trans_b, rng)
        graph.initializer.append(numpy_helper.from_array(value, node.output[0]))
    del graph.node[:]
    graph.node.extend(kept)
    # IR 3 lists every initializer among the inputs, which onnxruntime then treats as overridable
    # (not constant): IR 4 lets the weights be weights, and the model's one input its only input.
    used = {name for node in graph.node for name in node.input}
    live = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(live)
    weights = {t.name for t in live}
    inputs = [i for i in graph.input if i.name not in weights and i.name not in shapes]
    del graph.input[:]
    graph.input.extend(inputs)
    copy.ir_version = max(copy.ir_version, 4)
    return copy


def free_batch(model: ModelProto, name: str = "N") -> ModelProto:
    """A copy of ``model`` whose inputs' and outputs' dim 0 is the symbolic ``name`` (see Note:
    why the copies); intermediate shapes are dropped (shape inference finds them again).

    Args:
        model: A model whose dim 0 is a fixed 1 on every input and output.
        name: The dim's name.

    Returns:
        The copy; ``model`` is not changed.
    """
    copy = ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    initializers = {t.name: t for t in graph.initializer}
    for port in [*graph.input, *graph.output]:
        if port.name not in initializers and port.type.tensor_type.shape.dim:
            port.type.tensor_type.shape.dim[0].dim_param = name
    for node in graph.node:
        target = initializers.get(node.input[1]) if node.op_type == "Reshape" else None
        if target is not None:
            shape = numpy_helper.to_array(target).copy()
            if shape.size and shape[0] == 1 and -1 not in shape:
                shape[0] = -1
                target.CopyFrom(numpy_helper.from_array(shape, target.name))
    del graph.value_info[:]
    onnx.checker.check_model(copy)
    return copy


def light_copy(model: str, folder: Path, seed: int = 0) -> Path:
    """``light_<model>.onnx`` of the onnx wheel with seeded random weights and a free batch dim,
    saved in ``folder`` as ``<model>.onnx``; its path."""
    path = folder / f"{model}.onnx"
    onnx.save(free_batch(seeded_weights(onnx.load(str(light_model_path(model))), seed)), str(path))
    return path
