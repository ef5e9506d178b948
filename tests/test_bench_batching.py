"""benchmarks.batching runs end to end (tiny sizes, one round): its numbers are for the docs, not asserted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.batching import run


def test_the_batching_benchmark_runs_and_reports_every_row() -> None:
    from benchmarks.batching import RATIOS, ROWS

    result = run(layers=2, hidden=32, heads=2, past=4, tokens=4, rounds=1, streams=(2,))
    assert {(r["how"], r["streams"]) for r in result["rows"]} == {(name, 2) for name, *_ in ROWS}
    assert all(r["tokens_per_s"] > 0 and r["p99_ms"] > 0 and r["ttft_ms"] > 0 for r in result["rows"])
    assert set(result["ratios"][2]) == {name for name, _, _ in RATIOS} | {
        "one driver: p99 per token, batched / unbatched", "thread per stream: p99 per token, batched / unbatched",
        "one driver: time to first token, batched / unbatched"}
    assert result["one_stream_step"]["step_ms"] > 0 and len(result["stateless"]) == 4
    assert result["round_ms"]["round"] > 0 and result["round_ms"]["stage 0 session call"] > 0


def test_only_measures_the_rows_named_and_the_ratios_between_them() -> None:
    result = run(layers=2, hidden=32, heads=2, past=4, tokens=4, rounds=1, streams=(2,), only=("one driver",))
    assert {r["how"] for r in result["rows"]} == {"unbatched, one driver", "batched, one driver", "batched, one driver, 1 micro-batch"}
    assert set(result["ratios"][2]) == {"one driver: batched / unbatched", "one driver: micro-batches per stage / 1 micro-batch",
                                        "one driver: p99 per token, batched / unbatched", "one driver: time to first token, batched / unbatched"}
    assert result["one_stream_step"] is None and result["round_ms"] is None and result["stateless"] == []


def test_the_cut_between_llama_layers_is_what_the_layers_after_it_read() -> None:
    """benchmarks.batching --llama cuts an optimum export between its middle layers: the residual
    stream, the causal mask and the rotary cos / sin, not the weights the exporter passes through Identity."""
    import onnx

    from benchmarks.batching import between_layers
    from tests.decoder_exports import LLAMA, LLAMA_CUT

    assert between_layers(onnx.load(LLAMA), 0) == sorted(LLAMA_CUT)


def _llama_folder(where: Path) -> Path:
    """A folder as benchmarks.llama_exports makes one, of the committed small Llama's two exports."""
    from tests.decoder_exports import DECODERS

    (where / "genai").symlink_to(DECODERS / "genai-llama", target_is_directory=True)
    (where / "optimum").symlink_to(DECODERS / "optimum-llama", target_is_directory=True)
    model = json.loads((DECODERS / "genai-llama" / "genai_config.json").read_text())["model"]
    d = model["decoder"]
    (where / "about.json").write_text(json.dumps({"name": "test", "parameters": 0, "hidden": d["hidden_size"], "layers": d["num_hidden_layers"],
                                                  "heads": d["num_attention_heads"], "kv_heads": d["num_key_value_heads"], "vocab": model["vocab_size"]}))
    return where


@pytest.mark.parametrize("exporter", ["genai", "optimum"])
def test_the_context_rows_decode_the_same_tokens_and_report_the_bytes_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exporter: str) -> None:
    """--contexts on a Llama folder (without og.Generator's and OpenVINO GenAI's rows, which need their venvs):
    every row at every context, tokens checked equal, onnxpipe's bytes copied per stage."""
    from benchmarks import batching

    monkeypatch.setattr(batching, "INPUTS", set(batching.INPUTS))  # the genai export drops position_ids for the process
    monkeypatch.setattr(batching, "HEAD_SIZE", [0])
    result = batching.run_contexts(_llama_folder(tmp_path), exporter, (4, 8), (2,), tokens=3, rounds=1, only=("onnxpipe", "session"))
    names = [name for name, how in batching.CONTEXT_ROWS if how not in ("generator", "ovgenai")]
    assert {(r["how"], r["streams"], r["context"]) for r in result["rows"]} == {(n, 2, c) for n in names for c in (4, 8)}
    assert all(r["tokens_per_s"] > 0 and r["p99_ms"] > 0 and r["ttft_ms"] > 0 for r in result["rows"])
    assert all(len(r["copied"]) == 2 and min(r["copied"]) >= 0 for r in result["rows"] if r["how"].startswith("onnxpipe"))
    assert {q["ratio"] for q in result["ratios"]} == {"onnxpipe one driver / bound session", "thread per stream / one driver"}
    assert {(a["how"], a["streams"]) for a in result["step_added_ms"]} == {(n, 2) for n in names}
    assert result["logits_max_diff"] <= batching.LOGITS_ATOL and set(result["state_bytes_per_stream"]) == {"4", "8"}


