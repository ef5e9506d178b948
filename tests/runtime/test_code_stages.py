"""Code stages at run time: the allow-list (checked before any import), entry points that cannot be
found, outputs checked against the declared ports (a bad request fails, the next succeeds), shapes
changing within symbolic dims, and custom-op libraries named by package."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from onnxpipe import runtime
from onnxpipe._errors import BundleError, ConfigError, StageError
from onnxpipe.builder import PipelineConfig, build, export
from onnxpipe.runtime import SequentialPipeline, TensorSpec, benchmark, read_bundle
from tests import code_stages
from tests.models import bundle_of, stage_head


@pytest.fixture(scope="module")
def coded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundle of ``code_stages.config()``: head (ONNX) -> combine (code, factor 2)."""
    return bundle_of(code_stages.config(), tmp_path_factory.mktemp("coded"))


def _x(rows: int = 3, first: float | None = None) -> np.ndarray:
    x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) - 5
    if first is not None:
        x[0, 0] = first
    return x


def test_code_stage_runs_beside_onnx_stage(coded: Path) -> None:
    with runtime.load(coded, allow_code=["tests.*"]) as pipe:
        for rows in (1, 3, 7):  # N varies per request
            x = _x(rows)
            np.testing.assert_allclose(pipe({"x": x})["y"], code_stages.expected(x), rtol=0, atol=0)
        outs = list(pipe.map({"x": _x(r)} for r in range(1, 9)))
        for r, out in zip(range(1, 9), outs, strict=True):
            np.testing.assert_allclose(out["y"], code_stages.expected(_x(r)), rtol=0, atol=0)
        assert [s.stage for s in pipe.stats().stages] == ["head", "combine"]
        assert pipe.get_providers() == ["CPUExecutionProvider"]


def test_the_spec_stores_entry_point_and_params_and_no_code(coded: Path) -> None:
    spec = json.loads((coded / "pipeline.json").read_text())
    stage = spec["stages"][1]
    assert stage["code"] == {"entry": "tests.code_stages:combine", "params": {"factor": 2.0}}
    assert "module" not in stage
    files = json.loads((coded / "manifest.json").read_text())["files"]
    assert sorted(files) == ["pipeline.json", "stages/head.onnx"]


def test_code_not_allowed_is_refused_before_any_import(tmp_path: Path) -> None:
    bundle = bundle_of(code_stages.config("tests.code_guard:combine"), tmp_path)
    sys.modules.pop("tests.code_guard", None)
    for allow in ([], ["tests.code_stages:*"], ["other.*"]):
        with pytest.raises(BundleError, match=r"not allowed: 'tests\.code_guard:combine' \(stage 'combine'\).*allow_code=\['tests\.code_guard:combine'\]"):
            runtime.load(bundle, allow_code=allow)
    with pytest.raises(BundleError, match="not allowed"):
        SequentialPipeline(read_bundle(bundle).spec, bundle)
    assert "tests.code_guard" not in sys.modules
    with runtime.load(bundle, allow_code=["tests.code_guard:*"]) as pipe:  # the exact module, any callable
        np.testing.assert_allclose(pipe({"x": _x()})["y"], code_stages.expected(_x()))
    assert "tests.code_guard" in sys.modules


def test_refusal_names_every_entry_point(tmp_path: Path) -> None:
    config = code_stages.config("tests.code_guard:combine")
    extra = code_stages.add_rows(config)
    extra.output("count").connect(config.output("count"))
    bundle = bundle_of(config, tmp_path)
    with pytest.raises(BundleError, match=r"'tests\.code_guard:combine' \(stage 'combine'\), 'tests\.code_stages:positive_rows' \(stage 'rows'\)"):
        runtime.load(bundle)
    message = r"^the pipeline runs Python this host has not allowed: 'tests\.code_stages:positive_rows' \(stage 'rows'\); allowed now: 'tests\.code_guard:\*'"
    with pytest.raises(BundleError, match=message):
        runtime.load(bundle, allow_code=["tests.code_guard:*"])


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("tests.no_such_module:fn", r"stage 'combine': entry point 'tests\.no_such_module:fn': module 'tests\.no_such_module' is not installed"),
        ("tests.code_stages:nope", r"stage 'combine': entry point 'tests\.code_stages:nope': 'tests\.code_stages' has no attribute 'nope'"),
        ("tests.code_stages:Holder.nope", r"'tests\.code_stages\.Holder' has no attribute 'nope'"),
        ("tests.code_stages:NOT_CALLABLE", r"entry point 'tests\.code_stages:NOT_CALLABLE': 'NOT_CALLABLE' is a int, not a callable"),
    ],
)
def test_unknown_entry_point_is_one_error(tmp_path: Path, entry: str, message: str) -> None:
    bundle = bundle_of(code_stages.config(entry), tmp_path)
    with pytest.raises(BundleError, match=message):
        runtime.load(bundle, allow_code=["tests.*"])


