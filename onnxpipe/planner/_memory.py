"""What a plan's pipeline takes in memory, measured in a process of its own (see Note: memory).

``python -m onnxpipe.planner._memory BUNDLE DIMS_JSON WARMUP`` loads the bundle in a fresh
interpreter that has imported only the runtime, runs ``WARMUP`` requests of random inputs (sized by
the JSON dims), and prints the physical memory it added (``resident_bytes`` after, less before
loading). A fresh process, because in the planner's own one memory that earlier sessions freed is
handed out again without the process growing: loaded there, a plan measured 0.1 MiB.

Note: memory.
    On one host, replicas of the whole model often match a pipeline's throughput, but hold the
    weights once per replica, where a pipeline of k stages holds them once and still uses k
    cores. With ``memory`` (``split --auto --cores C --memory 1.5GiB``), each finalist's memory is
    **measured**, not estimated from its weights: its bundle loaded in a process of its own
    (``_memory.plan_memory``), the proportional set size (``runtime._stats.resident_bytes``: weights
    mapped in place count once) before loading and after loading and warming up (sessions,
    prepacked weights, arenas after the first runs). A process of its own, since in the planner's
    memory that earlier sessions freed is handed out again without the process growing.
    Finalists over the budget leave the choice, and the notes list them with what they measured;
    the one-session plan at one thread is always a finalist then, as the leanest simple plan. No
    plan fitting is a :class:`SplitError` listing every finalist's memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from onnxpipe._errors import SplitError

__all__ = ["plan_memory"]


def plan_memory(bundle: str | os.PathLike[str], dims: Mapping[str, int], warmup: int = 5, timeout: float = 600.0) -> int:
    """Bytes the bundle's pipeline takes once loaded and warmed up, measured in a child process.

    Raises:
        SplitError: the child could not load or run it, or this OS cannot measure memory.
    """
    args = [sys.executable, "-m", "onnxpipe.planner._memory", str(bundle), json.dumps(dict(dims)), str(warmup)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    last = done.stdout.strip().splitlines()[-1:] if done.stdout else []
    if done.returncode != 0 or not last or not last[0].isdigit():
        raise SplitError(f"measuring the memory of plan '{Path(bundle).name}' failed: {(done.stderr or done.stdout).strip().splitlines()[-1:] or 'no output'}")
    return int(last[0])


def _main(bundle: str, dims: str, warmup: int) -> int:
    from onnxpipe.runtime import load, random_inputs, spec_values
    from onnxpipe.runtime._stats import resident_bytes

    before = resident_bytes()
    if before is None:
        print("this OS has no /proc to read memory from", file=sys.stderr)
        return 1
    with load(bundle) as pipe:
        feeds, _ = random_inputs(pipe.spec.inputs, json.loads(dims), values=spec_values(pipe.spec))
        for _ in range(warmup):
            pipe(feeds)
        after = resident_bytes()
    print(max(0, (after or before) - before))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
