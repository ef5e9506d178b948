"""The registry of tiny test models: each function returns a fresh ModelProto (or writes one).

Models are written in ONNX text syntax (``onnx.parser``) where it can say what the test needs, and
with ``onnx.helper`` otherwise. Every docstring draws the graph and names the cuts the tests use, so
a test reads against the picture. Nodes carry names so tests can cut by node and assign by name.
Unless a model says otherwise it is IR 8, opset 17, float32 ``[1, 4]`` tensors.

The real light models of the onnx wheel (IR 3, weights made by ConstantOfShape, initializers listed
as inputs) are reached through :func:`light_model_path`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.parser
from onnx import ModelProto, NodeProto, TensorProto, helper, numpy_helper

__all__ = [
    "embed_mlp",
    "EXTERNAL_WEIGHT_BYTES",
    "LONG_NAMES",
    "LIGHT_MODELS",
    "branchy",
    "chain",
    "constants_shared",
    "dead_nodes",
    "dynamic_dims",
    "external_data",
    "fp16_if_decoder",
    "functions",
    "hand_wired",
    "head_then_tail",
    "ir3_initializer_inputs",
    "light_model_path",
    "long_names",
    "matmul_tail",
    "matmuls_then_chain",
    "nan_output",
    "overflowing_mask",
    "outer_scope",
    "sequence_boundary",
    "symbolic_batch",
    "symbolic_image",
    "two_inputs",
    "two_outputs",
    "unknown_dims",
]

_HEADER = '<ir_version: 8, opset_import: ["" : 17]>'

LIGHT_MODELS = ("bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet", "squeezenet", "vgg19", "zfnet512")


def light_model_path(name: str) -> Path:
    """The path of ``light_<name>.onnx`` bundled with the onnx wheel (IR 3, opset 8-9)."""
    path = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light" / f"light_{name}.onnx"
    if not path.is_file():
        raise FileNotFoundError(f"onnx wheel has no light model '{name}'; bundled: {', '.join(LIGHT_MODELS)}")
    return path


def _parse(text: str) -> ModelProto:
    model = onnx.parser.parse_model(text)
    onnx.checker.check_model(model, full_check=True)
    return model


def chain() -> ModelProto:
    """X -relu0-> a -add1(W)-> b -sig2-> c -mul3(c, c)-> Y.

    Four compute nodes in a line, one initializer ``W`` read by ``add1``.
    """
    return _parse(
        _HEADER
        + """
        chain (float[1,4] X) => (float[1,4] Y) <float[1,4] W = {0.5, -1.0, 2.0, 0.25}> {
            [relu0] a = Relu(X)
            [add1] b = Add(a, W)
            [sig2] c = Sigmoid(b)
            [mul3] Y = Mul(c, c)
        }
        """
    )


def branchy() -> ModelProto:
    """A DAG with fan-out, a skip edge and a cut crossed by two tensors.

    ::

        X -n0 Relu-> a -+-n1 Sigmoid-> b -+
                        |                 +-n3 Add-> d -n4 Mul(W)-> e -+
                        +-n2 Tanh----> c -+                            +-n5 Add-> f -n6 Relu-> Y
                        +------------------------ (skip) --------------+

    With cuts ``["a", ["b", "c"], "e"]`` the stages are {n0}, {n1, n2}, {n3, n4}, {n5, n6}: ``a``
    fans out to stages 1 and 3 (the edge to 3 skips two stages), and ``b`` and ``c`` both cross the
    middle cut.
    """
    return _parse(
        _HEADER
        + """
        branchy (float[1,4] X) => (float[1,4] Y) <float[1,4] W = {1.5, -0.5, 0.75, 2.0}> {
            [n0] a = Relu(X)
            [n1] b = Sigmoid(a)
            [n2] c = Tanh(a)
            [n3] d = Add(b, c)
            [n4] e = Mul(d, W)
            [n5] f = Add(e, a)
            [n6] Y = Relu(f)
        }
        """
    )


def two_inputs() -> ModelProto:
    """Two graph inputs; ``Z`` is read only by the last node.

    ``X -r0 Relu-> a -s1 Sigmoid-> b -add2(b, Z)-> Y``. A cut at ``a`` or ``b`` feeds ``Z`` to the
    last stage straight from the pipeline input.
    """
    return _parse(
        _HEADER
        + """
        two_inputs (float[1,4] X, float[1,4] Z) => (float[1,4] Y) {
            [r0] a = Relu(X)
            [s1] b = Sigmoid(a)
            [add2] Y = Add(b, Z)
        }
        """
    )


def two_outputs() -> ModelProto:
    """Two graph outputs; ``M`` is made by a middle node and also read downstream.

    ``X -r0 Relu-> a -s1 Sigmoid-> M -t2 Tanh-> c -add3(c, a)-> Y``; outputs ``(M, Y)``. With cuts
    ``["a", "M"]``, stage 1 makes ``M``, which is both a pipeline output and an input of stage 2.
    """
    return _parse(
        _HEADER
        + """
        two_outputs (float[1,4] X) => (float[1,4] M, float[1,4] Y) {
            [r0] a = Relu(X)
            [s1] M = Sigmoid(a)
            [t2] c = Tanh(M)
            [add3] Y = Add(c, a)
        }
        """
    )


def dead_nodes() -> ModelProto:
    """``X -r0 Relu-> a -s1 Sigmoid-> b -t2 Tanh-> Y`` plus dead nodes that reach no output.

    Dead: ``dead_neg`` (reads the live ``a``), ``dead_exp`` (reads ``dead_neg``'s output) and
    ``dead_x`` (reads the input ``X``); ``dead_w`` is a dead *weight* node (reads only ``K``), which
    is not reported as dropped since weight nodes are never assigned. ``K`` is read only by dead
    nodes, so no stage carries it.
    """
    return _parse(
        _HEADER
        + """
        dead_nodes (float[1,4] X) => (float[1,4] Y) <float[1,4] K = {1, 2, 3, 4}> {
            [r0] a = Relu(X)
            [dead_neg] na = Neg(a)
            [s1] b = Sigmoid(a)
            [dead_exp] ea = Exp(na)
            [dead_x] nx = Add(X, K)
            [dead_w] kk = Mul(K, K)
            [t2] Y = Tanh(b)
        }
        """
    )


def ir3_initializer_inputs() -> ModelProto:
    """IR 3, opset 9: initializers ``W`` and ``V`` are also listed as graph inputs (IR 3 requires it).

    ``X -add0(X, W)-> a -r1 Relu-> b -mul2(b, W)-> c -add3(c, V)-> Y``. ``W`` is read on both sides
    of a cut at ``a`` or ``b``, ``V`` only by the last node.
    """
    w = numpy_helper.from_array(np.array([[0.5, -1.0, 2.0, 0.25]], np.float32), "W")
    v = numpy_helper.from_array(np.array([[1.0, 2.0, -3.0, 0.5]], np.float32), "V")
    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4]) for n in ("X", "W", "V", "Y")]
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["X", "W"], ["a"], name="add0"),
            helper.make_node("Relu", ["a"], ["b"], name="r1"),
            helper.make_node("Mul", ["b", "W"], ["c"], name="mul2"),
            helper.make_node("Add", ["c", "V"], ["Y"], name="add3"),
        ],
        "ir3",
        info[:3],
        info[3:],
        initializer=[w, v],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], ir_version=3)
    onnx.checker.check_model(model, full_check=True)
    return model


def constants_shared() -> ModelProto:
    """Weights made by nodes (``Constant``, ``ConstantOfShape``), each read in several stages.

    ::

        cC   = Constant [1,4]              (weight node)
        cS   = Constant int64 [1,4]        (weight node, the shape)
        cK   = ConstantOfShape(S) = 0.5    (weight node)
        n0: a = Add(X, C)        -- stage 0 with cut "a"
        n1: b = Mul(a, K)        -- stage 1 with cut "b"
        n2: c = Add(b, C)        -- stage 2
        n3: Y = Sub(c, K)        -- stage 2

    So stage 0 carries {cC}, stage 1 {cS, cK}, stage 2 all three.
    """
    return _parse(
        _HEADER
        + """
        constants_shared (float[1,4] X) => (float[1,4] Y) {
            [cC] C = Constant<value = float[1,4] {0.5, -1.0, 2.0, 0.25}>()
            [cS] S = Constant<value = int64[2] {1, 4}>()
            [cK] K = ConstantOfShape<value = float[1] {0.5}>(S)
            [n0] a = Add(X, C)
            [n1] b = Mul(a, K)
            [n2] c = Add(b, C)
            [n3] Y = Sub(c, K)
        }
        """
    )


def outer_scope() -> ModelProto:
    """An ``If`` and a ``Loop`` whose bodies read tensors of the enclosing graph.

    ::

        relu0: a = Relu(X)
        sig1:  b = Sigmoid(a)
        sum2:  r = ReduceSum(X)                    (scalar)
        gt3:   cond = Greater(r, zero)             (zero: initializer)
        if4:   i = If(cond)  then: t_then = Add(b, W)   else: t_else = Mul(b, W)
                             (outer reads: compute tensor b, initializer W)
        loop5: Y = Loop(M, "", i)  body: v_out = Add(v, a)   (outer read: a, made two stages back)

    With cuts ``["b", "i"]`` the stages are {relu0, sig1}, {sum2, gt3, if4}, {loop5}; stage 1 reads
    ``b`` only through the If's branches, stage 2 reads ``a`` only through the Loop's body.
    """
    return _parse(
        _HEADER
        + """
        outer_scope (float[1,4] X) => (float[1,4] Y)
            <float[1,4] W = {1.0, -2.0, 0.5, 3.0}, int64 M = {3}, float zero = {0.0}> {
            [relu0] a = Relu(X)
            [sig1] b = Sigmoid(a)
            [sum2] r = ReduceSum<keepdims = 0>(X)
            [gt3] cond = Greater(r, zero)
            [if4] i = If(cond) <
                then_branch = then_g () => (float[1,4] t_then) { [then_add] t_then = Add(b, W) },
                else_branch = else_g () => (float[1,4] t_else) { [else_mul] t_else = Mul(b, W) }
            >
            [loop5] Y = Loop(M, "", i) <
                body = body_g (int64 it, bool c_in, float[1,4] v) => (bool c_out, float[1,4] v_out) {
                    [body_id] c_out = Identity(c_in)
                    [body_add] v_out = Add(v, a)
                }
            >
        }
        """
    )


def functions() -> ModelProto:
    """Local functions: one at top level, one used only inside an If branch, one calling another.

    ::

        f0:   a = local.AddOne(X)          -- AddOne (holds a Constant node)
        sum1: r = ReduceSum(a)             (scalar)
        gt2:  cond = Greater(r, zero)
        if3:  i = If(cond)  then: local.Twice(a)  else: Neg(a)   -- Twice used only in the branch
        f4:   Y = local.Wrap(i)            -- Wrap calls local.Inner

    With cuts ``["a", "i"]``: stage 0 carries {AddOne}, stage 1 {Twice}, stage 2 {Wrap, Inner}.
    """
    return _parse(
        """
        <ir_version: 8, opset_import: ["" : 17, "local" : 1]>
        functions (float[1,4] X) => (float[1,4] Y) <float zero = {0.0}> {
            [f0] a = local.AddOne(X)
            [sum1] r = ReduceSum<keepdims = 0>(a)
            [gt2] cond = Greater(r, zero)
            [if3] i = If(cond) <
                then_branch = then_g () => (float[1,4] t_then) { [then_twice] t_then = local.Twice(a) },
                else_branch = else_g () => (float[1,4] t_else) { [else_neg] t_else = Neg(a) }
            >
            [f4] Y = local.Wrap(i)
        }
        <domain: "local", opset_import: ["" : 17]>
        AddOne (x) => (y) {
            one = Constant<value = float {1.0}>()
            y = Add(x, one)
        }
        <domain: "local", opset_import: ["" : 17]>
        Twice (x) => (y) {
            y = Add(x, x)
        }
        <domain: "local", opset_import: ["" : 17, "local" : 1]>
        Wrap (x) => (y) {
            s = local.Inner(x)
            y = Relu(s)
        }
        <domain: "local", opset_import: ["" : 17]>
        Inner (x) => (y) {
            y = Sigmoid(x)
        }
        """
    )


def sequence_boundary() -> ModelProto:
    """A sequence value in the middle: ``X -r0-> a -mk1-> s (sequence) -at2(s, zero)-> Y``.

    Only tensors can cross a stage boundary, so a cut at ``s`` is refused; a cut at ``a`` is fine.
    """
    return _parse(
        _HEADER
        + """
        sequence_boundary (float[1,4] X) => (float[1,4] Y) <int64 zero = {0}> {
            [r0] a = Relu(X)
            [mk1] s = SequenceConstruct(a, a)
            [at2] Y = SequenceAt(s, zero)
        }
        """
    )


def symbolic_batch() -> ModelProto:
    """A symbolic batch dim: ``X[N,4] -mm0(W[4,3])-> a[N,3] -r1 Relu-> b -add2(B)-> Y[N,3]``."""
    return _parse(
        _HEADER
        + """
        symbolic_batch (float[N,4] X) => (float[N,3] Y)
            <float[4,3] W = {1, 0, -1, 0.5, 2, 1, -1, 0, 0.25, 1, 1, 1}, float[3] B = {0.1, -0.2, 0.3}> {
            [mm0] a = MatMul(X, W)
            [r1] b = Relu(a)
            [add2] Y = Add(b, B)
        }
        """
    )


#: The tensor names of :func:`long_names`, in graph order (each is 80+ characters, as transformer exports make them).
LONG_NAMES = tuple(f"/model/decoder/layers.{i}/self_attn/o_proj/MatMul_output_0/cast_to_float_and_back_again" for i in range(6))


def long_names() -> ModelProto:
    """Names as long as a transformer export's: ``X[N,16] -Relu-> LONG_NAMES[0] -Relu-> ... LONG_NAMES[5] -Identity-> Y``."""
    nodes, previous = [], "X"
    for i, name in enumerate(LONG_NAMES):
        nodes.append(helper.make_node("Relu", [previous], [name], name=f"/model/decoder/layers.{i}/Relu"))
        previous = name
    nodes.append(helper.make_node("Identity", [previous], ["Y"], name="out"))
    x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 16]) for n in ("X", "Y"))
    return helper.make_model(helper.make_graph(nodes, "long_names", [x], [y]), ir_version=8, opset_imports=[helper.make_opsetid("", 17)])


