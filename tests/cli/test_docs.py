"""The documentation's command lines are true: docs/cli.md is current, README's CLI session runs."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_HEADING = "## The CLI in 30 seconds"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_cli", ROOT / "docs" / "gen_cli.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _readme_session() -> list[str]:
    """The lines of the first ```sh block after README's CLI heading, as written."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index(README_HEADING)
    match = re.compile(r"^```sh\n(.*?)^```", re.M | re.S).search(readme, start)
    assert match is not None, f"no ```sh block under {README_HEADING!r} in README.md"
    return [line for line in match.group(1).splitlines() if line.strip()]


def _as_script(lines: list[str]) -> str:
    """The session as a bash script that runs outside the repository root.

    Only the repository-relative ``.venv`` paths change: ``.venv/bin/python`` becomes this
    interpreter and ``. .venv/bin/activate`` is dropped, since ``PATH`` already starts with its bin.
    """
    script = ["set -euo pipefail"]
    for line in lines:
        if re.fullmatch(r"\s*(\.|source)\s+\.venv/bin/activate\s*", line):
            continue
        script.append(re.sub(r"(?<![\w/]).venv/bin/python\b", sys.executable, line))
    return "\n".join(script) + "\n"


def test_cli_reference_is_current() -> None:
    generator = _generator()
    written = generator.OUTPUT.read_text(encoding="utf-8") if generator.OUTPUT.exists() else ""
    assert written == generator.render(), f"docs/cli.md is out of date with the CLI; run `{generator.COMMAND}` and commit the result"


def test_cli_reference_covers_every_command() -> None:
    from onnxpipe.cli import main

    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    for name in main.commands:
        assert f"\n## onnxpipe {name}\n" in text
        assert f"Usage: onnxpipe {name} [OPTIONS]" in text


def test_readme_session_is_extracted_as_written() -> None:
    lines = _readme_session()
    assert lines[0].startswith("M=$(.venv/bin/python ")
    assert sum(line.startswith("onnxpipe ") for line in lines) >= 5
    script = _as_script(lines)
    assert ".venv/bin/activate" not in script
    assert f"M=$({sys.executable} -c " in script


@pytest.mark.slow
def test_readme_cli_session_runs(tmp_path: Path) -> None:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("COLUMNS", None)
    result = subprocess.run(
        ["bash", "-c", _as_script(_readme_session())],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"README session failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert sorted(p.name for p in (tmp_path / "split").iterdir() if p.suffix == ".onnx"), "split/ has no stage models"
    assert (tmp_path / "built").is_dir() and any((tmp_path / "built").iterdir())
    assert (tmp_path / "resnet50.onnxpipe").exists()
