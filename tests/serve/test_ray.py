"""``onnxpipe serve --engine ray``: the same front door over stage actors on a real multi-node Ray
cluster on loopback (the session's ``ray_cluster``): results equal in process, sequences keep
their state in the actors, and SIGTERM leaves no actor behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from onnxpipe import runtime
from tests.conftest import cluster_processes
from tests.serve.conftest import serve_args, squeeze_input
from tests.serve.process import ServerProcess

pytestmark = pytest.mark.xdist_group("ray")


def _stage_actors(cluster: Any) -> set[int]:
    """Processes of stage actors now alive in ``cluster`` (Ray names them ``ray::_StageActor``):
    only its own processes are read, never another Ray cluster's on the same machine."""
    found = set()
    for pid in cluster_processes(cluster):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::_StageActor"):
                found.add(pid)
        except OSError:
            continue
    return found


def test_the_server_on_ray_answers_as_in_process_and_leaves_no_actor(ray_cluster: Any, bundles: dict[str, Path], tmp_path: Path) -> None:
    before = _stage_actors(ray_cluster)
    x = squeeze_input(5)
    with runtime.load(bundles["squeeze"]) as pipe:
        want = pipe({"data_0": x})["softmaxout_1"]
    with runtime.load(bundles["rnn"]) as pipe, pipe.stream() as s:
        xs = [np.random.default_rng(k).standard_normal((1, 4)).astype(np.float32) for k in range(4)]
        steps = [s.step({"x": v})["y"] for v in xs]
    with ServerProcess(*serve_args(bundles, "squeeze", "rnn"), "--engine", "ray", "--address", ray_cluster.address) as proc:
        proc.start(tmp_path / "serve.log")
        assert len(_stage_actors(ray_cluster) - before) == 4  # two stages of each model
        http = httpclient.InferenceServerClient(proc.http)
        tensor = httpclient.InferInput("data_0", [1, 3, 224, 224], "FP32")
        tensor.set_data_from_numpy(x)
        np.testing.assert_allclose(http.infer("squeeze", [tensor]).as_numpy("softmaxout_1"), want, rtol=1e-5, atol=1e-6)
        grpc = grpcclient.InferenceServerClient(proc.grpc)
        for t, v in enumerate(xs):
            tensor = grpcclient.InferInput("x", [1, 4], "FP32")
            tensor.set_data_from_numpy(v)
            got = grpc.infer("rnn", [tensor], sequence_id=42, sequence_start=t == 0, sequence_end=t == len(xs) - 1).as_numpy("y")
            np.testing.assert_allclose(got, steps[t], rtol=1e-6, atol=1e-7)
        assert proc.stop() == 0, proc.log()
    assert _stage_actors(ray_cluster) - before == set()
