"""benchmarks.batching runs end to end (tiny sizes, one round): its numbers are for the docs, not asserted."""

from __future__ import annotations

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
