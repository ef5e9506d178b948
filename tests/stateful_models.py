"""Models with state, built in memory (no downloads), for the stream tests and benchmarks/streams.py.

- :func:`recurrent`: two recurrent layers, each with its own state (``state1`` -> ``state1N``,
  ``state2`` -> ``state2N``); cut at ``state1N`` for two stages with one state each.
- :func:`growing`: a state that grows by each step's input (``stateN = Concat(state, x)``, as a
  KV cache does), ``y`` its sum; optionally a second stage that reshapes the sum to ``shape``, which
  onnxruntime refuses for any shape but ``[1, 1]`` (a later stage failing on a step).
- :func:`gpt_decoder`: a GPT-style decoder with optimum's names (``input_ids``, ``attention_mask``,
  ``position_ids``, ``past_key_values.N.key|value`` -> ``logits``, ``present.N.key|value``), random
  weights; the residual stream after layer ``n`` is ``layer{n}.out``, the place to cut between layers.

Plus the reference side: :func:`whole_generate` runs greedy decoding with the whole model in one
session, feeding the KV cache by hand, as a user of onnxruntime alone would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import GraphProto, ModelProto, TensorProto, helper, numpy_helper

from onnxpipe.builder import PipelineConfig
from onnxpipe.runtime import TensorSpec

__all__ = [
    "decode_in_threads", "decoder_feeds", "decoder_session", "encoder_decoder", "encoder_decoder_config", "encoder_decoder_whole", "generate", "gpt_decoder",
    "growing", "merged_decoder", "recurrent", "session_generate", "whole_generate", "whole_recurrent",
]

F = TensorProto.FLOAT
I64 = TensorProto.INT64


def recurrent(width: int = 4, hidden: int = 8, seed: int = 0) -> ModelProto:
    """``y, state1N, state2N = f(x, state1, state2)``, all ``[batch, .]``::

        state1N = tanh(x @ W1 + state1 @ U1)
        state2N = tanh(state1N @ W2 + state2 @ U2)
        y       = state2N @ Wo
    """
    rng = np.random.default_rng(seed)

    def w(name: str, *shape: int) -> TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.5).astype(np.float32), name)

    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["a1"], name="in1"),
        helper.make_node("MatMul", ["state1", "U1"], ["b1"], name="rec1"),
        helper.make_node("Add", ["a1", "b1"], ["c1"], name="sum1"),
        helper.make_node("Tanh", ["c1"], ["state1N"], name="act1"),
        helper.make_node("MatMul", ["state1N", "W2"], ["a2"], name="in2"),
        helper.make_node("MatMul", ["state2", "U2"], ["b2"], name="rec2"),
        helper.make_node("Add", ["a2", "b2"], ["c2"], name="sum2"),
        helper.make_node("Tanh", ["c2"], ["state2N"], name="act2"),
        helper.make_node("MatMul", ["state2N", "Wo"], ["y"], name="out"),
    ]
    graph = helper.make_graph(
        nodes,
        "recurrent",
        [helper.make_tensor_value_info(n, F, ["batch", d]) for n, d in (("x", width), ("state1", hidden), ("state2", hidden))],
        [helper.make_tensor_value_info(n, F, ["batch", d]) for n, d in (("y", width), ("state1N", hidden), ("state2N", hidden))],
        [w("W1", width, hidden), w("U1", hidden, hidden), w("W2", hidden, hidden), w("U2", hidden, hidden), w("Wo", hidden, width)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def whole_recurrent(model: ModelProto, xs: list[np.ndarray], hidden: int = 8) -> list[np.ndarray]:
    """The outputs ``y`` of one stream of steps ``xs`` through the whole model in one session."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    batch = xs[0].shape[0]
    s1 = s2 = np.zeros((batch, hidden), np.float32)
    ys = []
    for x in xs:
        y, s1, s2 = session.run(["y", "state1N", "state2N"], {"x": x, "state1": s1, "state2": s2})
        ys.append(y)
    return ys


