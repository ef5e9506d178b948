"""verify(): prove a split right by running the chained stages and the whole model on the same inputs.

Both run in onnxruntime (CPU, default optimizations). Every pipeline output is compared, and by
default every tensor that crosses a stage boundary too, against the same tensor of the whole model
(exposed as an extra output). Values match when ``|split - whole| <= atol + rtol * |whole|`` for
every element; integer and boolean tensors must be equal. A NaN or inf on one side only is a
mismatch, and an output the whole model gives non-finite values for fails the check unless
``allow_nonfinite`` (Note: non-finite values prove nothing, in ``runtime/_compare.py``).
The defaults, ``rtol=1e-4`` and ``atol=1e-5``, allow for the different kernel fusions onnxruntime
applies on either side of a cut, which reorder float sums.

Note: verifying a split with state.
    A split with state links (``split(..., states="auto")``, docs/streams.md) has no stateless
    request to run: its stages feed themselves their past. So it runs ``samples`` streams of
    ``steps`` steps each, through the pipeline's own streams (``Pipeline.stream``: the stages keep
    the state, as on a deployment host) and through the whole model with the state fed back by
    hand (zeros first, 0 long along each state link's ``empty_axis``: an empty past). The steps are
    a decoder's, made by ``runtime/_feeds.py``'s ``StreamFeeds`` as ``benchmark`` makes them (Note:
    a stream's sample steps): a prompt of 3 tokens (or as many as ``dims`` gives the token ids'
    dim 1), then steps of one token each, the greedy token of the whole model's ``logits`` at the
    step before. Every step's pipeline outputs are compared; the tensors
    crossing a boundary are not (a stream returns the pipeline's outputs only), though every one
    of them feeds the outputs of that step or a later one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import onnx
import onnxruntime as ort
from onnx import ModelProto

from onnxpipe._errors import InputError, OnnxpipeError, SplitError, ort_message
from onnxpipe.builder import CONFIG_FILE, save_model
from onnxpipe.runtime import (
    Bundle,
    Endpoint,
    Manifest,
    Pipeline,
    PipelineSpec,
    SequentialPipeline,
    check_inputs,
    is_bundle,
    random_inputs,
    read_bundle,
)
from onnxpipe.runtime._compare import difference
from onnxpipe.runtime._feeds import StreamFeeds
from onnxpipe.runtime._inputs import defaulted_dims, dims_hint, feed_shapes
from onnxpipe.runtime._values import spec_values, split_sizes
from onnxpipe.splitter._graph import load_model
from onnxpipe.splitter._plan import SplitPlan
from onnxpipe.splitter._values import graph_values

__all__ = ["Comparison", "VerifyReport", "verify"]

DEFAULT_RTOL = 1e-4
DEFAULT_ATOL = 1e-5
DEFAULT_STEPS = 4
_T = TypeVar("_T")


@dataclass
class Comparison:
    """One tensor compared between the chained stages and the whole model."""

    tensor: str
    kind: str  # "output" or "boundary"
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    ok: bool
    problem: str = ""
    #: The non-finite values of the whole model's tensor, the same in the split (``"12 of 12 values NaN"``).
    nonfinite: str = ""
    #: An output the whole model gives non-finite values for (``nonfinite``), not allowed: the check proves nothing.
    unproven: bool = False


@dataclass
class VerifyReport:
    """The comparisons of one :func:`verify` call.

    Attributes:
        rows: One row per tensor, the worst error over all samples.
        rtol: Relative tolerance used.
        atol: Absolute tolerance used.
        samples: How many input sets (or streams) were run.
        notes: What the user should know (symbolic dims defaulted, boundaries not compared, ...).
        steps: The steps of each stream, for a split with state (Note: verifying a split with
            state); 0 when each sample was one stateless request.
        given: The inputs were the caller's (``inputs=``, ``verify --inputs``), not random ones.
    """

    rows: list[Comparison]
    rtol: float
    atol: float
    samples: int
    notes: list[str] = field(default_factory=list)
    steps: int = 0
    given: bool = False

    @property
    def ok(self) -> bool:
        """True when every compared tensor is within tolerance (and every output finite, unless allowed)."""
        return all(r.ok for r in self.rows)

    @property
    def unproven(self) -> list[Comparison]:
        """The outputs the whole model gives non-finite values for, which the check cannot prove
        (Note: non-finite values prove nothing, in ``runtime/_compare.py``)."""
        return [r for r in self.rows if r.unproven]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "ok": self.ok,
            "rtol": self.rtol,
            "atol": self.atol,
            "samples": self.samples,
            "steps": self.steps,
            "given": self.given,
            "notes": self.notes,
            "tensors": [
                r.__dict__ | {"shape": list(r.shape), "max_abs": _finite(r.max_abs), "max_rel": _finite(r.max_rel)} for r in self.rows
            ],
        }


def _finite(x: float) -> float | None:
    # Strict JSON has no Infinity or NaN: a shape or dtype mismatch is reported as null.
    return x if np.isfinite(x) else None


def verify(
    split: SplitPlan | str | os.PathLike[str],
    model: ModelProto | str | os.PathLike[str],
    *,
    inputs: Sequence[Mapping[str, np.ndarray]] | None = None,
    dims: Mapping[str, int] | None = None,
    samples: int = 1,
    seed: int = 0,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    boundaries: bool = True,
    target: str | None = None,
    steps: int = DEFAULT_STEPS,
    allow_nonfinite: bool = False,
) -> VerifyReport:
    """Run the chained stages and the whole model on the same inputs and compare.

    A split with state links runs streams of steps instead (Note: verifying a split with state).

    Args:
        split: A :class:`SplitPlan`, a folder written by ``SplitPlan.save`` / ``onnxpipe split``, or a
            bundle (folder or archive, checked as the runtime checks it).
        model: The whole model (ModelProto or path).
        inputs: Input sets to use; default ``samples`` random sets (see :func:`random_inputs`). For
            a split with state: the pipeline inputs of one stream's steps, in order.
        dims: Sizes of symbolic dims for random inputs.
        samples: How many random input sets (for a split with state: streams).
        seed: Seed of the first random set.
        rtol: Relative tolerance.
        atol: Absolute tolerance.
        boundaries: Also compare every tensor crossing a stage boundary (not in a stream).
        target: Run every stage on this target instead of its own (e.g. ``"cpu"`` for a bundle
            built for a provider this host lacks).
        steps: The steps of each random stream, for a split with state.
        allow_nonfinite: Accept outputs the whole model gives NaN or inf for, where the split
            gives the same (a model whose outputs hold ``-inf`` by design); by default such an
            output fails (``Comparison.unproven``): the check proves nothing there. A NaN or
            inf on one side only fails either way.

    Returns:
        The :class:`VerifyReport`; ``report.ok`` says whether everything matched.

    Raises:
        InputError: ``dims`` names no dim of the inputs, or the whole model (or a stage) fails on
            the random inputs, naming the dims that were not given (they were 1).
        StageError: a stage fails on inputs that the whole model runs.
    """
    with tempfile.TemporaryDirectory(prefix="onnxpipe-verify-") as tmp, contextlib.ExitStack() as stack:
        source: Path | Bundle
        if isinstance(split, SplitPlan):
            source = split.save(Path(tmp) / "split")
            spec = _read_spec(source)
        elif is_bundle(split):
            source = stack.enter_context(read_bundle(split))
            spec = source.spec
        else:
            source = Path(split)
            spec = _read_spec(source)
        if spec.states:
            return _verify_streams(spec, source, model, Path(tmp), inputs, dict(dims or {}), samples, seed, rtol, atol, boundaries, target, steps,
                                   allow_nonfinite)
        pipeline = SequentialPipeline(spec, source, target=target)
        proto, model_dir = load_model(model)
        crossing = _crossing(spec) if boundaries else []
        notes: list[str] = []
        whole = _whole_session(proto, model_dir, [ep.tensor for ep in crossing], Path(tmp))
        hint = ""
        given = "the given inputs"
        caller = inputs is not None
        if inputs is not None:
            inputs = [_given_set(spec, feeds, k) for k, feeds in enumerate(inputs)]
        else:
            given = "the random inputs"
            generated: list[Mapping[str, np.ndarray]] = []
            dims, notes = split_sizes(spec, dims)  # the sizes the split was made for, unless given
            meanings = spec_values(spec) or graph_values(proto, {t.name: t for t in spec.inputs})  # Note: sample values
            for k in range(samples):
                sample, dim_notes = random_inputs(spec.inputs, dims, seed + k, meanings)
                generated.append(sample)
                notes.extend(n for n in dim_notes if n not in notes)
            inputs = generated
            hint = dims_hint(defaulted_dims(spec.inputs, dims))
        rows: dict[str, Comparison] = {}
        names = [o.name for o in whole.get_outputs()]
        for k, feeds in enumerate(inputs):
            expected = dict(zip(names, _run_whole(whole, names, feeds, f"input set {k}", hint), strict=True))
            values = _run_split(pipeline.run_all, feeds, hint)
            for t in spec.outputs:
                _merge(rows, _compare(t.name, "output", values[spec.source_of(Endpoint(None, t.name))], expected[t.name], rtol, atol, allow_nonfinite, given))
            for ep in crossing:
                _merge(rows, _compare(ep.tensor, "boundary", values[ep], expected[ep.tensor], rtol, atol))
    return VerifyReport(list(rows.values()), rtol, atol, len(inputs), notes + _nonfinite_notes(rows.values()), given=caller)


def _given_set(spec: PipelineSpec, feeds: Mapping[str, np.ndarray], k: int) -> dict[str, np.ndarray]:
    """Input set ``k`` of the caller's, checked against the pipeline's inputs as a request is."""
    try:
        return check_inputs(spec.inputs, feeds)
    except InputError as e:
        raise InputError(f"input set {k}: {e}") from e


def _run_whole(whole: ort.InferenceSession, names: Sequence[str], feeds: Mapping[str, np.ndarray], what: str, hint: str) -> list[np.ndarray]:
    """The whole model's outputs ``names`` on ``feeds``; a model that cannot run them is the inputs'
    fault (``hint``: which dims were defaulted), not the split's."""
    try:
        return list(whole.run(list(names), dict(feeds)))
    except Exception as e:  # onnxruntime's own types (Fail, InvalidArgument, ...)
        raise InputError(f"the whole model fails on {what} ({feed_shapes(feeds)}): {ort_message(e)}" + (f"; {hint}" if hint else "")) from e