def dynamic_dims() -> ModelProto:
    """A PaddlePaddle-style export: dynamic dims declared as ``dim_value: -1`` and as dims with
    neither a value nor a name, ``x[-1, 3, ?, ?] -c0 Conv(W0 [4,3,3,3], pad 1)-> a -r1 Relu-> b
    -c2 Conv(W1 [2,4,1,1])-> y[-1, 2, ?, ?]``. onnxruntime takes any batch and image size.
    """
    rng = np.random.default_rng(3)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3, None, None])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [-1, 2, None, None])
    for v in (x, y):  # make_tensor_value_info writes None as an empty dim already; -1 stays a value
        assert v.type.tensor_type.shape.dim[0].dim_value == -1
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "W0"], ["a"], name="c0", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["a"], ["b"], name="r1"),
            helper.make_node("Conv", ["b", "W1"], ["y"], name="c2"),
        ],
        "dynamic_dims",
        [x],
        [y],
        initializer=[
            numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "W0"),
            numpy_helper.from_array(rng.standard_normal((2, 4, 1, 1)).astype(np.float32), "W1"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def fp16_if_decoder() -> ModelProto:
    """A float16 convolutional decoder with If nodes whose branches make tensors shape inference
    cannot merge::

        enc0: h = Conv(x, W0)          x [1,4,8,8] float16, pads 1
        act1: e = Relu(h)
        if2:  d = If(keep) { then: Identity(e) [1,4,8,8] | else: Flatten(e) [1,256] }
        dec3: g = Conv(d, W1)          pads 1
        act4: r = Relu(g)
        if5:  p = If(pool) { then: Identity(r) | else: MaxPool(r) 2x2 }  (same rank, other sizes)
        dec6: q = Conv(p, W2)          [1,4,4,4]
        out7: Y = Relu(q)

    ``keep`` (true) and ``pool`` (false) are initializers, so the model always takes the rank-4
    path; shape inference merges the branches of ``if2`` (rank 4 and rank 2) into a tensor of
    unknown rank, and every tensor after it has no shape. ``if5`` merges into [1, 4, ?, ?].
    """
    rng = np.random.default_rng(5)
    half = TensorProto.FLOAT16

    def branch(name: str, node: NodeProto) -> onnx.GraphProto:
        return helper.make_graph([node], name, [], [helper.make_tensor_value_info(node.output[0], half, None)])

    weights = {"W0": (4, 4, 3, 3), "W1": (4, 4, 3, 3), "W2": (4, 4, 1, 1)}
    inits = [numpy_helper.from_array((0.3 * rng.standard_normal(s)).astype(np.float16), n) for n, s in weights.items()]
    inits += [numpy_helper.from_array(np.array(True), "keep"), numpy_helper.from_array(np.array(False), "pool")]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "W0"], ["h"], name="enc0", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["h"], ["e"], name="act1"),
            helper.make_node(
                "If",
                ["keep"],
                ["d"],
                name="if2",
                then_branch=branch("as_is", helper.make_node("Identity", ["e"], ["e_same"])),
                else_branch=branch("flat", helper.make_node("Flatten", ["e"], ["e_flat"])),
            ),
            helper.make_node("Conv", ["d", "W1"], ["g"], name="dec3", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["g"], ["r"], name="act4"),
            helper.make_node(
                "If",
                ["pool"],
                ["p"],
                name="if5",
                then_branch=branch("keep_size", helper.make_node("Identity", ["r"], ["r_same"])),
                else_branch=branch("halve", helper.make_node("MaxPool", ["r"], ["r_pooled"], kernel_shape=[2, 2], strides=[2, 2])),
            ),
            helper.make_node("Conv", ["p", "W2"], ["q"], name="dec6"),
            helper.make_node("Relu", ["q"], ["Y"], name="out7"),
        ],
        "fp16_if_decoder",
        [helper.make_tensor_value_info("x", half, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("Y", half, [1, 4, 4, 4])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def unknown_dims() -> ModelProto:
    """Dims onnxruntime reports as unknown, and every metadata field set.

    ``X[N, ?, -1, 3] -r0 Relu-> a -n1 Neg-> Y`` (``?``: a dim with neither size nor name) and
    ``Z[M] -i2 Identity-> W`` with ``Z`` int64; ``Y`` and ``W`` are declared without shapes.
    Producer, domain, doc strings, ``model_version`` 3 and two ``metadata_props`` are set. Cut at ``a``.
    """
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", None, -1, 3])
    x.type.tensor_type.shape.dim[1].Clear()
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["X"], ["a"], name="r0"),
            helper.make_node("Neg", ["a"], ["Y"], name="n1"),
            helper.make_node("Identity", ["Z"], ["W"], name="i2"),
        ],
        "unknown_dims",
        [x, helper.make_tensor_value_info("Z", TensorProto.INT64, ["M"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None), helper.make_tensor_value_info("W", TensorProto.INT64, None)],
        doc_string="graph doc",
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tests", producer_version="1", domain="ai.onnxpipe.test", model_version=3,
        doc_string="model doc",
    )  # fmt: skip
    helper.set_model_props(model, {"author": "onnxpipe", "license": "MIT"})
    # Not checked: onnx's checker wants a shape on every graph output; onnxruntime infers them.
    return model


