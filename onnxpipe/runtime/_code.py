"""Code stages and custom-op libraries: Python named by the bundle, run only if the host allows it.

Note: code is data only by name.
    A bundle never carries code and nothing is ever pickled: a code stage names a callable by its
    import path (``"pkg.module:qualname"``), and an ONNX stage needing a custom-op library names
    the Python package that ships it (``custom_ops = ["onnxruntime_extensions"]``), never a path.
    Whatever is named must already be installed on the host. Loading such a bundle is opt-in: the
    host passes an allow-list of :mod:`fnmatch` patterns (``load(..., allow_code=["mypkg.*"])``,
    ``onnxpipe run --allow-code 'mypkg.*'``), matched against the full entry point
    (``"mypkg.*"`` allows ``"mypkg.ocr:decode"``) or the package name of a custom-op library.
    :func:`check_allowed` runs before anything is imported and names every entry point and
    library refused, so the bundle cannot make the host import a module it did not allow -- not
    even to learn that it exists.

Note: what an entry point may name.
    The allow-list matches an entry point's text (``"tests.code_stages:*"``), so the text alone
    must not reach past the module it names: ``mod:threading._os.kill`` (a module ``mod``
    imports, and one that module imports) or ``mod:decode.__globals__.get`` would match the
    pattern and call what the module's author never offered. :func:`resolve_entry` follows the
    qualname one attribute at a time and takes each step only to what the module defines: a
    function or class whose own ``__module__`` is the module and whose ``__qualname__`` is the
    path walked (``Decoder.run``: a class, then its method), or, for the last step, an object
    (a callable instance) of a class the module defines. No name starting with ``__`` is
    followed (dunders and name-mangled privates), and only classes are walked through: never a
    module, a function's attributes, or something imported from elsewhere (``from os import
    kill`` in the module is os's ``kill``, refused). A function wrapped by a decorator that
    keeps its name (``functools.wraps``) still says where it was defined.

Note: saying how to allow code.
    Only the caller knows how its user spells the allow-list: ``allow_code=[...]`` to a Python
    caller, ``--allow-code`` to a command (``onnxpipe serve``'s, ``onnxpipe export``'s). So the
    refusal, :class:`CodeNotAllowedError`, keeps what it refused apart from the remedy: the runtime's
    message gives the generic one, ``allow_code=[...]`` with the patterns that allow each name,
    and a caller that knows better says it its own way: :meth:`CodeNotAllowedError.for_command`
    (the CLI and the server name their command and flag), :meth:`~CodeNotAllowedError.for_call`
    (the builder names ``export``).

Note: the GIL.
    A code stage runs Python on its worker thread and holds the GIL while it does, so it shares one
    core with every other code stage and with the Python parts of the pipeline (the hand-offs),
    while ONNX stages release the GIL inside onnxruntime. numpy releases it in many array
    operations. docs/pipelines.md measures what that costs; a stage that is pure Python and slow
    is better run where it has its own interpreter (the Ray engine runs each stage in its own
    actor process).
"""

from __future__ import annotations

import fnmatch
import importlib
import shlex
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from onnxpipe._errors import BundleError, closest
from onnxpipe.runtime._spec import PipelineSpec, StageSpec

__all__ = [
    "CodeFunction",
    "CodeNotAllowedError",
    "as_flags",
    "check_allowed",
    "code_entries",
    "copy_params",
    "custom_ops_library",
    "is_allowed",
    "package_library",
    "resolve_entry",
]

#: The callable a code stage names: ``fn(inputs, params) -> outputs`` (arrays by tensor name).
CodeFunction = Callable[[dict[str, np.ndarray], dict[str, Any]], Mapping[str, np.ndarray]]

_KINDS = {"code": "", "custom_ops": "custom-op library of package ", "ep_package": "execution provider library of package "}


#: What every way of saying how to allow code adds: the patterns are fnmatch patterns.
_FNMATCH = "(fnmatch patterns: 'mypkg.*' allows a whole package)"


