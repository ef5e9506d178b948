"""A code-stage module that must never be imported by a refused bundle (tests check sys.modules)."""

from __future__ import annotations

from typing import Any

import numpy as np


def combine(inputs: dict[str, np.ndarray], params: dict[str, Any]) -> dict[str, np.ndarray]:
    """Same as ``tests.code_stages.combine``."""
    return {"y": inputs["h"] * np.float32(params.get("factor", 1.0)) + inputs["g"]}
