"""onnxruntime-openvino installed as docs/building.md says, and two onnxruntime builds over each
other, for real.

`make test-openvino` makes .venv-openvino as the docs say (`pip install '.[openvino,ray,serve]'`, no
plain onnxruntime anywhere): `pip check` is clean there. Beside it, .venv-openvino-mixed is a copy with
plain onnxruntime installed over it, as `pip install 'onnxpipe[cpu]' onnxruntime-openvino` leaves a
host (both distributions are the package `onnxruntime`; plain onnxruntime's native module wins, so
there is no OpenVINO though onnxruntime-openvino is installed, and `pip check` sees nothing wrong):
a stage on OpenVINO fails to load naming both builds and the fix, and the fix, run in a copy of
that venv, gives a venv where the stage runs on OpenVINO and `pip check` is clean.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnxruntime as ort
import pytest

from onnxpipe.runtime._distributions import ort_distributions
from onnxpipe.splitter import split
from tests import models

pytestmark = pytest.mark.skipif(
    "OpenVINOExecutionProvider" not in ort.get_available_providers(),
    reason=f"this onnxruntime ({ort.__version__}) has no OpenVINOExecutionProvider: `make test-openvino` runs these in a venv with onnxruntime-openvino",
)

OV = "OpenVINOExecutionProvider"
VENV = Path(sys.prefix)
MIXED = VENV.with_name(f"{VENV.name}-mixed")
# (Where there is no OpenVINO at all, the module's own skip says so.)
needs_mixed = pytest.mark.skipif(OV in ort.get_available_providers() and not (MIXED / ".installed").is_file(),
                                 reason=f"no {MIXED} beside this venv: `make test-openvino` makes it")
# In a child: load the bundle; print the providers there, and the error or where each node ran.
_LOAD = """
import json, sys
import onnxruntime as ort
from onnxpipe import BundleError
from onnxpipe.runtime import load
from onnxpipe.runtime._distributions import ort_distributions
out = {"providers": ort.get_available_providers(), "builds": [str(d) for d in ort_distributions()]}
try:
    with load(sys.argv[1]) as pipe:
        out["placement"] = {stage: sorted(nodes or {}) for stage, nodes in pipe.placement().items()}
except BundleError as e:
    out["error"] = str(e)
print(json.dumps(out))
"""


def _site(venv: Path) -> Path:
    (site,) = venv.glob("lib/python*/site-packages")
    return site


def _python(venv: Path, *args: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    # cwd elsewhere than the repository: `python -m` puts the working folder on the path, and the
    # repository's own onnxpipe.egg-info (setuptools' build output) would then be an installed onnxpipe.
    return subprocess.run([str(venv / "bin" / "python"), *map(str, args)], capture_output=True, text=True, timeout=300, env=env, cwd=cwd or VENV)


def _load(venv: Path, bundle: Path) -> dict[str, Any]:
    done = _python(venv, "-c", _LOAD, bundle)
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout)
    return out


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny 2-stage bundle whose first stage runs on OpenVINO, built here (which proves it loads)."""
    plan = split(models.chain(), ["b"])
    plan.config.stages[0].configure(target="openvino")
    return models.bundle_of(plan, tmp_path_factory.mktemp("openvino-bundle"))


def test_pip_check_is_clean_where_onnxpipe_was_installed_as_documented(tmp_path: Path) -> None:
    if not (VENV / ".installed").is_file():
        pytest.skip(f"{VENV} was not made by `make test-openvino` (the documented install); its pip check says nothing about that")
    done = _python(VENV, "-m", "pip", "check", cwd=tmp_path)
    assert (done.returncode, done.stdout.strip()) == (0, "No broken requirements found."), done.stdout + done.stderr
    # One onnxruntime build, OpenVINO's, and onnxpipe's core requires none (each extra brings one).
    assert [d.name for d in ort_distributions()] == ["onnxruntime-openvino"]
    core = [r for r in importlib.metadata.requires("onnxpipe") or [] if "extra ==" not in r]
    assert [r for r in core if r.startswith("onnxruntime")] == []


