"""Messages that send the user the right way: a command refusing a bundle's code names its own
``--allow-code`` and the pattern that allows it, and ``build``'s next step is a command that works
(stateless, with code, with string inputs, with state); each hint is run as printed."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

import numpy as np
import pytest

from onnxpipe.builder import build, export
from onnxpipe.runtime import save_npz
from onnxpipe.splitter import split
from tests import code_stages, models
from tests.cli.helpers import assert_user_error, ok, run
from tests.stateful_models import recurrent

ALLOW = "--allow-code 'tests.code_stages:combine'"
REFUSED = "the pipeline runs Python this host has not allowed: 'tests.code_stages:combine' (stage 'combine'); nothing is allowed by default"


@pytest.fixture(scope="module")
def coded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A build folder of ``x -> head (ONNX) -> combine (code) -> y``."""
    return build(code_stages.config(), tmp_path_factory.mktemp("coded") / "built").path


@pytest.fixture(scope="module")
def coded_bundle(coded: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Its bundle, with one reference sample (computed with the code allowed)."""
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    return export(coded, tmp_path_factory.mktemp("coded-bundle") / "b.onnxpipe", reference_inputs=[{"x": x}], allow_code=["tests.*"])


def _hinted(result_output: str, prefix: str) -> list[str]:
    """The arguments of the one printed line starting with ``prefix``, up to its note in parentheses."""
    lines = [line for line in result_output.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, result_output
    command = shlex.split(lines[0][len(prefix):].partition("   (")[0])
    assert command[0] == "onnxpipe", lines[0]
    return command[1:]


def test_export_reference_of_code_names_export_and_the_pattern(coded: Path, tmp_path: Path) -> None:
    refused = run("export", coded, "-o", tmp_path / "b.onnxpipe", "--reference", "1")
    assert_user_error(refused, f"computing the reference outputs runs the pipeline here: {REFUSED}; allow it: onnxpipe export ... {ALLOW}")
    assert "onnxpipe run" not in refused.output and not (tmp_path / "b.onnxpipe").exists()
    ok("export", coded, "-o", tmp_path / "b.onnxpipe", "--reference", "1", *shlex.split(ALLOW))  # as the message says


@pytest.mark.parametrize(
    ("command", "args"),
    [
        ("run", ["--inputs", "{x}", "--outputs", "{out}"]),
        ("bench", ["--requests", "2", "--warmup", "0", "--standalone-runs", "0"]),
        ("verify", []),
    ],
)
def test_each_command_refusing_code_names_itself(coded_bundle: Path, tmp_path: Path, command: str, args: list[str]) -> None:
    x = tmp_path / "x.npz"
    save_npz(x, {"x": np.ones((2, 4), np.float32)})
    args = [a.format(x=x, out=tmp_path / "y.npz") for a in args]
    name, *flags = command.split()
    refused = run(name, coded_bundle, *flags, *args)
    assert_user_error(refused, f"{REFUSED}; allow it: onnxpipe {command} ... {ALLOW} (fnmatch patterns")
    assert "runtime.load" not in refused.output and "allow_code=" not in refused.output
    ok(name, coded_bundle, *flags, *args, *shlex.split(ALLOW))


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime_qnn") is None, reason="a plugin provider's package (the qnn extra) is what inspect --host imports")
def test_inspect_host_refusing_a_plugin_package_names_itself(tmp_path: Path) -> None:
    from tests.runtime.test_plugin_ep import _mlp

    split(_mlp(), ["r"]).save(tmp_path / "split")
    ok("build", tmp_path / "split", "-o", tmp_path / "built", "--stage", "0:target=qnn,ep_package=onnxruntime_qnn,ep_device=cpu,ep.backend_type=htp")
    ok("export", tmp_path / "built", "-o", tmp_path / "bundle")
    refused = run("inspect", tmp_path / "bundle", "--host")
    assert_user_error(refused, "not allowed: execution provider library of package 'onnxruntime_qnn' (stage 'stage0')",
                      "allow it: onnxpipe inspect --host ... --allow-code 'onnxruntime_qnn'")
    ok("inspect", tmp_path / "bundle", "--host", "--allow-code", "onnxruntime_qnn")


def test_build_hint_of_a_stateless_onnx_pipeline_stores_random_samples(tmp_path: Path) -> None:
    split(models.two_outputs(), ["a", "M"]).config.save(tmp_path / "split")
    built = ok("build", tmp_path / "split", "-o", tmp_path / "built").output
    args = _hinted(built, "next: ")
    assert args[-2:] == ["--reference", "2"], built
    shown = ok(*[str(tmp_path / "b.onnxpipe") if a == "BUNDLE.onnxpipe" else a for a in args]).output
    assert "2 reference sample(s)" in shown


def test_build_hint_of_code_allows_its_entry_points(tmp_path: Path) -> None:
    code_stages.config().save(tmp_path / "split")
    built = ok("build", tmp_path / "split", "-o", tmp_path / "built").output
    args = _hinted(built, "next: ")
    assert args[-4:] == ["--reference", "2", "--allow-code", "tests.code_stages:combine"], built
    assert f"--reference 2 {ALLOW}" in built
    ok(*[str(tmp_path / "b.onnxpipe") if a == "BUNDLE.onnxpipe" else a for a in args])
    ok("verify", tmp_path / "b.onnxpipe", *shlex.split(ALLOW))


def test_build_hint_of_string_inputs_asks_for_an_inputs_file(tmp_path: Path) -> None:
    code_stages.labelled().save(tmp_path / "split")
    built = ok("build", tmp_path / "split", "-o", tmp_path / "built").output
    args = _hinted(built, "next: ")
    assert args[-4:] == ["--reference-inputs", "INPUTS.npz", "--allow-code", "tests.code_stages:label"], built
    assert "input 'prefix' of dtype string: cannot make random values" in built
    inputs = tmp_path / "request.npz"
    save_npz(inputs, {"x": np.ones((2, 4), np.float32), "prefix": np.array(["a", "b"], dtype=object)})
    swap = {"BUNDLE.onnxpipe": str(tmp_path / "b.onnxpipe"), "INPUTS.npz": str(inputs)}
    assert "1 reference sample(s)" in ok(*[swap.get(a, a) for a in args]).output


def test_build_hint_of_a_pipeline_with_state_stores_no_samples(tmp_path: Path) -> None:
    split(recurrent(), ["state1N"], states="auto").config.save(tmp_path / "split")
    built = ok("build", tmp_path / "split", "-o", tmp_path / "built").output
    args = _hinted(built, "next: ")
    assert "--reference" not in args and args[-2:] == ["-o", "BUNDLE.onnxpipe"], built
    assert "(no --reference: a reference sample is one request, and this pipeline keeps state between steps)" in built
    ok(*[str(tmp_path / "b.onnxpipe") if a == "BUNDLE.onnxpipe" else a for a in args])
    refused = run("export", tmp_path / "built", "-o", tmp_path / "c.onnxpipe", "--reference", "2")  # what the hint used to say
    assert_user_error(refused, "reference samples are single requests, but this pipeline keeps state between steps")
