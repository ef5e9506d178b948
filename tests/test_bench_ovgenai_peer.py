"""benchmarks.ovgenai_peer's own logic, with a fake pipeline: OpenVINO GenAI is not needed (its venv
is not part of make test; the row itself runs in make bench-decoders)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from benchmarks.ovgenai_peer import BLOCK, drain, scheduler_sizes


def test_the_scheduler_takes_every_prompt_at_once_and_holds_every_streams_positions() -> None:
    sizes = scheduler_sizes(8, 2048, 64)
    assert sizes["max_num_seqs"] == 8 and sizes["max_num_batched_tokens"] == 8 * 2048 and sizes["dynamic_split_fuse"] is False
    assert sizes["num_kv_blocks"] * BLOCK >= 8 * (2048 + 64 + BLOCK)
    assert scheduler_sizes(2, 4, 3)["max_num_batched_tokens"] == 256  # never below the default


@dataclass
class _Output:
    generated_ids: list[int]


@dataclass
class _Handle:
    """A request whose tokens come one a step from ``joins`` on."""

    joins: int
    made: list[int] = field(default_factory=list)
    unread: list[int] = field(default_factory=list)

    def can_read(self) -> bool:
        return bool(self.unread)

    def read(self) -> dict[int, Any]:
        out, self.unread = self.unread, []
        return {0: _Output(out)}


@dataclass
class _Pipe:
    handles: list[_Handle]
    tokens: int
    steps: int = 0

    def step(self) -> None:
        for h in self.handles:
            if self.steps >= h.joins and len(h.made) < self.tokens:
                h.made.append(100 + len(h.made))
                h.unread.append(h.made[-1])
        self.steps += 1

    def has_non_finished_requests(self) -> bool:
        return any(len(h.made) < self.tokens for h in self.handles)


def test_drain_times_the_steps_after_every_streams_first_token_and_reads_each_streams_tokens() -> None:
    """A second prompt that takes two steps (a split prompt): the first token's time runs until
    every stream has one; each later step is a decode step, one token per stream that is left."""
    handles = [_Handle(joins=0), _Handle(joins=1)]
    ticks = itertools.count()
    figures = drain(_Pipe(handles, tokens=3), handles, clock=lambda: float(next(ticks)))
    assert figures["tokens"] == [[100, 101, 102], [100, 101, 102]]
    assert figures["first"] == [4.0]  # started at 0; the second step ends at tick 4
    assert figures["times"] == [1.0, 1.0] and figures["elapsed"] == 9.0


def test_the_openvino_export_keeps_the_weights_fp32() -> None:
    """optimum-intel compresses a large model's weights unless told: the peer must run the very weights of the other exports."""
    from pathlib import Path

    from benchmarks.llama_exports import openvino_command

    command = openvino_command("py", Path("hf"), Path("out/openvino"))
    assert command[:5] == ["py", "-m", "optimum.commands.optimum_cli", "export", "openvino"]
    assert command[command.index("--weight-format") + 1] == "fp32" and command[-1] == "out/openvino"