def _run_split(run: Callable[[Mapping[str, np.ndarray]], _T], feeds: Mapping[str, np.ndarray], hint: str) -> _T:
    """``run(feeds)`` through the stages; a stage's failure says which dims were defaulted (``hint``)."""
    try:
        return run(feeds)
    except OnnxpipeError as e:
        if not hint:
            raise
        raise InputError(f"{' '.join(str(e).split())}; {hint}") from e


def _verify_streams(
    spec: PipelineSpec,
    source: Path | Bundle,
    model: ModelProto | str | os.PathLike[str],
    tmp: Path,
    inputs: Sequence[Mapping[str, np.ndarray]] | None,
    dims: dict[str, int],
    samples: int,
    seed: int,
    rtol: float,
    atol: float,
    boundaries: bool,
    target: str | None,
    steps: int,
    allow_nonfinite: bool,
) -> VerifyReport:
    """:func:`verify` of a split with state (Note: verifying a split with state)."""
    if steps < 1:
        raise InputError(f"steps must be at least 1, got {steps}")
    feeder = StreamFeeds(spec, dims)
    proto, model_dir = load_model(model)
    whole = _whole_session(proto, model_dir, [link.output for link in spec.states], tmp)
    names = [o.name for o in whole.get_outputs()]
    bundle = source if isinstance(source, Bundle) else Bundle(source, spec, Manifest(files={}))
    given = list(inputs) if inputs is not None else None
    count = len(given) if given is not None else steps
    streams = 1 if given is not None else samples
    rows: dict[str, Comparison] = {}
    with Pipeline(bundle, target, max_streams=1) as pipe:
        for k in range(streams):
            expected: dict[str, np.ndarray] = {}
            with pipe.stream() as stream:
                for step in range(count):
                    if given is not None:
                        feeds, hint = check_inputs(spec.inputs, given[step]), ""
                    else:
                        feeds, hint = feeder.step(step, expected, seed + k * count + step)
                    state = feeder.state(feeds, expected)
                    what = f"step {step} of stream {k}"
                    expected = dict(zip(names, _run_whole(whole, names, {**_pipeline_inputs(spec, feeds), **state}, what, hint), strict=True))
                    got = _run_split(stream.step, _pipeline_inputs(spec, feeds), hint)
                    for t in spec.outputs:
                        _merge(rows, _compare(t.name, "output", got[t.name], expected[t.name], rtol, atol, allow_nonfinite, "the stream's steps"))
    if given is not None:
        what = "the given inputs"
    elif feeder.logits is not None:
        what = f"a prompt of {feeder.prompt} token(s), then one token a step: the greedy token of '{feeder.logits}' at the step before"
    else:
        what = "random inputs"
    notes = [f"ran {streams} stream(s) of {count} step(s) ({what}), the state kept in the stages and fed back by hand to the whole model",
             *(feeder.notes if given is None else []), *_nonfinite_notes(rows.values())]
    if boundaries and _crossing(spec):
        notes.append("tensors crossing stage boundaries are not compared in a stream (a stream returns the pipeline's outputs only)")
    return VerifyReport(list(rows.values()), rtol, atol, streams, notes, steps=count, given=given is not None)


