"""The memory a pipeline takes, measured (issue 22): stats(), bench, and the planner's child-process probe."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from onnxpipe.builder import PipelineConfig
from onnxpipe.runtime import load
from onnxpipe.runtime._stats import resident_bytes
from tests import models
from tests.cli.helpers import ok

needs_proc = pytest.mark.skipif(resident_bytes() is None, reason="no /proc to read memory from")


def _wide(tmp_path: Path) -> Path:
    config = PipelineConfig("wide")
    stage = config.add_stage(models.wide_mlp(width=1024), "mlp")  # 16 MiB of weights
    config.input("x").connect(stage.input("x"))
    stage.output("y").connect(config.output("y"))
    return models.bundle_of(config, tmp_path)


@needs_proc
def test_stats_report_the_memory_of_the_process_the_pipeline_runs_in(tmp_path: Path) -> None:
    bundle = _wide(tmp_path)
    with load(bundle) as pipe:
        pipe({"x": np.ones((1, 1024), np.float32)})
        stats = pipe.stats()
        polled = pipe.stats(memory=False)  # what a poller that does not show memory asks (the server's statistics)
    assert stats.resident_bytes is not None and stats.resident_bytes >= 16 << 20, stats.resident_bytes  # it holds the weights
    assert " MiB" in str(stats).splitlines()[0] and "resident" in str(stats)
    assert polled.resident_bytes is None and polled.stages[0].count == stats.stages[0].count == 1


@needs_proc
def test_bench_prints_the_memory(tmp_path: Path) -> None:
    out = ok("bench", _wide(tmp_path), "--requests", "5", "--warmup", "1").output
    assert "memory:" in out and "resident" in out


@needs_proc
def test_the_planners_probe_measures_a_bundle_in_a_process_of_its_own(tmp_path: Path) -> None:
    from onnxpipe.planner._memory import plan_memory

    taken = plan_memory(_wide(tmp_path), {"N": 1})
    assert 16 << 20 <= taken < 200 << 20, taken