@needs_mixed
def test_two_builds_over_each_other_are_named_where_a_stage_needs_openvino(bundle: Path) -> None:
    site = _site(MIXED)
    builds = {d.name: d for d in ort_distributions([str(site)])}
    assert sorted(builds) == ["onnxruntime", "onnxruntime-openvino"]
    plain, openvino = builds["onnxruntime"], builds["onnxruntime-openvino"]
    out = _load(MIXED, bundle)
    providers = out["providers"]
    assert isinstance(providers, list) and OV not in providers  # plain onnxruntime's native module won
    diagnosis = (f"{plain} and {openvino} are both installed in {site}, each as the package 'onnxruntime', one's files over the other's; "
                 f"the one Python imports ({site / 'onnxruntime'}) has {plain}'s native module, with {', '.join(providers)}; "
                 "keep one: pip uninstall -y onnxruntime onnxruntime-openvino && pip install onnxruntime-openvino")
    assert out["error"] == (f"stage 'stage0' targets {OV}, which this host's onnxruntime ({plain.version}) does not have; available: {', '.join(providers)}; "
                            f"{diagnosis}; or use target 'cpu' to run every stage on the CPU instead")
    # The command line: the same, as one line; and inspect --host of a bundle that loads warns.
    done = _python(MIXED, "-m", "onnxpipe.cli", "inspect", bundle, "--host")
    assert (done.returncode, done.stderr.strip()) == (1, f"error: {out['error']}")
    done = _python(MIXED, "-m", "onnxpipe.cli", "inspect", bundle, "--host", "--target", "cpu")
    assert done.returncode == 0, done.stderr
    assert f"  warning: {diagnosis}\n" in done.stdout


@pytest.fixture()
def mixed_copy(tmp_path: Path) -> Iterator[Path]:
    """A copy of the mixed venv to repair, of hard links where the file system allows (0.3 s; a real
    copy of its 800 MB takes 1-15 s): pip unlinks each file before it writes its replacement and
    writes metadata to a temporary file it renames, so the original's files keep their content."""
    copy = tmp_path / MIXED.name
    if subprocess.run(["cp", "-al", str(MIXED), str(copy)], capture_output=True).returncode != 0:
        shutil.rmtree(copy, ignore_errors=True)
        subprocess.run(["cp", "-a", str(MIXED), str(copy)], check=True)
    yield copy
    shutil.rmtree(copy, ignore_errors=True)


@needs_mixed
def test_the_fix_the_diagnosis_names_gives_openvino_and_a_clean_pip_check(bundle: Path, mixed_copy: Path, tmp_path: Path) -> None:
    error = str(_load(mixed_copy, bundle)["error"])
    fix = re.search(r"keep one: (pip uninstall -y [\w -]+) && (pip install [\w-]+);", error)
    assert fix is not None, error
    # The commands as the message gives them, run by that venv's pip; the index's onnxruntime-openvino
    # pinned to the one this suite tests, which pip's cache holds.
    constraint = tmp_path / "constraints.txt"
    constraint.write_text(f"onnxruntime-openvino=={importlib.metadata.version('onnxruntime-openvino')}\n")
    env = {**os.environ, "PIP_CONSTRAINT": str(constraint)}
    for command in fix.groups():
        done = _python(mixed_copy, "-m", *command.split(), "--quiet", env=env, cwd=tmp_path)
        assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"
    out = _load(mixed_copy, bundle)
    assert "error" not in out, out["error"]
    assert out["builds"] == [f"onnxruntime-openvino {importlib.metadata.version('onnxruntime-openvino')}"]
    assert out["placement"] == {"stage0": [OV], "stage1": ["CPUExecutionProvider"]}
    done = _python(mixed_copy, "-m", "pip", "check", cwd=tmp_path)
    assert (done.returncode, done.stdout.strip()) == (0, "No broken requirements found."), done.stdout + done.stderr
