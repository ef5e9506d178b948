"""Which installed distributions are the package ``onnxruntime``, over real metadata: the
``*.dist-info`` folders of the builds installed here, copied into throwaway folders and read
through ``importlib.metadata`` as any environment's would be; a bare venv for a host with no
onnxruntime at all, and one whose onnxruntime files were deleted under its metadata.

The other build's metadata (onnxruntime-openvino's beside plain onnxruntime, or the reverse) comes
from the sibling venv (.venv-openvino or .venv); where it is not there yet the tests needing it
skip, and `make test-openvino` runs this file again in .venv-openvino, beside .venv.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnxruntime.capi import build_and_package_info

from onnxpipe import BundleError
from onnxpipe.cli import main as cli
from onnxpipe.runtime import load
from onnxpipe.runtime._distributions import OrtDistribution, conflict, native_owner, ort_distributions
from onnxpipe.splitter import split
from tests import models

REPO = Path(__file__).resolve().parents[2]
OV = "OpenVINOExecutionProvider"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dist_info(site: Path, name: str) -> Path | None:
    """The real ``*.dist-info`` folder of distribution ``name`` in a site-packages folder."""
    for folder in site.glob("*.dist-info"):
        meta = folder / "METADATA"
        if meta.is_file() and any(_canonical(line[5:].strip()) == _canonical(name) for line in meta.read_text(errors="replace").splitlines()
                                  if line.startswith("Name:")):
            return folder
    return None


@pytest.fixture(scope="module")
def here() -> OrtDistribution:
    """This environment's onnxruntime build (the one distribution test_this_environment... checks)."""
    (build,) = ort_distributions()
    return build


@pytest.fixture(scope="module")
def here_info(here: OrtDistribution) -> Path:
    """This build's real dist-info folder."""
    folder = _dist_info(here.location, here.name)
    assert folder is not None, f"no dist-info of {here} in {here.location}"
    return folder


@pytest.fixture(scope="module")
def other() -> tuple[OrtDistribution, Path]:
    """The other build of the sibling venv, with its dist-info folder: onnxruntime-openvino from
    .venv-openvino beside plain onnxruntime, or plain onnxruntime from .venv beside OpenVINO's."""
    for venv in (".venv-openvino", ".venv"):
        for site in (REPO / venv).glob("lib/python*/site-packages"):
            builds = [d for d in ort_distributions([str(site)]) if d.name != build_and_package_info.package_name]
            if builds and (folder := _dist_info(site, builds[0].name)) is not None:
                return builds[0], folder
    pytest.skip("no other onnxruntime build's metadata here: `make test-openvino` makes .venv-openvino and runs this file there too")


def test_this_environment_has_one_onnxruntime_build_and_imports_its_native_module(here: OrtDistribution) -> None:
    # One, though the dev venv also has onnxruntime-qnn 2.x (a plugin for plain onnxruntime) and
    # onnxruntime-extensions: packages of their own (onnxruntime_qnn, onnxruntime_extensions).
    assert [d.name for d in ort_distributions()] == [here.name]
    assert here.name == build_and_package_info.package_name and here.version == ort.__version__
    assert native_owner([here], Path(ort.__file__).parent) == here
    assert here.native is not None and here.missing() == 0 and len(here.files) > 100
    assert conflict() is None


def _site_with(tmp_path: Path, *folders: Path) -> Path:
    site = tmp_path / "site-packages"
    site.mkdir()
    for folder in folders:
        shutil.copytree(folder, site / folder.name)
    return site


def _native_of(site: Path, build: OrtDistribution) -> Path:
    """Put ``build``'s real native module (a link to it) where the package in ``site`` has it."""
    assert build.native is not None
    link = site / build.native[0]
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink():
        link.unlink()
    link.symlink_to(build.location / build.native[0])
    return site / "onnxruntime"