def symbolic_image() -> ModelProto:
    """Text recognition's shapes: a batch ``N``, an image height ``H`` and width ``W``, and an unnamed dim.

    ``X[N,1,H,W] -r0 Relu-> a -s1 Sigmoid-> Y``, ``Z[N,?] -t2 Tanh-> V``.
    """
    return _parse(
        _HEADER
        + """
        symbolic_image (float[N,1,H,W] X, float[N,?] Z) => (float[N,1,H,W] Y, float[N,?] V) {
            [r0] a = Relu(X)
            [s1] Y = Sigmoid(a)
            [t2] V = Tanh(Z)
        }
        """
    )


#: Bytes of each weight of :func:`external_data` (float32).
EXTERNAL_WEIGHT_BYTES = {"W0": 256 * 4, "Wsh": 256 * 4, "W1": 256 * 4 * 4, "W2": 4 * 4}


def external_data(folder: str | os.PathLike[str], ir_version: int = 8) -> Path:
    """Write a model whose weights all live in one external file ``w.data``; returns the .onnx path.

    ::

        mul0: a = Mul(X, W0)       W0  [1,256]
        add1: b = Add(a, Wsh)      Wsh [1,256]  (shared with mul4)
        mm2:  c = MatMul(b, W1)    W1  [256,4]
        add3: Y = Add(c, W2)       W2  [1,4]    (16 bytes: small, still external in the source)
        mul4: Z = Mul(b, Wsh)

    Outputs ``(Y, Z)``, input ``X[1,256]``. With cuts ``["b", "c"]`` stage 0 holds {W0, Wsh}, stage 1
    {W1} and stage 2 {W2, Wsh}; ``b`` skips from stage 0 to stage 2. ``ir_version=3`` (opset 9)
    writes the same graph with an IR version that predates external data.
    """
    rng = np.random.default_rng(7)
    shapes = {"W0": (1, 256), "Wsh": (1, 256), "W1": (256, 4), "W2": (1, 4)}
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name) for name, shape in shapes.items()]
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["X", "W0"], ["a"], name="mul0"),
            helper.make_node("Add", ["a", "Wsh"], ["b"], name="add1"),
            helper.make_node("MatMul", ["b", "W1"], ["c"], name="mm2"),
            helper.make_node("Add", ["c", "W2"], ["Y"], name="add3"),
            helper.make_node("Mul", ["b", "Wsh"], ["Z"], name="mul4"),
        ],
        "external_data",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 256])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 4]), helper.make_tensor_value_info("Z", TensorProto.FLOAT, [1, 256])],
        initializer=inits,
    )
    if ir_version < 4:
        graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits)
    opset = 17 if ir_version >= 8 else 9
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="w.data", size_threshold=0)
    return path


