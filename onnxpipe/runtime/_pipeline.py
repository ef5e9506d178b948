"""load(): a bundle on the deployment host, checked and ready to run."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnxpipe._errors import InputError, closest
from onnxpipe.runtime._bundle import Bundle, Limits, read_bundle
from onnxpipe.runtime._inputs import check_inputs
from onnxpipe.runtime._sequential import SequentialPipeline
from onnxpipe.runtime._spec import PipelineSpec

__all__ = ["Pipeline", "ReferenceCheck", "load"]


@dataclass(frozen=True)
class ReferenceCheck:
    """One output of one reference sample, compared (see :meth:`Pipeline.check`)."""

    sample: int
    output: str
    max_abs: float
    ok: bool


class Pipeline:
    """A loaded bundle with one onnxruntime session per stage.

    Args:
        bundle: A checked bundle (see :func:`read_bundle`).
        target: Run every stage on this target instead of its own (e.g. ``"cpu"``).
    """

    def __init__(self, bundle: Bundle, target: str | None = None) -> None:
        self.bundle = bundle
        self._runner = SequentialPipeline(bundle.spec, bundle.root, target)
        # Replaced, never mutated: a request takes the mapping current when it starts.
        self._params: dict[str, dict[str, np.ndarray]] = {}

    @property
    def spec(self) -> PipelineSpec:
        """The pipeline's wiring and settings."""
        return self.bundle.spec

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Run one request and return its outputs by name.

        Raises:
            InputError: an input is unknown, missing, or of the wrong dtype or shape.
            StageError: a stage failed on this request.
        """
        return self._runner.run(check_inputs(self.spec.inputs, inputs), self._params)

    def set_params(self, group: str, values: Mapping[str, Any]) -> None:
        """Use new values for some of a parameter group's weights in every later request.

        Raises:
            InputError: unknown group or parameter, or a value of the wrong dtype or shape.
        """
        spec = next((g for g in self.spec.param_groups if g.name == group), None)
        if spec is None:
            raise InputError(f"unknown param group '{group}'; {closest(group, (g.name for g in self.spec.param_groups))}")
        names = {t.name for t in spec.params}
        for name in values:
            if name not in names:
                raise InputError(f"param group '{group}' has no parameter '{name}'; {closest(name, names)}")
        checked = check_inputs([t for t in spec.params if t.name in values], values, what="parameter")
        stage = dict(self._params.get(spec.stage, {}))
        stage.update(checked)
        self._params = {**self._params, spec.stage: stage}

    def check(self, rtol: float = 1e-4, atol: float = 1e-5) -> list[ReferenceCheck]:
        """Run the bundle's reference inputs and compare with its reference outputs.

        Values match when ``|got - want| <= atol + rtol * |want|`` everywhere (NaN equals NaN).
        """
        rows = []
        for i, (inputs, expected) in enumerate(self.bundle.reference()):
            got = self(inputs)
            for name, want in expected.items():
                value = got.get(name)
                if value is None or value.shape != want.shape or value.dtype != want.dtype:
                    rows.append(ReferenceCheck(i, name, float("inf"), False))
                    continue
                diff = float(np.nanmax(np.abs(value.astype(np.float64) - want.astype(np.float64)))) if want.size else 0.0
                rows.append(ReferenceCheck(i, name, diff, bool(np.allclose(value, want, rtol=rtol, atol=atol, equal_nan=True))))
        return rows

    def close(self) -> None:
        """Release the sessions and the bundle's temporary files."""
        self._runner = None  # type: ignore[assignment]
        self.bundle.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Pipeline(stages={[s.name for s in self.spec.stages]}, inputs={[t.name for t in self.spec.inputs]})"


def load(path: str | os.PathLike[str], *, target: str | None = None, limits: Limits | None = None) -> Pipeline:
    """Load a bundle (folder or ``.onnxpipe`` archive) with only numpy and onnxruntime.

    Every file is checked (see ``read_bundle``) before any session is created.

    Args:
        path: The bundle.
        target: Run every stage on this target instead of its own (e.g. ``"cpu"``).
        limits: Size and count limits for the bundle.

    Raises:
        BundleError: the bundle is missing, broken or refused as unsafe, or a stage's provider is
            not available here.
    """
    bundle = read_bundle(path, limits)
    try:
        return Pipeline(bundle, target)
    except BaseException:
        bundle.close()
        raise
