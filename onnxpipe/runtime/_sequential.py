"""Run a pipeline's stages one after another in this thread: the reference executor.

It is what ``verify`` uses to prove a split correct, and what the concurrent executor's results are
compared against. It follows the links of a :class:`PipelineSpec`, so skip edges and fan-out work as
the spec says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from onnxpipe._errors import InputError, OnnxpipeError, StageError, closest, ort_message
from onnxpipe.runtime._code import check_allowed, resolve_entry
from onnxpipe.runtime._session import make_session, run_options
from onnxpipe.runtime._spec import Endpoint, PipelineSpec, StageSpec
from onnxpipe.runtime._stage import CodeRunner, StagePlan
from onnxpipe.runtime.bundle import Bundle

__all__ = ["SequentialPipeline"]


class SequentialPipeline:
    """All stages of a spec as onnxruntime sessions, run in order for each call.

    Args:
        spec: A validated pipeline spec.
        base_dir: Folder that stage module paths are relative to, or a checked :class:`Bundle`
            (whose external data may stay in its archive).
        target: Run every stage on this target instead of its own (e.g. ``"cpu"``).
        allow_code: fnmatch patterns of the Python the stages may import (code stages' entry
            points, custom-op packages); see :func:`onnxpipe.runtime.load`.

    Raises:
        BundleError: a stage names Python ``allow_code`` does not allow (nothing is imported), or
            a session or entry point cannot be made.
    """

    def __init__(self, spec: PipelineSpec, base_dir: str | Path | Bundle, target: str | None = None, allow_code: Sequence[str] = ()) -> None:
        spec.validate()
        check_allowed(spec, allow_code)
        self.spec = spec
        self._sessions = {s.name: self._session(base_dir, s, target) for s in spec.stages}

    @staticmethod
    def _session(base_dir: str | Path | Bundle, stage: StageSpec, target: str | None) -> ort.InferenceSession | CodeRunner:
        if stage.is_code:
            return CodeRunner(StagePlan(stage, (), tuple(t.name for t in stage.outputs), ()), resolve_entry(stage))
        assert stage.module is not None
        if not isinstance(base_dir, Bundle):
            return make_session(Path(base_dir) / stage.module, stage, target)
        module, config = base_dir.session_source(stage)  # reads (and may rewrite) the module once
        return make_session(module, stage, target, config)

    def run(self, feeds: Mapping[str, Any], params: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, np.ndarray]:
        """Run one request through every stage.

        Args:
            feeds: One array per pipeline input, by name.
            params: Initializer values to use instead of the stored ones, per stage name.

        Returns:
            One array per pipeline output, by name, in the spec's output order.

        Raises:
            InputError: an input is missing or unknown.
            StageError: a stage's session failed.
        """
        values = self.run_all(feeds, params)
        return {t.name: values[self.spec.source_of(Endpoint(None, t.name))] for t in self.spec.outputs}

    def run_all(self, feeds: Mapping[str, Any], params: Mapping[str, Mapping[str, Any]] | None = None) -> dict[Endpoint, Any]:
        """Like :meth:`run`, but return every value: pipeline inputs and every stage output."""
        names = [t.name for t in self.spec.inputs]
        for name in feeds:
            if name not in names:
                raise InputError(f"unknown pipeline input '{name}'; {closest(name, names)}")
        missing = [n for n in names if n not in feeds]
        if missing:
            raise InputError(f"missing pipeline input(s): {', '.join(repr(n) for n in missing)}")
        values: dict[Endpoint, Any] = {Endpoint(None, n): feeds[n] for n in names}
        for stage in self.spec.stages:
            stage_feeds = {t.name: values[self.spec.source_of(Endpoint(stage.name, t.name))] for t in stage.inputs}
            if params and stage.name in params:
                stage_feeds.update(params[stage.name])
            runner = self._sessions[stage.name]
            try:
                if isinstance(runner, CodeRunner):
                    computed = runner.compute(stage_feeds)
                    results = [computed[t.name] for t in stage.outputs]
                else:
                    results = runner.run([t.name for t in stage.outputs], stage_feeds, run_options())  # its failure is the StageError below, said once
            except OnnxpipeError:
                raise
            except Exception as e:  # onnxruntime raises several unrelated types; a code stage any
                cause = ort_message(e)
                whole = None if cause == str(e) else f"stage '{stage.name}' failed: {e}"
                raise StageError(f"stage '{stage.name}' failed: {cause}", stage=stage.name, detail=whole) from e
            for t, value in zip(stage.outputs, results, strict=True):
                values[Endpoint(stage.name, t.name)] = value
        return values
