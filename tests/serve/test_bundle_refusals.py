"""What ``onnxpipe serve`` refuses of a bundle's settings and code, and of ``--set`` (issue 36, items 7,
8 and 12), from a real server process: a ``session_config`` that overrules the typed settings, an
entry point that walks out of its module, and an affinity too long to parse or naming cores this
host lacks. Each is one line naming the model, the stage and what to change; nothing is served."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tests import code_stages, models
from tests.cli.helpers import assert_usage_error, run
from tests.runtime.test_bundle import _rehash
from tests.serve.process import ServerProcess

#: How long a refused server may take to exit: it loads one small model, then stops.
_EXIT_S = 90


def _refused(proc: ServerProcess, log: Path) -> tuple[int, list[str]]:
    """Start ``proc``, wait for it to exit; its exit code and the lines of its log that say an error."""
    proc.start(log, wait=False)
    assert proc.proc is not None
    code = proc.proc.wait(_EXIT_S)
    return code, [line for line in proc.log().splitlines() if line.lower().startswith("error: ")]


# -- item 7: typed settings win over session_config --------------------------------------------------


def test_a_session_config_that_overrules_spinning_is_refused_whatever_set_says(bundles: dict[str, Path], tmp_path: Path) -> None:
    # Before: the bundle spun, --set '*:spinning=off' could not stop it, and the start line said spinning off.
    bundle = tmp_path / "spin"
    shutil.copytree(bundles["mlp"], bundle)
    data = json.loads((bundle / "pipeline.json").read_text())
    data["stages"][0]["settings"].update(spinning=False, session_config={"session.intra_op.allow_spinning": "1"})
    (bundle / "pipeline.json").write_text(json.dumps(data))
    _rehash(bundle)
    with ServerProcess(f"spin={bundle}", "--set", "*:spinning=off", grpc=False) as proc:
        code, errors = _refused(proc, tmp_path / "refused.log")
    assert code == 1, proc.log()
    assert errors == [
        f"error: model 'spin' ({bundle}): pipeline.json: pipeline spec: stages[0] ('mlp'): settings: session_config key "
        "'session.intra_op.allow_spinning' is what the setting 'spinning' makes: set spinning instead (StageSettings(spinning=...), "
        "or SEL:spinning=on|off in --stage / --set), so the session runs as its settings say"
    ], proc.log()
    assert "spinning off" not in proc.log() and "ready" not in proc.log()
    # The typed setting is the one a server runs, and its start line says so.
    with ServerProcess(f"mlp={bundles['mlp']}", "--set", "*:spinning=on", grpc=False) as proc:
        proc.start(tmp_path / "served.log")
        assert proc.stop() == 0, proc.log()
    assert "deploy-time settings: stage 'mlp': replicas 1, intra_op_threads 1, affinity none, max_batch 8, max_delay_ms 2, spinning on" in proc.log()


# -- item 8: an entry point resolves only to what its module defines --------------------------------


def test_an_entry_point_walking_out_of_its_module_is_refused_at_load_naming_it(tmp_path: Path) -> None:
    # 'tests.code_stages:*' matches it; before, it resolved to os.kill, which each request then called.
    entry = "tests.code_stages:threading._os.kill"
    bundle = models.bundle_of(code_stages.config(entry), tmp_path / "walk")
    with ServerProcess(f"walk={bundle}", "--allow-code", "tests.code_stages:*", grpc=False) as proc:
        code, errors = _refused(proc, tmp_path / "serve.log")
    assert code == 1, proc.log()
    assert len(errors) == 1, proc.log()
    assert errors[0].startswith(f"error: model 'walk' ({bundle}): stage 'combine': entry point '{entry}': 'threading' is the module 'threading', "
                                "not a function or class 'tests.code_stages' defines under that name"), proc.log()


# -- item 12: --set affinity is parsed in one pass, bounded, and every core is checked ---------------


def test_an_affinity_of_a_million_cores_is_refused_at_once_as_one_line(bundles: dict[str, Path], tmp_path: Path) -> None:
    # Before: 0-20000 took 7.5 s to parse, 0-1000000 never returned. _refused waits 90 s at most.
    with ServerProcess(f"mlp={bundles['mlp']}", "--set", "affinity=0-1000000", grpc=False) as proc:
        code, errors = _refused(proc, tmp_path / "serve.log")
    assert code == 2, proc.log()
    assert errors == ["Error: Invalid value for '--set': affinity=0-1000000 in 'affinity=0-1000000': core 1000000 in '0-1000000' "
                      "is past the largest core number, 8191 (Linux's most CPUs)"], proc.log()
    assert_usage_error(run("serve", f"mlp={bundles['mlp']}", "--http-port", "1", "--set", "affinity=²"),
                       "affinity=² in 'affinity=²': '²' is not a core list: give cores as 0, 0-3 or 0+2+5 (or none), in the digits 0-9")


def test_every_core_of_an_affinity_is_checked_with_one_thread(bundles: dict[str, Path], tmp_path: Path) -> None:
    # Before: with one thread only the first core was checked, so 'CORE+LACKING' served.
    allowed = sorted(os.sched_getaffinity(0))
    core, lacking = allowed[0], allowed[-1] + 1
    with ServerProcess(f"mlp={bundles['mlp']}", "--set", f"affinity={core}+{lacking},threads=1", grpc=False) as proc:
        code, errors = _refused(proc, tmp_path / "serve.log")
    assert code == 1, proc.log()
    assert errors == [f"error: model 'mlp' ({bundles['mlp']}): stage 'mlp': affinity names core(s) [{lacking}] this process may not use; "
                      f"allowed cores: {allowed}; choose others at load: load(..., overrides=...), or --set SEL:affinity=CORES "
                      "(onnxpipe serve/run/bench)"], proc.log()