# -- Stage modules for hand-wired pipelines (builder and runtime tests) ------------------------------

_STAGE_HEADER = '<ir_version: 8, opset_import: ["" : 17]>'


def stage_head() -> ModelProto:
    """x[N,4] -> h = Relu(x), g = Neg(x)."""
    return _parse(_STAGE_HEADER + "\nhead (float[N, 4] x) => (float[N, 4] h, float[N, 4] g) { h = Relu(x) \n g = Neg(x) }")


def stage_twin() -> ModelProto:
    """p, q -> s = p + q (fed twice by the same tensor in the hand-wired pipeline)."""
    return _parse(_STAGE_HEADER + "\ntwin (float[N, 4] p, float[N, 4] q) => (float[N, 4] s) { s = Add(p, q) }")


def stage_tail() -> ModelProto:
    """s, g, x -> y = (s * g - x) * scale, with initializer scale = [1, 1, 1, 1] (a param group)."""
    return _parse(
        _STAGE_HEADER
        + "\ntail (float[N, 4] s, float[N, 4] g, float[N, 4] x) => (float[N, 4] y)"
        + " <float[4] scale = {1.0, 1.0, 1.0, 1.0}> { t = Mul(s, g) \n u = Sub(t, x) \n y = Mul(u, scale) }"
    )


