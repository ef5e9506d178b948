"""The onnxpipe command: split / inspect / verify driven for real, exit codes, messages, files written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner, Result

from onnxpipe.cli import main
from onnxpipe.splitter._graph import GraphIndex
from tests.cli.helpers import assert_user_error

LIGHT = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"
SQUEEZENET = LIGHT / "light_squeezenet.onnx"


def run(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])



@pytest.fixture(scope="module")
def two_stages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Squeezenet split at its middle cut candidate (shared by the verify tests; do not modify)."""
    out = tmp_path_factory.mktemp("cli") / "split"
    summary = json.loads(run("inspect", SQUEEZENET, "--json").stdout)
    middle = min(summary["candidates"], key=lambda c: abs(c["fraction"] - 0.5))
    result = run("split", SQUEEZENET, "-o", out, "--at", middle["at"])
    assert result.exit_code == 0, result.output
    return out


def _stages(folder: Path) -> list[dict[str, object]]:
    return json.loads((folder / "pipeline.json").read_text())["stages"]


# -- help and version ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", [[], ["split"], ["inspect"], ["verify"], ["build"], ["export"], ["run"], ["bench"]])
def test_every_help_has_an_example(command: list[str]) -> None:
    result = run(*command, "--help")
    assert result.exit_code == 0
    assert "onnxpipe " in result.output and ("Example" in result.output or "Typical session" in result.output)


def test_version() -> None:
    from onnxpipe import __version__

    result = run("--version")
    assert result.exit_code == 0 and __version__ in result.output


# -- inspect -------------------------------------------------------------------------------------


def test_inspect_shows_model_ops_and_candidates() -> None:
    result = run("inspect", SQUEEZENET, "--top", "3")
    assert result.exit_code == 0, result.output
    out = result.stdout
    for fragment in ("IR version 3", "data_0: float32[1, 3, 224, 224]", "66 compute", "Concat", "cut candidates", "--at", "onnxpipe split"):
        assert fragment in out, fragment
    summary = json.loads(run("inspect", SQUEEZENET, "--top", "3", "--json").stdout)
    assert len(summary["candidates"]) == 3
    for c in summary["candidates"]:
        assert c["at"] in out


