"""The stage actor (runs on a node of the cluster), and the values it exchanges with the driver.

An actor runs its stage with the same runner as the thread engine (``make_runner``) and returns
what the runner says each run did (:class:`~onnxpipe.runtime._stage.Call`, times on this node's
wall clock), so the driver records them as the thread engine does; see ``_ray._engine`` for the
notes on placement, the data plane and faults.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from onnxpipe._errors import BundleError, OnnxpipeError
from onnxpipe.runtime._handoff import host
from onnxpipe.runtime._ortapi import SessionFacts
from onnxpipe.runtime._spec import Endpoint
from onnxpipe.runtime._stage import CLOSE, Call, Failure, Request, Runner, make_runner, plan_stages
from onnxpipe.runtime.bundle import MANIFEST_NAME, Bundle, Limits, read_bundle, sha256_file
from onnxpipe.runtime.scheduling import StepBatch, take_rows

__all__ = ["LAYOUT", "Values", "aligned", "entry", "inputs_of"]

#: Values as they travel between the driver and the actors: keyed by ``(stage, tensor)``.
Values = dict[tuple[str | None, str], Any]
#: One request of an actor call: ``(request, params, stream, sources, lost)`` (see :meth:`_StageActor.run`).
Item = tuple[int, int | None, tuple[int, int, dict[str, int], int, tuple[int, ...]] | None, Sequence[Any], Mapping[int, str] | None]
#: The key, among a call's values, of the layout of a batch of streams' steps those values are in
#: (``StepBatch.describe``): see Note: batches of steps. No tensor has it (a tensor name is never empty).
LAYOUT: tuple[str | None, str] = ("", "")
_RESTARTED = "the actor holding it died and was restarted without it"


class _StageActor:
    """One replica of one stage: re-reads and re-checks the bundle on its node, makes its runner
    with ``make_runner`` and runs requests' stage with it. Errors are returned as data (the runner's
    :class:`~onnxpipe.runtime._stage.Failure` records), never raised: a failing request must not
    become a Ray task error carrying a pickled exception."""

    def __init__(self, payload: Any, path: str | None, manifest_sha: str, limits: Mapping[str, Any], index: int, replica: int,
                 target: str | None, folder: str, returns: Sequence[str], allow_code: Sequence[str], stage: str,
                 overrides: Sequence[Any] = ()) -> None:
        self._error: str | None = None
        self._perf_to_wall = time.perf_counter() - time.time()
        import ray

        # A restarted actor (Ray's max_restarts) starts with no stream's state: see _state_gone().
        self._restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        self._bundle: Bundle | None = None
        self._runner: Runner | None = None
        self._stage = stage
        self._returns = tuple(returns)
        # A private folder named by the driver: a restarted actor removes what its previous
        # incarnation left, and close() removes it. read_bundle unpacks in there too.
        self._folder = Path(tempfile.gettempdir()) / folder
        try:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder.mkdir(mode=0o700)
            tempfile.tempdir = str(self._folder)
            if path is None:
                archive = self._folder / "bundle.onnxpipe"
                archive.write_bytes(memoryview(payload))
                path = str(archive)
            # The driver's allow-list travels with the bundle: code is imported only if it allows it.
            # Only this actor's stage is checked against the thread caps, and against this node's cores.
            # The driver's deploy-time settings too: the bundle's files hold the build's.
            self._bundle = read_bundle(path, Limits(**limits), allow_code=allow_code, sessions=(stage,), overrides=overrides)
            if sha256_file(self._bundle.root / MANIFEST_NAME) != manifest_sha:
                raise BundleError(f"the bundle at '{path}' is not the one the driver checked (its manifest differs)")
            plan = plan_stages(self._bundle.spec)[0][index]
            settings = plan.stage.settings
            if settings.intra_op_threads == 0:  # onnxruntime's default would use every core of the node
                settings = settings.replace(intra_op_threads=_cpus())
            plan = dataclasses.replace(plan, stage=dataclasses.replace(plan.stage, settings=settings))
            cores = settings.for_replica(replica).worker_cores()
            if cores is not None:
                os.sched_setaffinity(0, cores)
            self._runner = make_runner(self._bundle, plan, replica, target)
        except OnnxpipeError as e:
            self._error = str(e)
        except OSError as e:
            self._error = f"{type(e).__name__}: {e}"

    def ready(self) -> dict[str, Any]:
        """Where this actor runs, its session's facts, or why it could not start."""
        import ray

        info: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname(), "node_id": ray.get_runtime_context().get_node_id(), "error": self._error}
        if self._runner is not None and self._runner.session is not None:  # code stages have no session
            info["facts"] = SessionFacts.of(self._runner.session, self._runner.name).to_dict()
        return info

    def diagnose(self) -> dict[str, Any]:
        """Where this actor runs (as :meth:`ready`, without the session's facts) and what its
        runner holds: the streams whose state it keeps, its reuse of state blocks, their bytes."""
        import ray

        runner = self._runner
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(), "streams": runner.streams() if runner else [],
                "reused": runner.reused if runner else 0, "state_bytes": runner.state_bytes() if runner else 0}

    def run(self, calls: Sequence[Item], *objects: Any) -> tuple[list[Values | None], tuple[list[Call], list[list[tuple[int, str, int]]]]]:
        """Run the stage on each request of one call, in order. A call carries one request, or
        several when they queued up for this replica while it was busy (see the data-plane note);
        a stage that batches runs them as batched session calls (``StageRunner.run_many``).

        ``calls`` holds one ``(request, params, stream, sources, lost)`` per request: ``params`` is the
        position in ``objects`` of its parameter snapshot (or None); ``stream`` is ``(stream, step,
        dims, length, group)`` for a stream's step or close (see ``Request``), whose state the runner keeps in this
        actor; ``lost``, for a batch of steps, the members whose state the driver knows died (id ->
        why: Note: batches of steps); ``sources`` are what the stage reads from, one per producer: ``("v", values)`` for the
        request's pipeline inputs sent by value, ``("o", position, index)`` for an object of
        ``objects`` (an earlier call's outputs: its ``index``-th entry; ``index`` None: the object
        itself). Values are keyed by ``(stage, tensor)``.

        Returns the kept outputs of each request (None where it failed here or before) as ONE
        object; then what the runs did (the runner's :class:`Call` records, times on this node's
        wall clock; a request that failed before reaching the runner has a record of its own) and
        what each request's stage now holds of its streams' state (``Request.held``).
        """
        outputs: list[Values | None] = [None] * len(calls)
        held: list[list[tuple[int, str, int]]] = [[] for _ in calls]
        records: list[Call] = []
        runnable: list[Request] = []
        dropped: dict[int, tuple[Failure, ...]] = {}
        for request, params, stream, sources, lost in calls:
            produced = [s[1] if s[0] == "v" else entry(objects[s[1]], s[2]) for s in sources]
            req, failed = self._prepare(request, None if params is None else objects[params], stream, produced)
            if failed is not None:
                records.append(self._on_wall(failed))
            elif req is not None:
                if req.batch is not None:
                    dropped[req.id] = self._drop_lost(req, lost or {})
                runnable.append(req)
        if runnable:
            records += self._run(runnable, dropped, {item[0]: j for j, item in enumerate(calls)}, outputs, held)
        return outputs, (records, held)

    def _run(self, runnable: list[Request], dropped: Mapping[int, tuple[Failure, ...]], where: Mapping[int, int], outputs: list[Values | None],
             held: list[list[tuple[int, str, int]]]) -> list[Call]:
        """Run the requests that need it (one batched session call where the stage batches: Note:
        batched calls, _stage.py); fill in each one's outputs and held state at its place in the
        call (``where``: request id -> place); the runs' records."""
        assert self._runner is not None  # _prepare runs nothing without it
        at = {req.id: req for req in runnable}
        records = []
        for call in self._runner.run_many(runnable):
            whole = {f.request for f in call.failures if not f.member}
            for rid in call.requests:
                req, j = at[rid], where[rid]
                held[j] = req.held  # what this stage now holds of each stream's state (Note: a stream's state bytes, _stream.py)
                if rid not in whole and req.step != CLOSE:
                    outputs[j] = self._kept(req)
            records.append(self._on_wall(call, dropped.get(call.requests[0], ())))
        return records

    def _kept(self, request: Request) -> Values | None:
        """What a request that ran leaves for later stages and the driver: the stage's kept outputs
        (with the batch's layout after this stage, for a batch of steps); None when every member of
        its batch failed (later stages pass it on untouched)."""
        name = self._stage
        batch = request.batch
        if batch is not None and not len(batch):
            return None
        kept: Values = {(name, o): host(request.values[Endpoint(name, o)]) for o in self._returns}  # the object store takes numpy, not OrtValue
        if batch is not None:
            kept[LAYOUT] = batch.describe()
        return kept

    def _on_wall(self, call: Call, dropped: tuple[Failure, ...] = ()) -> Call:
        """A run's record as the driver reads it: its times on the wall clock (the driver's clock is
        another host's), with the batch's members that left before the run (``dropped``) counted in it."""
        return dataclasses.replace(call, start=call.start - self._perf_to_wall, end=call.end - self._perf_to_wall, size=call.size + len(dropped),
                                   failures=dropped + call.failures)

    def _prepare(self, request: int, params: Mapping[str, Any] | None, stream: tuple[int, int, dict[str, int], int, tuple[int, ...]] | None,
                 produced: Sequence[Values | None]) -> tuple[Request | None, Call | None]:
        """One request of a call: the :class:`Request` to run (None if it needs no run), or the record of its failure before any run."""
        if any(v is None for v in produced):  # an earlier stage failed: pass the request on untouched
            return None, None
        if stream is not None and stream[1] == CLOSE:  # drops the stream's state, in order with the call's other requests
            return (Request(request, {}, {}, 0.0, stream=stream[0], step=CLOSE) if self._runner is not None else None), None
        if self._runner is None:
            return None, self._failed(request, self._error or "the stage has no session")
        merged, layout = aligned(produced)  # type: ignore[arg-type]
        # A later step has no value from a first-step stage it passed: the runner feeds what it kept instead (_stage, Note: kept inputs).
        req = Request(request, {key: merged[(key.stage, key.tensor)] for _, key in self._runner.plan.sources if (key.stage, key.tensor) in merged},
                      {self._stage: params} if params else {}, 0.0)
        if layout is not None:
            req.batch = layout
        elif stream is not None:
            req.stream, req.step, req.dims, req.length, req.group = stream
            if self._state_gone(stream[0], stream[1]):
                return None, self._failed(request, _RESTARTED, lost=(stream[0],))
        return req, None

    def _failed(self, request: int, cause: str, lost: tuple[int, ...] = ()) -> Call:
        """The record of a request that failed before it reached the runner: a run of its own
        (``lost``: the streams whose state it needed died, ``cause`` saying how)."""
        now = time.perf_counter()
        return Call((request,), now, now, 1, (Failure(request, self._stage, cause, state_lost=bool(lost), streams=lost),))

    def _state_gone(self, stream: int, step: int) -> bool:
        """Whether a step after a stream's first needs state this actor does not hold: it was
        restarted (Ray's ``max_restarts``) after the stream began here."""
        runner = self._runner
        return self._restarted and step > 0 and runner is not None and runner.plan.keeps_state and stream not in runner.streams()

    def _drop_lost(self, request: Request, lost: Mapping[int, str]) -> tuple[Failure, ...]:
        """Members of a batch whose state is gone (the driver says so, or this actor restarted
        without it) leave the batch before it runs, failing as a stream alone would; they are returned."""
        batch = request.batch
        assert batch is not None
        gone: dict[int, Failure] = {}
        for j, (rid, stream, step) in enumerate(zip(batch.ids, batch.streams, batch.steps, strict=True)):
            why = lost.get(rid)
            if why is None and self._state_gone(stream, step):
                why = _RESTARTED
            if why is not None:
                gone[j] = Failure(rid, self._stage, why, member=True, state_lost=True, streams=(stream,))
        if gone:
            keep = [j for j in range(len(batch)) if j not in gone]
            request.values = {key: take_rows(value, batch.rows, keep) for key, value in request.values.items()}
            request.batch = batch.without({j: failure.error() for j, failure in gone.items()})
        return tuple(gone.values())

    def shutdown(self) -> None:
        """Stop a run in progress and remove the actor's files."""
        if self._runner is not None:
            self._runner.cancel()
        if self._bundle is not None:
            self._bundle.close()
        shutil.rmtree(self._folder, ignore_errors=True)


