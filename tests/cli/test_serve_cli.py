"""``onnxpipe serve``'s options, refusals and help, in process (the server itself is driven over
the network by tests/serve)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from onnxpipe.cli import _serve
from tests.cli.helpers import assert_usage_error, assert_user_error, run

pytest.importorskip("aiohttp", reason="onnxpipe serve needs the serve extra")


def test_the_cli_defaults_are_the_servers() -> None:
    from onnxpipe.serve import ServeOptions

    o = ServeOptions()
    assert (_serve._MAX_INFLIGHT, _serve._BODY_TIMEOUT, _serve._MAX_STREAMS, _serve._STREAM_TIMEOUT, _serve._DRAIN_TIMEOUT, _serve._IDLE_TIMEOUT,
            _serve._JSON_TIMEOUT) == (o.max_inflight, o.body_timeout, o.max_streams, o.stream_timeout, o.drain_timeout, o.idle_timeout, o.json_timeout)
    assert o.max_connections is None  # half the open-file limit, less 64
    assert _serve._MAX_BODY == "64MiB" and o.max_body_bytes == 64 << 20
    assert (_serve._MAX_SEQUENCE_STATE, _serve._SEQUENCE_STATE_BUDGET) == ("256MiB", "2GiB")
    assert (o.max_sequence_state_bytes, o.sequence_state_budget_bytes) == (256 << 20, 2 << 30)
    assert (o.host, o.http_port, o.grpc_port) == ("127.0.0.1", 8000, 8001)  # loopback unless told otherwise
    assert o.queue_depth is None  # as deep as --max-inflight


def test_refusals_before_anything_listens(tmp_path: Path) -> None:
    assert_user_error(run("serve"), "no model to serve: give bundles (PATH or NAME=PATH) or a model repository folder")
    assert_user_error(run("serve", tmp_path / "missing.onnxpipe"), f"bundle '{tmp_path / 'missing.onnxpipe'}' does not exist")
    assert_user_error(run("serve", "--model-repository", tmp_path), f"model repository '{tmp_path}' holds no bundle")
    assert_usage_error(run("serve", "x.onnxpipe", "--address", "auto"), "--address: only used with --engine ray")
    assert_usage_error(run("serve", "x.onnxpipe", "--http-port", "0"), "--http-port")
    empty = tmp_path / "token.txt"
    empty.write_text("  \n")
    assert_user_error(run("serve", "x.onnxpipe", "--auth-token-file", empty), "must hold one token: non-empty, without spaces")
    assert_user_error(run("serve", "x.onnxpipe", "--auth-token-file", tmp_path / "none.txt"), "cannot read --auth-token-file")


def test_help_shows_the_options_and_examples_without_importing_the_server() -> None:
    out = " ".join(run("serve", "--help").output.split())
    for text in ("--http-port", "[default: 8000;", "--grpc-port", "0: no gRPC", "--max-inflight", "--auth-token-file", "--drain-timeout",
                 "perf_analyzer -m resnet50"):
        assert text in out, text
    code = "import sys; from onnxpipe.cli import main; print(','.join(m for m in ('aiohttp', 'grpc', 'onnxruntime') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == ""


def test_without_the_serve_extra_it_says_which_to_install(tmp_path: Path) -> None:
    code = "import sys; sys.modules['aiohttp'] = None\nfrom onnxpipe.cli import main\nmain(['serve', 'x.onnxpipe'])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.strip() == "error: onnxpipe serve needs the serve extra (aiohttp is not installed): pip install 'onnxpipe[serve]'"
