"""The served models and one shared server for the client tests (a real process on loopback ports).

Models: ``squeeze`` (squeezenet from the onnx wheel in 2 stages, with a reference sample),
``twoout`` (two outputs, one also read downstream), ``labelled`` (a code stage with BYTES in and
out), ``rnn`` (a recurrent model in 2 stages, state kept per stream), ``slow`` (one slow stage),
``mlp`` (an embedding and a layer that batches requests: ``max_batch=8``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from onnxpipe.builder import PipelineConfig, build, export
from onnxpipe.runtime import StageSettings
from onnxpipe.splitter import split
from tests import code_stages, models
from tests.serve.process import ServerProcess
from tests.stateful_models import recurrent

pytest.importorskip("aiohttp", reason="the server tests need the serve extra: pip install 'onnxpipe[serve]'")
pytest.importorskip("tritonclient", reason="the server tests drive it with Triton's client: pip install tritonclient[all]")

SQUEEZE_CUT = [["r34", "r35"]]


def squeeze_input(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 3, 224, 224)).astype(np.float32)


def assert_mlp_in_flight(http: Any, ids: list[np.ndarray]) -> None:
    """Send every ``ids`` to the served ``mlp`` at once (binary HTTP, async: they can batch) and
    check each answer against onnxruntime on the whole model (its embedding depends on the ids)."""
    import onnxruntime as ort
    import tritonclient.http as httpclient

    session = ort.InferenceSession(models.embed_mlp().SerializeToString(), providers=["CPUExecutionProvider"])
    pending = []
    for x in ids:
        tensor = httpclient.InferInput("ids", list(x.shape), "INT64")
        tensor.set_data_from_numpy(x, binary_data=True)
        pending.append(http.async_infer("mlp", [tensor]))
    for x, p in zip(ids, pending, strict=True):
        np.testing.assert_allclose(p.get_result().as_numpy("y"), session.run(None, {"ids": x})[0], rtol=1e-5, atol=1e-5)


def _mlp() -> PipelineConfig:
    config = PipelineConfig("mlp")
    mlp = config.add_stage(models.embed_mlp(), "mlp", settings=StageSettings(max_batch=8, max_delay_ms=2))
    config.input("ids").connect(mlp.input("ids"))
    mlp.output("y").connect(config.output("y"))
    return config


def _slow() -> PipelineConfig:
    config = PipelineConfig("slow")
    slow = config.add_stage(models.slow_stage(1024), "slow")
    config.input("x").connect(slow.input("x"))
    slow.output("y").connect(config.output("y"))
    return config


@pytest.fixture(scope="session")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served")
    squeeze = split(str(models.light_model_path("squeezenet")), SQUEEZE_CUT)
    made = {
        "twoout": models.bundle_of(split(models.two_outputs(), ["a", "M"]), root / "twoout"),
        "labelled": models.bundle_of(code_stages.labelled(), root / "labelled"),
        "rnn": models.bundle_of(split(recurrent(), ["state1N"], states="auto"), root / "rnn"),
        "slow": models.bundle_of(_slow(), root / "slow"),
        "mlp": models.bundle_of(_mlp(), root / "mlp"),
        "squeeze": export(
            build(squeeze.config, root / "squeeze-built").path,
            root / "squeeze.onnxpipe",
            reference_inputs=[{"data_0": squeeze_input(7)}],
            reference_model=models.light_model_path("squeezenet"),
        ),
    }
    return made


def serve_args(bundles: dict[str, Path], *names: str) -> list[str]:
    return [f"{n}={bundles[n]}" for n in names]


@pytest.fixture(scope="session")
def server(bundles: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server of every model, for the tests that only send requests; stopped with SIGTERM (exit 0)."""
    proc = ServerProcess(*serve_args(bundles, "squeeze", "twoout", "labelled", "rnn", "mlp"), "--allow-code", "tests.*", "--stream-timeout", "5")
    with proc:
        proc.start(tmp_path_factory.mktemp("server-log") / "serve.log")
        yield proc
        assert proc.stop() == 0, proc.log()