def test_two_builds_in_one_folder_name_both_the_native_module_imported_and_the_fix(here: OrtDistribution, here_info: Path,
                                                                                    other: tuple[OrtDistribution, Path], tmp_path: Path) -> None:
    theirs, folder = other
    site = _site_with(tmp_path, here_info, folder)
    package = _native_of(site, here)
    providers = ort.get_available_providers()
    plain, openvino = sorted([here, theirs], key=lambda d: d.name)
    assert (plain.name, openvino.name) == ("onnxruntime", "onnxruntime-openvino")
    text = conflict(OV, path=[str(site)], package_dir=package, providers=providers)
    assert text == (f"{plain} and {openvino} are both installed in {site}, each as the package 'onnxruntime', one's files over the other's; "
                    f"the one Python imports ({package}) has {here}'s native module, with {', '.join(providers)}; "
                    "keep one: pip uninstall -y onnxruntime onnxruntime-openvino && pip install onnxruntime-openvino")
    # Which build's files won is read from the file, not from the order of installation.
    _native_of(site, theirs)
    assert f"has {theirs}'s native module" in (conflict(path=[str(site)], package_dir=package) or "")
    # The fix keeps the build that has the provider asked for; without one, the accelerator's.
    assert (conflict(path=[str(site)], package_dir=package) or "").endswith("&& pip install onnxruntime-openvino")
    assert (conflict("CUDAExecutionProvider", path=[str(site)], package_dir=package) or "").endswith("&& pip install onnxruntime-gpu")


def test_a_native_module_neither_build_lists_is_named_so(here: OrtDistribution, here_info: Path, other: tuple[OrtDistribution, Path], tmp_path: Path) -> None:
    site = _site_with(tmp_path, here_info, other[1])
    assert here.native is not None
    stray = site / here.native[0]
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"\0" * 64)  # a file of another size than either RECORD says
    assert native_owner(ort_distributions([str(site)]), site / "onnxruntime") is None
    assert "has a native module none of them lists;" in (conflict(path=[str(site)], package_dir=site / "onnxruntime") or "")


def test_the_same_build_in_two_folders_names_both_folders_and_the_one_imported(here: OrtDistribution, here_info: Path, tmp_path: Path) -> None:
    # A user site-packages or a PYTHONPATH entry beside the venv's own: Python imports the first.
    elsewhere = _site_with(tmp_path, here_info)
    package = Path(ort.__file__).parent
    text = conflict(path=[str(elsewhere), str(here.location)], package_dir=package, providers=["CPUExecutionProvider"])
    assert text == (f"{here} in {elsewhere} and {here} in {here.location} are both installed, each as the package 'onnxruntime'; "
                    f"the one Python imports ({package}) has {here}'s native module, with CPUExecutionProvider; "
                    f"keep one: pip uninstall -y {here.name} && pip install {here.name}")