class CodeNotAllowedError(BundleError):
    """A pipeline names Python the host has not allowed (:func:`check_allowed`); nothing was imported.

    Args:
        reason: What was refused, and what is allowed now.
        patterns: fnmatch patterns that allow each name refused (the names themselves).
        how: How to allow them, the message's end (default: ``allow_code=[...]`` with the
            patterns; see Note: saying how to allow code).

    Attributes:
        reason: As given.
        patterns: As given.
    """

    def __init__(self, reason: str, patterns: Sequence[str] = (), how: str | None = None) -> None:
        self.reason = reason
        self.patterns = tuple(patterns)
        if how is None and self.patterns:
            how = f"allow it with allow_code={list(self.patterns)!r} {_FNMATCH}"
        super().__init__(f"{reason}; {how}" if how else reason)

    def saying(self, how: str, context: str = "") -> CodeNotAllowedError:
        """The same refusal, ending with ``how`` to allow it, and ``context`` before the reason."""
        return CodeNotAllowedError(context + self.reason, self.patterns, how)

    def for_call(self, call: str, context: str = "") -> CodeNotAllowedError:
        """Said to a caller of the function ``call``: ``allow it with call(..., allow_code=[...])``."""
        return self.saying(f"allow it with {call}(..., allow_code={list(self.patterns)!r}) {_FNMATCH}", context)

    def for_command(self, command: str, flag: str, context: str = "") -> CodeNotAllowedError:
        """Said to a user of the command ``command``: ``allow it: command ... FLAG 'PATTERN' ...``."""
        return self.saying(f"allow it: {command} ... {as_flags(self.patterns, flag)} {_FNMATCH}", context)


def as_flags(patterns: Iterable[str], flag: str) -> str:
    """Patterns as a command line's options, each quoted for a shell: ``--allow-code 'mypkg.ocr:decode' ...``."""
    return " ".join(f"{flag} '{p}'" if "'" not in p else f"{flag} {shlex.quote(p)}" for p in patterns)


def code_entries(spec: PipelineSpec | Iterable[StageSpec]) -> list[tuple[str, str, str]]:
    """What Python a pipeline (or some of its stages) would import: ``(stage, kind, name)`` with kind
    ``"code"`` (name: the entry point), ``"custom_ops"`` (name: the package shipping the
    library) or ``"ep_package"`` (name: the package shipping a plugin execution provider), in
    pipeline order."""
    found: list[tuple[str, str, str]] = []
    for stage in spec.stages if isinstance(spec, PipelineSpec) else spec:
        if stage.code is not None:
            found.append((stage.name, "code", stage.code.entry))
        found.extend((stage.name, "custom_ops", package) for package in stage.settings.custom_ops)
        if stage.settings.ep_package is not None:
            found.append((stage.name, "ep_package", stage.settings.ep_package))
    return found


