"""The server's lifetime: listen, load, serve, drain, stop (:func:`serve`).

Note: lifecycle.
    The HTTP, gRPC and metrics ports are bound first (a port in use is one error, before any model loads),
    so ``/v2/health/live`` answers while the models load; ``/v2/health/ready`` turns true only once
    every model is loaded and, where its bundle carries reference samples, verified, and the JSON
    workers have started: the moment the server admits inference requests. A model's readiness
    (``.../ready``, gRPC's ModelReady) turns true then too, not as the model itself is loaded: a
    model is ready exactly when an inference request for it is admitted, by the same checks
    (``ServerState.takes``), so a client that waits for it is never refused for loading. A model that
    fails to load stops the server with one error naming it, unless ``allow_partial``. On SIGTERM
    or SIGINT the server drains: ready goes false, new inference requests get 503 (and so do
    those whose body is still arriving, at once), the requests already admitted finish and are
    answered (for at most ``drain_timeout`` seconds, the listener's connections included), then
    the listeners close, the pipelines close, and :func:`serve` returns. A second signal ends the
    wait at once: what is still in flight is cut off (its connection closed). A signal after that
    is ignored: the server is stopping already. Both front doors (aiohttp's HTTP server, grpcio's
    asyncio server) share one asyncio event loop (uvloop where installed); inference runs on the
    pipelines' own threads or actors, never on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from onnxpipe._errors import BundleError, ConfigError, OnnxpipeError
from onnxpipe.runtime import load
from onnxpipe.runtime._code import CodeNotAllowedError
from onnxpipe.runtime._overrides import describe_settings
from onnxpipe.serve import _logs as logs
from onnxpipe.serve._budget import BodyBudget
from onnxpipe.serve._connections import GatedSite, default_max_connections
from onnxpipe.serve._errors import printable
from onnxpipe.serve._grpc import make_server
from onnxpipe.serve._http import drain, make_app
from onnxpipe.serve._jsonwork import JsonWorkers
from onnxpipe.serve._metrics import metrics_app
from onnxpipe.serve._models import VERSION, ServedModel
from onnxpipe.serve._options import ModelSource, ModelSources, ServeOptions
from onnxpipe.serve._state import ServerState

__all__ = ["serve"]

Say = Callable[[str], None]
_BACKLOG = 2048
#: Connections the metrics port takes at once (a scraper holds one; one more closes the oldest, idle first); its fds come
#: from the reserve ``_connections`` keeps.
_METRICS_CONNECTIONS = 16
#: Seconds a metrics port's connection may take to send a request's head (from connecting or its previous answer), when
#: ``idle_timeout`` is longer: a scrape sends its request at once (``_connections``, Note: the metrics port).
_METRICS_HEAD_S = 5.0


def serve(models: Sequence[ModelSource], options: ServeOptions | None = None, say: Say = logs.progress) -> None:
    """Serve ``models`` over HTTP and gRPC until SIGTERM or SIGINT (see Note: lifecycle). Call it
    from the main thread: it handles those signals.

    Args:
        models: What to serve (see :func:`model_sources`; what it skipped is said at start).
        options: How (defaults: loopback, ports 8000, 8001 and 8002 for metrics).
        say: Where progress lines go (default: the server's log, ``onnxpipe.serve``: stderr in
            ``options.log_format`` unless logging is configured already; ``_logs``, Note: one
            format per run).

    Raises:
        ConfigError: a port cannot be bound, or no model loaded.
        OnnxpipeError: a model failed to load (without ``allow_partial``): the error names it.
    """
    skipped = models.skipped if isinstance(models, ModelSources) else []
    server = _Server(list(models), options or ServeOptions(), say, skipped)
    try:
        import uvloop
    except ImportError:
        run: Callable[[Any], None] = asyncio.run
    else:
        run = uvloop.run
    with logs.configured(server.options.log_format):
        run(server.run())


class _Server:
    def __init__(self, sources: list[ModelSource], options: ServeOptions, say: Say, skipped: Sequence[tuple[Path, str]] = ()) -> None:
        self.sources = sources
        self.skipped = skipped
        self.options = options
        self._say = say
        self.state = ServerState(options, [s.name for s in sources])
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self._deadline = 0.0  # when the drain's wait ends (its time is then up for the listener too)

    def say(self, line: str) -> None:
        """One progress line, on one line: what it says of the file system (a path, a load error) has its control characters
        escaped, so that no file's name writes a line of its own."""
        self._say(printable(line))

    def _signal(self) -> None:
        """SIGTERM or SIGINT (on the loop): start the drain, or end its wait."""
        self._signals += 1
        if self._stop is not None:
            self._stop.set()

    async def run(self) -> None:
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._signal)
        options, state = self.options, self.state
        http_socket = _bind(options.host, options.http_port)
        metrics_socket, metrics_runner = self._metrics_listener(http_socket)
        grpc_server = None
        workers = JsonWorkers(options.json_workers, options.json_timeout)
        cap = options.max_connections or default_max_connections()  # each listener's, HTTP's and gRPC's
        budget = BodyBudget(options.max_inflight * options.max_body_bytes)  # both doors' (_budget, Note: one budget, two doors)
        runner = web.AppRunner(
            make_app(state, budget, workers),
            handle_signals=False,
            access_log=None,  # each request's line is onnxpipe's (_logs, Note: one line per request)
            auto_decompress=False,  # inflated by onnxpipe, within --max-body-size
            shutdown_timeout=max(1.0, options.drain_timeout),
            keepalive_timeout=options.idle_timeout,  # also the deadline of a request's head (see Note: connections)
        )
        try:
            if options.grpc_port:
                try:
                    grpc_server, _ = make_server(state, f"{_url_host(options.host)}:{options.grpc_port}", cap, budget)
                except (OSError, RuntimeError) as e:
                    where = f"{options.host}:{options.grpc_port}"
                    raise ConfigError(f"cannot listen on {where} (gRPC): {e}; choose another --grpc-port, or 0 for no gRPC") from None
                await grpc_server.start()
            await runner.setup()
            await GatedSite(runner, http_socket, cap, _BACKLOG).start()
            if metrics_runner is not None and metrics_socket is not None:
                await metrics_runner.setup()
                await GatedSite(metrics_runner, metrics_socket, _METRICS_CONNECTIONS, _BACKLOG, evict=True).start()
            await self._load_all()
            await asyncio.to_thread(workers.start)
            if not self._signals:
                state.ready = True
                self.say(f"ready: {self._summary()}")
                idle = asyncio.create_task(self._close_idle_sequences())
                await self._stop.wait()
                idle.cancel()
                await self._drain(budget)
        finally:
            state.draining = True
            # The drain waited for the admitted requests; what is left (connections closing, reading on a refused body) gets
            # at most a second of what remains of its time, none after a second signal.
            runner._shutdown_timeout = 0.1 if self._signals > 1 else min(1.0, max(0.1, self._deadline - time.monotonic()))
            await runner.cleanup()  # stops listening; lets connections finish their responses
            http_socket.close()
            if metrics_runner is not None and metrics_socket is not None:
                await metrics_runner.cleanup()
                metrics_socket.close()
            if grpc_server is not None:
                await grpc_server.stop(grace=1.0)
            await asyncio.to_thread(self._close_models)
            await asyncio.to_thread(workers.close)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
                signal.signal(sig, signal.SIG_IGN)  # a signal now finds the server stopping already: not a kill (exit 143)
        self.say("stopped")

    def _metrics_listener(self, http_socket: socket.socket) -> tuple[socket.socket | None, web.AppRunner | None]:
        """The metrics port's socket, bound now with the others (see Note: lifecycle), and its
        runner; ``(None, None)`` for no metrics port (0, or ``allow_metrics`` off)."""
        o = self.options
        if not (o.allow_metrics and o.metrics_port):
            return None, None
        try:
            sock = _bind(o.metrics_host or o.host, o.metrics_port, "metrics", "choose another --metrics-port (0 for none) or --metrics-address")
        except ConfigError:
            http_socket.close()
            raise
        app = metrics_app(self.state.metrics)
        app.middlewares.append(logs.middleware(o.access_log))  # its scrapes are requests too (_logs, Note: one line per request)
        head_s = min(o.idle_timeout, _METRICS_HEAD_S)  # see Note: the metrics port (_connections)
        runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1.0, keepalive_timeout=head_s)
        return sock, runner

    async def _load_all(self) -> None:
        state = self.state
        for path, why in self.skipped:
            self.say(f"skipped {path}: {why}")
        self.say(f"loading {len(self.sources)} model(s); live at {self._summary()}")
        for source in self.sources:
            if self._signals:
                return
            started = time.perf_counter()
            try:
                model, note = await asyncio.to_thread(self._load, source)
            except OnnxpipeError as e:
                e = e.for_command("onnxpipe serve", "--allow-code") if isinstance(e, CodeNotAllowedError) else e  # its flag (Note in runtime/_code.py)
                # One line, as the CLI's error line (a load error may quote onnxruntime's lines), escaped as every progress line is.
                message = printable(" ".join(f"model '{source.name}' ({source.path}): {e}".split("\n")))
                if not self.options.allow_partial:
                    raise type(e)(message) from None
                state.failed[source.name] = str(e)
                self.say(f"not serving {message}")
                continue
            state.models[source.name] = model
            version = f" version {source.version} (of {', '.join(source.versions)})" if source.versions else ""
            self.say(f"model '{source.name}'{version}: {len(model.pipe.spec.stages)} stage(s), {note}, in {time.perf_counter() - started:.1f} s")
        if not state.models:
            raise ConfigError(f"no model could be loaded ({len(state.failed)} failed)")

    def _load(self, source: ModelSource) -> tuple[ServedModel, str]:
        """One model, loaded and verified (on a thread of its own: the loop keeps answering)."""
        o = self.options
        pipe = load(
            source.path,
            target=o.target,
            queue_depth=o.queue_depth or o.max_inflight,
            allow_code=o.allow_code,
            max_streams=o.max_streams,
            stream_timeout=o.stream_timeout,
            overrides=o.overrides,
            engine=o.engine,
            address=o.address,
        )
        try:
            model = ServedModel(source.name, source.path, pipe, o.max_inflight, source.version or VERSION, self.state.sequence_state)
            note = self._verify(pipe) if o.verify else "not verified (--no-verify)"
            if o.overrides:  # what --set made of the bundle's settings, said once per model
                note += "; deploy-time settings: " + "; ".join(f"stage '{s.name}': {describe_settings(s)}" for s in pipe.spec.stages)
            pipe.reset_stats()  # the statistics count what clients send
        except BaseException:
            pipe.close()
            raise
        return model, note

    def _verify(self, pipe: Any) -> str:
        if pipe.spec.states:
            return "a model with state (no reference check)"
        rows = pipe.check()
        if not rows:
            return "no reference samples to verify"
        bad = [r for r in rows if not r.ok]
        if bad:
            r = bad[0]
            how = r.problem or f"differs from the bundle's stored outputs by {r.max_abs:.3g}"
            raise BundleError(f"reference sample {r.sample}, output '{r.output}', {how} on this host")
        return f"verified against {len({r.sample for r in rows})} reference sample(s)"

    async def _drain(self, bodies: BodyBudget) -> None:
        """Refuse new requests and bodies still arriving, let the admitted ones finish (see Note: lifecycle)."""
        state = self.state
        state.draining = True
        drain(bodies)  # a body still arriving is answered 503 now, not after --body-timeout
        waiting = sum(m.inflight for m in state.models.values())
        self.say(f"draining: {waiting} request(s) in flight, waiting up to {self.options.drain_timeout:g} s")
        self._deadline = time.monotonic() + self.options.drain_timeout
        while sum(m.inflight for m in state.models.values()) and time.monotonic() < self._deadline and self._signals < 2:
            await asyncio.sleep(0.01)
        left = sum(m.inflight for m in state.models.values())
        if left:
            why = "a second signal" if self._signals > 1 else f"{self.options.drain_timeout:g} s"
            self.say(f"{left} request(s) still in flight after the drain ({why}); their connections are closed and they fail as the pipelines close")

    async def _close_idle_sequences(self) -> None:
        """Free the state of sequences idle past the stream timeout, without waiting for traffic."""
        timeout = self.options.stream_timeout
        models = [m for m in self.state.models.values() if m.stateful]
        if timeout is None or not models:
            return
        while True:
            await asyncio.sleep(min(max(timeout / 4, 0.05), 5.0))
            for model in models:
                await model.on_worker(model.close_idle)

    def _close_models(self) -> None:
        # Newest first: the first Ray pipeline started Ray in this process, and stops it as it closes.
        for model in reversed(list(self.state.models.values())):
            with contextlib.suppress(Exception):
                model.close()

    def _summary(self) -> str:
        o = self.options
        http = f"http://{_url_host(o.host)}:{o.http_port}"
        grpc = f", grpc {_url_host(o.host)}:{o.grpc_port}" if o.grpc_port else ""
        metrics = f", metrics http://{_url_host(o.metrics_host or o.host)}:{o.metrics_port}/metrics" if o.allow_metrics and o.metrics_port else ""
        names = ", ".join(self.state.models) or ", ".join(self.state.names)
        return f"{http}{grpc}{metrics} ({names})"


def _bind(host: str, port: int, what: str = "HTTP", remedy: str = "choose another --http-port or --host") -> socket.socket:
    """A listening socket: the HTTP port's (or ``what``'s, whose error says ``remedy``).

    Raises:
        ConfigError: the address cannot be bound (in use, not this host's, no permission).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=_BACKLOG)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port} ({what}): {e.strerror or e}; {remedy}") from None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