def stages_whole() -> ModelProto:
    """The three stages above as one model: y = ((relu(x) + relu(x)) * -x - x) * scale, with scale
    also a graph input (overridable), so the reference can be run with another scale."""
    return _parse(
        _STAGE_HEADER
        + "\nwhole (float[N, 4] x, float[4] scale) => (float[N, 4] y) <float[4] scale = {1.0, 1.0, 1.0, 1.0}>"
        + " { h = Relu(x) \n g = Neg(x) \n s = Add(h, h) \n t = Mul(s, g) \n u = Sub(t, x) \n y = Mul(u, scale) }"
    )


def failing_pair() -> tuple[ModelProto, ModelProto]:
    """Two stages that fail only for some data: ``head`` is h = Relu(x) for x[N,4]; ``reshape``
    reshapes h to [2,4], which onnxruntime refuses for any N other than 2."""
    head = _parse(_STAGE_HEADER + "\nhead (float[N, 4] x) => (float[N, 4] h) { h = Relu(x) }")
    tail = _parse(
        _STAGE_HEADER + "\nreshape (float[N, 4] h) => (float[2, 4] y) <int64[2] shape = {2, 4}> { y = Reshape(h, shape) }"
    )
    return head, tail


def failing_config(name: str = "pipeline") -> Any:
    """:func:`failing_pair` wired as ``x -> head -h-> reshape -> y``, as a PipelineConfig."""
    from onnxpipe.builder import PipelineConfig

    head, tail = failing_pair()
    config = PipelineConfig(name)
    a, b = config.add_stage(head, "head"), config.add_stage(tail, "reshape")
    config.input("x").connect(a.input("x"))
    a.output("h").connect(b.input("h"))
    b.output("y").connect(config.output("y"))
    return config