@pytest.mark.parametrize("entry", ["tests.code_stages:Holder.double", "tests.code_stages:doubled"])
def test_dotted_qualname_resolves(tmp_path: Path, entry: str) -> None:
    # A method through the class that defines it, and an object of a class the module defines.
    bundle = bundle_of(code_stages.config(entry), tmp_path)
    with runtime.load(bundle, allow_code=["tests.code_stages:*"]) as pipe:
        x = _x()
        np.testing.assert_allclose(pipe({"x": x})["y"], (np.maximum(x, 0) - x) * 2)


#: Entry points that the allow-list 'tests.code_stages:*' matches but that walk out of the module
#: (issue 36, item 8), and how each is refused.
WALKING = [
    ("tests.code_stages:threading._os.kill", r"'threading' is the module 'threading', not a function or class 'tests\.code_stages' defines under that name"),
    ("tests.code_stages:decode_png.__globals__.get", r"'__globals__' is a name Python gives an object \(or a private one\)"),
    ("tests.code_stages:np.save", r"'np' is the module 'numpy', not a function or class"),
    ("tests.code_stages:Any", r"'Any' is the class 'typing\.Any', not a function or class 'tests\.code_stages' defines under that name"),
    ("tests.code_stages:GATE.set", r"'GATE' is an object of class 'threading\.Event', not a function or class 'tests\.code_stages' defines"),
    ("tests.code_stages:doubled.factor.__class__", r"'__class__' is a name Python gives an object"),
    ("tests.code_stages:combine.__call__", r"'__call__' is a name Python gives an object"),
    ("tests.code_stages:Holder.__init__", r"'__init__' is a name Python gives an object"),
]


@pytest.mark.parametrize(("entry", "message"), WALKING)
def test_an_entry_point_resolves_only_to_what_its_module_defines(tmp_path: Path, entry: str, message: str) -> None:
    bundle = bundle_of(code_stages.config(entry), tmp_path)
    with pytest.raises(BundleError, match=rf"^stage 'combine': entry point '{re.escape(entry)}': {message}"):
        runtime.load(bundle, allow_code=["tests.code_stages:*"])


def test_an_entry_point_walks_only_through_classes(tmp_path: Path) -> None:
    # doubled is the module's own object, and its factor a numpy scalar it made: still not what the module defines as 'doubled.factor'.
    bundle = bundle_of(code_stages.config("tests.code_stages:doubled.factor"), tmp_path)
    with pytest.raises(BundleError, match=r"'doubled' is an object of class 'tests\.code_stages\.Scaled', not a class; an entry point walks only "
                                          r"through classes its module defines"):
        runtime.load(bundle, allow_code=["tests.code_stages:*"])


@pytest.mark.parametrize(
    ("entry", "where"),
    [("tests.code_stages", "no colon"), ("tests.code_stages:", "no attribute"), ("tests..x:f", "empty part"), ("1pkg:f", "digit"), ("a:b:c", "two colons")],
)
def test_malformed_entry_point_is_a_config_error(entry: str, where: str) -> None:
    config = PipelineConfig()
    with pytest.raises(ConfigError, match=r"stage 's': entry point .* is malformed; an entry point is 'package\.module:function'"):
        config.add_python_stage(entry, inputs=[], outputs=[TensorSpec("y", "float32", (1,))], name="s")


def test_malformed_entry_point_in_a_bundle_is_refused(coded: Path, tmp_path: Path) -> None:
    import shutil

    from onnxpipe.runtime.bundle import write_manifest

    copy = tmp_path / "b"
    shutil.copytree(coded, copy)
    spec = json.loads((copy / "pipeline.json").read_text())
    spec["stages"][1]["code"]["entry"] = "os.system"
    (copy / "pipeline.json").write_text(json.dumps(spec))
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").unlink()
    write_manifest(copy, {k: manifest[k] for k in ("versions", "opsets", "providers", "created")})
    with pytest.raises(BundleError, match=r"stages\[1\] \('combine'\): entry point \"os\.system\" is malformed"):
        read_bundle(copy)


