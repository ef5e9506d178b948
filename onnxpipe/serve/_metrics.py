"""Prometheus metrics (``GET /metrics``, on the HTTP port and on a metrics port of its own, as
Triton's ``--metrics-port``): Triton's families under Triton's names, onnxpipe's own beside them,
and the process's.

Note: nothing is counted twice.
    The request counter and histogram are the server's (one increment and one observation per
    answered request). Everything else is read when scraped, from what is kept anyway: Triton's
    families (``nv_inference_*``) from each model's :meth:`~ServedModel.statistics` (the numbers
    ``GET .../stats`` answers, so the two always agree), the stage families (``onnxpipe_stage_*``)
    from the same scrape's ``Pipeline.stats()`` (one call per model and scrape serves both), and
    in-flight requests, open streams and the bytes of their state from the model and its
    pipeline. ``onnxpipe bench`` and ``stats()`` show the same numbers.

Note: Triton's names.
    Triton's counters are named without Prometheus's ``_total`` (``nv_inference_request_success``,
    not ``nv_inference_request_success_total``), and dashboards and alerts query those names.
    prometheus_client writes every counter with ``_total``, so Triton's families are written here
    (:func:`_triton_text`), in the text format, with Triton's names, types, ``HELP`` texts and
    labels (``model``, ``version``; ``reason`` on failures, as Triton 2.49 (24.08) and later) and its
    integer microseconds. Triton's optional families (its summaries, behind
    ``--metrics-config summary_latencies=true``, the first-response histogram of decoupled models,
    the cache's, the GPU's) are not written: ``onnxpipe_request_duration_seconds`` is the
    latency histogram, and nothing here caches or runs on a GPU Triton's way.

Note: the host's CPU.
    Triton polls ``/proc/stat`` and ``/proc/meminfo`` every ``--metrics-interval-ms`` (2 s) on a
    thread of its own. Here they are read when scraped (70 us for both, measured on the 2-core VM
    under load; a scrape's ``Pipeline.stats()`` takes milliseconds): memory as Triton
    computes it (used = ``MemTotal - MemAvailable``), and utilization, the busy share of every
    CPU's time (user, nice, system, irq, softirq, steal over those and idle, iowait), over the
    time since the previous scrape (the first: since the server started), where Triton's is over
    its last interval; with Prometheus's scrape interval in place of Triton's, the same number.
    Where ``/proc`` is not there, they are left out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from onnxpipe.runtime import PipelineStats
from onnxpipe.serve._models import ServedModel

__all__ = ["OUTCOMES", "TRITON_FAMILIES", "Metrics", "metrics_app"]

#: How a request ended: answered, refused as malformed (4xx), refused for load (503), failed in a stage (5xx).
OUTCOMES = ("success", "bad_request", "unavailable", "error")
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: The Server header of the metrics port's answers, as the HTTP port's.
_SERVER = "onnxpipe"

#: Triton's per-model families: name -> (type, HELP), as Triton's core registers them (metrics.cc).
TRITON_FAMILIES: dict[str, tuple[str, str]] = {
    "nv_inference_request_success": ("counter", "Number of successful inference requests, all batch sizes"),
    "nv_inference_request_failure": ("counter", "Number of failed inference requests, all batch sizes"),
    "nv_inference_count": ("counter", "Number of inferences performed (does not include cached requests)"),
    "nv_inference_exec_count": ("counter", "Number of model executions performed (does not include cached requests)"),
    "nv_inference_request_duration_us": ("counter", "Cumulative inference request duration in microseconds (includes cached requests)"),
    "nv_inference_queue_duration_us": ("counter", "Cumulative inference queuing duration in microseconds (includes cached requests)"),
    "nv_inference_compute_input_duration_us": ("counter", "Cumulative compute input duration in microseconds (does not include cached requests)"),
    "nv_inference_compute_infer_duration_us": ("counter", "Cumulative compute inference duration in microseconds (does not include cached requests)"),
    "nv_inference_compute_output_duration_us": ("counter", "Cumulative inference compute output duration in microseconds (does not include cached requests)"),
    "nv_inference_pending_request_count": ("gauge", "Instantaneous number of pending requests awaiting execution per-model."),
}
#: The ``inference_stats`` entry each duration family sums (``success`` is the whole request).
_DURATIONS = {
    "nv_inference_request_duration_us": "success",
    "nv_inference_queue_duration_us": "queue",
    "nv_inference_compute_input_duration_us": "compute_input",
    "nv_inference_compute_infer_duration_us": "compute_infer",
    "nv_inference_compute_output_duration_us": "compute_output",
}


def outcome_of(status: int) -> str:
    """The outcome label of an HTTP status."""
    if status < 400:
        return "success"
    if status == 503:
        return "unavailable"
    return "bad_request" if status < 500 else "error"


@dataclass(frozen=True)
class _Scraped:
    """One model as one scrape reads it: its pipeline's statistics, taken once."""

    name: str
    model: ServedModel
    stats: PipelineStats