def is_allowed(name: str, allow: Iterable[str]) -> bool:
    """Whether an entry point (or custom-op package name) matches one of the ``allow`` patterns."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in allow)


def check_allowed(spec: PipelineSpec | Iterable[StageSpec], allow: Sequence[str]) -> None:
    """Refuse a pipeline naming Python the host did not allow; imports nothing.

    Raises:
        CodeNotAllowedError: one message naming every entry point and custom-op package not allowed,
            the stage of each, and how to allow them (a :class:`BundleError`).
    """
    if isinstance(allow, str):
        raise TypeError("allow_code takes a list of patterns, not one string")
    refused = [(stage, kind, name) for stage, kind, name in code_entries(spec) if not is_allowed(name, allow)]
    if not refused:
        return
    listed = ", ".join(f"{_KINDS[kind]}'{name}' (stage '{stage}')" for stage, kind, name in refused)
    shown = f"allowed now: {', '.join(repr(p) for p in allow)}" if allow else "nothing is allowed by default"
    names = dict.fromkeys(name for _, _, name in refused)  # a name, as a pattern, allows itself only
    raise CodeNotAllowedError(f"the pipeline runs Python this host has not allowed: {listed}; {shown}", list(names))


def resolve_entry(stage: StageSpec) -> CodeFunction:
    """Import a code stage's module and find its callable (call only after :func:`check_allowed`).

    Raises:
        BundleError: one message naming the stage and the entry point: the module is not installed,
            importing it failed, the attribute is missing, it is not callable, or it is not what
            the module defines (see Note: what an entry point may name).
    """
    assert stage.code is not None
    entry = stage.code.entry
    module_name, _, qualname = entry.partition(":")
    where = f"stage '{stage.name}': entry point '{entry}'"
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise BundleError(f"{where}: module '{module_name}' is not installed on this host (a bundle carries no code: install it here)") from e
        raise BundleError(f"{where}: importing '{module_name}' failed: {e}") from e
    except Exception as e:  # anything the module's own top level raises
        raise BundleError(f"{where}: importing '{module_name}' failed: {type(e).__name__}: {e}") from e
    path, parts = module_name, qualname.split(".")
    hidden = next((part for part in parts if part.startswith("__")), None)
    if hidden is not None:
        raise BundleError(f"{where}: '{hidden}' is a name Python gives an object (or a private one); an entry point names a function or class "
                          f"that '{module_name}' defines, through classes it defines (see Note: what an entry point may name)")
    for i, part in enumerate(parts):
        if not hasattr(target, part):
            choices = sorted(n for n in dir(target) if not n.startswith("_"))
            raise BundleError(f"{where}: '{path}' has no attribute '{part}'; {closest(part, choices)}")
        target = getattr(target, part)
        path, walked, last = f"{path}.{part}", ".".join(parts[: i + 1]), i == len(parts) - 1
        if last and not callable(target):
            raise BundleError(f"{where}: '{qualname}' is a {type(target).__name__}, not a callable")
        if not _defined_in(target, module_name, walked):
            raise BundleError(f"{where}: '{walked}' is {_describe(target)}, not a function or class '{module_name}' defines under that name; an entry "
                              "point names what its module defines, through classes it defines (see Note: what an entry point may name)")
        if not last and not isinstance(target, type):
            raise BundleError(f"{where}: '{walked}' is {_describe(target)}, not a class; an entry point walks only through classes its module "
                              "defines ('mypkg.ocr:Decoder.run'), never into a function's or an object's attributes")
    return target


def _defined_in(obj: object, module: str, qualname: str) -> bool:
    """Whether ``module`` defines ``obj`` as ``qualname`` (see Note: what an entry point may name)."""
    own = getattr(obj, "__qualname__", None)
    if isinstance(own, str):  # a function, class or method says where it was defined
        return getattr(obj, "__module__", None) == module and own == qualname
    return type(obj).__module__ == module  # an object (a callable instance) of a class the module defines


def _describe(obj: object) -> str:
    """What an entry point reached that its module does not define, for the refusal."""
    if isinstance(obj, types.ModuleType):
        return f"the module '{obj.__name__}'"
    own = getattr(obj, "__qualname__", None)
    if isinstance(own, str):
        return f"{'the class' if isinstance(obj, type) else 'the function'} '{getattr(obj, '__module__', None)}.{own}'"
    return f"an object of class '{type(obj).__module__}.{type(obj).__qualname__}'"


def custom_ops_library(stage: str, package: str) -> str:
    """The path of the custom-op library a package ships, from its ``get_library_path()``
    (call only after :func:`check_allowed`).

    Raises:
        BundleError: the package is not installed (naming it, to install), or gives no library.
    """
    return package_library(stage, package, "custom-op library", "onnxruntime_extensions")


def package_library(stage: str, package: str, what: str = "custom-op library", example: str = "onnxruntime_extensions") -> str:
    """The path of the library (``what``: a custom-op library, an execution provider's) a
    package ships, from its ``get_library_path()`` (call only after :func:`check_allowed`).

    Raises:
        BundleError: the package is not installed (naming it, to install), or gives no library.
    """
    where = f"stage '{stage}' needs the {what} of package '{package}'"
    try:
        module = importlib.import_module(package)
    except ModuleNotFoundError as e:
        if e.name is not None and (package == e.name or package.startswith(e.name + ".")):
            hint = package.split(".")[0].replace("_", "-")
            raise BundleError(f"{where}, which is not installed on this host; install it (pip install {hint})") from e
        raise BundleError(f"{where}: importing it failed: {e}") from e
    except Exception as e:
        raise BundleError(f"{where}: importing it failed: {type(e).__name__}: {e}") from e
    get_path = getattr(module, "get_library_path", None)
    if not callable(get_path):
        raise BundleError(f"{where}, but '{package}' has no get_library_path(); name a package that ships a {what} (e.g. {example})")
    path = get_path()
    if not isinstance(path, str) or not path:
        raise BundleError(f"{where}: its get_library_path() gave {path!r}, not a path")
    return path


def copy_params(value: Any) -> Any:
    """A deep copy of plain JSON values (each code runner gets its own params)."""
    if isinstance(value, dict):
        return {k: copy_params(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copy_params(v) for v in value]
    return value
