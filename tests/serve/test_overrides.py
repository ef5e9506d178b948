"""``onnxpipe serve --set`` (issue 29, item 4): a model's deploy-time settings, as Triton's
``instance_group`` at deploy time; one server process, driven by Triton's client."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from tests.cli.helpers import assert_user_error, run
from tests.serve.conftest import assert_mlp_in_flight, serve_args
from tests.serve.process import ServerProcess

CORE = min(os.sched_getaffinity(0))


def test_a_server_runs_the_settings_it_was_given_and_says_so(bundles: dict[str, Path], tmp_path: Path) -> None:
    """mlp was built with max_batch=8, max_delay_ms=2, one replica and no pinning."""
    settings = ("--set", "replicas=2", "--set", f"mlp:max_batch=4,affinity={CORE}")
    with ServerProcess(*serve_args(bundles, "mlp"), *settings, grpc=False) as proc:
        proc.start(tmp_path / "serve.log")
        http = httpclient.InferenceServerClient(proc.http, concurrency=4)
        assert http.get_model_config("mlp")["max_batch_size"] == 4  # what the pipeline runs, not what the bundle says
        assert_mlp_in_flight(http, [np.random.default_rng(k).integers(0, 16, (1, 3)).astype(np.int64) for k in range(4)])
        assert proc.stop() == 0, proc.log()
    assert f"deploy-time settings: stage 'mlp': replicas 2, intra_op_threads 1, affinity {CORE}, max_batch 4, max_delay_ms 2" in proc.log()


def test_a_setting_that_makes_the_module_is_refused_before_anything_listens(bundles: dict[str, Path]) -> None:
    # Refused as the options are read: no port is bound, no model loaded (so no process is needed).
    refused = run("serve", *serve_args(bundles, "mlp"), "--http-port", "1", "--set", "mlp:opt=basic")
    assert_user_error(refused, "--set mlp:opt=basic: 'optimization' cannot change at deploy time", "onnxpipe build")