def test_inspect_json_is_json_only() -> None:
    result = run("inspect", SQUEEZENET, "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["compute_nodes"] == 66 and data["ops"]["Conv"] == 26
    assert data["weights_bytes"] >= data["computed_weight_bytes"] > data["initializer_bytes"]  # light models compute their weights
    assert [c["position"] for c in data["candidates"]] == sorted(c["position"] for c in data["candidates"])


# -- split ---------------------------------------------------------------------------------------


def test_split_writes_stages_and_reports_them(two_stages: Path) -> None:
    assert sorted(p.name for p in two_stages.iterdir()) == ["pipeline.json", "stage0.onnx", "stage1.onnx"]
    stages = _stages(two_stages)
    assert [s["name"] for s in stages] == ["stage0", "stage1"]
    onnx.checker.check_model(onnx.load(two_stages / "stage1.onnx"))


def test_split_output_table(tmp_path: Path) -> None:
    result = run("split", SQUEEZENET, "-o", tmp_path / "out", "--at", "r20")
    assert result.exit_code == 0, result.output
    for fragment in ("2 stages", "stage0", "stage1", "bytes in", "r20", "KiB", "pipeline.json", "stage1.onnx", str(tmp_path / "out")):
        assert fragment in result.stdout, fragment


def test_multi_tensor_at_is_one_cut(tmp_path: Path) -> None:
    # r6 and r8 are the two branches of squeezenet's first fire module, joined by a Concat.
    result = run("split", SQUEEZENET, "-o", tmp_path / "out", "--at", "r4", "--at", "r6,r8")
    assert result.exit_code == 0, result.output
    stages = _stages(tmp_path / "out")
    assert len(stages) == 3
    assert [t["name"] for t in stages[1]["outputs"]] == ["r6", "r8"]
    assert [t["name"] for t in stages[2]["inputs"]] == ["r6", "r8"]


def test_at_op(tmp_path: Path) -> None:
    result = run("split", SQUEEZENET, "-o", tmp_path / "out", "--at-op", "Conv:3", "--at-op", "Concat:4")
    assert result.exit_code == 0, result.output
    stages = _stages(tmp_path / "out")
    assert len(stages) == 3
    # The 4th Conv (index 3) is n7 -> r7; stage 0 also hands on r4, which its sibling branch reads.
    assert [t["name"] for t in stages[0]["outputs"]] == ["r4", "r7"]


def test_assign(tmp_path: Path) -> None:
    index = GraphIndex(onnx.load(SQUEEZENET))
    compute = index.compute_nodes()
    assignment = {index.nodes[i].name: int(k >= len(compute) // 3) + int(k >= 2 * len(compute) // 3) for k, i in enumerate(compute)}
    file = tmp_path / "stages.json"
    file.write_text(json.dumps(assignment))
    result = run("split", SQUEEZENET, "-o", tmp_path / "out", "--assign", file)
    assert result.exit_code == 0, result.output
    assert len(_stages(tmp_path / "out")) == 3


def test_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run("split", SQUEEZENET, "-o", out, "--at", "r20").exit_code == 0
    assert_user_error(run("split", SQUEEZENET, "-o", out, "--at", "r40"), "exists and is not empty")
    assert run("split", SQUEEZENET, "-o", out, "--at", "r40", "--overwrite").exit_code == 0
    assert [t["name"] for t in _stages(out)[0]["outputs"]] == ["r40"]


# -- verify --------------------------------------------------------------------------------------


def test_verify_passes(two_stages: Path) -> None:
    result = run("verify", two_stages, "--model", SQUEEZENET, "--samples", "2")
    assert result.exit_code == 0, result.output
    assert "softmaxout_1" in result.stdout and "boundary" in result.stdout and "ok: all" in result.stdout
    data = json.loads(run("verify", two_stages, "--model", SQUEEZENET, "--json").stdout)
    assert data["ok"] is True and {t["kind"] for t in data["tensors"]} == {"output", "boundary"}
    outputs_only = json.loads(run("verify", two_stages, "--model", SQUEEZENET, "--json", "--no-boundaries").stdout)
    assert {t["kind"] for t in outputs_only["tensors"]} == {"output"}


def test_verify_fails_on_tampered_weights(two_stages: Path, tmp_path: Path) -> None:
    tampered = tmp_path / "tampered"
    tampered.mkdir()
    for f in two_stages.iterdir():
        (tampered / f.name).write_bytes(f.read_bytes())
    stage0 = onnx.load(tampered / "stage0.onnx")
    conv1_w = next(n for n in stage0.graph.node if n.output[0] == "conv1_w_0")
    conv1_w.attribute[0].t.float_data[0] *= -3.0
    onnx.save(stage0, tampered / "stage0.onnx")
    result = run("verify", tampered, "--model", SQUEEZENET)
    assert_user_error(result, "tensor(s) differ past rtol=0.0001 atol=1e-05")
    assert "FAIL" in result.stdout
    as_json = run("verify", tampered, "--model", SQUEEZENET, "--json")
    assert as_json.exit_code == 1
    data = json.loads(as_json.stdout)
    assert data["ok"] is False and any(not t["ok"] and t["kind"] == "boundary" for t in data["tensors"])


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["split", SQUEEZENET, "--at", "r20x"], ["unknown tensor or node 'r20x'", "closest: 'r20'"]),
        (["split", SQUEEZENET, "--at", "r20", "--at", "r4"], ["cuts must be given in pipeline order"]),
        (["split", SQUEEZENET, "--at", "data_0"], ["it is a model input"]),
        (["split", SQUEEZENET, "--at-op", "Conv:99"], ["out of range", "indices 0..25"]),
        (["split", SQUEEZENET, "--at-op", "conv:1"], ["no node of op type 'conv'", "closest: 'Conv'"]),
        (["split", "missing.onnx", "--at", "r20"], ["model file 'missing.onnx' does not exist"]),
        (["split", __file__, "--at", "r20"], ["cannot read", "as an ONNX model"]),
        (["inspect", SQUEEZENET, "--dim", "batch=2"], ["no symbolic dim 'batch'"]),
        (["verify", "no-such-folder", "--model", SQUEEZENET], ["is not a split folder"]),
    ],
)
def test_user_errors_exit_1_with_one_line(args: list[object], fragments: list[str], tmp_path: Path) -> None:
    if args[0] == "split":
        args = [*args, "-o", tmp_path / "out"]
    assert_user_error(run(*args), *fragments)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [("[1, 2]", "must hold a JSON object"), ("{oops", "cannot read assignment file"), ('{"n0": 0}', "without a stage")],
)
def test_bad_assignment_files(content: str, fragment: str, tmp_path: Path) -> None:
    file = tmp_path / "a.json"
    file.write_text(content)
    assert_user_error(run("split", SQUEEZENET, "-o", tmp_path / "out", "--assign", file), fragment)


