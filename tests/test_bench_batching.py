"""benchmarks.batching runs end to end (tiny sizes, one round): its numbers are for the docs, not asserted."""

from __future__ import annotations

from benchmarks.batching import run


def test_the_batching_benchmark_runs_and_reports_every_row() -> None:
    result = run(layers=2, hidden=32, heads=2, past=4, tokens=4, rounds=1, streams=(2,))
    assert {(r["how"], r["streams"]) for r in result["rows"]} == {
        ("unbatched", 2), ("batched, delay 0", 2), ("batched, delay 2 ms", 2), ("lockstep session", 2),
        ("unbatched, one driver", 2), ("batched, delay 0, one driver", 2)}
    assert all(r["tokens_per_s"] > 0 for r in result["rows"])
    assert set(result["ratios"][2]) == {"batched, delay 0 / unbatched", "batched, delay 0 / lockstep session",
                                        "batched, delay 2 ms / unbatched", "batched, delay 2 ms / lockstep session",
                                        "one driver: batched / unbatched", "one driver: batched / lockstep session"}
    assert result["one_stream_step"]["step_ms"] > 0 and len(result["stateless"]) == 4
