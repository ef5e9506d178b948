"""What every command shares: the user-error machinery, common option types, and .npz files.

Nothing here imports numpy, onnx, onnxruntime or rich at module level: ``onnxpipe --help`` loads
this module.
"""

from __future__ import annotations

import json
import re
import zipfile
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

import click

from onnxpipe._errors import OnnxpipeError

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "DIM",
    "PROFILE_THREADS",
    "TARGET",
    "Group",
    "PinType",
    "SizeType",
    "UserError",
    "bundle_size",
    "given",
    "quiet_onnxruntime",
    "read_json",
    "read_npz",
    "request_files_option",
]



class UserError(click.ClickException):
    """A user error: one line ``error: <message>`` on stderr, exit code 1."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split("\n")))

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True, file=file)


class Group(click.Group):
    """Turns every :class:`OnnxpipeError` a command raises into a :class:`UserError`."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OnnxpipeError as e:
            raise UserError(str(e)) from e


class _DimType(click.ParamType):
    name = "NAME=VALUE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[str, int]:
        if isinstance(value, tuple):
            return value
        name, sep, size = str(value).partition("=")
        if not sep or not name.strip():
            self.fail(f"{value!r} is not NAME=VALUE (e.g. batch=8)", param, ctx)
        try:
            number = int(size)
        except ValueError:
            self.fail(f"{value!r}: the size must be an integer, got {size!r}", param, ctx)
        if number < 1:
            self.fail(f"{value!r}: the size must be at least 1", param, ctx)
        return name.strip(), number


DIM = click.option(
    "--dim",
    "dims",
    type=_DimType(),
    multiple=True,
    help=(
        "Size of a dynamic dim: by name, --dim batch=8, or by input and axis when it has no name "
        "(declared -1 or empty), --dim x.0=8 (repeatable). Dims not given count as 1, which a model "
        "may not run at (a convolutional one needs image sizes): profiling and sample runs that fail say which to give."
    ),
)


PROFILE_THREADS = click.option(
    "--threads",
    "threads",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    metavar="T",
    help="Intra-op threads to profile node costs with: the threads each stage will run with.",
)

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)", re.IGNORECASE)


class SizeType(click.ParamType):
    """Bytes: ``1048576``, ``512MiB``, ``2GiB``, ``1.5GB`` (KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB of 1024)."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        match = _SIZE.fullmatch(str(value).strip())
        if match is None:
            self.fail(f"{value!r} is not a size: give bytes or a number with a unit, e.g. 512MiB, 2GiB, 1.5GB", param, ctx)
        number, unit = match.groups()
        scale = _UNITS.get(unit.lower() or "b")
        if scale is None:
            self.fail(f"{value!r}: unknown unit {unit!r}; use B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)", param, ctx)
        size = int(Fraction(number) * scale)
        if size < 1:
            self.fail(f"{value!r} is less than one byte", param, ctx)
        return size


class PinType(click.ParamType):
    """``NODE=STAGE``: a node (or the tensor it computes) and the stage, from 0, it must be in."""

    name = "NODE=STAGE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[str, int]:
        if isinstance(value, tuple):
            return value
        # The last '=' separates: a node name may hold one, a stage number cannot.
        node, sep, stage = str(value).rpartition("=")
        if not sep or not node:
            self.fail(f"{value!r} is not NODE=STAGE (e.g. conv1=0: node conv1 in the first stage)", param, ctx)
        if not stage.strip().isdigit():
            self.fail(f"{value!r}: the stage must be a position from 0, got {stage!r}", param, ctx)
        return node, int(stage)


ALLOW_CODE = click.option(
    "--allow-code",
    "allow_code",
    multiple=True,
    metavar="PATTERN",
    help="Let the bundle run the Python it names (code stages, custom-op libraries) when it matches this fnmatch pattern, e.g. 'mypkg.*' "
    "(repeatable; default: none, and such a bundle is refused before anything is imported).",
)
ALLOW_NONFINITE = click.option(
    "--allow-nonfinite",
    "allow_nonfinite",
    is_flag=True,
    help="Accept reference outputs that hold NaN or inf, for a model whose outputs hold them by design (-inf masks); "
    "by default they fail: a check against them proves nothing.",
)


_F = TypeVar("_F", bound=Callable[..., Any])


def request_files_option(what: str, required: bool = False) -> Callable[[_F], _F]:
    """``--inputs FILE.npz|FOLDER`` (repeatable), as ``run`` and ``verify`` take it: ``what`` says what
    one file is and what the files are for."""
    return click.option("--inputs", "input_paths", multiple=True, required=required, type=click.Path(path_type=Path), metavar="FILE.npz|FOLDER",
                        help=f"{what} (repeatable).")


TARGET = click.option(
    "--target", "target", metavar="TARGET", help="Run every stage on this target instead of its own, e.g. cpu for a bundle built for a GPU this host lacks."
)


def given(ctx: click.Context, *params: str) -> list[str]:
    """The options among ``params`` (parameter names) that the user set, as their flags (``--seed``)."""
    flags = []
    for p in ctx.command.params:
        if p.name in params and ctx.get_parameter_source(p.name) not in (click.core.ParameterSource.DEFAULT, None):
            flags.append(p.opts[0])
    return flags


def read_json(path: Path, what: str) -> Any:
    """The JSON value in ``path``.

    Raises:
        UserError: the file is missing or is not JSON (the message names it as ``what``).
    """
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{what} '{path}' does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {what} '{path}': {e}") from e


def read_npz(path: Path, what: str) -> dict[str, np.ndarray]:
    """The arrays of an .npz file by name, read without pickle.

    Raises:
        UserError: the file is missing or is not an .npz of plain arrays.
    """
    from onnxpipe._errors import BundleError
    from onnxpipe.runtime import load_npz

    if not path.is_file():
        raise UserError(f"{what} '{path}' does not exist")
    try:
        return load_npz(path)
    except BundleError as e:
        raise UserError(f"{what} '{path}': {e}") from e


def quiet_onnxruntime() -> None:
    """Only errors from onnxruntime's own logger: its warnings (unused initializers, ...) are noise here."""
    from onnxpipe.runtime._distributions import require_onnxruntime

    require_onnxruntime()  # first: a missing or broken onnxruntime is one error saying what to install, not a traceback
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)


def bundle_size(path: Path) -> tuple[str, int, int]:
    """``("archive" | "folder", bytes, files)`` of a bundle on disk, manifest included."""
    if path.is_file():
        with zipfile.ZipFile(path) as zf:
            return "archive", path.stat().st_size, sum(1 for m in zf.infolist() if not m.is_dir())
    files = [p for p in path.rglob("*") if p.is_file()]
    return "folder", sum(p.stat().st_size for p in files), len(files)