@pytest.mark.parametrize(
    "args",
    [
        ["split", SQUEEZENET, "-o", "out"],  # no cut at all
        ["split", SQUEEZENET, "-o", "out", "--at", "r20", "--at-op", "Conv:3"],  # mixed cut forms
        ["split", SQUEEZENET, "--at", "r20"],  # no -o
        ["split", SQUEEZENET, "-o", "out", "--at-op", "Conv"],
        ["split", SQUEEZENET, "-o", "out", "--at", "r4,,r6"],
        ["inspect", SQUEEZENET, "--dim", "batch"],
        ["inspect", SQUEEZENET, "--top", "-1"],
        ["verify", "out", "--model", SQUEEZENET, "--samples", "0"],
        ["frobnicate"],
    ],
)
def test_usage_errors_exit_2(args: list[object]) -> None:
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert "Usage:" in result.stderr


def test_unexpected_exceptions_keep_their_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxpipe.splitter

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(onnxpipe.splitter, "inspect_model", broken)
    result = run("inspect", SQUEEZENET)
    assert result.exit_code == 1
    assert isinstance(result.exception, RuntimeError)  # not turned into a one-line user error


# -- the real entry point ------------------------------------------------------------------------


@pytest.mark.parametrize("command", [[], ["split"], ["inspect"], ["verify"], ["build"], ["export"], ["run"], ["bench"]])
def test_help_imports_neither_onnx_nor_onnxruntime(command: list[str]) -> None:
    code = (
        "import sys\n"
        "from onnxpipe.cli import main\n"
        f"main({[*command, '--help']!r}, standalone_mode=False)\n"
        "leaked = [m for m in ('onnx', 'onnxruntime', 'numpy', 'rich') if m in sys.modules]\n"
        "print('LEAKED=' + ','.join(leaked))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "Usage: " in out.stdout
    assert out.stdout.strip().endswith("LEAKED="), out.stdout


def test_python_m_entry_point_user_error() -> None:
    out = subprocess.run([sys.executable, "-m", "onnxpipe.cli", "split", "missing.onnx", "-o", "x", "--at", "t"], capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stderr == "error: model file 'missing.onnx' does not exist\n"


@pytest.mark.parametrize("command", sorted(main.commands))
@pytest.mark.parametrize("content", [None, b"", b"not a model \x00\xff", b'{"format": "onnxpipe.pipeline", "version": 1}'])
def test_every_command_turns_a_bad_file_into_one_line(command: str, content: bytes | None, tmp_path: Path) -> None:
    # Every command is registered on the Group that turns onnxpipe's errors into one line; a missing,
    # empty, garbage or half-valid file given as a model, split folder, build folder or bundle must
    # end as that line (exit 1), never as a traceback.
    path = tmp_path / "thing.onnx"
    if content is not None:
        path.write_bytes(content)
    args = [command, path] + (["-o", tmp_path / "out"] if command in {"split", "build", "export"} else [])
    args += ["--at", "x"] if command == "split" else ["--inputs", path] if command == "run" else []
    result = run(*args)
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    if result.exit_code == 2:  # click refused an argument itself (a file where a folder is wanted, ...)
        assert "Usage:" in result.stderr
    else:
        assert_user_error(result)
