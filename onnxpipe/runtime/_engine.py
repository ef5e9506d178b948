"""Engines: where stage workers live, chosen by name from a registry (:data:`ENGINES`): the thread
engine (``_thread``: a thread of this process per stage replica) and the Ray engine (``_ray``: a
Ray actor per stage replica, on a cluster).

Note: the engine boundary.
    An engine receives the stage plans, makes (or has its actors make) each replica's runner with
    ``make_runner``, takes requests with ``submit``, and hands each finished request to
    ``request.done``. It knows nothing of futures, ordering, inputs or parameters: those live in
    the pipeline, and what a stage does lives in the runner (:class:`~onnxpipe.runtime._stage.Runner`),
    which runs requests and says what each run did (a :class:`~onnxpipe.runtime._stage.Call`,
    made where the run happened, recorded with ``StageRecorder.record``). An engine implements
    :class:`Engine` (requests in, requests out, what it holds, its statistics, its sessions'
    facts, its process's memory, its diagnostics) and, as a class, :class:`EngineClass` (its name,
    whether its sessions are in this process, whether it runs at a cluster address, how it
    starts); it reuses the runners, the plans, the records and the statistics. Nothing outside an
    engine compares engine names: it asks the engine (or its class, before it starts).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from onnxpipe._errors import ConfigError
from onnxpipe.runtime._diagnostics import StageDiagnostics
from onnxpipe.runtime._ortapi import SessionFacts
from onnxpipe.runtime._ray import RayEngine, RayOptions
from onnxpipe.runtime._stage import Request, Runner, StagePlan
from onnxpipe.runtime._stats import StageRecorder
from onnxpipe.runtime._thread import DEFAULT_QUEUE_DEPTH, RunnerFactory, ThreadEngine
from onnxpipe.runtime.bundle import Bundle

__all__ = ["DEFAULT_QUEUE_DEPTH", "ENGINES", "Engine", "EngineClass", "RunnerFactory", "ThreadEngine", "engine_class"]


class Engine(Protocol):
    """What the pipeline needs from a running engine."""

    @property
    def capacity(self) -> int:
        """Requests it holds in flight (in its queues and workers) before :meth:`submit` waits."""

    def submit(self, request: Request, block: bool = True) -> None:
        """Enqueue a request for the first stage; block while the pipeline is full (or, when
        ``block`` is false, refuse at once and take nothing).

        Raises:
            Closed: the engine is closed.
            Full: ``block`` is false and the pipeline cannot take the request now.
        """

    def watch_entry(self, callback: Callable[[Request], None]) -> bool:
        """Call ``callback(request)`` each time the first stage has finished with a request (run
        it, or passed it on failed), on the thread that did, which must not wait on anything in
        it; whether the engine will (``False``: it cannot tell cheaply). The step scheduler sends
        batches when the first stage frees up (``scheduling``, Note: continuous batching)."""

    def close(self) -> list[Request]:
        """Stop every worker promptly; return the requests that did not finish."""

    def recorders(self) -> list[list[StageRecorder]]:
        """Each stage's replicas' recorders, in pipeline order."""

    def queues(self) -> list[tuple[int, int, int]]:
        """Each stage's input queue: depth now, high water, capacity."""

    def runners(self) -> list[list[Runner]]:
        """Each stage's replicas' runners in this process, in pipeline order (empty rows where
        the sessions live elsewhere)."""

    def session_facts(self) -> list[SessionFacts]:
        """The first replica's session facts of each ONNX stage, in pipeline order."""

    def resident_bytes(self) -> int | None:
        """The physical memory of the process the sessions run in, or ``None`` where that is not
        this process (or Linux's ``/proc`` is not there)."""

    def diagnostics(self) -> list[StageDiagnostics]:
        """Each stage's replicas now: where they run, what they ran and hold (see ``_diagnostics``)."""


class EngineClass(Protocol):
    """An engine before it starts: what :data:`ENGINES` holds by name (an engine class, whose
    class attributes say these facts and whose ``start`` class method starts it).

    Attributes:
        name: The name users give it (``load(..., engine=NAME)``, ``--engine NAME``).
        in_process: Its sessions are made in this process: ``load`` checks them here while it reads
            the bundle (on Ray, each actor checks its own stage on its own node instead), and stages
            can run alone here (``Pipeline.idle_runners``, ``benchmark``'s standalone times).
        takes_address: It runs on a cluster reached at an address (``address``, ``ray_options``).
    """

    name: str
    in_process: bool
    takes_address: bool

    def start(self, bundle: Bundle, plans: Sequence[StagePlan], *, target: str | None, queue_depth: int, trace: bool,
              address: str | None = None, ray_options: RayOptions | None = None, source: str | os.PathLike[str] | None = None) -> Engine:
        """Start the stages of a checked bundle; the running engine.

        Raises:
            ConfigError: options this engine does not take, or it cannot start them (see each engine).
            BundleError: a session could not be created.
        """


#: The engines by name: each a class that says, before it starts, what load(), the CLI and the
#: server need to know of it (:class:`EngineClass`).
ENGINES: Mapping[str, EngineClass] = {ThreadEngine.name: ThreadEngine, RayEngine.name: RayEngine}


def engine_class(name: str) -> EngineClass:
    """The engine called ``name``.

    Raises:
        ConfigError: no engine has that name (the message names those that do).
    """
    found = ENGINES.get(name)
    if found is None:
        raise ConfigError(f"unknown engine {name!r}; valid: {', '.join(ENGINES)}")
    return found
