"""The cost model: how long each node takes on the target, and what handing a tensor over costs.

Note: measuring node costs.
    The whole model runs under onnxruntime's profiler with the settings its stages will use
    (provider, threads, optimization level), several warm runs, and each node's kernel time is the
    median over runs. onnxruntime fuses and rewrites nodes, so profiled kernels are mapped back to
    the original nodes: by node name, else by the tensor the kernel produces (a fused Conv+Relu is
    named after its output, e.g. ``r1_nchwc``, and charged to the node producing ``r1``), else to
    the kernel that ran just before it (layout reorders sit next to the convolution they serve).
    Kernel times are then scaled so they add up to the measured (unprofiled) run time, which
    spreads the framework's per-run overhead over the nodes. Nodes folded away (weights) cost 0.

    When the target's provider is not on this host, costs come from an analytic model instead
    (multiply-adds for Conv / Gemm / MatMul, bytes moved for everything else), marked
    ``source="analytic"``: good for balancing, not for predicting seconds.

    Handing a tensor from one stage to the next costs a fixed per-hop time (the runtime's queue and
    wake-up) plus its bytes times a per-byte cost (the consumer reading data another core wrote),
    both measured on this host.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import ModelProto

from onnxpipe._errors import SplitError, ort_message
from onnxpipe.builder import tensor_spec
from onnxpipe.runtime import StageSettings, TensorSpec, random_inputs
from onnxpipe.runtime._dims import dim_names
from onnxpipe.runtime.bundle import sha256_file
from onnxpipe.splitter._extract import infer_types
from onnxpipe.splitter._graph import GraphIndex, load_model
from onnxpipe.splitter._sizes import kernel_floors, sample_dims
from onnxpipe.splitter._values import graph_values

__all__ = ["CostProfile", "median_run_seconds", "profile_model"]

PROFILE_VERSION = 1
_SUFFIXES = re.compile(r"(_nchwc|_fused.*|_token_\d+|_output_\d+|_\d+)$")
_HOP_SECONDS = 25e-6  # queue hand-over and wake-up, measured with identity stages (benchmarks/pipeline_efficiency.py)
_ANALYTIC_FLOPS = 2e10  # nominal multiply-add rate for the analytic fallback; only ratios matter there
_MIN_SECONDS = 0.3  # profile at least this long...
_MAX_RUNS = 200  # ...but no more runs than this


@dataclass
class CostProfile:
    """Per-node costs of one model under one set of settings.

    Attributes:
        model_sha256: Hash of the model file (or serialized model) the costs belong to.
        settings: The settings profiled with (provider, threads, optimization).
        source: ``measured`` (onnxruntime profiler) or ``analytic`` (FLOPs and bytes).
        node_seconds: Cost of each node, by its index in ``model.graph.node``.
        total_seconds: One whole-model run (median), unprofiled.
        hop_seconds: Fixed cost of one hand-over between stages.
        byte_seconds: Cost per byte handed over.
        runs: Profiled runs the medians come from.
        unmatched: Profiled kernels that matched no node by name and were charged to their neighbour.
        notes: What the user should know about the profiling inputs (dynamic dims sized 1, ...).
    """

    model_sha256: str
    settings: dict[str, Any]
    source: str
    node_seconds: dict[int, float]
    total_seconds: float
    hop_seconds: float
    byte_seconds: float
    runs: int
    unmatched: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def crossing_seconds(self, nbytes: int) -> float:
        """Time to hand ``nbytes`` over to the next stage."""
        return self.hop_seconds + nbytes * self.byte_seconds

    def to_json(self) -> str:
        """JSON text (node indices as strings)."""
        data = asdict(self)
        data["node_seconds"] = {str(k): v for k, v in self.node_seconds.items()}
        return json.dumps({"version": PROFILE_VERSION, **data}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> CostProfile:
        """Read :meth:`to_json` output."""
        data = json.loads(text)
        if data.pop("version", None) != PROFILE_VERSION:
            raise ValueError("profile cache of another version")
        data["node_seconds"] = {int(k): float(v) for k, v in data["node_seconds"].items()}
        return cls(**data)


def _model_bytes(model: ModelProto) -> bytes:
    return model.SerializeToString()


def _cache_key(digest: str, settings: StageSettings, dims: Mapping[str, int]) -> str:
    # Not keyed by ``runs``: a profile of 3 runs serves a request for 5 as well as it can.
    wanted = {"provider": settings.provider, "threads": settings.intra_op_threads, "opt": settings.optimization, "dims": dict(dims)}
    return hashlib.sha256((digest + json.dumps(wanted, sort_keys=True)).encode()).hexdigest()[:16]


#: Where profiles are cached when neither ``cache_dir`` nor the model's own folder is used.
CACHE_ENV = "ONNXPIPE_CACHE_DIR"


def _cache_path(model_path: Path | None, key: str, cache_dir: Path | None) -> Path:
    if cache_dir is None and os.environ.get(CACHE_ENV):
        cache_dir = Path(os.environ[CACHE_ENV])
    if cache_dir is not None:
        return cache_dir / f"{key}.profile.json"
    # Next to the model, unless it lives in an installed package (the onnx wheel's light models).
    if model_path is not None and os.access(model_path.parent, os.W_OK) and "site-packages" not in model_path.parts:
        return model_path.parent / f"{model_path.name}.{key}.profile.json"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "onnxpipe" / f"{key}.profile.json"


def profile_model(
    model: ModelProto | str | os.PathLike[str],
    settings: StageSettings | None = None,
    *,
    runs: int = 5,
    dims: Mapping[str, int] | None = None,
    cache: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
) -> CostProfile:
    """Measure (or recall) the cost of every node of ``model``.

    The profile is cached, keyed by the model's hash and the settings, so planning again is
    instant: in ``cache_dir`` if given, else in ``$ONNXPIPE_CACHE_DIR`` if set, else next to the
    model (``<model>.onnx.<key>.profile.json``), or in the user's cache folder
    (``$XDG_CACHE_HOME/onnxpipe``, ``~/.cache/onnxpipe``) when the model's folder is not writable or
    is inside an installed package.

    Args:
        model: The model (path or ModelProto).
        settings: The settings stages will run with (default: CPU, 1 thread).
        runs: Profiled runs at least (more for fast models, until 0.3 s of runs, 200 at most);
            node costs are medians over them.
        dims: Sizes of symbolic input dims for the profiling inputs.
        cache: Read and write the cache.
        cache_dir: Where the cache lives instead of next to the model.

    Returns:
        The :class:`CostProfile`.
    """
    settings = settings or StageSettings()
    path = None if isinstance(model, ModelProto) else Path(model)
    proto, _ = load_model(model)
    digest = sha256_file(path) if path is not None else hashlib.sha256(_model_bytes(proto)).hexdigest()
    key = _cache_key(digest, settings, dims or {})
    file = _cache_path(path, key, Path(cache_dir) if cache_dir else None)
    if cache and file.is_file():
        try:
            return CostProfile.from_json(file.read_text())
        except (ValueError, KeyError, TypeError):
            pass  # a stale or foreign cache file: measure again
    index = GraphIndex(proto)
    if settings.provider in ort.get_available_providers():
        profile = _measure(proto, path, index, settings, runs, dims or {}, digest)
    else:
        profile = _analytic(proto, index, settings, digest)
    if cache:
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(profile.to_json())
        except OSError:
            pass  # caching is a convenience
    return profile


def _session_source(proto: ModelProto, path: Path | None, tmp: Path) -> str | bytes:
    if path is not None:
        return str(path)
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
        raise SplitError("an in-memory model with external data cannot be profiled; pass its path")
    return proto.SerializeToString()


def _measure(proto: ModelProto, path: Path | None, index: GraphIndex, settings: StageSettings, runs: int, dims: Mapping[str, int], digest: str) -> CostProfile:
    types, _ = infer_types(proto)
    specs = [tensor_spec(types[name]) for name in index.inputs]
    dims = sample_dims(proto, dims, types)  # Note: dims the graph fixes (_sizes)
    feeds, notes = random_inputs(specs, dims, values=graph_values(proto))
    with tempfile.TemporaryDirectory(prefix="onnxpipe-profile-") as tmp:
        source = _session_source(proto, path, Path(tmp))
        try:
            plain = ort.InferenceSession(source, sess_options=_quiet(settings.replace(affinity=None).session_options()), providers=settings.providers())
            for _ in range(2):
                plain.run(None, feeds)
        except Exception as e:  # onnxruntime's own types: a model that cannot run on these sizes
            raise SplitError(_unprofiled(proto, specs, feeds, dims, e, kernel_floors(proto, types))) from e
        # Small models run many more times than asked: a median of 5 runs of 2 ms is noise.
        total, runs = median_run_seconds(functools.partial(plain.run, None, feeds), runs, _MIN_SECONDS, _MAX_RUNS)
        opts = settings.replace(affinity=None).session_options()
        opts.enable_profiling = True
        opts.profile_file_prefix = str(Path(tmp) / "profile")
        profiled = ort.InferenceSession(source, sess_options=opts, providers=settings.providers())
        for _ in range(runs + 1):
            profiled.run(None, feeds)
        events = json.loads(Path(profiled.end_profiling()).read_text())
    node_seconds, unmatched = _attribute(events, index, runs)
    node_seconds = _to_chain_heads(index, node_seconds)
    kernel_sum = sum(node_seconds.values())
    scale = total / kernel_sum if kernel_sum > 0 else 1.0
    return CostProfile(
        model_sha256=digest,
        settings={"provider": settings.provider, "intra_op_threads": settings.intra_op_threads, "optimization": settings.optimization},
        source="measured",
        node_seconds={i: s * scale for i, s in node_seconds.items()},
        total_seconds=total,
        hop_seconds=_HOP_SECONDS,
        byte_seconds=_byte_seconds(),
        runs=runs,
        unmatched=sorted(unmatched),
        notes=[f"profiled with {n}" for n in notes],
    )


def _quiet(options: ort.SessionOptions) -> ort.SessionOptions:
    """onnxruntime logs a failed run at error level to the terminal; the SplitError says it instead."""
    options.log_severity_level = 4
    return options


def _unprofiled(proto: ModelProto, specs: Sequence[TensorSpec], feeds: Mapping[str, np.ndarray], dims: Mapping[str, int], error: Exception,
                floors: Mapping[str, tuple[int, str]]) -> str:
    """Why profiling could not run the model: the shapes it fed, the dims it sized 1 (and why 1 fails,
    where a Conv's kernel says: ``floors``, Note: a convolution's least input), and how to size them."""
    leading: dict[str, bool] = {}  # each dim not given -> whether it leads (a batch of 1 is seldom what fails, so it is named last)
    for spec in specs:
        for axis, d in enumerate(spec.shape or ()):
            key = d if isinstance(d, str) and d else f"{spec.name}.{axis}"
            if isinstance(d, int) or key in dims or f"{spec.name}.{axis}" in dims:
                continue
            for name in sorted(dim_names(key) or {key}):  # a formula is computed from the dims it names: those are asked for
                if name not in dims:
                    leading.setdefault(name, axis == 0 and len(spec.shape or ()) >= 2)
    defaulted = sorted(leading, key=lambda k: leading[k])  # stable: in order of first sight, the leading ones last
    shapes = ", ".join(f"'{n}' {list(a.shape)}" for n, a in feeds.items())
    name = proto.graph.name or "the model"
    head = f"profiling cannot run {name}: onnxruntime failed on random inputs of shapes {shapes}: {ort_message(error)}"
    if not defaulted:
        return head
    given = " ".join(f"--dim {k}=SIZE" for k in defaulted)
    why = _too_short(defaulted, floors) or "a convolutional model needs real image sizes"
    return (f"{head}. Symbolic dims not given were sized 1 ({', '.join(defaulted)}), which this model may not take ({why}); "
            f"give them: {given} (in Python: dims={{NAME: SIZE}})")


def _too_short(defaulted: Sequence[str], floors: Mapping[str, tuple[int, str]]) -> str:
    """Which of the dims sized 1 a Conv needs longer (Note: a convolution's least input, ``_sizes``), by Conv."""
    short: dict[tuple[int, str], list[str]] = {}  # (least size, Conv) -> the dims it slides along
    for k in defaulted:
        if k in floors:
            short.setdefault(floors[k], []).append(k)
    return "; ".join(f"{', '.join(ks)}: 1 is shorter than the kernel of Conv '{conv}', which needs at least {least}" for (least, conv), ks in short.items())


def _attribute(events: list[dict[str, Any]], index: GraphIndex, runs: int) -> tuple[dict[int, float], set[str]]:
    """Median kernel seconds per original node; the first of ``runs + 1`` profiled runs is a warm-up."""
    kernels = sorted((e for e in events if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")), key=lambda e: e["ts"])
    if not kernels:
        return {}, set()
    per_run = len(kernels) // (runs + 1)
    by_run: list[dict[int, float]] = []
    unmatched: set[str] = set()
    for r in range(1, runs + 1):
        chunk = kernels[r * per_run : (r + 1) * per_run]
        costs: dict[int, float] = {}
        previous: int | None = None
        for e in chunk:
            name = e["name"][: -len("_kernel_time")]
            node = _match(name, index)
            if node is None:
                unmatched.add(name)
                node = previous
            if node is None:
                continue
            costs[node] = costs.get(node, 0.0) + e["dur"] * 1e-6
            previous = node
        by_run.append(costs)
    nodes = set().union(*by_run)
    return {n: statistics.median(run.get(n, 0.0) for run in by_run) for n in nodes}, unmatched


def _to_chain_heads(index: GraphIndex, costs: dict[int, float]) -> dict[int, float]:
    """Charge a fused kernel to the first node of the chain it absorbed.

    onnxruntime names a fused Conv+BatchNormalization+Relu kernel after the Relu's output, so the
    Conv and the BatchNormalization show no time of their own. The work is the Conv's: if a cut
    fell inside the chain, the Conv's side would pay for it. So the cost moves up a chain of nodes
    that have no time of their own and feed only the next node of the chain.
    """
    out = dict(costs)
    for node in sorted(costs, key=index.position.__getitem__, reverse=True):
        head = node
        while True:
            feeders = {index.producer[x] for x in index.node_inputs[head] if x in index.producer and not index.is_weight_tensor(x)}
            if len(feeders) != 1:
                break
            (prev,) = feeders
            sole = all(index.consumers.get(o, []) == [head] for o in index.nodes[prev].output if o)
            if out.get(prev, 0.0) > 0 or not sole or prev in costs:
                break
            head = prev
        if head != node:
            out[head] = out.pop(node)
    return out


def _match(name: str, index: GraphIndex) -> int | None:
    candidate = name
    for _ in range(3):
        if candidate in index.by_name:
            return index.by_name[candidate]
        if candidate in index.producer:
            return index.producer[candidate]
        stripped = _SUFFIXES.sub("", candidate)
        if stripped == candidate:
            break
        candidate = stripped
    return None


def median_run_seconds(run: Callable[[], object], runs: int, min_seconds: float, max_runs: int) -> tuple[float, int]:
    """The median seconds of a call of ``run``, and how many were timed: at least ``runs``, more
    (up to ``max_runs``) until ``min_seconds`` of them, so that fast calls are timed often."""
    samples: list[float] = []
    while len(samples) < runs or (sum(samples) < min_seconds and len(samples) < max_runs):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), len(samples)


def _byte_seconds() -> float:
    """Seconds per byte of reading a tensor another core wrote: a copy through memory, per byte."""
    src = np.ones(1 << 22, np.float32)  # 16 MiB: past the caches
    dst = np.empty_like(src)
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) / src.nbytes


def _analytic(proto: ModelProto, index: GraphIndex, settings: StageSettings, digest: str) -> CostProfile:
    types, _ = infer_types(proto)
    specs = {name: tensor_spec(v) for name, v in types.items() if v.type.HasField("tensor_type")}
    costs: dict[int, float] = {}
    for i in index.compute_nodes():
        node = index.nodes[i]
        out = specs.get(node.output[0]) if node.output else None
        out_elems = (out.nbytes(default=1) or 0) // max(1, _itemsize(out)) if out else 0
        if node.op_type == "Conv" and len(node.input) > 1 and node.input[1] in specs:
            w = specs[node.input[1]].shape or ()
            per_out = int(np.prod([d for d in w[1:] if isinstance(d, int)])) if w else 1
            flops = 2 * out_elems * per_out
        elif node.op_type in ("Gemm", "MatMul") and node.input and node.input[0] in specs:
            a = specs[node.input[0]].shape or ()
            k = a[-1] if a and isinstance(a[-1], int) else 1
            flops = 2 * out_elems * k
        else:
            flops = 4 * out_elems
        costs[i] = flops / _ANALYTIC_FLOPS
    return CostProfile(
        model_sha256=digest,
        settings={"provider": settings.provider, "intra_op_threads": settings.intra_op_threads, "optimization": settings.optimization},
        source="analytic",
        node_seconds=costs,
        total_seconds=sum(costs.values()),
        hop_seconds=_HOP_SECONDS,
        byte_seconds=_byte_seconds(),
        runs=0,
    )


def _itemsize(spec: Any) -> int:
    from onnxpipe.runtime._dtypes import itemsize

    return itemsize(spec.dtype)
