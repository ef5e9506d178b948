"""Progress bars and spinners on stderr, shown only where a person may be watching.

rich is imported only when a bar is actually shown, so that ``onnxpipe --help`` and runs whose
stderr is a file or a pipe never load it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress

__all__ = ["PROGRESS_MIN", "progress", "stderr_is_terminal", "step_progress", "working"]

#: More requests than this get a progress bar (on a terminal); fewer finish before one would help.
PROGRESS_MIN = 20


def progress(total: int, label: str, quiet: bool = False, then: str | None = None) -> AbstractContextManager[Callable[[int, int], None]]:
    """A progress bar on stderr for ``total`` steps; the context gives the ``(done, total)`` callback.

    Only on a terminal, for more than :data:`PROGRESS_MIN` steps, and never when ``quiet`` (--json):
    otherwise the callback does nothing. ``then`` labels the bar once every step is done.
    """
    if quiet or total <= PROGRESS_MIN or not stderr_is_terminal():
        return contextlib.nullcontext(_no_progress)
    return _progress_bar(total, label, then)


def step_progress(quiet: bool = False) -> AbstractContextManager[Callable[[str, int, int], None]]:
    """A progress bar on stderr for work in named steps; the context gives the ``(step, done, total)`` callback.

    Only on a terminal and never when ``quiet``: otherwise the callback does nothing.
    """
    if quiet or not stderr_is_terminal():
        return contextlib.nullcontext(_no_step_progress)
    return _step_bar()


def working(label: str, quiet: bool = False) -> AbstractContextManager[object]:
    """A spinner with ``label`` on stderr while a single long step runs; only on a terminal, never when ``quiet``."""
    if quiet or not stderr_is_terminal():
        return contextlib.nullcontext()
    from rich.console import Console
    from rich.text import Text

    return Console(stderr=True).status(Text(label))


def stderr_is_terminal() -> bool:
    """Whether a person may be watching stderr (a progress bar helps) rather than a file or a pipe."""
    return sys.stderr.isatty()


def _no_progress(done: int, total: int) -> None:
    pass


def _no_step_progress(step: str, done: int, total: int) -> None:
    pass


def _bar() -> Progress:
    """A transient progress bar on stderr."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    return Progress(*columns, console=Console(stderr=True), transient=True)


@contextmanager
def _progress_bar(total: int, label: str, then: str | None) -> Iterator[Callable[[int, int], None]]:
    with _bar() as bar:
        task = bar.add_task(label, total=total)

        def advance(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, description=then if then and done >= total else label)

        yield advance


@contextmanager
def _step_bar() -> Iterator[Callable[[str, int, int], None]]:
    with _bar() as bar:
        task = bar.add_task("", total=None)

        def advance(step: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, description=step)

        yield advance
