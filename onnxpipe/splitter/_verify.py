"""verify(): prove a split right by running the chained stages and the whole model on the same inputs.

Both run in onnxruntime (CPU, default optimizations). Every pipeline output is compared, and by
default every tensor that crosses a stage boundary too, against the same tensor of the whole model
(exposed as an extra output). Values match when ``|split - whole| <= atol + rtol * |whole|`` for
every element (numpy's ``allclose``, NaN equal to NaN); integer and boolean tensors must be equal.
The defaults, ``rtol=1e-4`` and ``atol=1e-5``, allow for the different kernel fusions onnxruntime
applies on either side of a cut, which reorder float sums.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import ModelProto

from onnxpipe._errors import SplitError
from onnxpipe.builder import CONFIG_FILE, save_model
from onnxpipe.runtime import Bundle, Endpoint, PipelineSpec, SequentialPipeline, is_bundle, random_inputs, read_bundle
from onnxpipe.splitter._graph import load_model
from onnxpipe.splitter._plan import SplitPlan

__all__ = ["Comparison", "VerifyReport", "verify"]

DEFAULT_RTOL = 1e-4
DEFAULT_ATOL = 1e-5


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


@dataclass
class VerifyReport:
    """The comparisons of one :func:`verify` call.

    Attributes:
        rows: One row per tensor, the worst error over all samples.
        rtol: Relative tolerance used.
        atol: Absolute tolerance used.
        samples: How many input sets were run.
        notes: What the user should know (symbolic dims defaulted, boundaries not compared, ...).
    """

    rows: list[Comparison]
    rtol: float
    atol: float
    samples: int
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every compared tensor is within tolerance."""
        return all(r.ok for r in self.rows)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "ok": self.ok,
            "rtol": self.rtol,
            "atol": self.atol,
            "samples": self.samples,
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
) -> VerifyReport:
    """Run the chained stages and the whole model on the same inputs and compare.

    Args:
        split: A :class:`SplitPlan`, a folder written by ``SplitPlan.save`` / ``onnxpipe split``, or a
            bundle (folder or archive, checked as the runtime checks it).
        model: The whole model (ModelProto or path).
        inputs: Input sets to use; default ``samples`` random sets (see :func:`random_inputs`).
        dims: Sizes of symbolic dims for random inputs.
        samples: How many random input sets.
        seed: Seed of the first random set.
        rtol: Relative tolerance.
        atol: Absolute tolerance.
        boundaries: Also compare every tensor crossing a stage boundary.
        target: Run every stage on this target instead of its own (e.g. ``"cpu"`` for a bundle
            built for a provider this host lacks).

    Returns:
        The :class:`VerifyReport`; ``report.ok`` says whether everything matched.
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
        pipeline = SequentialPipeline(spec, source, target=target)
        proto, model_dir = load_model(model)
        crossing = _crossing(spec) if boundaries else []
        notes: list[str] = []
        whole = _whole_session(proto, model_dir, crossing, Path(tmp))
        if inputs is None:
            generated: list[Mapping[str, np.ndarray]] = []
            for k in range(samples):
                sample, dim_notes = random_inputs(spec.inputs, dims, seed + k)
                generated.append(sample)
                notes.extend(n for n in dim_notes if n not in notes)
            inputs = generated
        rows: dict[str, Comparison] = {}
        for feeds in inputs:
            values = pipeline.run_all(feeds)
            expected = dict(zip([o.name for o in whole.get_outputs()], whole.run(None, dict(feeds)), strict=True))
            for t in spec.outputs:
                _merge(rows, _compare(t.name, "output", values[spec.source_of(Endpoint(None, t.name))], expected[t.name], rtol, atol))
            for ep in crossing:
                _merge(rows, _compare(ep.tensor, "boundary", values[ep], expected[ep.tensor], rtol, atol))
    return VerifyReport(list(rows.values()), rtol, atol, len(inputs), notes)


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


def _whole_session(proto: ModelProto, model_dir: Path | None, crossing: list[Endpoint], tmp: Path) -> ort.InferenceSession:
    """The whole model with every boundary tensor as an extra output.

    A model with external data is written to ``tmp`` with its own copy of the weights (streamed,
    see :func:`~onnxpipe.builder.save_model`), since onnxruntime finds external data only next to
    the model file it opens.
    """
    augmented = ModelProto()
    augmented.CopyFrom(proto)
    declared = {v.name for v in augmented.graph.output}
    for ep in crossing:
        if ep.tensor not in declared:
            augmented.graph.output.add(name=ep.tensor)  # untyped: onnxruntime infers it
    if not any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
        return ort.InferenceSession(augmented.SerializeToString(), providers=["CPUExecutionProvider"])
    if model_dir is None:
        raise SplitError("the model keeps its weights in external data: pass its path rather than a loaded ModelProto")
    path = tmp / "whole.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # an IR bump of this private copy is no news to the user
        save_model(augmented, path, model_dir)
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _compare(name: str, kind: str, got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> Comparison:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return Comparison(name, kind, tuple(want.shape), np.inf, np.inf, False, f"got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}")
    if want.size == 0:
        return Comparison(name, kind, tuple(want.shape), 0.0, 0.0, True)
    if want.dtype.kind not in "fc":
        equal = bool(np.array_equal(got, want))
        return Comparison(name, kind, tuple(want.shape), 0.0 if equal else np.inf, 0.0 if equal else np.inf, equal)
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    both_nan = np.isnan(got) & np.isnan(want)
    diff = np.where(both_nan, 0.0, diff)
    rel = diff / np.maximum(np.abs(want.astype(np.float64)), atol)
    ok = bool(np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True))
    return Comparison(name, kind, tuple(want.shape), float(np.nanmax(diff)), float(np.nanmax(rel)), ok)


def _merge(rows: dict[str, Comparison], new: Comparison) -> None:
    old = rows.get(new.tensor)
    if old is None:
        rows[new.tensor] = new
        return
    old.max_abs, old.max_rel = max(old.max_abs, new.max_abs), max(old.max_rel, new.max_rel)
    old.ok = old.ok and new.ok
    old.problem = old.problem or new.problem
