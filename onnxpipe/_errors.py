"""The one exception family of onnxpipe.

User errors (a bad cut, an unknown tensor, a broken bundle, a wrong input) raise a subclass of
:class:`OnnxpipeError` whose message names the offending thing and the valid choices. Bugs stay
plain Python exceptions with their tracebacks.

Note: a stream's errors carry facts, each layer says them.
    A stream's errors (:class:`StreamError`, :class:`StateDimError`) keep what happened as fields:
    the stream, the step, the stages that took it, why the stream was closed (:class:`Closure`),
    the limit involved, and what its owner can do (:class:`Remedy`). Their text is rendered from
    those fields in some layer's words (:class:`StreamTerms`): ``str()`` gives the runtime's
    ("stream 3", ``stream_timeout=``, "open a new one with pipe.stream()"), and the server renders
    the same fields in a client's (its ``sequence_id``, ``--stream-timeout``, "start it again with
    'sequence_start': true"; ``serve/_models.py``, Note: a client's terms). No layer rewrites
    another's text. An error that wraps a step's failure (``cause``) renders the cause in the same
    words when it is a stream's error too, and as its own text otherwise (a stage's failure).

Note: onnxruntime's words, said short.
    onnxruntime's exceptions carry a head (``[ONNXRuntimeError] : 2 : INVALID_ARGUMENT :``), the
    node a run failed in as its graph optimizer renamed it (``Non-zero status code returned while
    running Conv node. Name:'/conv/Conv_output_0_nchwc' Status Message:``), its C++ source
    (``/onnxruntime_src/.../reshape_helper.h:91 onnxruntime::ReshapeHelper::ReshapeHelper(...)
    input_shape_size == requested_shape_size was false.``) and advice that fits no user of
    onnxpipe (``Please fix either the inputs/outputs or the model.``). :func:`ort_message` keeps
    what went wrong, on one line: ``Conv node '/conv/Conv': Input channels C is not equal to
    kernel channels * group. C: 5 kernel channels: 3 group: 1``, the node named as the model names
    it where its optimized name allows (``_nchwc`` and ``_token_N`` are onnxruntime's suffixes; an
    NCHWc node is named after its output, which a torch export names ``NODE_output_0``). Each
    caller says first what the user did that onnxruntime refused ("the whole model fails on input
    set 0 (x[1, 5, 8, 8]): ..."). The whole text stays on the error's ``__cause__``, and a stage's
    failure keeps it as ``StageError.detail`` for a server's log.
"""

from __future__ import annotations

import difflib
import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

