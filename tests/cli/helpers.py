"""What every CLI test file needs: invoke the real command and check how it ended."""

from __future__ import annotations

from click.testing import CliRunner, Result

from onnxpipe.cli import main

__all__ = ["assert_usage_error", "assert_user_error", "ok", "run"]


def run(*args: object, env: dict[str, str] | None = None) -> Result:
    """Invoke ``onnxpipe ARGS`` wide enough that no table cell wraps (tests match whole words)."""
    return CliRunner(env={"COLUMNS": "200", **(env or {})}).invoke(main, [str(a) for a in args])


def ok(*args: object) -> Result:
    """:func:`run`, asserting exit code 0."""
    result = run(*args)
    assert result.exit_code == 0, result.output
    return result


def assert_usage_error(result: Result, *fragments: str) -> None:
    """Exit 2 with click's usage message, containing every fragment."""
    assert result.exit_code == 2, result.output
    assert "Usage:" in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, fragment


def assert_user_error(result: Result, *fragments: str) -> None:
    """Exit 1, one line 'error: ...' on stderr containing every fragment, no traceback."""
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    assert "Traceback" not in result.output
