"""Prometheus metrics (``GET /metrics``): requests by outcome and their durations, as the protocol
layer sees them, and per stage what the pipeline's own statistics say, read when scraped.

Note: nothing is counted twice.
    The request counter and histogram are the server's (one increment and one observation per
    answered request). Stage runs, failures, compute and queue time, in-flight requests and open
    streams are not kept here at all: a collector reads them from each pipeline's ``stats()`` and
    ``open_streams`` at scrape time, so they are the numbers ``onnxpipe bench`` and ``stats()``
    show.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from onnxpipe.serve._models import ServedModel

__all__ = ["OUTCOMES", "Metrics"]

#: How a request ended: answered, refused as malformed (4xx), refused for load (503), failed in a stage (5xx).
OUTCOMES = ("success", "bad_request", "unavailable", "error")
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def outcome_of(status: int) -> str:
    """The outcome label of an HTTP status."""
    if status < 400:
        return "success"
    if status == 503:
        return "unavailable"
    return "bad_request" if status < 500 else "error"


class Metrics:
    """The server's registry.

    Args:
        models: The served models by name (read at each scrape; it may grow while models load).
    """

    def __init__(self, models: Callable[[], Mapping[str, ServedModel]]) -> None:
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
        self.registry.register(_PipelineCollector(models))
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
        """The text exposition format of everything."""
        return generate_latest(self.registry)


class _PipelineCollector(Collector):
    """Per model and stage, what the pipelines' own statistics say at scrape time (see the note above)."""

    def __init__(self, models: Callable[[], Mapping[str, ServedModel]]) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        inflight = GaugeMetricFamily("onnxpipe_inflight_requests", "Requests admitted and not answered yet.", labels=["model"])
        streams = GaugeMetricFamily("onnxpipe_open_streams", "Sequences (streams) open now.", labels=["model"])
        runs = CounterMetricFamily("onnxpipe_stage_runs", "Runs of each stage, failed ones included.", labels=["model", "stage"])
        failed = CounterMetricFamily("onnxpipe_stage_failures", "Runs of each stage that failed.", labels=["model", "stage"])
        compute = CounterMetricFamily("onnxpipe_stage_compute_seconds", "Time each stage spent running, over its replicas.", labels=["model", "stage"])
        queued = CounterMetricFamily("onnxpipe_stage_queue_seconds", "Time requests waited in each stage's queue.", labels=["model", "stage"])
        depth = GaugeMetricFamily("onnxpipe_stage_queue_depth", "Requests waiting in each stage's queue now.", labels=["model", "stage"])
        for name, model in self._models().items():
            inflight.add_metric([name], model.inflight)
            streams.add_metric([name], len(model.pipe.open_streams))
            for s in model.pipe.stats().stages:
                runs.add_metric([name, s.stage], s.count)
                failed.add_metric([name, s.stage], s.failed)
                compute.add_metric([name, s.stage], s.busy_s)
                queued.add_metric([name, s.stage], s.queued_s)
                depth.add_metric([name, s.stage], s.queue_depth)
        yield from (inflight, streams, runs, failed, compute, queued, depth)
