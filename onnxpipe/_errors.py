"""The one exception family of onnxpipe.

User errors (a bad cut, an unknown tensor, a broken bundle, a wrong input) raise a subclass of
:class:`OnnxpipeError` whose message names the offending thing and the valid choices. Bugs stay
plain Python exceptions with their tracebacks.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "BuildError",
    "BundleError",
    "BusyError",
    "ConfigError",
    "InputError",
    "OnnxpipeError",
    "SplitError",
    "StageError",
    "StreamError",
    "closest",
]


class OnnxpipeError(Exception):
    """Base class of every error onnxpipe raises on purpose for bad user input."""


class SplitError(OnnxpipeError):
    """A model cannot be split as asked (unknown name, bad cut, empty stage, ...)."""


class ConfigError(OnnxpipeError):
    """A pipeline wiring is invalid (unbound input, dtype mismatch, cycle, ...)."""


class BuildError(OnnxpipeError):
    """A stage cannot be built for its target."""


class BundleError(OnnxpipeError):
    """A bundle is missing, broken, or refused as unsafe."""


class StageError(OnnxpipeError):
    """A stage failed while running a request (or the pipeline closed before it finished).

    Attributes:
        stage: The stage that failed, when one did.
        request: The request's number, when the error belongs to one request.
    """

    def __init__(self, message: str, *, stage: str | None = None, request: int | None = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.request = request


class StreamError(StageError):
    """A stream cannot take a step (closed, timed out, too many streams), or one of its steps failed.

    Attributes:
        state_valid: For a failed step: whether the stream's state is still what it was before the
            step (the stream can go on), or not (close it). ``None`` when no step failed.
    """

    def __init__(self, message: str, *, stage: str | None = None, request: int | None = None, state_valid: bool | None = None) -> None:
        super().__init__(message, stage=stage, request=request)
        self.state_valid = state_valid


class BusyError(OnnxpipeError):
    """The pipeline cannot take a request now without waiting (``submit(..., block=False)``);
    nothing was submitted."""


class InputError(OnnxpipeError):
    """Inputs given to a pipeline or a model do not match what it declares."""


#: Up to this many valid names, a message lists every one of them (keys, settings, stages...);
#: past it (the tensors of a big model) the first few and how many more.
ALL_UP_TO = 30


def closest(name: str, choices: Iterable[str], n: int = 3) -> str:
    """Format the valid names closest to ``name`` for an error message.

    Args:
        name: The name the user gave.
        choices: Every valid name.
        n: How many close names to show, and how many valid ones when there are more than
            :data:`ALL_UP_TO` and none is close.

    Returns:
        ``"closest: 'a', 'b'"`` (with every valid name after it when there are few), or the valid
        names: all of them up to :data:`ALL_UP_TO`, else the first ``n`` and how many more.
    """
    pool = sorted(set(choices))
    near = difflib.get_close_matches(name, pool, n=n, cutoff=0.5)
    every = len(pool) <= ALL_UP_TO
    listing = ", ".join(repr(c) for c in pool)
    if near:
        return "closest: " + ", ".join(repr(c) for c in near) + (f"; valid: {listing}" if every and len(pool) > len(near) else "")
    if not pool:
        return "there are none"
    if every:
        return f"valid: {listing}"
    return f"valid: {', '.join(repr(c) for c in pool[:n])} (and {len(pool) - n} more)"
