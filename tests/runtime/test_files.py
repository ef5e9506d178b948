"""Requests in files (``runtime/_files.py``): .npz requests streamed through a real pipeline, each
result written as it comes; ``load(before_start=...)`` refusing a run before any session starts.

Two tiny bundles from the model registry, built once per module (do not modify them): ``hand``
(head -> twin -> tail, x[N,4] -> y[N,4]) and ``failing`` (head -> reshape, which fails for any N
but 2). Requests vary N and their values, so a result written to the wrong file has the wrong
shape or the wrong values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from onnxpipe import ConfigError, InputError, StageError
from onnxpipe.builder import build, export
from onnxpipe.runtime import PipelineSpec, check_request_files, load, load_npz, map_files, request_files, save_npz
from tests import models


def assert_results(pipe: object, inputs: list[Path], outputs: list[Path]) -> None:
    """Each outputs file holds what the pipeline gives for its inputs file, and nothing else."""
    for src, dst in zip(inputs, outputs, strict=True):
        x = load_npz(src)["x"]
        y = load_npz(dst)
        want = pipe({"x": x})  # type: ignore[operator]
        assert list(y) == ["y"] and y["y"].shape == x.shape and np.isfinite(y["y"]).all()
        np.testing.assert_array_equal(y["y"], want["y"])


# -- request_files ---------------------------------------------------------------------------------


def test_request_files_expand_folders_in_name_order_and_keep_the_order_given(tmp_path: Path) -> None:
    files = models.write_requests(tmp_path / "in", [1, 2, 3])
    (tmp_path / "in" / "notes.txt").write_text("not a request")
    (tmp_path / "in" / "sub.npz").mkdir()  # a folder named like a request is not one
    extra = models.write_requests(tmp_path / "extra", [2])[0]
    assert request_files([extra, tmp_path / "in"]) == [extra, *files]
    assert request_files([str(files[2]), files[0]]) == [files[2], files[0]]
    assert request_files([]) == []


def test_request_files_refuse_what_is_not_there(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=f"^inputs file '{tmp_path / 'nope'}' does not exist$"):
        request_files([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=f"^inputs folder '{tmp_path / 'empty'}' holds no .npz file$"):
        request_files([tmp_path / "empty"])


# -- check_request_files ---------------------------------------------------------------------------


def test_check_request_files_names_the_file_and_the_mismatch(hand: Path, tmp_path: Path) -> None:
    spec = PipelineSpec.from_json((hand / "pipeline.json").read_text())
    files = models.write_requests(tmp_path / "in", [2] * 5)
    check_request_files(spec.inputs, files)
    cases = [
        ({"x": np.zeros((2, 4))}, "input 'x' has dtype float64; expected float32"),
        ({"x": np.zeros((2, 5), np.float32)}, "input 'x' has shape [2, 5]"),
        ({"y": np.zeros((2, 4), np.float32)}, "unknown input 'y'"),
    ]
    for arrays, message in cases:
        save_npz(files[3], arrays)
        with pytest.raises(InputError, match=f"^inputs file '{files[3]}': ") as caught:
            check_request_files(spec.inputs, files)
        assert message in str(caught.value)
    files[3].write_text("not numpy")  # said once, not wrapped in a second "inputs file ...:"
    with pytest.raises(InputError, match=f"^inputs file '{files[3]}': cannot read 'r03.npz' as an .npz of arrays") as caught:
        check_request_files(spec.inputs, files)
    assert str(caught.value).count("inputs file") == 1
    files[3].unlink()
    with pytest.raises(InputError, match=f"^inputs file '{files[3]}' does not exist$"):
        check_request_files(spec.inputs, files)


# -- map_files --------------------------------------------------------------------------------------


def test_map_files_writes_each_result_to_its_file_in_order(hand: Path, tmp_path: Path) -> None:
    files = models.write_requests(tmp_path / "in", [1 + k % 3 for k in range(20)])
    outputs = [tmp_path / "out" / "deep" / f.name for f in files]  # the folder is made
    with load(hand) as pipe:
        yielded = list(map_files(pipe, files, outputs))
        assert [r["y"].shape[0] for r in yielded] == [1 + k % 3 for k in range(20)]
        assert_results(pipe, files, outputs)
        expected = list(pipe.map({"x": load_npz(f)["x"]} for f in files))
        for got, want in zip(yielded, expected, strict=True):
            np.testing.assert_array_equal(got["y"], want["y"])
    assert sorted(p.name for p in (tmp_path / "out" / "deep").iterdir()) == [f.name for f in files]


def test_map_files_reads_each_file_only_when_the_pipeline_takes_it(hand: Path, tmp_path: Path) -> None:
    files = models.write_requests(tmp_path / "in", [2] * 60)
    outputs = [tmp_path / "out" / f.name for f in files]
    with load(hand) as pipe:
        results = map_files(pipe, files, outputs)
        next(results)
        files[-1].unlink()  # far beyond what the pipeline holds: not read yet
        with pytest.raises(InputError, match=f"^inputs file '{files[-1]}' does not exist$"):
            for _ in results:
                pass
        written = sorted(p.name for p in (tmp_path / "out").iterdir())
        assert written == [f.name for f in files[: len(written)]] and 1 <= len(written) < len(files) - 1
        assert_results(pipe, files[: len(written)], outputs[: len(written)])


def test_a_request_failing_in_a_stage_names_its_file_and_keeps_the_results_before_it(failing: Path, tmp_path: Path) -> None:
    rows = [2] * 12
    rows[7] = 3  # fits the pipeline's inputs, refused by the reshape stage
    files = models.write_requests(tmp_path / "in", rows)
    outputs = [tmp_path / "out" / f.name for f in files]
    with load(failing) as pipe:
        pipe.reset_stats()
        with pytest.raises(StageError, match=f"^inputs file '{files[7]}': stage 'reshape' failed on request 7: ") as caught:
            list(map_files(pipe, files, outputs))
        assert str(caught.value).endswith("; the 7 output file(s) written before it are complete and stay")
        assert caught.value.stage == "reshape" and caught.value.request == 7
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f.name for f in files[:7]]  # no temporary file either
        for src, dst in zip(files[:7], outputs[:7], strict=True):
            np.testing.assert_array_equal(load_npz(dst)["y"], np.maximum(load_npz(src)["x"], 0))
    first = models.write_requests(tmp_path / "first", [3])
    with load(failing) as pipe, pytest.raises(StageError, match="; no output file was written$"):
        list(map_files(pipe, first, [tmp_path / "y.npz"]))
    assert not (tmp_path / "y.npz").exists()


def test_map_files_refuses_results_it_cannot_write(hand: Path, tmp_path: Path) -> None:
    files = models.write_requests(tmp_path / "in", [2, 2])
    (tmp_path / "afile").write_text("x")
    with load(hand) as pipe:
        with pytest.raises(ConfigError, match=f"^cannot write '{tmp_path / 'afile' / 'sub' / 'r00.npz'}': Not a directory$"):
            list(map_files(pipe, files, [tmp_path / "afile" / "sub" / f.name for f in files]))
        with pytest.raises(ConfigError, match=r"^2 inputs file\(s\) but 1 outputs file\(s\); give one outputs file per inputs file$"):
            list(map_files(pipe, files, [tmp_path / "y.npz"]))


# -- load(before_start=...) -------------------------------------------------------------------------


def test_before_start_sees_the_spec_with_its_overrides(hand: Path) -> None:
    seen: list[PipelineSpec] = []
    with load(hand, overrides={"twin": {"replicas": 2}}, before_start=seen.append) as pipe:
        assert [s.settings.replicas for s in seen[0].stages] == [1, 2, 1]
        assert seen[0] == pipe.spec


def test_before_start_refuses_before_any_session_starts_and_leaves_nothing_open(tmp_path: Path, private_tmp: Path) -> None:
    archive = export(build(models.hand_wired(), tmp_path / "built").path, tmp_path / "hand.onnxpipe")  # unpacked into private_tmp
    files = models.write_requests(tmp_path / "in", [2, 2])
    save_npz(files[1], {"x": np.zeros((2, 4))})

    unpacked: list[Path] = []

    def check(spec: PipelineSpec) -> None:
        unpacked.extend(private_tmp.iterdir())
        check_request_files(spec.inputs, files)

    refused = {"*": {"affinity": [4000]}}  # a stage pinned to a core no host has fails as its session starts
    with pytest.raises(ConfigError, match=r"affinity names core\(s\) \[4000\]"):
        load(archive, overrides=refused)
    with pytest.raises(InputError, match=f"^inputs file '{files[1]}': input 'x' has dtype float64; expected float32$") as refusal:
        load(archive, overrides=refused, before_start=check)
    # Removed at once, while the refusal (and so load's frame) is still alive, not when the bundle is collected.
    assert unpacked and not any(p.exists() for p in unpacked) and refusal.value