class Metrics:
    """The server's registry.

    Args:
        models: The served models by name (read at each scrape; it may grow while models load).
    """

    def __init__(self, models: Callable[[], Mapping[str, ServedModel]]) -> None:
        self._models = models
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "onnxpipe_requests", "Inference requests answered, by model, protocol and outcome.", ["model", "protocol", "outcome"], registry=self.registry
        )
        self._duration = Histogram(
            "onnxpipe_request_duration_seconds",
            "Time from a request's body being in to its response, successful requests.",
            ["model", "protocol"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        # The process's CPU, memory and descriptors, the interpreter's and its collector's, as Prometheus's default registry has them.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.registry.register(_HostCollector())
        self._children: dict[tuple[str, str, str], tuple[Any, Any]] = {}  # labelled children, looked up once

    def answered(self, model: str, protocol: str, status: int, seconds: float) -> None:
        """One inference request answered with ``status`` after ``seconds``."""
        outcome = outcome_of(status)
        key = (model, protocol, outcome)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (self._requests.labels(*key), self._duration.labels(model, protocol))
        children[0].inc()
        if outcome == "success":
            children[1].observe(seconds)

    def render(self) -> bytes:
        """The text exposition format of everything (each pipeline's statistics read once: see Note: nothing is counted twice)."""
        scraped = [_Scraped(name, model, model.pipe.stats(memory=False)) for name, model in self._models().items()]
        return generate_latest(_Scrape(self.registry, scraped)) + _triton_text(scraped).encode()

    def answer(self) -> web.Response:
        """``GET /metrics``'s answer, on either port."""
        return web.Response(body=self.render(), content_type="text/plain", charset="utf-8", headers={"X-Content-Format": "0.0.4"})


def metrics_app(metrics: Metrics) -> web.Application:
    """The metrics port's application: ``GET /metrics`` alone, without the token (Prometheus
    scrapes it; it binds loopback unless told otherwise, see docs/serving.md)."""

    async def scrape(request: web.Request) -> web.StreamResponse:
        return metrics.answer()

    async def server_header(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["Server"] = _SERVER

    app = web.Application()
    app.on_response_prepare.append(server_header)
    app.router.add_get("/metrics", scrape)
    return app


class _Scrape(Collector):
    """The registry's families and, from one scrape's statistics, the pipelines' (see Note: nothing is counted twice)."""

    def __init__(self, registry: CollectorRegistry, scraped: list[_Scraped]) -> None:
        self._registry = registry
        self._scraped = scraped

    def collect(self) -> Iterator[Metric]:
        yield from self._registry.collect()
        yield from _pipeline_families(self._scraped)


def _pipeline_families(scraped: Iterable[_Scraped]) -> Iterator[Metric]:
    """Per model and stage, what the pipelines' own statistics say."""
    inflight = GaugeMetricFamily("onnxpipe_inflight_requests", "Requests admitted and not answered yet.", labels=["model"])
    streams = GaugeMetricFamily("onnxpipe_open_streams", "Sequences (streams) open now.", labels=["model"])
    state = GaugeMetricFamily("onnxpipe_sequence_state_bytes", "Bytes of state the open sequences hold, as their last steps left it.", labels=["model"])
    runs = CounterMetricFamily("onnxpipe_stage_runs", "Runs of each stage, failed ones included.", labels=["model", "stage"])
    failed = CounterMetricFamily("onnxpipe_stage_failures", "Runs of each stage that failed.", labels=["model", "stage"])
    compute = CounterMetricFamily("onnxpipe_stage_compute_seconds", "Time each stage spent running, over its replicas.", labels=["model", "stage"])
    queued = CounterMetricFamily("onnxpipe_stage_queue_seconds", "Time requests waited in each stage's queue.", labels=["model", "stage"])
    depth = GaugeMetricFamily("onnxpipe_stage_queue_depth", "Requests waiting in each stage's queue now.", labels=["model", "stage"])
    for one in scraped:
        inflight.add_metric([one.name], one.model.inflight)
        streams.add_metric([one.name], len(one.model.pipe.open_streams))
        state.add_metric([one.name], one.model.pipe.state_bytes)
        for s in one.stats.stages:
            runs.add_metric([one.name, s.stage], s.count)
            failed.add_metric([one.name, s.stage], s.failed)
            compute.add_metric([one.name, s.stage], s.busy_s)
            queued.add_metric([one.name, s.stage], s.queued_s)
            depth.add_metric([one.name, s.stage], s.queue_depth)
    yield from (inflight, streams, state, runs, failed, compute, queued, depth)


def _triton_text(scraped: list[_Scraped]) -> str:
    """Triton's per-model families in the text format, under Triton's names (see Note: Triton's names)."""
    if not scraped:
        return ""
    samples: dict[str, list[tuple[dict[str, str], int]]] = {name: [] for name in TRITON_FAMILIES}
    for one in scraped:
        stats = one.model.statistics(one.stats)
        labels = {"model": one.name, "version": stats["version"]}
        inference = stats["inference_stats"]
        samples["nv_inference_request_success"].append((labels, inference["success"]["count"]))
        for reason, count in one.model.failures().items():
            samples["nv_inference_request_failure"].append(({**labels, "reason": reason}, count))
        samples["nv_inference_count"].append((labels, stats["inference_count"]))
        samples["nv_inference_exec_count"].append((labels, stats["execution_count"]))
        for family, entry in _DURATIONS.items():
            samples[family].append((labels, inference[entry]["ns"] // 1000))  # integer microseconds, as Triton's
        samples["nv_inference_pending_request_count"].append((labels, one.model.pending(one.stats)))
    lines = []
    for name, (kind, help_text) in TRITON_FAMILIES.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{{{_labels(labels)}}} {value}" for labels, value in samples[name]]
    return "\n".join(lines) + "\n"


def _labels(labels: Mapping[str, str]) -> str:
    """A sample's labels, sorted as Triton's (prometheus-cpp keeps them in a sorted map), their values escaped."""
    def escaped(value: str) -> str:
        return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    return ",".join(f'{key}="{escaped(value)}"' for key, value in sorted(labels.items()))


class _HostCollector(Collector):
    """Triton's CPU families: the host's CPU utilization and memory (see Note: the host's CPU)."""

    def __init__(self) -> None:
        self._last = _cpu_times()

    def collect(self) -> Iterator[Metric]:
        now = _cpu_times()
        if now is not None:
            last = self._last or (0, 0)
            busy, idle = now[0] - last[0], now[1] - last[1]
            self._last = now
            utilization = GaugeMetricFamily("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]")
            utilization.add_metric([], busy / (busy + idle) if busy + idle > 0 else 0.0)
            yield utilization
        memory = _memory()
        if memory is not None:
            total = GaugeMetricFamily("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes")
            total.add_metric([], memory[0])
            used = GaugeMetricFamily("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes")
            used.add_metric([], memory[0] - memory[1])
            yield from (total, used)


def _cpu_times() -> tuple[int, int] | None:
    """``(busy, idle)`` clock ticks of every CPU since boot, as Triton sums them; ``None`` without ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    except (OSError, ValueError):
        return None
    return user + nice + system + irq + softirq + steal, idle + iowait


def _memory() -> tuple[int, int] | None:
    """``(MemTotal, MemAvailable)`` in bytes; ``None`` without ``/proc/meminfo``."""
    found: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    found[key] = int(rest.split()[0]) * 1024
                    if len(found) == 2:
                        return found["MemTotal"], found["MemAvailable"]
    except (OSError, ValueError, IndexError):
        pass
    return None