def test_the_plain_sessions_run_with_onnxruntimes_defaults_their_idle_threads_spinning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The peers are onnxruntime as a user runs it: a session made without spinning was 1.1-1.2x
    slower on the 24.7 M Llama, which made onnxpipe's ratios to it look better than they are."""
    from benchmarks import batching

    made: list[tuple[int, bool]] = []
    real = batching.decoder_session

    def recorded(model: Any, threads: int = 1, spinning: bool = False) -> Any:
        made.append((threads, spinning))
        return real(model, threads, spinning)

    monkeypatch.setattr(batching, "INPUTS", set(batching.INPUTS))
    monkeypatch.setattr(batching, "HEAD_SIZE", [0])
    monkeypatch.setattr(batching, "decoder_session", recorded)
    result = batching.run_contexts(_llama_folder(tmp_path), "genai", (4,), (2,), tokens=2, rounds=1, only=("session",))
    assert {r["how"] for r in result["rows"]} == {name for name, how in batching.CONTEXT_ROWS if how in ("bound", "numpy")}
    assert made and set(made) == {(2, True)}


def test_a_genai_export_shorter_than_the_context_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import batching

    monkeypatch.setattr(batching, "INPUTS", set(batching.INPUTS))
    monkeypatch.setattr(batching, "HEAD_SIZE", [0])
    with pytest.raises(SystemExit, match="holds 256 positions .* fewer than context 250 \\+ 8 tokens"):
        batching.run_contexts(_llama_folder(tmp_path), "genai", (250,), (2,), tokens=8, rounds=1)


def test_a_row_whose_tokens_or_last_logits_differ_fails_the_run() -> None:
    from benchmarks.batching import _check

    ref = {"tokens": [[1, 2], [3, 4]], "logits": np.zeros((2, 5), np.float32)}
    assert _check({"a": ref, "b": {**ref, "logits": np.full((2, 5), 1e-4)}}, 128, 2) == pytest.approx(1e-4)
    with pytest.raises(RuntimeError, match="context 128, 2 streams: 'b' against 'a': stream 1's tokens differ: \\[3, 5\\] against \\[3, 4\\]"):
        _check({"a": ref, "b": {**ref, "tokens": [[1, 2], [3, 5]]}}, 128, 2)
    with pytest.raises(RuntimeError, match="'c' against 'a': the last step's logits differ by 1.00e-02, more than 0.001"):
        _check({"a": ref, "b": ref, "c": {**ref, "logits": np.full((2, 5), 1e-2)}}, 128, 2)


def test_a_row_that_ends_a_stream_at_its_end_token_is_compared_up_to_it() -> None:
    """og.Generator ends a stream at the export's end-of-sequence token (2 here) where the others go on."""
    from benchmarks.batching import _check

    ref = {"tokens": [[5, 2, 7], [3, 4, 6]], "logits": np.zeros((2, 5), np.float32)}
    ended = {"tokens": [[5, 2, 2], [3, 4, 6]], "logits": np.array([[9.0] * 5, [0.0] * 5]), "stops_at": {2}}
    assert _check({"a": ref, "og": ended}, 128, 2) == 0.0
    with pytest.raises(RuntimeError, match="stream 1's tokens differ: \\[3, 4, 5\\] against \\[3, 4, 6\\]"):
        _check({"a": ref, "og": {**ended, "tokens": [[5, 2, 2], [3, 4, 5]]}}, 128, 2)
    with pytest.raises(RuntimeError, match="stream 0's tokens differ: \\[5, 3\\] against \\[5, 2\\]"):
        _check({"a": ref, "og": {**ended, "tokens": [[5, 3, 2], [3, 4, 6]]}}, 128, 2)