def growing(reshaped: bool = False) -> ModelProto:
    """``stateN = Concat(state, x)`` along axis 1 (``x`` ``[1, n]``, the state ``[1, past]`` and
    empty at first: it holds every value the stream was sent) and ``y = ReduceSum(stateN)``
    ``[1, 1]``; ``reshaped``: then ``y = Reshape(sum, shape)`` with ``shape`` an int64[2] input,
    for a split at ``sum`` whose second stage fails (inside onnxruntime) for any ``shape`` but
    ``[1, 1]`` after the first has taken the step."""
    nodes = [
        helper.make_node("Concat", ["state", "x"], ["stateN"], axis=1, name="grow"),
        helper.make_node("ReduceSum", ["stateN"], ["sum" if reshaped else "y"], keepdims=1, name="total"),
    ]
    inputs = [helper.make_tensor_value_info("x", F, [1, "n"]), helper.make_tensor_value_info("state", F, [1, "past"])]
    if reshaped:
        nodes.append(helper.make_node("Reshape", ["sum", "shape"], ["y"], name="shaped"))
        inputs.append(helper.make_tensor_value_info("shape", I64, [2]))
    outputs = [helper.make_tensor_value_info("y", F, None if reshaped else [1, 1]), helper.make_tensor_value_info("stateN", F, [1, "total"])]
    graph = helper.make_graph(nodes, "growing", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def merged_decoder(passed: bool = False) -> ModelProto:
    """A merged decoder as optimum makes them, small: one ``If`` on ``use_cache_branch`` over a
    branch without a past (``else``: the first step) and one that reads it (``then``), with an
    attention mask so that its streams batch. ``x [batch, seq, 4]``, ``attention_mask [batch,
    past + seq]``, ``encoder_hidden_states [batch, enc, 4]``, the past ``past_key_values.0.key
    [batch, past, 4]`` and the encoder's ``past_key_values.0.encoder.key [batch, enc, 4]``::

        first step: present = x;               present.0.encoder.key = 2 * encoder_hidden_states
        after:      present = Concat(past, x); present.0.encoder.key = a [0, 1, 4] placeholder
                    (``passed``: the past passed through by Identity)
        y = x + sum(present * mask, axis 1) + sum(encoder KV, axis 1)
    """
    def branch(name: str, later: bool) -> GraphProto:
        nodes = [
            helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.array([1], np.int64))),
            helper.make_node("Constant", [], ["two"], value=numpy_helper.from_array(np.array([2], np.int64))),
            helper.make_node("Concat", ["past_key_values.0.key", "x"], [f"{name}_present"], axis=1) if later
            else helper.make_node("Identity", ["x"], [f"{name}_present"]),
            helper.make_node("Unsqueeze", ["attention_mask", "two"], ["mask3"]),
            helper.make_node("Cast", ["mask3"], ["maskf"], to=F),
            helper.make_node("Mul", [f"{name}_present", "maskf"], ["masked"]),
            helper.make_node("ReduceSum", ["masked", "one"], ["s"], keepdims=1),
        ]
        if not later:
            nodes.append(helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array(2.0, np.float32))))
            nodes.append(helper.make_node("Mul", ["encoder_hidden_states", "k"], [f"{name}_enc"]))
            kv = f"{name}_enc"
        else:
            kv = "past_key_values.0.encoder.key"
            nodes.append(helper.make_node("Identity", [kv], [f"{name}_enc"]) if passed else
                         helper.make_node("Constant", [], [f"{name}_enc"], value=numpy_helper.from_array(np.zeros((0, 1, 4), np.float32))))
        nodes += [
            helper.make_node("ReduceSum", [kv, "one"], ["e"], keepdims=1),
            helper.make_node("Add", ["x", "s"], ["xs"]),
            helper.make_node("Add", ["xs", "e"], [f"{name}_y"]),
        ]
        outs = [helper.make_tensor_value_info(f"{name}_{o}", F, None) for o in ("y", "present", "enc")]
        return helper.make_graph(nodes, name, [], outs)

    node = helper.make_node("If", ["use_cache_branch"], ["y", "present.0.key", "present.0.encoder.key"], name="merged",
                            then_branch=branch("with_past", True), else_branch=branch("without_past", False))
    inputs = [
        helper.make_tensor_value_info("x", F, ["batch", "seq", 4]),
        helper.make_tensor_value_info("attention_mask", I64, ["batch", "total"]),
        helper.make_tensor_value_info("encoder_hidden_states", F, ["batch", "enc", 4]),
        helper.make_tensor_value_info("use_cache_branch", TensorProto.BOOL, [1]),
        helper.make_tensor_value_info("past_key_values.0.key", F, ["batch", "past", 4]),
        helper.make_tensor_value_info("past_key_values.0.encoder.key", F, ["batch", "enc", 4]),
    ]
    outputs = [
        helper.make_tensor_value_info("y", F, ["batch", "seq", 4]),
        helper.make_tensor_value_info("present.0.key", F, ["batch", "total", 4]),
        helper.make_tensor_value_info("present.0.encoder.key", F, ["batch", "enc_out", 4]),
    ]
    graph = helper.make_graph([node], "merged", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def gpt_decoder(layers: int = 4, hidden: int = 32, heads: int = 2, vocab: int = 64, positions: int = 128, seed: int = 0) -> ModelProto:
    """A pre-norm GPT decoder with a KV cache, optimum's input and output names.

    Inputs ``input_ids``, ``position_ids`` ``[batch, seq]`` int64, ``attention_mask``
    ``[batch, total_seq]`` int64 and ``past_key_values.N.key|value`` ``[batch, heads, past_seq,
    head_dim]``; outputs ``logits`` ``[batch, seq, vocab]`` and ``present.N.key|value`` ``[batch,
    heads, total_seq, head_dim]`` (the past with this step's keys and values appended). The causal
    and padding mask is one additive bias ``[batch, 1, seq, total_seq]`` made before the layers.
    """
    rng = np.random.default_rng(seed)
    d = hidden // heads
    inits: list[TensorProto] = []
    nodes = []

    def w(name: str, *shape: int, scale: float | None = None) -> str:
        scale = scale if scale is not None else 1.0 / np.sqrt(shape[0])
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(value, name))
        return name

    def node(op: str, ins: list[str], out: str, **attrs: Any) -> str:
        nodes.append(helper.make_node(op, ins, [out], name=out, **attrs))
        return out

    const("one_f", np.array(1.0, np.float32))
    const("neg_big", np.array(-1e4, np.float32))
    const("scale", np.array(1.0 / np.sqrt(d), np.float32))
    const("ax0", np.array([0], np.int64))
    const("ax1", np.array([1], np.int64))
    const("ax12", np.array([1, 2], np.int64))
    const("i1", np.array([1], np.int64))
    const("zero_i", np.array(0, np.int64))
    const("one_i", np.array(1, np.int64))
    const("heads_shape", np.array([0, 0, heads, d], np.int64))
    const("merge_shape", np.array([0, 0, hidden], np.int64))
    const("ln_scale", np.ones(hidden, np.float32))
    const("ln_bias", np.zeros(hidden, np.float32))
    # Embeddings.
    tok = node("Gather", [w("wte", vocab, hidden, scale=1.0), "input_ids"], "tok_emb")
    pos = node("Gather", [w("wpe", positions, hidden, scale=1.0), "position_ids"], "pos_emb")
    x = node("Add", [tok, pos], "embed")
    # The mask: key j is visible to query i (at absolute position total - seq + i) when j <= that
    # position and the attention mask keeps it.
    total = node("Gather", [node("Shape", ["attention_mask"], "mask_shape"), "i1"], "total_len")
    seq = node("Gather", [node("Shape", ["input_ids"], "ids_shape"), "i1"], "seq_len")
    total_s = node("Squeeze", [total, "ax0"], "total_s")
    seq_s = node("Squeeze", [seq, "ax0"], "seq_s")
    cols = node("Range", ["zero_i", total_s, "one_i"], "cols")
    rows = node("Add", [node("Range", ["zero_i", seq_s, "one_i"], "rows0"), node("Sub", [total_s, seq_s], "offset")], "rows")
    causal = node("LessOrEqual", [cols, node("Unsqueeze", [rows, "ax1"], "rows_col")], "causal")  # [seq, total]
    keep = node("Cast", [node("Unsqueeze", ["attention_mask", "ax12"], "mask4")], "keep_f", to=F)  # [batch, 1, 1, total]
    allowed = node("Mul", [keep, node("Cast", [causal], "causal_f", to=F)], "allowed")  # [batch, 1, seq, total]
    bias = node("Mul", [node("Sub", ["one_f", allowed], "blocked"), "neg_big"], "attn_bias")
    for n in range(layers):
        p = f"layer{n}"
        h = node("LayerNormalization", [x, "ln_scale", "ln_bias"], f"{p}.ln1", axis=-1)

        def heads_of(name: str, p: str = p, h: str = h) -> str:
            flat = node("MatMul", [h, w(f"{p}.W{name}", hidden, hidden)], f"{p}.{name}")
            split = node("Reshape", [flat, "heads_shape"], f"{p}.{name}4")
            return node("Transpose", [split], f"{p}.{name}h", perm=[0, 2, 1, 3])

        q, k, v = heads_of("q"), heads_of("k"), heads_of("v")
        pk = node("Concat", [f"past_key_values.{n}.key", k], f"present.{n}.key", axis=2)
        pv = node("Concat", [f"past_key_values.{n}.value", v], f"present.{n}.value", axis=2)
        kt = node("Transpose", [pk], f"{p}.kT", perm=[0, 1, 3, 2])
        scores = node("Mul", [node("MatMul", [q, kt], f"{p}.qk"), "scale"], f"{p}.scores")
        probs = node("Softmax", [node("Add", [scores, bias], f"{p}.masked")], f"{p}.probs", axis=-1)
        ctx4 = node("Transpose", [node("MatMul", [probs, pv], f"{p}.ctx4")], f"{p}.ctxT", perm=[0, 2, 1, 3])
        ctx = node("Reshape", [ctx4, "merge_shape"], f"{p}.ctx")
        x = node("Add", [x, node("MatMul", [ctx, w(f"{p}.Wo", hidden, hidden)], f"{p}.attn")], f"{p}.mid")
        h2 = node("LayerNormalization", [x, "ln_scale", "ln_bias"], f"{p}.ln2", axis=-1)
        up = node("Relu", [node("MatMul", [h2, w(f"{p}.W1", hidden, 4 * hidden)], f"{p}.up")], f"{p}.act")
        x = node("Add", [x, node("MatMul", [up, w(f"{p}.W2", 4 * hidden, hidden)], f"{p}.down")], f"{p}.out")
    final = node("LayerNormalization", [x, "ln_scale", "ln_bias"], "ln_f", axis=-1)
    node("MatMul", [final, w("lm_head", hidden, vocab)], "logits")
    kv: list[str | int | None] = ["batch", heads, "past_seq", d]
    inputs = [
        helper.make_tensor_value_info("input_ids", I64, ["batch", "seq"]),
        helper.make_tensor_value_info("attention_mask", I64, ["batch", "total_seq"]),
        helper.make_tensor_value_info("position_ids", I64, ["batch", "seq"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", F, ["batch", "seq", vocab])]
    for n in range(layers):
        for part in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{n}.{part}", F, kv))
            outputs.append(helper.make_tensor_value_info(f"present.{n}.{part}", F, ["batch", heads, "total_seq", d]))
    graph = helper.make_graph(nodes, "gpt_decoder", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def decoder_feeds(tokens: list[int], done: int) -> dict[str, np.ndarray]:
    """The inputs of a decode step: the tokens not fed yet (``tokens[done:]``), batch 1."""
    new = tokens[done:]
    return {
        "input_ids": np.array([new], np.int64),
        "attention_mask": np.ones((1, len(tokens)), np.int64),
        "position_ids": np.arange(done, len(tokens), dtype=np.int64)[None, :],
    }


def generate(step: Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]], prompt: list[int], count: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy decoding of ``count`` tokens after ``prompt`` with any step function (a stream's
    ``step``); returns the new tokens and each step's last logits."""
    tokens = list(prompt)
    done = 0
    logits = []
    for _ in range(count):
        out = step(decoder_feeds(tokens, done))
        done = len(tokens)
        last = out["logits"][0, -1]
        logits.append(last)
        tokens.append(int(np.argmax(last)))
    return tokens[len(prompt):], logits


def decoder_session(model: ModelProto, threads: int = 1, spinning: bool = False) -> ort.InferenceSession:
    """The whole model in one onnxruntime session with ``threads`` intra-op threads (whose pool
    spins between parallel sections with ``spinning``, onnxruntime's default; else it does not)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def session_generate(session: ort.InferenceSession, prompt: list[int], count: int) -> tuple[list[int], list[np.ndarray]]:
    """:func:`generate` with the whole model in one session, the KV cache fed by hand."""
    past_names = [i.name for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    shapes = {i.name: i.shape for i in session.get_inputs()}
    cache = {n: np.zeros((1, shapes[n][1], 0, shapes[n][3]), np.float32) for n in past_names}
    out_names = [o.name for o in session.get_outputs()]

    def step(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        results = dict(zip(out_names, session.run(out_names, {**feeds, **cache}), strict=True))
        for n in past_names:
            cache[n] = results[n.replace("past_key_values.", "present.")]
        return results

    return generate(step, prompt, count)


def decode_in_threads(pipe: Any, prompts: list[list[int]], counts: list[int], apart: float, opened: bool = False) -> list[tuple[list[int], list[np.ndarray]]]:
    """Each prompt greedy-decoded through a stream of its own (``pipe.stream()``), in a thread of its
    own, the threads started ``apart`` seconds after one another (so streams join while others
    decode, and leave when their count is done); each stream's tokens and logits, in order. With
    ``opened``, every stream is opened before any thread starts (so every group's members are known
    before a step, as a server's sequences are) and closed after all are done.

    Raises:
        AssertionError: a thread failed (with its errors).
    """
    import time

    from tests.waiting import in_threads

    ready = [pipe.stream() for _ in prompts] if opened else None

    def run(k: int) -> tuple[list[int], list[np.ndarray]]:
        time.sleep(apart * k)
        if ready is not None:
            return generate(ready[k].step, prompts[k], counts[k])
        with pipe.stream() as s:
            return generate(s.step, prompts[k], counts[k])

    results = in_threads(run, len(prompts))
    for stream in ready or ():
        stream.close()
    return results


def quiet_member(pipe: Any, steps: int = 4) -> tuple[list[int], list[int]]:
    """Two streams in one group: b steps once (a prompt of 1) and goes quiet without closing, a
    (a prompt of 2) goes on for ``steps`` more steps alone. ``(a's prompt, a's tokens)``."""
    a, b = pipe.stream(), pipe.stream()
    futures = pipe.submit_steps({a: decoder_feeds([1, 2], 0), b: decoder_feeds([4], 0)})  # prompts of 2 and 1: two batches of 1
    futures[b].result(timeout=60)
    tokens = [1, 2, int(np.argmax(futures[a].result(timeout=60)["logits"][0, -1]))]
    for _ in range(steps):
        out = a.submit(decoder_feeds(tokens, len(tokens) - 1)).result(timeout=60)
        tokens.append(int(np.argmax(out["logits"][0, -1])))
    return tokens[:2], tokens[2:]


def whole_generate(model: ModelProto, prompt: list[int], count: int, threads: int = 1) -> tuple[list[int], list[np.ndarray]]:
    """:func:`session_generate` with a new session of the whole model."""
    return session_generate(decoder_session(model, threads), prompt, count)


def encoder_decoder() -> tuple[ModelProto, ModelProto]:
    """An encoder and a decoder, as optimum exports a seq2seq model's two halves (issue 39): the
    encoder ``h = 2 * x * mask`` (``x``, ``mask`` ``[batch, n]``) and the decoder
    ``y = state + tok + ReduceSum(h * mask, axis 1)`` with ``stateN = y`` (``tok``, ``state``
    ``[batch, 1]``), so each step's ``y`` says whether the decoder was fed the encoder's output and
    the mask of the stream's first step: ``y_t = sum of tok_0..tok_t + (t + 1) * ctx``, ``ctx =
    sum(2 * x * mask * mask)``."""
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    encoder = helper.make_graph(
        [helper.make_node("Mul", ["x", "mask"], ["xm"], name="masked"), helper.make_node("Mul", ["xm", "two"], ["h"], name="scaled")],
        "encoder",
        [helper.make_tensor_value_info("x", F, ["batch", "n"]), helper.make_tensor_value_info("mask", F, ["batch", "n"])],
        [helper.make_tensor_value_info("h", F, ["batch", "n"])],
        [two],
    )
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    decoder = helper.make_graph(
        [
            helper.make_node("Mul", ["h", "mask"], ["hm"], name="attend"),
            helper.make_node("ReduceSum", ["hm", "axes"], ["ctx"], keepdims=1, name="pool"),
            helper.make_node("Add", ["state", "tok"], ["st"], name="carry"),
            helper.make_node("Add", ["st", "ctx"], ["y"], name="out"),
            helper.make_node("Identity", ["y"], ["stateN"], name="next"),
        ],
        "decoder",
        [helper.make_tensor_value_info(n, F, ["batch", d]) for n, d in (("tok", 1), ("h", "n"), ("mask", "n"), ("state", 1))],
        [helper.make_tensor_value_info("y", F, ["batch", 1]), helper.make_tensor_value_info("stateN", F, ["batch", 1])],
        [axes],
    )
    return tuple(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8) for g in (encoder, decoder))  # type: ignore[return-value]


def encoder_decoder_config(max_batch: int = 1, runs: str = "first", states: bool = True) -> PipelineConfig:
    """The pair of :func:`encoder_decoder` wired as a user would: the encoder first-step-only
    (``runs``), the decoder with its state (or ``state`` a pipeline input without ``states``)."""
    encoder_model, decoder_model = encoder_decoder()
    config = PipelineConfig("encdec")
    encoder = config.add_stage(encoder_model, "encoder", runs=runs)
    decoder = config.add_stage(decoder_model, "decoder")
    for stage in (encoder, decoder):
        stage.configure(max_batch=max_batch)
    config.add_input(TensorSpec("x", "float32", ("batch", "n"))).connect(encoder.input("x"))
    mask = config.add_input(TensorSpec("mask", "float32", ("batch", "n")))
    mask.connect(encoder.input("mask"))
    mask.connect(decoder.input("mask"))
    config.add_input(TensorSpec("tok", "float32", ("batch", 1))).connect(decoder.input("tok"))
    encoder.output("h").connect(decoder.input("h"))
    decoder.output("y").connect(config.add_output(TensorSpec("y", "float32", ("batch", 1))))
    if states:
        config.add_state(decoder.output("stateN"), decoder.input("state"))
    else:
        config.add_input(TensorSpec("state", "float32", ("batch", 1))).connect(decoder.input("state"))
    return config


def encoder_decoder_whole(x: np.ndarray, mask: np.ndarray, toks: list[np.ndarray]) -> list[np.ndarray]:
    """What :func:`encoder_decoder`'s decoder gives at each step, worked out with numpy."""
    ctx = np.sum(2 * x * mask * mask, axis=1, keepdims=True)
    state, out = np.zeros((len(x), 1), np.float32), []
    for tok in toks:
        state = state + tok + ctx
        out.append(state)
    return out