def _cpus() -> int:
    import ray

    return max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))


def inputs_of(request: Request) -> Values:
    """A request's pipeline inputs as the actors read them, keyed by ``(None, tensor)``; with its
    layout, for a batch of steps (Note: batches of steps)."""
    inputs: Values = {(key.stage, key.tensor): value for key, value in request.values.items()}
    if request.batch is not None:
        inputs[LAYOUT] = request.batch.describe()
    return inputs


def aligned(produced: Sequence[Mapping[tuple[str | None, str], Any]]) -> tuple[Values, StepBatch | None]:
    """The values of several producers merged, each brought to the newest batch layout among them
    (the one with the fewest members: members only leave a batch), and that layout (None: not a
    batch of steps). See Note: batches of steps."""
    layouts = [p[LAYOUT] for p in produced if p is not None and LAYOUT in p]
    if not layouts:
        return {k: v for p in produced if p is not None for k, v in p.items()}, None
    newest = min(layouts, key=lambda layout: len(layout[0]))
    ids = newest[0]
    merged: Values = {}
    for p in produced:
        if p is None:
            continue
        layout = p.get(LAYOUT, newest)
        if tuple(layout[0]) == tuple(ids):
            merged.update(p)
            continue
        at = {rid: j for j, rid in enumerate(layout[0])}
        keep = [at[rid] for rid in ids]
        merged.update({k: v if k == LAYOUT else take_rows(v, layout[4], keep) for k, v in p.items()})
    merged.pop(LAYOUT, None)
    return merged, StepBatch.from_description(newest)


def entry(outputs: Any, index: int | None) -> Any:
    """Entry ``index`` of a call's outputs, or the whole object when ``index`` is None."""
    return outputs if index is None else outputs[index]
