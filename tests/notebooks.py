"""Running a tutorial notebook from a clean kernel, for the notebook tests (tests/test_tutorial.py,
tests/examples/test_ocr_notebook.py): one copy of how a notebook is executed and checked as stored."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient

__all__ = ["assert_stored_clean", "execute"]


def _kernel_spec(folder: Path) -> Path:
    """A jupyter data folder whose ``python3`` kernel is this interpreter.

    Note: nbclient finds kernels by name on the jupyter path, where a ``python3`` kernel registered in
    the user's home (``ipykernel install --user``) would come before this environment's and could run
    another Python without onnxpipe. Putting this folder first on ``JUPYTER_PATH`` pins the kernel to
    ``sys.executable``; the notebook records ``sys.prefix`` and a test compares it.
    """
    spec = folder / "kernels" / "python3"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "Python 3 (onnxpipe)", "language": "python"}))
    return folder


def execute(notebook: Path, tmp_path_factory: pytest.TempPathFactory, out: str, cell_timeout: int) -> tuple[Any, dict[str, Any], Path]:
    """Run ``notebook`` once from a clean kernel in a temporary folder.

    Returns:
        The executed notebook, the ``<out>/summary.json`` it wrote, and the folder it ran in.
    """
    folder = tmp_path_factory.mktemp(notebook.stem)
    nb = nbformat.read(notebook, as_version=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(_kernel_spec(tmp_path_factory.mktemp("jupyter"))))
        client = NotebookClient(nb, timeout=cell_timeout, startup_timeout=60, kernel_name="python3", resources={"metadata": {"path": str(folder)}})
        client.execute()
    summary = json.loads((folder / out / "summary.json").read_text())
    return nb, summary, folder


def assert_stored_clean(notebook: Path) -> None:
    """The notebook as committed: valid, the python3 kernel, no outputs or execution counts."""
    nb = nbformat.read(notebook, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "the notebook has no code cells"
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, f"cells {dirty} were stored with outputs or execution counts; clear them before committing"
    assert all("execution" not in c.metadata for c in code), "cells carry execution timing metadata"
