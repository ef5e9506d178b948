"""Big bundles: peak memory and disk writes of every step, as multiples of the bundle's weights.

Builds a chain of MatMul + Add with float32 weights of N GiB in all (each weight generated and
written to external data on its own, so the script never holds more than one), splits it into 2
stages in the middle, builds them, and exports a single-file bundle and a folder bundle. Then each
command runs in a fresh process that reports its peak resident memory (``VmHWM``) and what it wrote
(``wchar``: bytes handed to write(), ``write_bytes``: bytes sent to storage, from /proc/self/io):

    python -m benchmarks.big_bundle --gib 2.25 [--work DIR] [--keep]

Goals (issue 10): ``bench`` below 1.2 x the weights (no stage ever has two sessions); loading an
archive writes at most one copy of the weights, ideally none.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

_PAGE = 4096


def _model(folder: Path, gib: float, width: int) -> tuple[Path, str, int]:
    """A chain of ``MatMul(w_k) + b_k`` layers of about ``gib`` GiB; returns the file, the tensor to
    cut after (the middle layer's output) and the weights' bytes."""
    import onnx
    from onnx import TensorProto, helper

    layer = width * width * 4
    layers = max(2, round(gib * 2**30 / layer))
    path = folder / "big.onnx"
    nodes, inits, x = [], [], "x"
    with open(folder / "big.onnx.data", "wb") as data:
        for k in range(layers):
            rng = np.random.default_rng(k)
            w = rng.standard_normal((width, width), dtype=np.float32)
            w *= np.float32(1 / math.sqrt(width))
            data.write(b"\0" * (-data.tell() % _PAGE))
            offset = data.tell()
            data.write(w.tobytes())
            del w
            t = TensorProto(name=f"w{k}", data_type=TensorProto.FLOAT, dims=[width, width], data_location=TensorProto.EXTERNAL)
            for key, value in (("location", "big.onnx.data"), ("offset", str(offset)), ("length", str(layer))):
                t.external_data.add(key=key, value=value)
            inits += [t, onnx.numpy_helper.from_array(np.zeros(width, np.float32), f"b{k}")]
            nodes += [helper.make_node("MatMul", [x, f"w{k}"], [f"m{k}"]), helper.make_node("Add", [f"m{k}", f"b{k}"], [f"y{k}"])]
            x = f"y{k}"
    graph = helper.make_graph(
        nodes,
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, width])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path, f"y{layers // 2 - 1}", layers * (layer + width * 4)


def _child(args: list[str]) -> None:
    """Run one onnxpipe command in this (fresh) process, then print its peak memory and writes."""
    from onnxpipe.cli import main

    try:
        main.main(args, standalone_mode=False)
    finally:
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        usage = {"hwm": int(status["VmHWM"].split()[0]) * 1024, "wchar": int(io["wchar"]), "write_bytes": int(io["write_bytes"])}
        print("BIG_BUNDLE " + json.dumps(usage), file=sys.stderr)


def _measure(args: list[str]) -> dict[str, int]:
    done = subprocess.run([sys.executable, "-m", "benchmarks.big_bundle", "--child", *args], capture_output=True, text=True, check=False)
    line = next((x for x in done.stderr.splitlines() if x.startswith("BIG_BUNDLE ")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"onnxpipe {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(line.removeprefix("BIG_BUNDLE ")))


def run(gib: float, work: Path, width: int) -> dict[str, Any]:
    model, cut, weights = _model(work, gib, width)
    np.savez(work / "x.npz", x=np.ones((1, width), np.float32))
    steps = {
        "split": ["split", str(model), "-o", str(work / "split"), "--at", cut],
        "build": ["build", str(work / "split"), "-o", str(work / "built")],
        "export archive": ["export", str(work / "built"), "-o", str(work / "big.onnxpipe")],
        "export folder": ["export", str(work / "built"), "-o", str(work / "bundle")],
        "run archive": ["run", str(work / "big.onnxpipe"), "--inputs", str(work / "x.npz"), "--outputs", str(work / "y.npz")],
        "run folder": ["run", str(work / "bundle"), "--inputs", str(work / "x.npz"), "--outputs", str(work / "y2.npz")],
        "bench archive": ["bench", str(work / "big.onnxpipe"), "--requests", "10", "--warmup", "2", "--standalone-runs", "3"],
        "bench folder": ["bench", str(work / "bundle"), "--requests", "10", "--warmup", "2", "--standalone-runs", "3"],
    }
    rows = {}
    for name, args in steps.items():
        usage = _measure(args)
        rows[name] = {**usage, "hwm_x": usage["hwm"] / weights, "wchar_x": usage["wchar"] / weights}
        print(
            f"{name:15s} peak RSS {usage['hwm'] / 2**30:6.2f} GiB = {rows[name]['hwm_x']:.2f} x weights; "
            f"written {usage['wchar'] / 2**30:6.2f} GiB = {rows[name]['wchar_x']:.2f} x (to storage {usage['write_bytes'] / 2**30:.2f} GiB)",
            flush=True,
        )
    goals = {
        "bench <= 1.2 x weights": all(rows[k]["hwm_x"] <= 1.2 for k in ("bench archive", "bench folder")),
        "archive load writes <= 1 copy": rows["run archive"]["wchar_x"] <= 1.0,
        "archive load writes no copy (< 0.01 x)": rows["run archive"]["wchar_x"] < 0.01,
    }
    for goal, ok in goals.items():
        print(f"{'ok  ' if ok else 'MISS'} {goal}")
    return {"gib": gib, "weights_bytes": weights, "width": width, "steps": rows, "goals": goals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=0.5, help="Weights of the generated model, in GiB.")
    parser.add_argument("--width", type=int, default=8192, help="Each weight is width x width float32 (8192: 256 MiB).")
    parser.add_argument("--work", type=Path, help="Folder to work in (default: a temporary one, removed after).")
    parser.add_argument("--json", type=Path, help="Also write the results here.")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args.child)
        return
    with tempfile.TemporaryDirectory(prefix="big-bundle-", dir=args.work) as tmp:
        result = run(args.gib, Path(tmp), args.width)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