def test_the_context_ratios_are_paired_by_round_and_the_step_added_is_the_longest_context_less_the_shortest() -> None:
    from benchmarks.batching import CONTEXT_ROWS, _paired, _step_added

    driver, og = CONTEXT_ROWS[0][0], CONTEXT_ROWS[2][0]
    measured = {(128, 8, driver): [{"decode_per_s": 100.0}, {"decode_per_s": 50.0}], (128, 8, og): [{"decode_per_s": 200.0}, {"decode_per_s": 25.0}]}
    assert _paired(measured, (128,), (8,)) == [{"ratio": "onnxpipe one driver / og.Generator", "context": 128, "streams": 8,
                                                "median": 1.25, "min": 0.5, "max": 2.0}]
    rows = [{"how": driver, "streams": 8, "context": c, "p50_ms": ms} for c, ms in ((2048, 30.0), (128, 10.0), (512, 15.0))]
    assert _step_added(rows) == [{"how": driver, "streams": 8, "ms": 20.0}]


def _fake_ovgenai(where: Path, figures: dict[str, object]) -> Path:
    """A stand-in for the OpenVINO GenAI venv's Python: it prints ``figures`` as benchmarks.ovgenai_peer
    would, and keeps the request it was given beside itself."""
    python = where / "python"
    python.write_text(f"#!/bin/sh\ncat > {where / 'request.json'}\necho '{json.dumps(figures)}'\n")
    python.chmod(0o755)
    return python


def test_the_openvino_row_reduces_the_peers_step_times_as_every_rows_and_is_compared_by_its_tokens(tmp_path: Path) -> None:
    """Its decode tokens/s are the steps after every prompt's first token (3 streams x 2 tokens over
    their 0.3 s), TTFT the time to every stream's first; the request carries the prompts, the token
    count and the cores; with no logits exposed, _check compares its tokens alone."""
    import os

    from benchmarks.batching import _check, _ovgenai, _prompt

    python = _fake_ovgenai(tmp_path, {"tokens": [[5, 6, 7]] * 3, "first": [0.5], "times": [0.1, 0.2], "elapsed": 0.8})
    row = _ovgenai(tmp_path / "openvino", python, streams=3, past=4, tokens=3, vocab=64)
    assert row["decode_per_s"] == pytest.approx(3 * 2 / 0.3) and row["tokens_per_s"] == pytest.approx(3 * 3 / 0.8)
    assert row["ttft_ms"] == pytest.approx(500.0) and row["p50_ms"] == pytest.approx(200.0) and len(row["logits"]) == 0
    request = json.loads((tmp_path / "request.json").read_text())
    assert request == {"model": str(tmp_path / "openvino"), "prompts": [_prompt(k, 4, 64) for k in range(3)], "tokens": 3,
                       "threads": len(os.sched_getaffinity(0))}
    ref = {"tokens": [[5, 6, 7]] * 3, "logits": np.zeros((3, 5), np.float32)}
    assert _check({"a": ref, "ov": row}, 4, 3) == 0.0
    with pytest.raises(RuntimeError, match="'ov' against 'a': stream 0's tokens differ: \\[5, 6, 7\\] against \\[5, 6, 8\\]"):
        _check({"a": {**ref, "tokens": [[5, 6, 8]] * 3}, "ov": row}, 4, 3)


