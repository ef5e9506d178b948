"""Hostile archives: what loading writes to disk before it refuses a ~1 MiB archive that inflates to GiBs.

Exports a one-stage bundle, then zips it with one extra or swapped member of N GiB of zeros
(deflated about 1029:1), and loads each archive, reporting the bytes in the loader's temporary
folder when it gave up (measured as the folder is removed), the time taken and the message:

    python -m benchmarks.hostile_archive [--gib 1]

Goal (issue 11): nothing but the manifest is written before the archive is refused.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from onnxpipe import BundleError
from onnxpipe.builder import PipelineConfig, build, export
from onnxpipe.runtime import Limits, load


def _bundle(root: Path) -> Path:
    x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 4]) for n in ("x", "y"))
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
    config = PipelineConfig("relu")
    stage = config.add_stage(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), "relu")
    config.input("x").connect(stage.input("x"))
    stage.output("y").connect(config.output("y"))
    return export(build(config, root / "built").path, root / "bundle", reference_inputs=[{"x": np.ones((2, 4), np.float32)}])


def _archive(bundle: Path, out: Path, member: str, gib: float) -> Path:
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for p in sorted(bundle.rglob("*")):
            if p.is_file() and p.relative_to(bundle).as_posix() != member:
                zf.write(p, p.relative_to(bundle).as_posix())
        with zf.open(member, "w", force_zip64=True) as f:
            chunk = bytes(1 << 20)
            for _ in range(int(gib * 1024)):
                f.write(chunk)
    return out


def _attempt(archive: Path, limits: Limits) -> str:
    written: list[int] = []
    real = shutil.rmtree

    def measure(path: Any, *args: Any, **kwargs: Any) -> None:
        written.append(sum(q.stat().st_size for q in Path(path).rglob("*") if q.is_file()))
        real(path, *args, **kwargs)

    shutil.rmtree = measure  # type: ignore[assignment]
    start = time.perf_counter()
    try:
        load(archive, limits=limits).close()
        outcome = "loaded"
    except BundleError as e:
        outcome = str(e)
    finally:
        shutil.rmtree = real
    return f"{time.perf_counter() - start:.2f} s, {written[-1] if written else 0} bytes written: {outcome}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of zeros in the hostile member")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hostile-archive-"))
    try:
        bundle = _bundle(root)
        trusting = Limits(max_compression_ratio=1e9)
        cases = [
            ("unlisted member, default limits", "stages/zeros.bin", Limits()),
            ("unlisted member, ratio limit off", "stages/zeros.bin", trusting),
            ("module larger than the manifest says, ratio limit off", "stages/relu.onnx", trusting),
        ]
        for label, member, limits in cases:
            archive = _archive(bundle, root / "hostile.onnxpipe", member, args.gib)
            print(f"{label} ({archive.stat().st_size} byte archive): {_attempt(archive, limits)}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
