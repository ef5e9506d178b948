"""load() and Pipeline: a bundle on the deployment host, its stages working concurrently.

Each stage (each replica) runs on its own worker; a request moves from stage to stage through
bounded queues, so stage 0 works on request n+1 while stage 1 works on request n. The API is TVM's
pipeline executor's (``set_input`` / ``set_params`` / ``run`` / ``get_output``, ``_tvm``) plus what
Python users expect (``submit`` -> Future, ``map``, calling the pipeline, a context manager, streams)
and onnxruntime's session (``_ortapi``): faces over one core, the requests' table and dispatcher
(``_requests``) and the stream registry (``_streams``), which :class:`Pipeline` composes with its
engine, statistics and timelines.

Note: ordering and failures.
    Every request gets a future when it is submitted. Results are delivered through the futures,
    so ``get_output`` and ``map`` return them in submission order even when replicas finish out of
    order. A stage that raises fails only that request: its future raises :class:`StageError`
    naming the stage and the request, later stages let it pass untouched, and other requests go on.

Note: withdrawn requests.
    A stateless request's future stays pending while the request waits in front of the first
    stage, and turns running only when that stage takes it: until then ``future.cancel()``
    withdraws it, and no stage runs it (it still passes through the queues, marked failed, so the
    engines' bookkeeping stays one path; it counts neither as completed nor as failed). The stage
    asks through ``Request.claim`` (``_stage.claimed``), once, so an engine knows nothing of
    futures (Note: the engine boundary, ``_engine``). Once running, ``cancel()`` returns False and
    the request finishes; whoever cancelled it simply does not read it. A stream's steps are
    never withdrawn (a step left out would leave the stream's state a step behind what its client
    sent): their futures are running from the start.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
import onnxruntime as ort

from onnxpipe._errors import ConfigError, StageError
from onnxpipe.runtime._code import check_allowed
from onnxpipe.runtime._compare import difference
from onnxpipe.runtime._diagnostics import Diagnostics
from onnxpipe.runtime._engine import DEFAULT_QUEUE_DEPTH, ENGINES, Engine, engine_class
from onnxpipe.runtime._ortapi import ArgumentTypeError, InferenceSessionAPI, SessionFacts
from onnxpipe.runtime._overrides import Overrides
from onnxpipe.runtime._ray import RayOptions  # ray itself is imported only when a RayEngine starts
from onnxpipe.runtime._requests import Dispatcher, closed_before
from onnxpipe.runtime._spec import PipelineSpec
from onnxpipe.runtime._stage import Runner, plan_stages
from onnxpipe.runtime._stats import PipelineStats, summarize, write_trace
from onnxpipe.runtime._stream import Stream
from onnxpipe.runtime._streams import StreamRegistry, StreamsView
from onnxpipe.runtime._tvm import TVMProtocol
from onnxpipe.runtime.bundle import Bundle, Limits, read_bundle

__all__ = ["ENGINES", "Pipeline", "ReferenceCheck", "load"]

Outputs = dict[str, np.ndarray]
_TVM: Any = object()  # run() called without arguments: the TVM protocol
#: Streams that may be open at once, by default: each holds its state in every stage with state.
DEFAULT_MAX_STREAMS = 64


@dataclass(frozen=True)
class ReferenceCheck:
    """One output of one reference sample, compared (see :meth:`Pipeline.check`).

    Attributes:
        sample: The reference sample's number.
        output: The output's name.
        max_abs: The largest ``|got - want|`` over the values finite on both sides (``inf`` for
            a mismatch of shape, dtype, integers or non-finite values).
        ok: Within tolerance, and (unless allowed) the stored output finite.
        problem: Why not, beyond the tolerance: a mismatch of shape or dtype, NaN or inf on one
            side only, a stored output that is not finite.
    """

    sample: int
    output: str
    max_abs: float
    ok: bool
    problem: str = ""


class Pipeline(TVMProtocol, InferenceSessionAPI):
    """A loaded bundle, its stages running concurrently.

    Its faces share one core: TVM's pipeline executor protocol (``set_input`` / ``run`` /
    ``get_output``, :class:`~onnxpipe.runtime._tvm.TVMProtocol`), what Python users expect
    (:meth:`submit`, :meth:`map`, calling it), streams (:meth:`stream`), and a drop-in for an
    ``onnxruntime.InferenceSession`` (``get_inputs``, ``get_outputs``, ``get_modelmeta``,
    ``get_providers``, ``run(output_names, input_feed)``; see
    :class:`~onnxpipe.runtime._ortapi.InferenceSessionAPI`). Every request is numbered in one
    table (``_requests``), and every stream kept in one registry (``_streams``).

    Args:
        bundle: A checked bundle (see :func:`read_bundle`).
        target: Run every stage on this target instead of its own (e.g. ``"cpu"``).
        queue_depth: Requests that may wait in front of each stage; a full queue blocks the
            stage before it, and a full first queue blocks :meth:`submit` (backpressure).
        trace: Record every stage run, for :meth:`save_trace`.
        engine: Where the stage workers live: ``"thread"`` (threads of this process) or ``"ray"``
            (Ray actors on a Ray cluster, see ``docs/distributed.md``).
        address: The Ray cluster (``"auto"`` or ``"HOST:PORT"``; engine ``"ray"`` only).
        ray_options: Placement, shipping and supervision on Ray (engine ``"ray"`` only).
        source: The bundle's path, for ``RayOptions(shared=True)``.
        max_streams: Streams that may be open at once (see :meth:`stream`).
        stream_timeout: Close a stream idle for longer than this many seconds (``None``: never);
            its next step then raises :class:`StreamError` saying so.
        micro_batches: For streams whose stages batch: how many groups the streams are spread
            over, each stepping as one batch (``None``: one per stage, so every stage has a batch
            to work on). See ``onnxpipe.runtime.scheduling``.

    Raises:
        BundleError: the bundle names Python (code stages, custom-op libraries) that
            ``bundle.allow_code`` does not allow (nothing is imported then), or that is not on
            this host.
        ConfigError: ``max_streams``, ``stream_timeout`` or ``micro_batches`` is not positive.
    """

    def __init__(
        self,
        bundle: Bundle,
        target: str | None = None,
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        trace: bool = False,
        engine: str = "thread",
        address: str | None = None,
        ray_options: RayOptions | None = None,
        source: str | os.PathLike[str] | None = None,
        max_streams: int = DEFAULT_MAX_STREAMS,
        stream_timeout: float | None = None,
        micro_batches: int | None = None,
    ) -> None:
        _check_stream_settings(max_streams, stream_timeout, micro_batches)
        check_allowed(bundle.spec, bundle.allow_code)  # every refusal in one message, before any import
        super().__init__()
        self.bundle = bundle
        self._target = target
        plans, finals = plan_stages(bundle.spec)
        self._origin = time.perf_counter()
        self.micro_batches = micro_batches or len(plans)
        self._node_counts: dict[str, dict[str, int]] | None = None
        self._engine: Engine = engine_class(engine).start(bundle, plans, target=target, queue_depth=queue_depth, trace=trace, address=address,
                                                          ray_options=ray_options, source=source)
        self._session_facts: list[SessionFacts] = self._engine.session_facts()
        self.engine = engine
        # A pipeline dropped without close() must not leave its workers running.
        self._finalizer = weakref.finalize(self, self._engine.close)
        #: Requests the engine holds in flight (its queues and workers) before submit waits: what map() keeps in flight.
        self.capacity = self._engine.capacity
        self._dispatch = Dispatcher(self._engine, bundle.spec, finals)
        self._streams = StreamRegistry(self._dispatch, bundle.spec, plans, finals, max_streams, stream_timeout, self.micro_batches)

    # -- what the pipeline looks like ------------------------------------------------------------

    @property
    def spec(self) -> PipelineSpec:
        """The pipeline's wiring and settings."""
        return self.bundle.spec

    @property
    def target(self) -> str | None:
        """The target every stage runs on instead of its own, if one was given at load."""
        return self._target

    @property
    def max_streams(self) -> int:
        """Streams that may be open at once (see :meth:`stream`)."""
        return self._streams.max_streams

    @property
    def stream_timeout(self) -> float | None:
        """Seconds a stream may stay idle before it is closed (``None``: never)."""
        return self._streams.stream_timeout

    # -- Pythonic API -----------------------------------------------------------------------------

    def submit(self, inputs: Mapping[str, Any], block: bool = True) -> Future[Outputs]:
        """Submit one request; returns a future of its outputs by name.

        Blocks only while the first stage's queue is full; with ``block=False`` it never waits
        (for an event loop, say) and raises :class:`BusyError` instead. Until the first stage
        takes the request, ``future.cancel()`` withdraws it: no stage runs it (see Note:
        withdrawn requests).

        Raises:
            InputError: an input is unknown, missing, or of the wrong dtype or shape (the pipeline
                stays usable).
            BusyError: ``block`` is false and the first stage's queue is full; nothing was submitted.
            StageError: the pipeline is closed.
            StreamError: the pipeline keeps state between steps: run it through :meth:`stream`.
        """
        return self._dispatch.submit(inputs, block)[1]

    def map(self, inputs: Iterable[Mapping[str, Any]], max_in_flight: int | None = None) -> Iterator[Outputs]:
        """Stream requests through the pipeline; yield their outputs in order.

        At most ``max_in_flight`` requests (default: what the queues and workers hold) are in
        the pipeline at once, so an endless iterable runs in bounded memory.

        Raises:
            StageError: when the failed request's turn comes; the requests after it still run.
        """
        limit = max_in_flight or self.capacity
        window: collections.deque[Future[Outputs]] = collections.deque()
        for item in inputs:
            window.append(self.submit(item))
            if len(window) >= limit:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()

    def __call__(self, inputs: Mapping[str, Any]) -> Outputs:
        """Run one request and wait for its outputs."""
        return self.submit(inputs).result()

    @overload
    def run(self) -> int: ...

    @overload
    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options: ort.RunOptions | None = None) -> list[np.ndarray]: ...

    def run(self, output_names: Any = _TVM, input_feed: Any = _TVM, run_options: ort.RunOptions | None = None) -> int | list[np.ndarray]:
        """Without arguments (TVM): submit the inputs given with :meth:`set_input` as one request;
        its outputs come from :meth:`get_output`, in order. Returns at once unless the pipeline is
        full (backpressure).

        With arguments (onnxruntime's ``InferenceSession.run``): run one request and wait; return
        the outputs named in ``output_names`` (all, in declared order, for ``None`` or ``[]``) as a
        list in that order. Thread-safe. ``run_options.terminate`` stops the wait.

        Returns:
            The request's number (TVM), or the outputs (onnxruntime).

        Raises:
            InputError: an input was not set (TVM); an input is missing, unknown or of the wrong
                dtype or shape, or an output name is unknown (onnxruntime: these also subclass the
                type onnxruntime raises, see :mod:`onnxpipe.runtime._ortapi`).
            StageError: a stage failed on the request (onnxruntime).
        """
        if input_feed is not _TVM:
            return self._ort_run(None if output_names is _TVM else output_names, input_feed, run_options)
        if output_names is not _TVM or run_options is not None:
            raise ArgumentTypeError("run() takes no argument (TVM: run what set_input staged) or output_names and input_feed (onnxruntime)")
        return self._tvm_run()

    # -- streams ----------------------------------------------------------------------------------

    def stream(self) -> Stream:
        """Open a stream: a sequence of steps whose state (``PipelineSpec.states``) stays in the stages.

        Each stage with state keeps the stream's state in the runner of one of its replicas, which
        takes all of the stream's steps; steps of one stream run in order, steps of different
        streams overlap. Close the stream (or use it as a context manager) to free its state.

        Returns:
            The new :class:`Stream`.

        Raises:
            StreamError: ``max_streams`` streams are open already (none is ever evicted to make
                room), or the pipeline is closed.
        """
        return self._streams.open()

    def submit_steps(self, steps: Mapping[Stream, Mapping[str, Any]]) -> dict[Stream, Future[Outputs]]:
        """Submit the next step of many streams at once; a future of each stream's outputs.

        What one thread stepping many streams (a generation loop, a server's batch) calls instead
        of ``Stream.submit`` per stream: every step is checked first, and nothing is submitted
        when one is refused; the steps then leave for the pipeline at once, as few batches as the
        streams' groups allow (``onnxpipe.runtime.scheduling``), without waiting for any other
        step. Each stream's step runs after its earlier ones, as with ``Stream.submit``.

        Raises:
            StreamError: a stream is closed, belongs to another pipeline, or its state is no longer valid.
            InputError: a step's inputs do not fit (as ``Stream.submit``); the message names the stream.
            StageError: the pipeline is closed.
        """
        return self._streams.submit_many(steps)

    @property
    def open_streams(self) -> list[int]:
        """The ids of the streams open now."""
        return self._streams.open_ids

    @property
    def state_bytes(self) -> int:
        """Bytes of the open streams' state in the stages, each as its last finished step left it
        (the sum of their :attr:`Stream.state_bytes`, kept as they change: reading it costs
        nothing). See Note: a stream's state bytes, ``_stream.py``."""
        return self._streams.state_bytes

    @property
    def streams(self) -> StreamsView:
        """What the streams look like now: open, idle, what expiry looked at, their state bytes,
        whether their steps travel in batches and which streams share them (:class:`StreamsView`)."""
        return StreamsView(self._streams)

    def close_idle_streams(self) -> list[int]:
        """Close the streams idle for longer than ``stream_timeout`` now, instead of at the next
        :meth:`stream` or step (which do it too); a server calls this on a timer, so that idle
        state is freed without new traffic. Waits until their state is freed.

        Returns:
            The ids of the streams closed (none when ``stream_timeout`` is ``None``).
        """
        return self._streams.expire_idle()

    def check(self, rtol: float = 1e-4, atol: float = 1e-5, allow_nonfinite: bool = False) -> list[ReferenceCheck]:
        """Run the bundle's reference inputs and compare with its reference outputs.

        Values match when ``|got - want| <= atol + rtol * |want|`` everywhere; integer, boolean
        and string outputs when they are equal. A NaN or inf on one side only is a mismatch, and a
        stored output that holds NaN or inf fails (the check proves nothing there) unless
        ``allow_nonfinite`` and the pipeline gives the same (Note: non-finite values prove
        nothing, in ``runtime/_compare.py``).
        """
        rows = []
        samples = self.bundle.reference()
        for i, ((_, expected), got) in enumerate(zip(samples, self.map(s[0] for s in samples), strict=True)):
            for name, want in expected.items():
                value = got.get(name)
                if value is None:
                    rows.append(ReferenceCheck(i, name, float("inf"), False, "the pipeline has no such output"))
                    continue
                d = difference(value, want, rtol, atol, ("the pipeline", "the stored reference"))
                if d.nonfinite and not allow_nonfinite and d.ok:
                    rows.append(ReferenceCheck(i, name, d.max_abs, False, f"the stored reference is not finite ({d.nonfinite}): the check proves nothing"))
                    continue
                rows.append(ReferenceCheck(i, name, d.max_abs, d.ok, d.problem))
        return rows

    def idle_runners(self) -> list[Runner]:
        """The first replica's runner of each stage, in pipeline order, for running stages alone
        with the pipeline's own sessions while it is idle (see :func:`benchmark`), so that no stage
        ever needs a second session (a second copy of its weights).

        Raises:
            StageError: requests are in flight, so a stage would not run alone, or the stages run
                on Ray actors (no session is in this process).
        """
        if not engine_class(self.engine).in_process:
            raise StageError(f"the stages run on {self.engine} actors, not in this process: running a stage alone needs engine='thread'")
        in_flight = self._dispatch.table.in_flight
        if in_flight:
            raise StageError(f"{in_flight} request(s) are in flight; stages run alone only while the pipeline is idle")
        return [runners[0] for runners in self._engine.runners()]

    # -- observability ----------------------------------------------------------------------------

    def stats(self, memory: bool = True) -> PipelineStats:
        """Throughput, latency, and per-stage utilization and queues since load or :meth:`reset_stats`.

        Args:
            memory: Also read the process's physical memory (``resident_bytes``): a walk of its
                mappings, 2 ms here and 8-20 ms in a server holding several models; a poller that
                does not show it (the server's statistics and metrics, on its event loop) skips it.
        """
        rows = [(p[0].stage, p, q[0], q[1], q[2]) for p, q in zip(self._engine.recorders(), self._engine.queues(), strict=True)]
        stats = summarize(rows, self._dispatch.recorder, self._dispatch.table.in_flight)
        if self._node_counts is None:  # the sessions do not change: counted once, not on every poll
            self._node_counts = {stage: {ep: len(nodes) for ep, nodes in (where or {}).items()} for stage, where in self.placement().items()}
        settings = {s.name: s.settings for s in self.spec.stages}  # those in effect: the bundle's, with the host's overrides
        stages = tuple(
            dataclasses.replace(
                s, nodes=dict(self._node_counts.get(s.stage, {})), intra_op_threads=settings[s.stage].intra_op_threads,
                inter_op_threads=settings[s.stage].inter_op_threads, affinity=settings[s.stage].affinity, max_batch=settings[s.stage].max_batch,
            )
            for s in stats.stages
        )
        held = self._engine.resident_bytes() if memory else None  # None where the sessions live in other processes (Ray)
        return dataclasses.replace(stats, stages=stages, resident_bytes=held)

    def diagnostics(self) -> Diagnostics:
        """Where each stage replica runs and what it holds now: its process (on Ray: its node, its
        labels, its private folder, whether it is alive), the requests it ran, the streams whose
        state it keeps and their bytes, its reuse of state blocks; the engine's capacity. For
        tests, benchmarks and operators (docs/runtime.md, Diagnostics). On Ray each live actor is
        asked, beside any run in progress (a few milliseconds; an actor that does not answer
        within 10 s is reported with ``streams=None``).
        """
        return Diagnostics(self.engine, engine_class(self.engine).in_process, self._engine.capacity, tuple(self._engine.diagnostics()))

    def reset_stats(self) -> None:
        """Start a new measurement window (e.g. after warm-up)."""
        for recorders in self._engine.recorders():
            for r in recorders:
                r.reset()
        self._dispatch.recorder.reset()

    def save_trace(self, path: str | os.PathLike[str]) -> Path:
        """Write a Chrome-trace / Perfetto JSON timeline, one track per stage worker.

        Raises:
            StageError: the pipeline was loaded without ``trace=True``.
        """
        recorders = [r for rs in self._engine.recorders() for r in rs]
        if any(r.events is None for r in recorders):
            raise StageError("no timeline was recorded: load the pipeline with trace=True")
        return write_trace(path, recorders, self._origin)

    # -- lifetime ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers promptly, fail the requests still in flight, remove temporary files.

        Requests that did not finish raise :class:`StageError` from their futures.
        """
        if not self._dispatch.table.close():
            return
        self._finalizer.detach()
        self._streams.close_all()
        for request in self._engine.close():
            self._dispatch.fail(request, closed_before(request.id))
        self._streams.join()
        for rid, future in self._dispatch.table.stranded():
            if not future.done():
                future.set_exception(closed_before(rid))
        self.bundle.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Pipeline(stages={[s.name for s in self.spec.stages]}, inputs={[t.name for t in self.spec.inputs]})"


def _check_stream_settings(max_streams: int, stream_timeout: float | None, micro_batches: int | None) -> None:
    if micro_batches is not None and micro_batches < 1:
        raise ConfigError(f"micro_batches must be at least 1, got {micro_batches}")
    if max_streams < 1:
        raise ConfigError(f"max_streams must be at least 1, got {max_streams}")
    if stream_timeout is not None and not stream_timeout > 0:
        raise ConfigError(f"stream_timeout must be a positive number of seconds or None, got {stream_timeout}")


def load(
    path: str | os.PathLike[str],
    *,
    target: str | None = None,
    queue_depth: int = DEFAULT_QUEUE_DEPTH,
    trace: bool = False,
    limits: Limits | None = None,
    allow_code: Sequence[str] = (),
    engine: str = "thread",
    address: str | None = None,
    ray_options: RayOptions | None = None,
    max_streams: int = DEFAULT_MAX_STREAMS,
    stream_timeout: float | None = None,
    micro_batches: int | None = None,
    overrides: Overrides | None = None,
    before_start: Callable[[PipelineSpec], None] | None = None,
) -> Pipeline:
    """Load a bundle (folder or ``.onnxpipe`` archive) with only numpy and onnxruntime, and start it.

    Every file is checked (see ``read_bundle``) before any session is created.

    Args:
        path: The bundle.
        target: Run every stage on this target instead of its own (e.g. ``"cpu"``).
        queue_depth: Requests that may wait in front of each stage.
        trace: Record a timeline of every stage run (see :meth:`Pipeline.save_trace`).
        limits: Size and count limits for the bundle.
        allow_code: fnmatch patterns of the Python the bundle may make this host import: code
            stages' entry points (``"mypkg.*"`` allows ``"mypkg.ocr:decode"``) and custom-op
            packages (``"onnxruntime_extensions"``). Default: none; a bundle naming any is refused,
            naming each, before anything is imported (docs/pipelines.md).
        engine: ``"thread"`` (default: every stage in this process) or ``"ray"`` (each stage
            replica a Ray actor on a Ray cluster; needs ``pip install 'onnxpipe[ray]'``).
        address: The Ray cluster's address, ``"auto"`` or ``"HOST:PORT"`` (engine ``"ray"``).
        ray_options: Placement, shipping and supervision on Ray (:class:`RayOptions`).
        max_streams: Streams that may be open at once (see :meth:`Pipeline.stream`).
        stream_timeout: Close streams idle for longer than this many seconds (``None``: never).
        micro_batches: Groups the streams of a pipeline whose stages batch them are spread over,
            each stepping as one batch (``None``: one per stage; see :class:`Pipeline`).
        overrides: Deploy-time settings of some or all stages, instead of the bundle's:
            ``intra_op_threads``, ``inter_op_threads``, ``execution_mode``, ``spinning``,
            ``affinity``, ``replicas``, ``max_batch`` (up to the bundle's), ``max_delay_ms``,
            ``host``; as :class:`StageOverrides` (applied in order) or a mapping
            ``{"*": {...}, "STAGE": {...}, "1": {...}}``. Checked as the bundle's own settings
            are; the bundle's files are not changed (``onnxpipe rebundle`` writes a new bundle).
        before_start: Called with the pipeline's spec (overrides applied) once every file of the
            bundle is checked, before any session starts or any actor is placed: the caller's own
            checks against the pipeline (its request files' names, dtypes and shapes:
            :func:`check_request_files`) refuse the run before it costs anything. What it raises
            is raised here, and nothing is left open.

    Raises:
        BundleError: the bundle is missing, broken or refused as unsafe, a stage's provider is
            not available here (or, on Ray, on the node its actor landed on), or it names Python
            ``allow_code`` does not allow or this host does not have.
        ConfigError: the OS refused a stage's CPU affinity; an unknown engine; on Ray: Ray is not
            installed, the cluster cannot be reached, or a stage cannot be placed; ``max_streams``,
            ``stream_timeout`` or ``micro_batches`` is not positive; an override names no stage,
            a setting that may not change at deploy time, a bad value, or a ``max_batch`` above
            what the build allows (naming the stage and its maximum).
    """
    # A hostile bundle, or code the host does not allow, is refused here, before anything ships. On
    # Ray no session starts here: each actor checks its stage's threads against its own node.
    kind = ENGINES.get(engine)  # an unknown one is refused by Pipeline, once the bundle is read
    bundle = read_bundle(path, limits, allow_code=allow_code, sessions=None if kind is None or kind.in_process else (), overrides=overrides)
    try:
        if before_start is not None:
            before_start(bundle.spec)
        return Pipeline(bundle, target, queue_depth, trace, engine, address, ray_options, path, max_streams=max_streams, stream_timeout=stream_timeout,
                        micro_batches=micro_batches)
    except BaseException:
        bundle.close()
        raise
