"""Shared test set-up. Tiny models live in tests/models.py; real ones in the onnx wheel."""

from __future__ import annotations

import onnxruntime as ort

# The onnx light models carry unused initializers; onnxruntime warns about each one.
ort.set_default_logger_severity(3)