def test_the_openvino_row_is_left_out_with_a_line_saying_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Without the Llama's openvino export, or without the venv that runs it, the row is skipped and says so."""
    from benchmarks import batching

    llama = _llama_folder(tmp_path)
    assert "no OpenVINO export" in str(batching.ovgenai_missing(llama, Path("/bin/sh")))
    (llama / "openvino").mkdir()
    (llama / "openvino" / "openvino_model.xml").write_text("")
    assert "no /nowhere/python (make it: make .venv-ovgenai/.installed" in str(batching.ovgenai_missing(llama, Path("/nowhere/python")))
    assert batching.ovgenai_missing(llama, Path("/bin/sh")) is None
    monkeypatch.setattr(batching, "INPUTS", set(batching.INPUTS))
    monkeypatch.setattr(batching, "HEAD_SIZE", [0])
    result = batching.run_contexts(llama, "optimum", (4,), (2,), tokens=3, rounds=1, only=("one driver", "OpenVINO"),
                                   ovgenai_python=Path("/nowhere/python"))
    assert {r["how"] for r in result["rows"]} == {"onnxpipe batched, one driver"}
    assert "skipped 'OpenVINO GenAI, continuous batching': no /nowhere/python" in capsys.readouterr().err


def test_a_layout_is_written_stages_x_threads_and_other_layouts_get_rows_and_ratios_of_their_own() -> None:
    from benchmarks.batching import CONTEXT_RATIOS, CONTEXT_ROWS, Layout, layout_rows

    assert Layout.parse("2x1") == Layout() and str(Layout.parse(" 2x2:1 ")) == "2x2:1" and Layout.parse("1x2") == Layout(1, 2, None)
    assert Layout.parse("1x2+spin") == Layout(1, 2, None, True) and str(Layout(2, 2, 1, True)) == "2x2:1+spin"
    for bad in ("3x1", "2x0", "2x1:0", "2", "x1", "2x1:", "2x1+spun"):
        with pytest.raises(ValueError, match="STAGESxTHREADS"):
            Layout.parse(bad)
    rows, ratios = layout_rows((Layout(), Layout(2, 2, 1)))
    assert rows[: len(CONTEXT_ROWS)] == [(name, how, Layout()) for name, how in CONTEXT_ROWS]
    assert rows[len(CONTEXT_ROWS):] == [("onnxpipe batched 2x2:1, one driver", "driver", Layout(2, 2, 1)),
                                        ("onnxpipe batched 2x2:1, thread per stream", "threads", Layout(2, 2, 1))]
    assert ratios[: len(CONTEXT_RATIOS)] == list(CONTEXT_RATIOS)
    assert [r[0] for r in ratios[len(CONTEXT_RATIOS):]] == ["onnxpipe 2x2:1 one driver / og.Generator", "onnxpipe 2x2:1 one driver / bound session",
                                                            "2x2:1: thread per stream / one driver", "onnxpipe 2x2:1 one driver / OpenVINO GenAI"]


def test_each_layout_runs_its_own_bundle_and_decodes_the_same_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The 2 x 1 pipeline in one micro-batch beside its default (one per stage): each layout its
    own bundle and clients, checked against each other's tokens."""
    from benchmarks import batching

    monkeypatch.setattr(batching, "INPUTS", set(batching.INPUTS))
    monkeypatch.setattr(batching, "HEAD_SIZE", [0])
    result = batching.run_contexts(_llama_folder(tmp_path), "genai", (4,), (2,), tokens=3, rounds=1, only=("one driver",),
                                   layouts=(batching.Layout(), batching.Layout(1, 1, 1), batching.Layout(2, 1, 1)))
    assert result["order"] == ["onnxpipe batched, one driver", "onnxpipe batched 1x1:1, one driver", "onnxpipe batched 2x1:1, one driver"]
    assert result["model"]["layouts"] == ["2x1", "1x1:1", "2x1:1"]
    batches = {r["how"]: r["batch_mean"] for r in result["rows"]}
    assert batches == {"onnxpipe batched, one driver": [1.0, 1.0], "onnxpipe batched 1x1:1, one driver": [2.0],
                       "onnxpipe batched 2x1:1, one driver": [2.0, 2.0]}  # a stage each; 2 micro-batches of 1 stream, or one of 2
    assert {q["ratio"] for q in result["ratios"]} == set()  # neither og nor the bound session was measured