def slow_stage(size: int = 768) -> ModelProto:
    """x[1, size] -> y: two MatMuls with [size, size] weights; tens of milliseconds per run on one
    core with ``batch`` = 256 rows: x is [256, size]."""
    w = numpy_helper.from_array(np.full((size, size), 1.0 / size, np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("MatMul", ["h", "w"], ["y"])],
        "slow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [256, size])],
        initializer=[w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def endless_stage() -> ModelProto:
    """x[N, 4] -> y: a Loop of 2**62 trips adding 1: a run that ends only when it is cancelled
    (onnxruntime's Loop stops at ``RunOptions.terminate``), so a test of cancelling need not race a
    run's end. It keeps one core busy while it runs."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["v_in", "one"], ["v_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("v_out", TensorProto.FLOAT, ["N", 4])],
        initializer=[numpy_helper.from_array(np.array(1.0, np.float32), "one")],
    )
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", "cond", "x"], ["y"], body=body)],
        "endless",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        initializer=[numpy_helper.from_array(np.array(1 << 62, np.int64), "trips"), numpy_helper.from_array(np.array(True), "cond")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def matmul_tail(columns: int) -> ModelProto:
    """``h[N,4] -> y = h @ w`` with ``w`` [4, columns] of 0.5: 16 x ``columns`` bytes of weights, enough
    for an external ``.data`` file from 1 << 16 columns on."""
    w = numpy_helper.from_array(np.full((4, columns), 0.5, np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["h", "w"], ["y"])],
        "tail",
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", columns])],
        initializer=[w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def head_then_tail(columns: int) -> Any:
    """Two stages, :func:`stage_head` then :func:`matmul_tail`: ``x -> head -h-> tail -> y``."""
    from onnxpipe.builder import PipelineConfig

    config = PipelineConfig("two")
    head = config.add_stage(stage_head(), "head")
    tail = config.add_stage(matmul_tail(columns), "tail")
    config.input("x").connect(head.input("x"))
    head.output("h").connect(tail.input("h"))
    tail.output("y").connect(config.output("y"))
    return config


def write_requests(folder: Path, rows: list[int], seed: int = 0) -> list[Path]:
    """One .npz request per entry of ``rows`` for :func:`hand_wired` bundles: ``x`` of shape
    ``[rows[k], 4]`` with values of its own, named r00.npz, r01.npz, ... in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    files = []
    for k, n in enumerate(rows):
        files.append(folder / f"r{k:02d}.npz")
        np.savez(files[-1], x=rng.standard_normal((n, 4)).astype(np.float32))
    return files


def bundle_of(config: object, folder: str | os.PathLike[str]) -> Path:
    """Build and export a PipelineConfig (or a SplitPlan's config) into ``folder/bundle``."""
    from onnxpipe.builder import build, export

    config = getattr(config, "config", config)
    folder = Path(folder)
    return export(build(config, folder / "built").path, folder / "bundle")  # type: ignore[arg-type]


def hand_wired(param_group: str | None = None, tail_first: bool = False) -> Any:
    """The three stages above wired by hand: ``x`` skips to ``tail``, ``g`` skips ``twin``, ``h``
    feeds both inputs of ``twin``; optionally ``tail``'s ``scale`` in a parameter group, and
    ``tail`` added first (the config must still order it last). Computes :func:`stages_whole`."""
    from onnxpipe.builder import PipelineConfig

    config = PipelineConfig("hand")
    tail = config.add_stage(stage_tail(), "tail") if tail_first else None
    head = config.add_stage(stage_head(), "head")
    twin = config.add_stage(stage_twin(), "twin")
    tail = tail or config.add_stage(stage_tail(), "tail")
    config.input("x").connect(head.input("x"))
    config.input("x").connect(tail.input("x"))
    head.output("h").connect(twin.input("p"))
    head.output("h").connect(twin.input("q"))
    head.output("g").connect(tail.input("g"))
    twin.output("s").connect(tail.input("s"))
    tail.output("y").connect(config.output("y"))
    if param_group:
        config.add_param_group(param_group, tail, ["scale"])
    return config


def embed_mlp(vocab: int = 16, width: int = 8) -> ModelProto:
    """``y = relu(E[ids] @ W)``, ids ``[batch, n]`` int64 -> y ``[batch, n, width]``: a Gather, so
    an id outside the vocabulary fails in onnxruntime (a bad request that passes every check)."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["E", "ids"], ["e"]), helper.make_node("MatMul", ["e", "W"], ["m"]), helper.make_node("Relu", ["m"], ["y"])],
        "embed_mlp",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "n", width])],
        [numpy_helper.from_array(rng.standard_normal((vocab, width)).astype(np.float32), "E"),
         numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32), "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def fpn_net() -> ModelProto:
    """A feature-pyramid block, as in PP-OCR's detector: ``x [N, 3, H, W]`` -> conv -> c0 [N, 8, H, W];
    c0 -> stride-2 conv -> c1 -> Resize x2 -> up; ``y = Concat(c0, up)`` [N, 16, H, W]. It runs only
    where H and W are even: at the 1 x 1 a profile would guess, up is 2 x 2 and the Concat fails."""
    rng = np.random.default_rng(0)
    w0 = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.2, "w0")
    w1 = numpy_helper.from_array(rng.standard_normal((8, 8, 3, 3)).astype(np.float32) * 0.1, "w1")
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1, 1, 1, 1], name="conv0"),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("Conv", ["r0", "w1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2], name="conv1"),
        helper.make_node("Resize", ["c1", "", "scales"], ["up"], mode="nearest", name="up"),
        helper.make_node("Concat", ["r0", "up"], ["y"], axis=1, name="cat"),
    ]
    graph = helper.make_graph(nodes, "fpn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16, "H", "W"])], initializer=[w0, w1, scales])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def wide_mlp(width: int = 2048, layers: int = 4) -> ModelProto:
    """``x [N, width]`` through ``layers`` MatMul+Relu layers of ``width x width`` float32 weights
    (16 MiB each at 2048): a model whose weights, not its activations, take its memory."""
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for k in range(layers):
        inits.append(numpy_helper.from_array((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32), f"w{k}"))
        out = "y" if k == layers - 1 else f"r{k}"
        nodes += [helper.make_node("MatMul", [prev, f"w{k}"], [f"m{k}"], name=f"mm{k}"), helper.make_node("Relu", [f"m{k}"], [out], name=f"relu{k}")]
        prev = out
    graph = helper.make_graph(nodes, "wide_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def matmuls_then_chain(rows: int = 256, width: int = 512, matmuls: int = 8, chain: int = 200, columns: int = 32) -> onnx.ModelProto:
    """``x[rows, width]`` through ``matmuls`` MatMuls of ``width x width`` (intra-op threads split them
    well: 2.3 ms on one thread here, 1.2 ms on two), then down to ``[rows, columns]`` and ``chain``
    elementwise ops one after another, which onnxruntime runs on one thread however many it has
    (2.0 ms on one or two). At N = 1 one session with 2 threads answers faster
    than anything with 1 thread a request; at N = 16 two 1-thread workers (replicas, or the 2-stage
    pipeline cut between the two parts) each run a request on a core of their own, and beat it."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32), f"w{k}") for k in range(matmuls)]
    inits.append(numpy_helper.from_array((rng.standard_normal((width, columns)) / np.sqrt(width)).astype(np.float32), "down"))
    nodes, prev = [], "x"
    for k in range(matmuls):
        nodes.append(helper.make_node("MatMul", [prev, f"w{k}"], [f"m{k}"], name=f"mm{k}"))
        prev = f"m{k}"
    nodes.append(helper.make_node("MatMul", [prev, "down"], ["s0"], name="down"))
    for i in range(chain):
        out = "y" if i == chain - 1 else f"s{i + 1}"
        nodes.append(helper.make_node("Tanh" if i % 2 else "Sin", [f"s{i}"], [out], name=f"e{i}"))
    graph = helper.make_graph(nodes, "matmuls_then_chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, columns])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def nan_output() -> ModelProto:
    """A model whose output is NaN whatever its input: the log of a negative number.

    ``X -relu0-> a -neg1-> b -sub2(one)-> c -log3-> Y``: ``b`` and ``c`` are finite, ``Y`` all NaN.
    """
    return _parse(
        _HEADER
        + """
        nan_output (float[1,4] X) => (float[1,4] Y) <float[1] one = {1.0}> {
            [relu0] a = Relu(X)
            [neg1] b = Neg(a)
            [sub2] c = Sub(b, one)
            [log3] Y = Log(c)
        }
        """
    )


def overflowing_mask() -> ModelProto:
    """T5's attention mask, ``(1 - mask) * finfo(float32).min`` added to the scores: a mask of ones
    and zeros gives finite logits, a mask value of 3 overflows to +inf and the softmax gives NaN.

    ``encoder_attention_mask -cast0-> m -sub1(one - m)-> inv -mul2(min)-> bias``, ``hidden,
    bias -add3-> scores -softmax4-> probs -matmul5(W)-> logits``; inputs ``hidden`` float[1,4],
    ``encoder_attention_mask`` int64[1,4]; the cut the tests use: ``scores``.
    """
    return _parse(
        _HEADER
        + """
        overflowing_mask (float[1,4] hidden, int64[1,4] encoder_attention_mask) => (float[1,4] logits)
            <float[1] one = {1.0}, float[1] lowest = {-3.4028235e38}, float[4,4] W = {1.0, 0.5, -0.5, 0.25, 0.0, 1.0, 0.5, -1.0,
             0.25, 0.0, 1.0, 0.5, -0.5, 0.25, 0.0, 1.0}> {
            [cast0] m = Cast<to = 1>(encoder_attention_mask)
            [sub1] inv = Sub(one, m)
            [mul2] bias = Mul(inv, lowest)
            [add3] scores = Add(hidden, bias)
            [softmax4] probs = Softmax<axis = -1>(scores)
            [matmul5] logits = MatMul(probs, W)
        }
        """
    )
