"""Fixtures shared by the runtime tests: a private temporary folder, the recurrent model's bundle, a
fresh copy of a module's bundle to tamper with (the Ray cluster is in tests/conftest.py)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from onnxpipe.splitter import split
from tests.models import bundle_of
from tests.stateful_models import recurrent


@pytest.fixture()
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Route tempfile into a folder of our own, to see that the loader leaves nothing behind (also when it refuses)."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder
    assert list(folder.iterdir()) == [], "the loader left files in its temporary folder"


@pytest.fixture(scope="module")
def rnn_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/stateful_models.py ``recurrent()`` cut at ``state1N`` with its states kept in their
    stages (one in each of the 2 stages), built once per module."""
    return bundle_of(split(recurrent(), ["state1N"], states="auto"), tmp_path_factory.mktemp("rnn"))


@pytest.fixture()
def bundle(pristine_bundle: Path, tmp_path: Path) -> Path:
    """A fresh copy of the module's ``pristine_bundle`` (a module-scoped fixture each bundle test
    module defines), for a test to tamper with."""
    copy = tmp_path / "bundle"
    shutil.copytree(pristine_bundle, copy)
    return copy
