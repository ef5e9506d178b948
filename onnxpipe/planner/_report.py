"""What the planner hands back: the plan chosen (for each N), everything considered, and its summary and table."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from onnxpipe._errors import SplitError
from onnxpipe.builder._modules import move_into_place
from onnxpipe.planner._candidates import PlanCandidate
from onnxpipe.planner._rules import LoadChoice, PlanChoice
from onnxpipe.splitter import SplitPlan

__all__ = ["LoadPlan", "PlanResult"]


@dataclass
class LoadPlan:
    """The plan chosen for N requests in flight.

    Attributes:
        concurrency: N.
        plan: Its split, the stages' settings set (threads, replicas, affinity, ``max_batch``, ``max_delay_ms``).
        chosen: The chosen candidate (its ``loads`` hold what every N measured).
        choice: Why it won at this N.
    """

    concurrency: int
    plan: SplitPlan
    chosen: PlanCandidate
    choice: LoadChoice


@dataclass
class PlanResult:
    """The chosen plan and everything considered.

    Attributes:
        plan: The split of the chosen plan, its stages' settings (threads, replicas, affinity) set;
            one stage when a single session or replicas won.
        chosen: The chosen candidate.
        candidates: Every candidate, best measured first, then by prediction.
        cores: The core budget.
        choice: Why the chosen plan won and how sure that is.
        notes: What the user should know.
        batching: Whether batching requests (``max_batch``) paid for the chosen plan, measured
            (see Note: batching), or why it was not considered; ``None`` when it was not asked for.
        loads: With ``concurrency``: the plan chosen for each N, in the order given (``plan``,
            ``chosen`` and ``choice`` are then the first one's; see Note: the served workload).
        p99_ms: The p99 bound the choice met, or ``None``.
    """

    plan: SplitPlan
    chosen: PlanCandidate
    candidates: list[PlanCandidate]
    cores: int
    choice: PlanChoice | LoadChoice
    notes: list[str] = field(default_factory=list)
    batching: str | None = None
    loads: list[LoadPlan] = field(default_factory=list)
    p99_ms: float | None = None

    def baselines(self) -> dict[str, float]:
        """Measured throughput of the best one-session plan and the best replicas plan (of those
        that took part in the choice: a plan a memory budget dropped does not)."""
        best: dict[str, float] = {}
        for c in self.candidates:
            if c.kind != "pipeline" and c.measured is not None and c.rounds:
                best[c.kind] = max(best.get(c.kind, 0.0), c.measured)
        return best

    def load_table(self) -> tuple[list[str], list[list[str]]]:
        """With ``concurrency``: the header and one row per finalist, its req/s, p50 and p99 at each N
        (medians, the rounds' min-max in brackets) and the Ns it was chosen at."""
        header = ["plan"]
        for lp in self.loads:
            header += [f"N={lp.concurrency} req/s", "p50 ms", "p99 ms"]
        rows = []
        for c in self.candidates:
            if not c.loads:
                continue
            row = [c.label]
            for lp in self.loads:
                m = c.loads.get(lp.concurrency)
                if m is None:
                    row += ["-", "-", "-"]
                    continue
                row += [f"{m.throughput:.1f} ({min(m.rounds):.1f}-{max(m.rounds):.1f})", _ms(m.p50_ms),
                        f"{_ms(m.p99_ms)} ({_ms(min(m.p99_rounds))}-{_ms(max(m.p99_rounds))})"]
            rows.append([*row, ", ".join(f"N={lp.concurrency}" for lp in self.loads if lp.chosen is c)])
        return [*header, "chosen at"], rows

    def load_summary(self) -> dict[str, object]:
        """With ``concurrency``: a JSON-ready summary, every finalist's figures at each N and the choice at each N."""
        finalists = [
            {"plan": c.label, "kind": c.kind, "threads": list(c.threads), "replicas": list(c.replicas), "targets": list(c.targets),
             "max_batch": c.max_batch, "max_delay_ms": c.max_delay_ms, "spinning": c.spinning, "memory_bytes": c.memory_bytes,
             "loads": {str(n): m.to_dict() for n, m in c.loads.items()}}
            for c in self.candidates if c.loads
        ]
        chosen = {str(lp.concurrency): {"plan": lp.chosen.label, "why": str(lp.choice), "stages": len(lp.plan.stages)} for lp in self.loads}
        first = self.loads[0].choice if self.loads else None
        return {"cores": self.cores, "concurrency": [lp.concurrency for lp in self.loads], "p99_ms": self.p99_ms,
                "rounds": first.rounds if first else 0, "requests": first.requests if first else 0, "finalists": finalists,
                "chosen": chosen, "notes": list(self.notes)}

    def save(self, directory: str | os.PathLike[str], overwrite: bool = False) -> Path:
        """Write the chosen plan with its settings to ``directory`` (:meth:`SplitPlan.save`); with
        several N, each N's plan to ``directory/concurrency-N/`` (see :meth:`folders`) and
        :meth:`load_summary` to ``directory/summary.json``, the whole folder written or not at all.

        Raises:
            SplitError: the folder exists, is not empty, and ``overwrite`` is false.
        """
        if len(self.loads) < 2:
            return self.plan.save(directory, overwrite=overwrite)
        directory = Path(directory)
        if directory.exists() and (not directory.is_dir() or (any(directory.iterdir()) and not overwrite)):
            raise SplitError(f"output folder '{directory}' " + ("is a file; choose another name" if not directory.is_dir() else
                                                                "exists and is not empty; choose another or overwrite it"))
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        try:
            for lp, folder in zip(self.loads, self.folders(staging).values(), strict=True):
                lp.plan.save(folder)
            (staging / "summary.json").write_text(json.dumps(self.load_summary(), indent=2) + "\n")
            move_into_place(staging, directory)
        finally:
            if staging.exists():
                shutil.rmtree(staging)
        return directory

    def folders(self, directory: str | os.PathLike[str]) -> dict[int, Path]:
        """Where :meth:`save` writes each N's plan: ``directory`` itself for one N (or none), else ``directory/concurrency-N``."""
        directory = Path(directory)
        if len(self.loads) < 2:
            return {lp.concurrency: directory for lp in self.loads}
        return {lp.concurrency: directory / f"concurrency-{lp.concurrency}" for lp in self.loads}

    def __str__(self) -> str:
        if self.loads:
            return self._loads_str()
        lines = [f"plan for {self.cores} core(s): {self.chosen.label}, {self.chosen.measured or 0:.1f} req/s measured", f"  {self.choice}"]
        lines += [f"    {reason}" for reason in (self.choice.reasons() if isinstance(self.choice, PlanChoice) else ())]
        for kind, value in self.baselines().items():
            if value:
                lines.append(f"  vs best {kind}: {value:.1f} req/s ({(self.chosen.measured or 0) / value:.2f}x)")
        for c in self.candidates:
            measured = f"{c.measured:8.1f}" if c.measured is not None else "       -"
            spread = f" ({min(c.rounds):.1f}-{max(c.rounds):.1f})" if c.rounds else ""
            lines.append(f"  {c.label:<32} predicted {c.predicted:8.1f}  measured {measured} req/s{spread}")
        if self.batching:
            lines.append(f"  batching: {self.batching}")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])

    def _loads_str(self) -> str:
        first = self.loads[0].choice
        chosen = ", ".join(f"N={lp.concurrency}: {lp.chosen.label}" for lp in self.loads)
        lines = [f"plans for {self.cores} core(s) under N requests in flight (closed loop): {chosen}",
                 f"  median of {first.rounds} round(s) of {first.requests} requests at each N, the rounds' min-max in brackets"]
        header, rows = self.load_table()
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            cells = (cell.ljust(w) if i in (0, len(row) - 1) else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
            lines.append(("  " + "  ".join(cells)).rstrip())
        lines += [f"  {lp.choice}" for lp in self.loads]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _ms(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:.0f}"


