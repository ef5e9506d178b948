"""``serve``: bundles behind the Open Inference Protocol (KServe v2) over HTTP and gRPC.

Parses options, calls ``onnxpipe.serve.serve`` and returns when it has drained; the server and its
dependencies are imported only when the command runs (``onnxpipe --help`` stays light).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import click

from onnxpipe.cli._common import ALLOW_CODE, TARGET, SizeType, UserError
from onnxpipe.cli._deploy import ADDRESS, ENGINE, SET, _engine_args
from onnxpipe.cli._stageopts import StageOption, deploy_overrides

__all__ = ["serve"]

#: The server's own defaults (``onnxpipe.serve.ServeOptions``, not imported here to keep ``--help``
#: fast; a test checks they agree).
_MAX_INFLIGHT = 64
_MAX_BODY = "64MiB"
_BODY_TIMEOUT = 30.0
_MAX_STREAMS = 64
_STREAM_TIMEOUT = 60.0
_MAX_SEQUENCE_STATE = "256MiB"
_SEQUENCE_STATE_BUDGET = "2GiB"
_DRAIN_TIMEOUT = 30.0
_IDLE_TIMEOUT = 30.0
_JSON_TIMEOUT = 30.0


@click.command(short_help="Serve bundles over HTTP and gRPC (KServe v2 / Triton's protocol).")
@click.argument("bundles", nargs=-1, metavar="[BUNDLE|NAME=BUNDLE]...")
@click.option(
    "--model-repository",
    "repository",
    type=click.Path(file_okay=False, path_type=Path),
    metavar="DIR",
    help="Serve every bundle in DIR too (folders and .onnxpipe archives; each named after its file).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on; 0.0.0.0 for every interface (then set --auth-token-file).")
@click.option("--http-port", default=8000, show_default=True, type=click.IntRange(1, 65535), help="HTTP/REST port (GET /metrics too, behind the token).")
@click.option("--grpc-port", default=8001, show_default=True, type=click.IntRange(0, 65535), help="gRPC port; 0: no gRPC.")
@click.option("--metrics-port", default=8002, show_default=True, type=click.IntRange(0, 65535),
              help="Port of GET /metrics alone (Prometheus; no token asked there, as Triton's); 0: none.")
@click.option("--metrics-address", metavar="ADDRESS", help="Address the metrics port binds [default: --host's].")
@click.option("--allow-metrics/--no-allow-metrics", default=True, show_default=True,
              help="Serve metrics at all (Triton's --allow-metrics=false is --no-allow-metrics): the metrics port and GET /metrics on the HTTP port.")
@click.option(
    "--auth-token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE",
    help="Every request but the health checks and the metrics port's must carry 'Authorization: Bearer <the token in FILE>' (gRPC: metadata 'authorization').",
)
@ALLOW_CODE
@SET
@ENGINE
@ADDRESS
@TARGET
@click.option(
    "--queue-depth",
    "queue_depth",
    type=click.IntRange(min=1),
    metavar="Q",
    help="Requests that may wait in front of each stage [default: --max-inflight, so admitted requests wait in the pipeline's queues].",
)
@click.option(
    "--max-inflight",
    default=_MAX_INFLIGHT,
    show_default=True,
    type=click.IntRange(min=1),
    metavar="N",
    help="Requests admitted at once per model; more are refused at once with 503 (never queued without bound).",
)
@click.option("--max-body-size", default=_MAX_BODY, show_default=True, type=SizeType(), help="Largest request body or gRPC message (also once inflated).")
@click.option("--body-timeout", default=_BODY_TIMEOUT, show_default=True, type=click.FloatRange(min=0, min_open=True), metavar="S",
              help="Seconds a request body may take to arrive; slower ones get 408.")
@click.option("--max-streams", default=_MAX_STREAMS, show_default=True, type=click.IntRange(min=1), metavar="N",
              help="Sequences open at once per model with state; more are refused with 503.")
@click.option("--stream-timeout", default=_STREAM_TIMEOUT, show_default=True, type=click.FloatRange(min=0), metavar="S",
              help="Seconds a sequence may stay idle before its state is freed (0: never).")
@click.option("--max-sequence-state", default=_MAX_SEQUENCE_STATE, show_default=True, type=SizeType(),
              help="Bytes one sequence's state may hold; a step that leaves it larger is answered 400 and its sequence ended.")
@click.option("--sequence-state-budget", default=_SEQUENCE_STATE_BUDGET, show_default=True, type=SizeType(),
              help="Bytes the sequences of every model may hold together; a step that leaves them larger is answered 503 and its sequence ended.")
@click.option("--drain-timeout", default=_DRAIN_TIMEOUT, show_default=True, type=click.FloatRange(min=0, min_open=True), metavar="S",
              help="On SIGTERM or SIGINT: seconds to let admitted requests finish before the pipelines close.")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), metavar="S",
              help="Seconds an inference request may wait for its model to start it; then it is answered 503 (Triton's queue timeout; "
                   "a request's 'timeout' parameter may ask for less) [default: no limit].")
@click.option("--idle-timeout", default=_IDLE_TIMEOUT, show_default=True, type=click.FloatRange(min=0, min_open=True), metavar="S",
              help="Seconds an HTTP connection may take to send a request's head, from connecting or from its last answer; then it is closed.")
@click.option("--max-connections", type=click.IntRange(min=1), metavar="N",
              help="HTTP connections open at once; more are answered 503 and closed [default: half the open-file limit, less 64].")
@click.option("--json-workers", default=1, show_default=True, type=click.IntRange(min=0), metavar="N",
              help="Processes that decode JSON requests of 1 MiB or more, so the event loop never waits on them (0: a thread).")
@click.option("--json-timeout", default=_JSON_TIMEOUT, show_default=True, type=click.FloatRange(min=0, min_open=True), metavar="S",
              help="Seconds a JSON request of 1 MiB or more may wait for a free JSON worker, and then hold one; past either it is "
                   "answered 503, and a worker that took too long is killed and replaced.")
@click.option("--allow-partial", is_flag=True, help="Serve the models that load even if some fail (each failure is printed; those models answer 503).")
@click.option("--strict-readiness", is_flag=True,
              help="With --allow-partial: /v2/health/ready (and gRPC ServerReady) answer not ready while a model failed to load (Triton's flag).")
@click.option("--no-verify", "no_verify", is_flag=True, help="Do not run the bundles' reference samples at load.")
@click.option("--access-log", is_flag=True,
              help="Log every request, HTTP and gRPC (health checks too), one line each; failed ones are logged without it too.")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="The log's lines on stderr: 'onnxpipe serve: ...' text, or one JSON object a line (for log shippers; docs/serving.md#logs).")
def serve(
    bundles: Sequence[str],
    repository: Path | None,
    host: str,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    metrics_address: str | None,
    allow_metrics: bool,
    auth_token_file: Path | None,
    allow_code: Sequence[str],
    settings: Sequence[StageOption],
    engine: str,
    address: str | None,
    target: str | None,
    queue_depth: int | None,
    max_inflight: int,
    max_body_size: int,
    body_timeout: float,
    max_streams: int,
    stream_timeout: float,
    max_sequence_state: int,
    sequence_state_budget: int,
    drain_timeout: float,
    request_timeout: float | None,
    idle_timeout: float,
    max_connections: int | None,
    json_workers: int,
    json_timeout: float,
    allow_partial: bool,
    strict_readiness: bool,
    no_verify: bool,
    access_log: bool,
    log_format: str,
) -> None:
    """Serve BUNDLEs (and every bundle in --model-repository) over the Open Inference Protocol
    (KServe v2) with Triton's extensions, so Triton's clients (tritonclient, perf_analyzer) and any
    HTTP client work unchanged. A model's name is its bundle's file or folder name without
    .onnxpipe; NAME=BUNDLE names it.

    \b
    HTTP (--http-port): GET /v2/health/live|ready, GET /v2, GET /v2/models/NAME[/versions/V]
      [/ready|/config|/stats], POST .../infer (JSON or binary tensors), GET /metrics (Prometheus).
    gRPC (--grpc-port): inference.GRPCInferenceService, with ModelConfig, ModelStatistics and
      ModelStreamInfer (Triton's stream: many requests in flight, answered in order).
    Metrics (--metrics-port): GET /metrics, Triton's nv_inference_* names and onnxpipe's, no token.
    A model with state takes Triton's sequence parameters (sequence_id, sequence_start,
    sequence_end). It listens on loopback unless --host says otherwise; ready once every model
    is loaded and verified against its reference samples; SIGTERM drains: new requests get 503,
    admitted ones are answered, then it exits 0. See docs/serving.md.

    \b
    Examples:
      onnxpipe serve resnet50.onnxpipe                                # 127.0.0.1:8000 HTTP, :8001 gRPC, :8002 metrics
      onnxpipe serve det=ocr_det.onnxpipe ocr.onnxpipe --allow-code 'mypkg.*'
      onnxpipe serve --model-repository bundles/ --host 0.0.0.0 --auth-token-file token.txt
      onnxpipe serve decoder.onnxpipe --max-streams 16 --stream-timeout 300
      onnxpipe serve resnet50.onnxpipe --engine ray --address auto --max-inflight 32
      onnxpipe serve resnet50.onnxpipe --set '*:affinity=0-1' --set 1:replicas=2   # this host's cores
      curl localhost:8000/v2/health/ready; curl localhost:8000/v2/models/resnet50/config
      perf_analyzer -m resnet50 -u localhost:8001 -i grpc --concurrency-range 1:8
    """
    where_run = _engine_args(engine, address)
    token = _token(auth_token_file) if auth_token_file is not None else None
    try:
        from onnxpipe import serve as server
    except ImportError as e:
        raise UserError(f"onnxpipe serve needs the serve extra ({e.name} is not installed): pip install 'onnxpipe[serve]'") from e
    from onnxpipe.cli._common import quiet_onnxruntime

    quiet_onnxruntime()
    sources = server.model_sources(bundles, repository)
    options = server.ServeOptions(
        host=host,
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        metrics_host=metrics_address,
        allow_metrics=allow_metrics,
        auth_token=token,
        allow_code=tuple(allow_code),
        target=target,
        queue_depth=queue_depth,
        max_inflight=max_inflight,
        max_body_bytes=max_body_size,
        body_timeout=body_timeout,
        max_streams=max_streams,
        stream_timeout=stream_timeout or None,
        max_sequence_state_bytes=max_sequence_state,
        sequence_state_budget_bytes=sequence_state_budget,
        drain_timeout=drain_timeout,
        request_timeout=request_timeout,
        idle_timeout=idle_timeout,
        max_connections=max_connections,
        json_workers=json_workers,
        json_timeout=json_timeout,
        allow_partial=allow_partial,
        strict_readiness=strict_readiness,
        overrides=deploy_overrides(settings),
        verify=not no_verify,
        access_log=access_log,
        log_format=log_format,
        **where_run,
    )
    server.serve(sources, options)


def _token(path: Path) -> str:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as e:
        raise UserError(f"cannot read --auth-token-file '{path}': {e.strerror or e}") from e
    except UnicodeDecodeError:
        raise UserError(f"--auth-token-file '{path}' is not text") from None
    if not token or any(c.isspace() for c in token):
        raise UserError(f"--auth-token-file '{path}' must hold one token: non-empty, without spaces")
    return token
