"""Build bundles for OpenVINO on a host without it (a cross-target build): run with plain
onnxruntime's Python, ``python -m tests.targets.cross_build OUT``; the OpenVINO tests load them.

- ``OUT/openvino-cpu``: PP-OCR's recognizer in 2 stages, stage 0 on ``openvino``, stage 1 on ``cpu``.
- ``OUT/onehot-no-fallback``: the recognizer with a Hardmax after it, in 2 stages, stage 1 (with the Hardmax OpenVINO
  cannot take) on ``openvino`` with ``fallback=off``: a build here cannot see that; the host must.
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnxruntime as ort

from onnxpipe.builder import build, export
from tests.targets.models import recognizer, recognizer_onehot, split_on


def main(out: Path) -> None:
    if "OpenVINOExecutionProvider" in ort.get_available_providers():
        raise SystemExit("this onnxruntime has OpenVINO: a cross-target build needs one without it")
    for name, plan in (("openvino-cpu", split_on(recognizer(), ["openvino", "cpu"])),
                       ("onehot-no-fallback", split_on(recognizer_onehot(), ["cpu", "openvino"], fallback=False))):
        result = build(plan.config, out / f"{name}-built", overwrite=True)
        export(result.path, out / name, overwrite=True)
        print(f"{name}: {result.report[0].optimization} | {result.report[1].optimization}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
