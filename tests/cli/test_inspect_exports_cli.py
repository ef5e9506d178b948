"""`onnxpipe inspect` of exports as users have them (issue 27): formula dims sized from --dim, the
unk__N dims of an optimum export in one short note, and a bundle's state links shown as state."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from onnxpipe.splitter import split
from tests.cli.helpers import ok
from tests.decoder_exports import LLAMA, LLAMA_CUT
from tests.models import bundle_of
from tests.splitter.test_inspect_exports import D0, D1, D2, HALF, paddle_formulas


def notes(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("note: ")]


def test_formula_dims_take_their_size_from_the_input_dims(tmp_path: Path) -> None:
    model = tmp_path / "det.onnx"
    onnx.save(paddle_formulas(), model)
    shown = ok("inspect", model).output
    assert notes(shown) == [f"note: input dim(s) {D0}, {D1}, {D2} counted as 1 (4 dim(s) computed from them, e.g. '{HALF[0]}', follow); "
                            "give sizes with dims / --dim NAME=VALUE"]
    sized = ok("inspect", model, "--dim", f"{D0}=2", "--dim", f"{D1}=64", "--dim", f"{D2}=47").output
    assert notes(sized) == []
    assert "192.0 KiB" in sized  # c: float32 [2, 8, 64, 48], what onnxruntime makes of a 2 x 3 x 64 x 47 input
    data = json.loads(ok("inspect", model, "--dim", f"{D0}=2", "--dim", f"{D1}=64", "--dim", f"{D2}=47", "--json").output)
    assert max(c["bytes"] for c in data["candidates"]) == 4 * 2 * 8 * 64 * 48


def test_optimum_export_notes_are_short() -> None:
    first, second = notes(ok("inspect", LLAMA).output)
    assert first.startswith("note: input dim(s) batch_size, past_sequence_length, sequence_length counted as 1")
    assert "internal dim(s) that no input has (unk__0, unk__1, unk__2, ...:" in second
    assert len(first) < 250 and len(second) < 250


@pytest.fixture(scope="module")
def stream_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bundle_of(split(onnx.load(LLAMA), [LLAMA_CUT], states="auto"), tmp_path_factory.mktemp("llama"))


def test_bundle_shows_state_outputs_as_state(stream_bundle: Path) -> None:
    shown = ok("inspect", stream_bundle).output
    for layer in (0, 1):  # layer 0's caches are kept in stage 0, layer 1's in stage 1
        for kind in ("key", "value"):
            past, present = f"past_key_values.{layer}.{kind}", f"present.{layer}.{kind}"
            assert f"  in  {past}: float32[batch_size, 2, past_sequence_length, 16]  <- state {present} (previous step; starts empty along axis 2)" in shown
            assert f"  out {present}: float32[batch_size, 2, past_sequence_length + sequence_length, 16]  -> state of {past} (next step)" in shown
    assert "unused" not in shown