@pytest.mark.parametrize(
    ("first", "message"),
    [
        (101.0, r"stage 'combine' failed on request \d+: code stage 'combine': stage 'combine' output 'y' has dtype float64; expected float32"),
        (102.0, r"output 'y' has shape \[12\]; expected rank 2: \[N, 4\]"),
        (103.0, r"missing stage 'combine' output\(s\) 'y'"),
        (104.0, r"code stage 'combine' returned output\(s\) 'z' it does not declare; declared: 'y'"),
        (105.0, r"code stage 'combine' returned list; it must return a dict of arrays by output name"),
        (106.0, r"stage 'combine' failed on request \d+: misbehave was asked to raise"),
        (107.0, r"output 'y' has shape \[3, 5\]; expected \[N, 4\] \(dim 1 must be 4\)"),
    ],
)
def test_bad_output_fails_that_request_and_the_next_succeeds(tmp_path: Path, first: float, message: str) -> None:
    bundle = bundle_of(code_stages.config("tests.code_stages:misbehave"), tmp_path)
    with runtime.load(bundle, allow_code=["tests.code_stages:*"]) as pipe:
        bad = pipe.submit({"x": _x(first=first)})
        good = pipe.submit({"x": _x()})
        with pytest.raises(StageError, match=message) as info:
            bad.result()
        assert info.value.stage == "combine"
        np.testing.assert_allclose(good.result()["y"], code_stages.expected(_x()))


def test_shapes_vary_within_symbolic_dims(tmp_path: Path) -> None:
    config = PipelineConfig("rows")
    rows = code_stages.add_rows(config)
    rows.output("rows").connect(config.output("rows"))
    rows.output("count").connect(config.output("count"))
    bundle = bundle_of(config, tmp_path)
    with runtime.load(bundle, allow_code=["tests.*"]) as pipe:
        for n in (2, 5):
            x = _x(n)
            out = pipe({"x": x})
            assert out["rows"].shape == (int((x.sum(axis=1) > 0).sum()), 4)
            assert out["count"][0] == out["rows"].shape[0]
        assert pipe.get_modelmeta().graph_name == "rows"  # no ONNX stage to take metadata from
        report = benchmark(pipe, 3, warmup=1, standalone_runs=2, dims={"N": 4})
        assert report.stages[0].standalone_ms > 0


def test_code_stage_replicas(tmp_path: Path) -> None:
    config = code_stages.config()
    config.stage("combine").configure(replicas=2)
    bundle = bundle_of(config, tmp_path)
    with runtime.load(bundle, allow_code=["tests.*"]) as pipe:
        xs = [_x(r) for r in range(1, 12)]
        for x, out in zip(xs, pipe.map({"x": x} for x in xs), strict=True):
            np.testing.assert_allclose(out["y"], code_stages.expected(x))


def test_export_with_reference_runs_the_code_only_if_allowed(tmp_path: Path) -> None:
    built = build(code_stages.config(), tmp_path / "built").path
    with pytest.raises(Exception, match=r"computing the reference outputs runs the pipeline here: .*export\(\.\.\., allow_code"):
        export(built, tmp_path / "refused", reference_inputs=[{"x": _x()}])
    bundle = export(built, tmp_path / "b.onnxpipe", reference_inputs=[{"x": _x()}], allow_code=["tests.*"])
    with runtime.load(bundle, allow_code=["tests.*"]) as pipe:
        assert all(row.ok for row in pipe.check())


def test_version_1_spec_with_code_is_refused(coded: Path) -> None:
    spec = json.loads((coded / "pipeline.json").read_text())
    spec["version"] = 1
    with pytest.raises(ConfigError, match="code stages need version 2"):
        runtime.PipelineSpec.from_dict(spec)


def test_code_stage_ports_need_shapes_and_known_dtypes() -> None:
    config = PipelineConfig()
    with pytest.raises(ConfigError, match="code stage 's': port 'y' needs a shape"):
        config.add_python_stage("m:f", inputs=[], outputs=[TensorSpec("y", "float32", None)], name="s")
    with pytest.raises(ConfigError, match="stage 's': tensor 'y' has unknown dtype 'float33'"):
        config.add_python_stage("m:f", inputs=[], outputs=[TensorSpec("y", "float33", (1,))], name="s")
    with pytest.raises(ConfigError, match="stage 's': code stage 'm:f': params must be plain JSON values"):
        config.add_python_stage("m:f", inputs=[], outputs=[TensorSpec("y", "float32", (1,))], params={"a": object()}, name="s")


def test_param_groups_cannot_name_a_code_stage() -> None:
    config = code_stages.config()
    with pytest.raises(ConfigError, match="stage 'combine' has no initializers"):
        config.add_param_group("g", "combine")


# -- custom-op libraries ---------------------------------------------------------------------------


