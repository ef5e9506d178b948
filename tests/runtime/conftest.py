"""Fixtures shared by the runtime tests: a private temporary folder (the Ray cluster is in tests/conftest.py)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture()
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Route tempfile into a folder of our own, to see that the loader leaves nothing behind (also when it refuses)."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder
    assert list(folder.iterdir()) == [], "the loader left files in its temporary folder"