__all__ = [
    "BuildError",
    "BundleError",
    "BusyError",
    "Closure",
    "ConfigError",
    "InputError",
    "RUNTIME_TERMS",
    "OnnxpipeError",
    "Remedy",
    "SplitError",
    "StageError",
    "StateDimError",
    "StreamError",
    "StreamTerms",
    "closest",
    "ort_message",
    "said",
    "without_source",
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
        detail: The whole text of what failed where the message says it short (onnxruntime's,
            with its source: Note: onnxruntime's words, said short), for a log; else ``None``.
        held: For a stream's step: what of the state the stage held and fed it does not fit the
            step (its own state is what the model refused: stepping again fails the same way), or "".
    """

    def __init__(self, message: str, *, stage: str | None = None, request: int | None = None, detail: str | None = None, held: str = "") -> None:
        super().__init__(message)
        self.stage = stage
        self.request = request
        self.detail = detail
        self.held = held


class BusyError(OnnxpipeError):
    """The pipeline cannot take a request now without waiting (``submit(..., block=False)``);
    nothing was submitted."""


class InputError(OnnxpipeError):
    """Inputs given to a pipeline or a model do not match what it declares."""


class Remedy(enum.Enum):
    """What the owner of a stream can do about a :class:`StreamError` or :class:`StateDimError`
    (each layer words it: :class:`StreamTerms`)."""

    #: The step failed but the stream's state is as before it: step again.
    GO_ON = "go_on"
    #: The stream's state is no longer valid: close the stream.
    CLOSE = "close"
    #: The stream refuses steps (its state is no longer valid): close it and open a new one.
    RESTART = "restart"
    #: The stream is closed: open a new one.
    REOPEN = "reopen"
    #: A step sizes a state dim differently than the stream's first step: open a new stream for that size.
    NEW_STREAM = "new_stream"
    #: ``max_streams`` streams are open: close one, or allow more.
    MAKE_ROOM = "make_room"


@dataclass(frozen=True)
class Closure:
    """Why a stream was closed (``Stream.closure``, ``StreamError.closure``).

    Attributes:
        cause: ``"owner"`` (its ``close()``), ``"idle"`` (idle past the pipeline's
            ``stream_timeout``) or ``"pipeline"`` (its pipeline was closed).
        timeout: For ``"idle"``: the ``stream_timeout`` it passed, in seconds.
    """

    cause: Literal["owner", "idle", "pipeline"]
    timeout: float | None = None


class StreamTerms:
    """The words a layer says a stream's facts in: these are the runtime's (``str()`` of a
    stream's error); the server subclasses it with a client's (see Note: a stream's errors carry
    facts, each layer says them)."""

    #: What a stream's state is called.
    state = "the stream's state"
    #: Each remedy, as a sentence's last clause (:attr:`Remedy.NEW_STREAM`'s is followed by the dim's name).
    remedies: ClassVar[Mapping[Remedy, str]] = {
        Remedy.GO_ON: "the stream can go on",
        Remedy.CLOSE: "close the stream",
        Remedy.RESTART: "close it and open a new one",
        Remedy.REOPEN: "open a new one with pipe.stream()",
        Remedy.NEW_STREAM: "open a new stream for another",
        Remedy.MAKE_ROOM: "close one first, or load the pipeline with a larger max_streams",
    }

    def stream(self, stream: int) -> str:
        """The stream an error is about, as the subject of its sentence."""
        return f"stream {stream}"

    def timeout(self, seconds: float) -> str:
        """The idle timeout a stream passed."""
        return f"stream_timeout={seconds:g}"

    def closure(self, closure: Closure) -> str:
        """Why a stream was closed (``Stream.closed_because``)."""
        if closure.cause == "idle":
            return f"it was idle for more than {self.timeout(closure.timeout or 0.0)} s, and its state was freed"
        return "closed by its owner" if closure.cause == "owner" else "its pipeline was closed"


#: The runtime's words (``str()`` of every stream error).
RUNTIME_TERMS = StreamTerms()


def said(error: BaseException, terms: StreamTerms = RUNTIME_TERMS) -> str:
    """An error's text in ``terms``: a stream's error rendered from its fields, any other its own text."""
    if isinstance(error, StreamError | StateDimError):
        return error.render(terms)
    return str(error)


class StreamError(StageError):
    """A stream cannot take a step (closed, timed out, too many streams), or one of its steps failed.

    Made by its constructors (:meth:`closed`, :meth:`refused`, :meth:`step_failed`,
    :meth:`state_lost`, :meth:`too_many`), it keeps the facts as fields and its text is rendered from
    them (:meth:`render`); one made from a message alone (the pipeline is closed, a stream of
    another pipeline) has only its message.

    Attributes:
        state_valid: For a failed step: whether the stream's state is still what it was before the
            step (the stream can go on), or not (close it). ``None`` when no step failed.
        remedy: What its owner can do (``None`` for an error with a message alone).
        stream: The stream a refusal is about (closed, or refusing steps).
        step: The step that failed (for a refusal: the step whose failure left the state invalid).
        cause: The step's failure this error wraps (a stage's error, or the engine's :meth:`state_lost`).
        took: The stages with state that took the failed step before the failing one.
        streams: The streams whose state an engine lost (:meth:`state_lost`).
        detail: What happened to the state an engine lost.
        closure: Why the stream was closed.
        limit: The limit that was reached (``max_streams``).
        open_ids: The streams open when ``limit`` was reached.
    """

    def __init__(
        self,
        message: str | None = None,
        *,
        stage: str | None = None,
        request: int | None = None,
        state_valid: bool | None = None,
        remedy: Remedy | None = None,
        stream: int | None = None,
        step: int | None = None,
        cause: BaseException | None = None,
        took: Sequence[str] = (),
        streams: Sequence[int] = (),
        detail: str = "",
        closure: Closure | None = None,
        limit: int | None = None,
        open_ids: Sequence[int] = (),
    ) -> None:
        StageError.__init__(self, message or "", stage=stage, request=request)
        self.state_valid = state_valid
        self.remedy = remedy
        self.stream = stream
        self.step = step
        self.cause = cause
        self.took = tuple(took)
        self.streams = tuple(streams)
        self.detail = detail
        self.closure = closure
        self.limit = limit
        self.open_ids = tuple(open_ids)
        if message is None:
            self.args = (self.render(),)

    @classmethod
    def closed(cls, stream: int, closure: Closure) -> StreamError:
        """A step of a closed stream."""
        return cls(remedy=Remedy.REOPEN, stream=stream, closure=closure)

    @classmethod
    def refused(cls, stream: int, step: int, failure: StreamError) -> StreamError:
        """A step of a stream whose step ``step`` failed as ``failure`` and left its state invalid."""
        return cls(remedy=Remedy.RESTART, stream=stream, step=step, cause=failure, state_valid=False)

    @classmethod
    def step_failed(cls, error: BaseException, step: int, took: Sequence[str]) -> StreamError:
        """A stream's step failed with ``error`` (in ``error.stage``) after the stages with state
        ``took`` had taken it: the state is unchanged when none had, else no longer valid; and no
        longer usable when the failing stage's own state is what the step could not run on
        (``StageError.held``: every later step would fail on it too)."""
        stage = error.stage if isinstance(error, StageError) else None
        held = error.held if isinstance(error, StageError) else ""
        remedy = Remedy.CLOSE if took or held else Remedy.GO_ON
        return cls(stage=stage, request=getattr(error, "request", None), state_valid=not took and not held, remedy=remedy, step=step, cause=error,
                   took=took, detail=held)

    @classmethod
    def state_lost(cls, stage: str, streams: Sequence[int], detail: str, request: int | None = None) -> StreamError:
        """An engine lost the state of ``streams`` in ``stage``: ``detail`` says how (e.g. "the
        actor holding it (replica 0) died (...)"). Every engine that can lose a state says so with
        this, so each layer words it alike."""
        return cls(stage=stage, request=request, state_valid=False, remedy=Remedy.CLOSE, streams=streams, detail=detail)

    @classmethod
    def too_many(cls, limit: int, open_ids: Sequence[int]) -> StreamError:
        """No stream can open: ``limit`` streams (``max_streams``) are open, ``open_ids``."""
        return cls(remedy=Remedy.MAKE_ROOM, limit=limit, open_ids=open_ids)

    def render(self, terms: StreamTerms = RUNTIME_TERMS) -> str:
        """The error's text in ``terms`` (``str()``: the runtime's)."""
        remedy = self.remedy
        if remedy is None:
            return str(self.args[0])
        then = terms.remedies[remedy]
        if remedy is Remedy.REOPEN:
            assert self.closure is not None and self.stream is not None
            return f"{terms.stream(self.stream)} is closed ({terms.closure(self.closure)}); {then}"
        if remedy is Remedy.RESTART:
            assert self.stream is not None and isinstance(self.cause, StreamError)
            return f"{terms.stream(self.stream)} cannot take more steps: {self.cause.failure(self.step, terms)}; {then}"
        if remedy is Remedy.MAKE_ROOM:
            return f"max_streams={self.limit} streams are open already (ids {', '.join(map(str, self.open_ids))}); {then}"
        if self.streams:
            which = f"stream {self.streams[0]}" if len(self.streams) == 1 else "streams " + ", ".join(map(str, self.streams))
            return f"stage '{self.stage}' lost the state of {which}: {self.detail}; {then}"
        cause = said(self.cause, terms) if self.cause is not None else ""
        if remedy is Remedy.GO_ON:
            return f"{cause}; {terms.state} is unchanged (as after step {(self.step or 0) - 1}): {then}"
        if self.detail and not self.took:
            return (f"{cause}; stage '{self.stage}' ran the step on the state it holds (as after step {(self.step or 0) - 1}), and that state does not fit "
                    f"it: {self.detail}; every later step would fail on it too: {then}")
        return f"{cause}; {terms.state} is no longer valid: stage(s) {_quoted(self.took)} took step {self.step} and stage '{self.stage}' did not; {then}"

    def failure(self, step: int | None, terms: StreamTerms = RUNTIME_TERMS) -> str:
        """What this failure of step ``step`` did to the stream, as a refusal of its later steps says it."""
        if self.took:
            return f"step {step} failed in stage '{self.stage}' after stage(s) {_quoted(self.took)} had updated their state"
        if self.detail and not self.streams:
            return f"step {step} failed in stage '{self.stage}' on the state it holds ({self.detail})"
        return f"step {step} failed: {said(self, terms)}"


class StateDimError(InputError):
    """A stream's step sizes a dim of the stream's state (its symbolic dims but the empty axis)
    differently than the stream's first step did; nothing was submitted and the stream goes on.

    Attributes:
        stream: The stream.
        step: The step's number.
        name: The input that gives the dim.
        dim: The dim's name.
        size: Its size in this step.
        bound: Its size since the stream's first step.
        remedy: Always :attr:`Remedy.NEW_STREAM`.
    """

    remedy = Remedy.NEW_STREAM

    def __init__(self, message: str | None = None, *, stream: int = 0, step: int = 0, name: str = "", dim: str = "", size: int = 0, bound: int = 0) -> None:
        self.stream, self.step, self.name, self.dim, self.size, self.bound = stream, step, name, dim, size, bound
        super().__init__(self.render() if message is None else message)

    def render(self, terms: StreamTerms = RUNTIME_TERMS) -> str:
        """The error's text in ``terms`` (``str()``: the runtime's)."""
        return (f"{terms.stream(self.stream)}, step {self.step}: input '{self.name}' has {self.dim}={self.size}, but {terms.state} was made "
                f"with {self.dim}={self.bound} on its first step; {terms.remedies[self.remedy]} {self.dim}")


def _quoted(names: Iterable[str]) -> str:
    return ", ".join(f"'{n}'" for n in names)


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


#: onnxruntime's C++ source in its messages (Note: onnxruntime's words, said short): a source file
#: and line, then the function (``__PRETTY_FUNCTION__``: a return type and a qualified name with
#: its arguments; or ``__FUNCTION__``, a bare name), and an ORT_ENFORCE's condition when a message
#: follows it; and a source file in a folder found elsewhere. Every repetition is bounded and a file
#: begins a word, so that the time taken grows with the text's length (a megabyte of the worst text
#: found took 0.2-0.5 s).
_FOLDER = r"[\w.+-]{1,128}/"
_FILE = r"[\w.+-]{1,128}\.(?:h|hh|hpp|hxx|inc|c|cc|cpp|cxx|cu|cuh)(?![\w+-])"
_PRETTY = (r"(?:[\w:<>,*&~]{1,256} ){0,8}?[\w<>~,]{0,256}(?:::[\w<>~,]{1,256}){1,16}"  # [return type] qualified::name
           r"\((?:[^()\n]|\([^()\n]{0,256}\)){0,1024}\)(?: const)?(?: \[with [^\]\n]{0,1024}\])?")  # (arguments) const [with T = float]
_ORT_WHERE = re.compile(rf"(?<![\w.+/-])/?(?:{_FOLDER}){{0,32}}{_FILE}:\d{{1,9}} (?:{_PRETTY} |\w{{1,256}} )(?:[^\n]{{1,1024}}? was false\. (?=\S))?")
_ORT_PATH = re.compile(rf"(?<![\w.+/-])/?(?:{_FOLDER}){{1,32}}{_FILE}(?::\d{{1,9}})?")
#: onnxruntime's head (``[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : ``), and the node a run failed in.
_ORT_HEAD = re.compile(r"\[ONNXRuntimeError\] : \d+ : \w+ : ")
_ORT_NODE = re.compile(r"Non-zero status code returned while running (\w+) node\. Name:'([^']*)' Status Message: ?")
#: Suffixes onnxruntime's optimizer gives the nodes it makes, and torch's name of a node's output.
_ORT_SUFFIX = re.compile(r"(?:_nchwc|_token_\d+)+$")
_TORCH_OUTPUT = re.compile(r"(.+)_output_\d+$")
#: Advice of onnxruntime's that says nothing to a user of onnxpipe.
_ORT_ADVICE = " Please fix either the inputs/outputs or the model."


def without_source(text: str) -> str:
    """``text`` without onnxruntime's C++ source files, functions and failed checks, on one line
    (Note: onnxruntime's words, said short)."""
    return " ".join(_ORT_PATH.sub("", _ORT_WHERE.sub("", text)).split())


def ort_message(error: BaseException | str) -> str:
    """onnxruntime's error said short, on one line (Note: onnxruntime's words, said short): without
    its head, its source and its advice, the node it failed in named as the model names it
    (``Conv node '/conv/Conv': Input channels C is not equal to ...``). Any other error's text is
    returned as it is."""
    text = str(error)
    if not (_ORT_HEAD.search(text) or _ORT_NODE.search(text)):
        return text
    text = without_source(text.split("Stacktrace:", 1)[0])
    text = _ORT_NODE.sub(lambda m: _node(m[1], m[2]), _ORT_HEAD.sub("", text))
    return text.replace(_ORT_ADVICE, "").strip()


def _node(op: str, name: str) -> str:
    """The node onnxruntime failed in, as the model names it where its optimized name allows."""
    base = _ORT_SUFFIX.sub("", name)
    if base != name and name.endswith("_nchwc"):  # an NCHWc node, named after its output
        made = _TORCH_OUTPUT.fullmatch(base)
        if made and re.fullmatch(rf"(?:.*/)?{op}(?:_\d+)?", made[1]):  # torch's node '/conv/Conv' makes '/conv/Conv_output_0'
            return f"{op} node '{made[1]}': "
        return f"{op} node making '{base}': "  # fused with the node that made it (a Conv with its Relu)
    return f"{op} node '{base}': " if base else f"{op} node: "
