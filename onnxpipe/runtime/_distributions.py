"""Which installed distributions bring the package ``onnxruntime``, and one line saying what to do
when that is not exactly one whose files import.

Note: one package, many distributions.
    onnxruntime, onnxruntime-gpu, onnxruntime-openvino, onnxruntime-directml, onnxruntime-training
    and others are separate distributions of one package directory, ``onnxruntime/``, and pip has no
    "provides": a second one writes its files over the first's (``pip install 'onnxpipe[cpu]'
    onnxruntime-openvino``), the native module that wins decides which providers exist (plain
    onnxruntime's, after that line: no OpenVINO, though onnxruntime-openvino is installed), and
    uninstalling one deletes files the other still lists (what is left imports as an empty namespace
    package, and ``pip check`` sees nothing wrong). The one repair is to uninstall every one and install
    one. So onnxpipe's core requires no onnxruntime distribution; the extras ``cpu``, ``openvino`` and
    ``gpu`` bring one each (as optimum's ``onnxruntime`` and ``onnxruntime-gpu`` extras do), and
    ``pip check`` holds whichever a host has.

Note: cost.
    Finding the distributions reads every installed distribution's ``top_level.txt`` (its ``RECORD``
    where it has none): 6.1 ms for the 151 distributions of the dev venv, 2.6 ms for the 42 of
    .venv-openvino, about 18 ms the first time in a process, which imports ``importlib.metadata``
    (``python -m timeit -s "from onnxpipe.runtime._distributions import ort_distributions"
    "ort_distributions()"``; 2 cores, 2026-12). So it runs only where
    something already went wrong or was asked for: a stage's provider is missing (loading it, or
    planning for it: ``split --targets``), onnxruntime does not import, ``onnxpipe inspect BUNDLE
    --host``. Never at import, never on a request's path; on
    success :func:`require_onnxruntime` costs an attribute lookup.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from onnxpipe._errors import OnnxpipeError

if TYPE_CHECKING:
    from importlib.metadata import Distribution

__all__ = [
    "EXTRAS",
    "PROVIDER_DISTRIBUTIONS",
    "OnnxruntimeImportError",
    "OrtDistribution",
    "conflict",
    "import_problem",
    "native_owner",
    "ort_distributions",
    "require_onnxruntime",
]

PACKAGE = "onnxruntime"
#: onnxpipe's extras, each one onnxruntime distribution: what a host without any should install.
EXTRAS: dict[str, str] = {"cpu": "onnxruntime", "openvino": "onnxruntime-openvino", "gpu": "onnxruntime-gpu"}
#: The distribution whose build has a provider, for a provider that needs its own build of onnxruntime.
PROVIDER_DISTRIBUTIONS: dict[str, str] = {
    "OpenVINOExecutionProvider": "onnxruntime-openvino",
    "CUDAExecutionProvider": "onnxruntime-gpu",
    "TensorrtExecutionProvider": "onnxruntime-gpu",
    "DmlExecutionProvider": "onnxruntime-directml",
    "ROCMExecutionProvider": "onnxruntime-rocm",
    "MIGraphXExecutionProvider": "onnxruntime-migraphx",
}
_NATIVE = f"{PACKAGE}/capi/onnxruntime_pybind11_state"


class OnnxruntimeImportError(OnnxpipeError, ImportError):
    """onnxruntime is not installed, or its files do not import (the message says which distributions
    are there and what to install); an ``ImportError`` too, since it is raised by an import."""


@dataclass(frozen=True)
class OrtDistribution:
    """An installed distribution that brings the package ``onnxruntime``.

    Attributes:
        name: Its name as its metadata spells it (``onnxruntime-openvino``).
        version: Its version.
        location: The folder its ``onnxruntime/`` is in (a site-packages).
        native: Its ``RECORD`` entry for the native module: path, hash (``sha256=...``), size; ``None``
            when it lists none.
        files: The files under ``onnxruntime/`` its ``RECORD`` lists with a hash (the ones it ships).
    """

    name: str
    version: str
    location: Path
    native: tuple[str, str, int] | None
    files: tuple[str, ...] = field(repr=False)

    def __str__(self) -> str:
        return f"{self.name} {self.version}"

    def missing(self) -> int:
        """How many of :attr:`files` are not on disk."""
        return sum(not (self.location / f).is_file() for f in self.files)


def ort_distributions(path: Sequence[str] | None = None) -> list[OrtDistribution]:
    """Every installed distribution whose package is ``onnxruntime``, by name, then in path order (see Note: cost).

    Args:
        path: The folders to look in (``sys.path`` when ``None``), as ``importlib.metadata`` takes them.
    """
    import importlib.metadata

    found = []
    dists = importlib.metadata.distributions() if path is None else importlib.metadata.distributions(path=list(path))
    for dist in dists:
        top = dist.read_text("top_level.txt")
        if top is not None:
            if PACKAGE not in top.split():
                continue
            record = dist.read_text("RECORD") or ""
        else:  # no top_level.txt (not setuptools): the files say
            record = dist.read_text("RECORD") or ""
            if not (record.startswith(f"{PACKAGE}/") or f"\n{PACKAGE}/" in record):
                continue
        found.append(_distribution(dist, record))
    # By name; one name in two folders in the order of the path, so the one Python imports comes
    # first. A folder twice on the path lists its distributions twice: once is enough.
    return sorted(dict.fromkeys(found), key=lambda d: d.name.lower())


def _distribution(dist: Distribution, record: str) -> OrtDistribution:
    native = None
    files = []
    for line in record.splitlines():
        entry, _, rest = line.partition(",")
        if not entry.startswith(f"{PACKAGE}/"):
            continue
        digest, _, size = rest.partition(",")
        if digest:
            files.append(entry)
        if entry.startswith(_NATIVE) and entry.endswith((".so", ".pyd")) and digest and size.isdigit():
            native = (entry, digest, int(size))
    return OrtDistribution(str(dist.metadata["Name"]), str(dist.version), Path(str(dist.locate_file(""))), native, tuple(files))


def native_owner(dists: Iterable[OrtDistribution], package_dir: Path) -> OrtDistribution | None:
    """The distribution whose native module is the one in ``package_dir`` (the ``onnxruntime/``
    Python imports): its ``RECORD``'s size, then its hash where sizes tie; ``None`` when none's is."""
    target = package_dir.resolve()
    sized = []
    for d in dists:
        if d.native is None or (d.location / PACKAGE).resolve() != target:
            continue
        on_disk = d.location / d.native[0]
        if on_disk.is_file() and on_disk.stat().st_size == d.native[2]:
            sized.append((d, on_disk))
    if len(sized) <= 1:
        return sized[0][0] if sized else None
    digest = _sha256(sized[0][1])  # same path for each: they share the folder
    return next((d for d, _ in sized if d.native is not None and d.native[1] == digest), None)


def _sha256(path: Path) -> str:
    import base64
    import hashlib

    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256=" + base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def conflict(provider: str | None = None, *, path: Sequence[str] | None = None, package_dir: Path | None = None,
             providers: Sequence[str] | None = None, error: str | None = None) -> str | None:
    """One line naming the onnxruntime distributions installed side by side and the fix, or ``None``
    when there are fewer than two (see Note: one package, many distributions).

    Args:
        provider: The provider wanted (a stage's): the fix reinstalls the distribution that has it.
        path: Where to look for distributions (``sys.path`` when ``None``).
        package_dir: The ``onnxruntime/`` Python imports (the imported module's when ``None``).
        providers: Its providers (the imported module's when ``None``).
        error: Why it does not import, when it does not.
    """
    dists = ort_distributions(path)
    if len(dists) < 2:
        return None
    if package_dir is None and error is None:
        package_dir, providers = _imported(providers)
    names = list(dict.fromkeys(d.name for d in dists))
    locations = {d.location for d in dists}
    every = "both" if len(dists) == 2 else "all"
    if len(locations) == 1:
        text = (f"{_and([str(d) for d in dists])} are {every} installed in {next(iter(locations))}, each as the package 'onnxruntime', "
                "one's files over the other's")
    else:
        text = f"{_and([f'{d} in {d.location}' for d in dists])} are {every} installed, each as the package 'onnxruntime'"
    if package_dir is not None:
        owner = native_owner(dists, package_dir)
        present = any((package_dir.parent / d.native[0]).is_file() for d in dists if d.native is not None)
        whose = f"{owner}'s native module" if owner is not None else "a native module none of them lists" if present else "no native module"
        text += f"; the one Python imports ({package_dir}) has {whose}"
        if providers is not None and error is None:
            text += f", with {', '.join(providers)}"
    if error is not None:
        text += f"; import onnxruntime fails: {error}"
    return f"{text}; keep one: pip uninstall -y {' '.join(names)} && pip install {_keep(names, provider)}"


def _keep(names: Sequence[str], provider: str | None) -> str:
    wanted = PROVIDER_DISTRIBUTIONS.get(provider or "")
    if wanted is not None:
        return wanted
    # Without a provider to go by: an accelerator build is the one installed on purpose (plain
    # onnxruntime comes in as some package's requirement).
    return next((n for n in names if n.lower() != PACKAGE), names[0])


def _imported(providers: Sequence[str] | None) -> tuple[Path | None, Sequence[str] | None]:
    """The imported (or importable) ``onnxruntime/`` and its providers, importing nothing new."""
    module = sys.modules.get(PACKAGE)
    file = getattr(module, "__file__", None)
    if module is not None and file is not None:
        if providers is None and hasattr(module, "get_available_providers"):
            providers = list(module.get_available_providers())
        return Path(file).parent, providers
    import importlib.util

    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None, providers
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return (Path(locations[0]) if locations else None), providers


def _and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def import_problem(error: ImportError | str, *, path: Sequence[str] | None = None, package_dir: Path | None = None) -> str:
    """The one line for an ``import onnxruntime`` that failed: no distribution (install one of
    onnxpipe's extras), one whose files are gone or do not load, or several (:func:`conflict`).

    Args:
        error: The import's error, or what was wrong with what it imported.
        path: Where to look for distributions (``sys.path`` when ``None``).
        package_dir: The ``onnxruntime/`` Python finds (found when ``None``).
    """
    why = str(error)
    dists = ort_distributions(path)
    if not dists:
        extras = ", ".join(f"'onnxpipe[{extra}]' ({name})" for extra, name in EXTRAS.items())
        plain = isinstance(error, ModuleNotFoundError) and error.name == PACKAGE
        cause = "" if plain else f" ({why})"
        return (f"onnxruntime is not installed{cause}: install onnxpipe with exactly one onnxruntime build, "
                f"e.g. pip install 'onnxpipe[cpu]'; the extras: {extras}")
    if len(dists) > 1:
        if package_dir is None:
            package_dir = _imported(None)[0]
        return conflict(path=path, package_dir=package_dir, error=why) or why
    d = dists[0]
    gone = d.missing()
    if gone:
        return (f"{d} is installed ({d.location}) but does not import ({why}): {gone} of its {len(d.files)} files are gone, as when "
                f"another onnxruntime distribution was uninstalled over it; reinstall it: pip install --force-reinstall --no-deps {d.name}=={d.version}")
    return f"{d} is installed ({d.location}) but does not import: {why}"


def require_onnxruntime() -> None:
    """Import onnxruntime, or raise one error saying what to install (the runtime's first import).

    Raises:
        OnnxruntimeImportError: onnxruntime is not installed, or does not import (see :func:`import_problem`).
    """
    try:
        import onnxruntime
    except ImportError as e:
        raise OnnxruntimeImportError(import_problem(e)) from e
    if getattr(onnxruntime, "__file__", None) is None:  # a folder of leftovers: a namespace package
        where = ", ".join(getattr(onnxruntime, "__path__", []))
        raise OnnxruntimeImportError(import_problem(f"{where} has no __init__.py", package_dir=Path(where) if where else None))
