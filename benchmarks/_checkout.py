"""This checkout beside an older one, measured in one run (``--against REV``).

:func:`checkout` gives a detached worktree of a git revision (removed after). :func:`interleaved`
runs a benchmark's own module once per round in a fresh process (``--rounds 1 --json``), on each
side in turn (the older revision, then this checkout, and again), so that the host's load drifting
over the minutes a run takes falls on both sides alike; :func:`compare` pairs each round's figures
and :func:`print_comparison` prints medians, their spread and the ratios new / old.

Note: what each side runs. Both sides run this checkout's benchmark code, and only ``onnxpipe``
differs: each process starts with ``python -P`` (no current directory on ``sys.path``) and
``PYTHONPATH`` = a folder holding nothing but a link named ``onnxpipe`` to the side's own package,
then this checkout's root (for ``benchmarks`` and ``tests``). The older revision's benchmark
scripts may lack the flags used here, or measure differently; with one script the figures differ
by the runtime alone. The cost: this checkout's script must find in the older ``onnxpipe`` the
public API it calls (``load``, ``split``, ``build``, ``export``, ``Pipeline.map``, streams), which a
change with no change in behaviour keeps. Each side's process is checked to import its own
``onnxpipe`` before anything is measured.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from benchmarks._timing import spread

ROOT = Path(__file__).resolve().parents[1]
#: The label of this checkout's side in printed and JSON results.
NEW = "this checkout"


@contextlib.contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """A detached worktree of ``rev`` (removed after)."""
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp) / "checkout"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--quiet", "--detach", str(where), rev], check=True)
        try:
            yield where
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)], check=True)


def revision(rev: str) -> str:
    """``rev`` with its short commit id, as printed: ``HEAD~3 (c18ce00)``."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True, text=True).stdout.strip()
    return rev if rev == sha else f"{rev} ({sha})"


class Side:
    """One side of a comparison: this checkout's benchmarks with ``onnxpipe`` from ``root``
    (see the module's Note)."""

    def __init__(self, label: str, root: Path, work: Path) -> None:
        self.label = label
        self.overlay = work / label.replace(" ", "-")
        self.overlay.mkdir()
        (self.overlay / "onnxpipe").symlink_to(root / "onnxpipe", target_is_directory=True)
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(self.overlay), str(ROOT), os.environ.get("PYTHONPATH")]))}
        imported = self._python("-c", "import onnxpipe; print(onnxpipe.__file__)").strip()
        if Path(imported).parent != self.overlay / "onnxpipe":
            raise RuntimeError(f"the {label} side imports onnxpipe from {imported}, not from {root / 'onnxpipe'}")

    def _python(self, *args: str) -> str:
        done = subprocess.run([sys.executable, "-P", *args], cwd=ROOT, env=self.env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{self.label}: python {' '.join(args)} exited {done.returncode}:\n{done.stderr[-4000:]}")
        return done.stdout

    def round(self, module: str, args: list[str]) -> dict[str, Any]:
        """One round of ``python -m module --rounds 1 --json *args``: its JSON result."""
        out = self._python("-m", module, *args, "--rounds", "1", "--json")
        try:
            result: dict[str, Any] = json.loads(out)
        except json.JSONDecodeError as e:
            raise RuntimeError(f"{self.label}: {module} printed no JSON result: {out[-2000:]!r}") from e
        return result


#: What a comparison holds per figure: side label -> one value per round (None: not measured).
Samples = dict[str, dict[str, list[float | None]]]


def interleaved(module: str, args: list[str], old_root: Path, old_label: str, rounds: int,
                figures: Callable[[dict[str, Any]], Mapping[str, float | None]],
                fixed: Callable[[dict[str, Any]], list[str]] | None = None) -> Samples:
    """``rounds`` rounds of ``module`` (old, new, old, new, ...), each a fresh process: per figure
    (named by ``figures`` from a round's JSON result), the values of each side's rounds.

    ``fixed``, if given, turns the first round's result into arguments every later round gets too
    (a choice the benchmark makes by timing, such as a model's cut, made once for both sides)."""
    samples: Samples = {}
    extra: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        sides = [Side(old_label, old_root, Path(tmp)), Side(NEW, ROOT, Path(tmp))]
        for k in range(rounds):
            for side in sides:
                result = side.round(module, args + extra)
                if fixed is not None and not extra:
                    extra = fixed(result)
                for name, value in figures(result).items():
                    samples.setdefault(name, {s.label: [] for s in sides})[side.label].append(value)
                print(f"  round {k + 1}/{rounds}: {side.label} done", file=sys.stderr, flush=True)
    return samples


def compare(samples: Samples) -> dict[str, dict[str, Any]]:
    """Per figure: each side's median with its min and max, and the ratio new / old paired by
    round (round k of this checkout over round k of the older one, run just before it) with its
    spread; a round where either side has no value, or one that is not positive (a fitted
    intercept or slope below the noise), is left out of the ratio."""
    rows: dict[str, dict[str, Any]] = {}
    for name, sides in samples.items():
        (old_label, old), (_, new) = sides.items()
        row: dict[str, Any] = {label: spread([v for v in values if v is not None]) if any(v is not None for v in values) else None
                               for label, values in sides.items()}
        ratios = [n / o for o, n in zip(old, new, strict=True) if o is not None and n is not None and o > 0 and n > 0]
        row["new_over_old"] = spread(ratios) if ratios else None
        row["old"] = old_label
        rows[name] = row
    return rows


def report(rows: dict[str, dict[str, Any]], rev: str, rounds: int, as_json: bool, legend: str) -> None:
    """Print a benchmark's ``--against REV`` result: as JSON, or as :func:`print_comparison`'s
    table followed by ``legend`` (which way is better)."""
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    print_comparison(rows, revision(rev), rounds)
    print(legend)


def print_comparison(rows: dict[str, dict[str, Any]], old_label: str, rounds: int) -> None:
    """The comparison of :func:`compare` as a table: a figure per line, each side's median
    (min-max), new / old; ``old_label`` names the older side in the header."""

    def cell(s: dict[str, float] | None, fmt: str, unit: str = "") -> str:
        if s is None:
            return "-"
        between = " to " if s["min"] < 0 else "-"  # a fitted intercept may be below 0
        return f"{s['median']:{fmt}}{unit} ({s['min']:{fmt}}{between}{s['max']:{fmt}})"

    width = max(len(name) for name in rows)
    print(f"{old_label} against {NEW}: {rounds} interleaved rounds ({old_label} first), each side's a fresh process running "
          f"this checkout's benchmark on its own onnxpipe; median (min-max) of the rounds; new / old paired by round")
    print(f"{'':<{width}}  {old_label:>26}  {NEW:>26}  {'new / old':>20}")
    for name, row in rows.items():
        values = [s["median"] for s in (row[row["old"]], row[NEW]) if s is not None]
        fmt = ".3f" if values and max(abs(v) for v in values) < 10 else ".1f"
        print(f"{name:<{width}}  {cell(row[row['old']], fmt):>26}  {cell(row[NEW], fmt):>26}  {cell(row['new_over_old'], '.2f', 'x'):>20}")