def _custom_ops_bundle(tmp_path: Path, package: str) -> Path:
    config = PipelineConfig("ops")
    head = config.add_stage(stage_head(), "head")
    config.input("x").connect(head.input("x"))
    head.output("h").connect(config.output("h"))
    built = build(config, tmp_path / "built").path
    spec = json.loads((built / "pipeline.json").read_text())
    spec["stages"][0]["settings"]["custom_ops"] = [package]  # as a build with custom ops would write it
    (built / "pipeline.json").write_text(json.dumps(spec))
    return export(built, tmp_path / "bundle")


def test_custom_ops_library_not_allowed_is_refused(tmp_path: Path) -> None:
    bundle = _custom_ops_bundle(tmp_path, "tests.code_guard")
    sys.modules.pop("tests.code_guard", None)
    with pytest.raises(BundleError, match=r"not allowed: custom-op library of package 'tests\.code_guard' \(stage 'head'\)"):
        runtime.load(bundle)
    assert "tests.code_guard" not in sys.modules


def test_custom_ops_package_missing_is_one_error_naming_what_to_install(tmp_path: Path) -> None:
    bundle = _custom_ops_bundle(tmp_path, "onnxruntime_extensions_missing")
    message = r"stage 'head' needs the custom-op library of package 'onnxruntime_extensions_missing', which is not installed on this host; install it"
    with pytest.raises(BundleError, match=message + r" \(pip install onnxruntime-extensions-missing\)"):
        runtime.load(bundle, allow_code=["onnxruntime_extensions*"])


def test_custom_ops_package_without_a_library_is_refused(tmp_path: Path) -> None:
    bundle = _custom_ops_bundle(tmp_path, "tests.code_guard")
    with pytest.raises(BundleError, match=r"'tests\.code_guard' has no get_library_path\(\)"):
        runtime.load(bundle, allow_code=["tests.code_guard"])


def test_a_real_custom_op_library_runs_once_the_host_allows_it(tmp_path: Path) -> None:
    """onnxruntime-extensions' Inverse op (domain ai.onnx.contrib): built, exported, refused, then run."""
    extensions = pytest.importorskip("onnxruntime_extensions")
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Inverse", ["x"], ["y"], domain="ai.onnx.contrib")],
        "inverse",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.contrib", 1)])
    config = PipelineConfig("contrib")
    stage = config.add_stage(model, "inverse", settings=runtime.StageSettings(custom_ops=("onnxruntime_extensions",)))
    config.input("x").connect(stage.input("x"))
    stage.output("y").connect(config.output("y"))
    bundle = export(build(config, tmp_path / "built").path, tmp_path / "bundle")
    with pytest.raises(BundleError, match=r"not allowed: custom-op library of package 'onnxruntime_extensions' \(stage 'inverse'\)"):
        runtime.load(bundle)
    x = np.array([[2, 0, 0], [0, 4, 0], [1, 0, 8]], np.float32)
    with runtime.load(bundle, allow_code=["onnxruntime_extensions"]) as pipe:
        np.testing.assert_allclose(pipe({"x": x})["y"], np.linalg.inv(x), rtol=1e-6, atol=1e-6)
    assert extensions.get_library_path()


@pytest.mark.parametrize("value", ["/usr/lib/libevil.so", ["../libevil.so"], [""], "onnxruntime_extensions"])
def test_custom_ops_is_never_a_path(value: object) -> None:
    with pytest.raises(ConfigError, match="custom_ops must be a list of Python package names"):
        runtime.StageSettings(custom_ops=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("how", ["pipeline", "sequential"])
def test_each_call_gets_its_own_params_so_changing_them_leaks_nothing(tmp_path: Path, how: str) -> None:
    bundle = bundle_of(code_stages.config("tests.code_stages:remember", params={"seen": [7], "factor": 2.0}), tmp_path)
    x = _x()
    h, g = np.maximum(x, 0), -x
    if how == "pipeline":
        with runtime.load(bundle, allow_code=["tests.code_stages:*"]) as pipe:
            outs = [pipe({"x": x})["y"] for _ in range(3)] + [o["y"] for o in pipe.map({"x": x} for _ in range(3))]
    else:
        seq = SequentialPipeline(read_bundle(bundle).spec, bundle, allow_code=["tests.code_stages:*"])
        outs = [seq.run({"x": x})["y"] for _ in range(3)]
    for y in outs:  # every call saw seen = [7]: after its append, length 2
        np.testing.assert_allclose(y, h * 2 + g)
    assert json.loads((bundle / "pipeline.json").read_text())["stages"][1]["code"]["params"] == {"seen": [7], "factor": 2.0}
