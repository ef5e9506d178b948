"""KServe's own v2 clients (kserve 0.21: ``InferenceRESTClient`` with ``RESTConfig(protocol="v2")``
and ``InferenceGRPCClient``) against ``onnxpipe serve`` (issue 29, item 1): health and readiness as
KServe reads them (the REST spec's ``{"live": true}`` / ``{"ready": true}`` bodies), and inferences
over REST (JSON and binary tensors; KServe always sends ``model_name``) and gRPC equal to the
bundle in process, and a model with state stepped as Triton sequences through KServe's request
``parameters`` over both, equal to an in-process stream. KServe runs in ``.venv-kserve`` (``make test`` makes it; its dependencies are
not ours: kserve pins psutil below 6, ipython needs 7), driven by tests/serve/kserve_clients.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from onnxpipe import runtime
from tests.serve.process import ROOT, ServerProcess

KSERVE_PYTHON = ROOT / ".venv-kserve" / "bin" / "python"


@pytest.mark.skipif(not KSERVE_PYTHON.exists(), reason="KServe's clients live in .venv-kserve: make test (or make .venv-kserve/.installed) makes it")
def test_kserves_rest_and_grpc_clients_read_health_and_infer_as_in_process(server: ServerProcess, bundles: dict[str, Path]) -> None:
    values = np.arange(4, dtype=np.float32).reshape(1, 4) - 1.5
    steps = [np.random.default_rng(t).standard_normal((1, 4)).astype(np.float32) for t in range(4)]
    done = subprocess.run([str(KSERVE_PYTHON), str(ROOT / "tests" / "serve" / "kserve_clients.py"), server.http, server.grpc, "twoout", "X",
                           "[1, 4]", json.dumps(values.reshape(-1).tolist()), "rnn", json.dumps([x.tolist() for x in steps])],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["rest_live"] is None or got["rest_live"] is True  # kserve 0.21 returns nothing from is_server_live: it raised nothing
    assert got["rest_ready"] is True and got["rest_model_ready"] is True
    assert got["grpc_live"] is True and got["grpc_ready"] is True and got["grpc_model_ready"] is True
    with runtime.load(bundles["twoout"]) as pipe:
        want = {name: np.asarray(value).tolist() for name, value in pipe({"X": values}).items()}
    for key in ("rest_infer_json", "rest_infer_binary", "grpc_infer"):
        assert set(got[key]) == set(want), key
        for name in want:
            np.testing.assert_allclose(np.array(got[key][name]), np.array(want[name]), rtol=1e-6, err_msg=f"{key}: {name}")
    with runtime.load(bundles["rnn"]) as pipe, pipe.stream() as stream:
        alone = [stream.step({"x": x})["y"] for x in steps]
    for key in ("rest_sequence", "grpc_sequence"):  # JSON's floats are float32's exact doubles: the same sessions, bit for bit
        assert len(got[key]) == len(alone), key
        for t, (value, expected) in enumerate(zip(got[key], alone, strict=True)):
            np.testing.assert_array_equal(np.array(value, np.float32), expected, err_msg=f"{key}: step {t}")