def test_a_stage_on_a_missing_provider_says_two_builds_are_installed_instead_of_install_one(here: OrtDistribution, here_info: Path, tmp_path: Path,
                                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # Where onnxruntime says "install onnxruntime-openvino", that is the wrong advice when another
    # build is already there: the error names both and how to keep one.
    candidates = (("openvino", OV, "onnxruntime-openvino"), ("cuda", "CUDAExecutionProvider", "onnxruntime-gpu"))
    target, provider, keep = next(c for c in candidates if c[1] not in ort.get_available_providers())
    plan = split(models.chain(), ["b"])
    plan.config.stages[0].configure(target=target)
    bundle = models.bundle_of(plan, tmp_path)
    elsewhere = _site_with(tmp_path, here_info)
    monkeypatch.syspath_prepend(str(elsewhere))
    build = re.escape(str(here))
    with pytest.raises(BundleError, match=(rf"^stage 'stage0' targets {provider}, which this host's onnxruntime \({re.escape(ort.__version__)}\) "
                                           rf"does not have; available: .*; {build} in {re.escape(str(elsewhere))} and {build} in .* "
                                           rf"are both installed, each as the package 'onnxruntime'; the one Python imports .* has "
                                           rf"{build}'s native module, with .*; keep one: pip uninstall -y {here.name} && "
                                           rf"pip install {keep}; or use target 'cpu' to run every stage on the CPU instead$")):
        load(bundle)


def test_inspect_host_warns_under_the_hosts_providers(here: OrtDistribution, here_info: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = models.bundle_of(split(models.chain(), ["b"]), tmp_path)  # CPU stages: it loads, and inspect --host says what it found
    runner = CliRunner()
    result = runner.invoke(cli, ["inspect", str(bundle), "--host"])
    assert result.exit_code == 0 and "warning:" not in result.output, result.output
    elsewhere = _site_with(tmp_path, here_info)
    monkeypatch.syspath_prepend(str(elsewhere))
    result = runner.invoke(cli, ["inspect", str(bundle), "--host"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("on this host (onnxruntime "))
    assert lines[header + 1].startswith(f"  warning: {here} in {elsewhere} and {here} in {here.location} are both installed, ")
    assert lines[header + 1].endswith(f"; keep one: pip uninstall -y {here.name} && pip install {here.name}")
    assert lines[header + 2].startswith("  stage0: CPUExecutionProvider ")


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with nothing installed (no pip either: 0.4 s), as a host before any onnxruntime."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv / "bin" / "python"


def _run(python: Path | str, code: str, *path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (*path, REPO))}
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd=str(REPO))


_CATCH = ("import sys\ntry:\n    import {module}\nexcept ImportError as e:\n    from onnxpipe import OnnxpipeError\n"
          "    print(type(e).__name__, isinstance(e, OnnxpipeError)); print(e); sys.exit(1)\n")


@pytest.mark.parametrize("module", ["onnxpipe.runtime", "onnxpipe.builder"])
def test_without_onnxruntime_importing_the_runtime_is_one_error_naming_the_extras(bare_python: Path, module: str) -> None:
    # The bare venv has no numpy or onnx either: the builder's first import is the runtime's check.
    done = _run(bare_python, _CATCH.format(module=module))
    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines() == [
        "OnnxruntimeImportError True",
        "onnxruntime is not installed: install onnxpipe with exactly one onnxruntime build, e.g. pip install 'onnxpipe[cpu]'; the extras: "
        "'onnxpipe[cpu]' (onnxruntime), 'onnxpipe[openvino]' (onnxruntime-openvino), 'onnxpipe[gpu]' (onnxruntime-gpu)",
    ]
    assert _run(bare_python, "import onnxpipe").returncode == 0  # the top-level package stays light


def test_a_build_whose_files_were_deleted_under_its_metadata_says_reinstall(here: OrtDistribution, here_info: Path, bare_python: Path, tmp_path: Path) -> None:
    # What `pip uninstall onnxruntime` leaves when onnxruntime-openvino was installed over it: the
    # other's metadata, and folders without files that import as an empty namespace package.
    site = _site_with(tmp_path, here_info)
    (site / "onnxruntime" / "capi").mkdir(parents=True)
    done = _run(bare_python, _CATCH.format(module="onnxpipe.runtime"), site)
    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines() == [
        "OnnxruntimeImportError True",
        f"{here} is installed ({site}) but does not import ({site / 'onnxruntime'} has no __init__.py): {len(here.files)} of its {len(here.files)} "
        f"files are gone, as when another onnxruntime distribution was uninstalled over it; reinstall it: "
        f"pip install --force-reinstall --no-deps {here.name}=={here.version}",
    ]


def test_two_builds_whose_files_are_gone_name_both_and_why_the_import_fails(here: OrtDistribution, here_info: Path, other: tuple[OrtDistribution, Path],
                                                                          bare_python: Path, tmp_path: Path) -> None:
    site = _site_with(tmp_path, here_info, other[1])
    (site / "onnxruntime" / "capi").mkdir(parents=True)
    done = _run(bare_python, _CATCH.format(module="onnxpipe.runtime"), site)
    assert done.returncode == 1, done.stderr
    plain, openvino = sorted([here, other[0]], key=lambda d: d.name)
    package = site / "onnxruntime"
    assert done.stdout.splitlines() == [
        "OnnxruntimeImportError True",
        f"{plain} and {openvino} are both installed in {site}, each as the package 'onnxruntime', one's files over the other's; "
        f"the one Python imports ({package}) has no native module; import onnxruntime fails: {package} has no __init__.py; "
        "keep one: pip uninstall -y onnxruntime onnxruntime-openvino && pip install onnxruntime-openvino",
    ]


def test_the_cli_gives_one_line_when_onnxruntime_does_not_import(here: OrtDistribution) -> None:
    # onnxruntime made unimportable in a child process (its metadata stays): `inspect MODEL`
    # imports the runtime, which says so in one line, exit 1, instead of a traceback.
    code = ("import sys; sys.modules['onnxruntime'] = None\nfrom onnxpipe.cli import main\n"
            f"sys.argv = ['onnxpipe', 'inspect', {str(models.light_model_path('squeezenet'))!r}]\nmain()\n")
    done = _run(sys.executable, code)
    assert done.returncode == 1
    assert done.stderr.strip() == f"error: {here} is installed ({here.location}) but does not import: import of onnxruntime halted; None in sys.modules"