def _pipeline_inputs(spec: PipelineSpec, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {t.name: feeds[t.name] for t in spec.inputs}


def _read_spec(folder: Path) -> PipelineSpec:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise SplitError(f"'{folder}' is not a split folder: it has no {CONFIG_FILE}")
    return PipelineSpec.from_json(file.read_text())


def _crossing(spec: PipelineSpec) -> list[Endpoint]:
    """Stage outputs that feed another stage and are not pipeline outputs already."""
    outputs = {t.name for t in spec.outputs}
    seen: dict[Endpoint, None] = {}
    for link in spec.links:
        if link.src.stage is not None and link.dst.stage is not None and link.src.tensor not in outputs:
            seen[link.src] = None
    return list(seen)


def _whole_session(proto: ModelProto, model_dir: Path | None, extra: Sequence[str], tmp: Path) -> ort.InferenceSession:
    """The whole model with the tensors ``extra`` (boundary tensors, states) as outputs too.

    A model with external data is written to ``tmp`` with its own copy of the weights (streamed,
    see :func:`~onnxpipe.builder.save_model`), since onnxruntime finds external data only next to
    the model file it opens.
    """
    augmented = ModelProto()
    augmented.CopyFrom(proto)
    declared = {v.name for v in augmented.graph.output}
    for name in extra:
        if name not in declared:
            augmented.graph.output.add(name=name)  # untyped: onnxruntime infers it
    if not any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
        return ort.InferenceSession(augmented.SerializeToString(), _quiet(), providers=["CPUExecutionProvider"])
    if model_dir is None:
        raise SplitError("the model keeps its weights in external data: pass its path rather than a loaded ModelProto")
    path = tmp / "whole.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # an IR bump of this private copy is no news to the user
        save_model(augmented, path, model_dir)
    return ort.InferenceSession(str(path), _quiet(), providers=["CPUExecutionProvider"])


def _quiet() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 4  # its failure on the inputs is an InputError (see _run_whole), not a log line on the user's terminal
    return options


def _compare(name: str, kind: str, got: np.ndarray, want: np.ndarray, rtol: float, atol: float, allow_nonfinite: bool = True, inputs: str = "") -> Comparison:
    """One tensor compared (Note: non-finite values prove nothing, in ``runtime/_compare.py``): an
    output the whole model gives non-finite values for on ``inputs`` fails unless ``allow_nonfinite``."""
    d = difference(got, want, rtol, atol, ("the split", "the whole model"))
    shape = tuple(np.shape(want))
    unproven = bool(d.nonfinite) and not allow_nonfinite and d.ok  # a mismatch fails as one, whatever else
    problem = d.problem or (f"the whole model's output is not finite on {inputs} ({d.nonfinite}): the check proves nothing" if unproven else "")
    return Comparison(name, kind, shape, d.max_abs, d.max_rel, d.ok and not unproven, problem, d.nonfinite, unproven)


def _nonfinite_notes(rows: Iterable[Comparison]) -> list[str]:
    """What the report says of the non-finite values both sides share where they do not fail it."""
    return [f"{r.kind} '{r.tensor}' is not finite in the whole model ({r.nonfinite}), and the same in the split"
            + (": allowed (allow_nonfinite)" if r.kind == "output" else "") for r in rows if r.nonfinite and not r.unproven]


def _merge(rows: dict[str, Comparison], new: Comparison) -> None:
    old = rows.get(new.tensor)
    if old is None:
        rows[new.tensor] = new
        return
    old.max_abs, old.max_rel = max(old.max_abs, new.max_abs), max(old.max_rel, new.max_rel)
    old.ok = old.ok and new.ok
    old.problem = old.problem or new.problem
    old.nonfinite = old.nonfinite or new.nonfinite
    old.unproven = old.unproven or new.unproven
