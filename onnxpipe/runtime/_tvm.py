"""TVM's pipeline executor protocol (``set_input`` / ``set_params`` / ``run`` / ``get_output``) as a
face of :class:`~onnxpipe.runtime.Pipeline`: inputs staged one by one, then submitted as one
request whose outputs come back in order. It keeps only what the protocol itself needs (the staged
inputs, the futures not collected yet); the requests are the pipeline's (``_requests.Dispatcher``).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import numpy as np

from onnxpipe._errors import InputError, closest
from onnxpipe.runtime._inputs import check_inputs
from onnxpipe.runtime._requests import Dispatcher
from onnxpipe.runtime._spec import Endpoint, ParamGroup
from onnxpipe.runtime.bundle import Bundle

__all__ = ["TVMProtocol"]

Outputs = dict[str, np.ndarray]


class TVMProtocol:
    """TVM's pipeline executor methods, for a class that has a ``bundle`` and hands its requests
    to a :class:`~onnxpipe.runtime._requests.Dispatcher` (``_dispatch``)."""

    bundle: Bundle
    _dispatch: Dispatcher

    def __init__(self) -> None:
        self._staged: dict[str, Any] = {}
        self._run_queue: collections.deque[Future[Outputs]] = collections.deque()

    @property
    def num_inputs(self) -> int:
        """How many global inputs a request has."""
        return len(self.bundle.spec.inputs)

    @property
    def num_outputs(self) -> int:
        """How many global outputs a request gives."""
        return len(self.bundle.spec.outputs)

    @property
    def num_executing_pipeline(self) -> int:
        """Requests submitted and not finished yet."""
        return self._dispatch.table.in_flight

    def get_input_pipeline_map(self, name: str) -> list[tuple[str, str]]:
        """The (stage, input) pairs a global input feeds.

        Raises:
            InputError: no such input.
        """
        spec = self.bundle.spec
        if name not in {t.name for t in spec.inputs}:
            raise InputError(f"unknown input '{name}'; {closest(name, (t.name for t in spec.inputs))}")
        return [(lk.dst.stage, lk.dst.tensor) for lk in spec.links if lk.src == Endpoint(None, name) and lk.dst.stage is not None]

    def get_params_group_pipeline_map(self, group: str) -> str:
        """The stage a parameter group belongs to.

        Raises:
            InputError: no such group.
        """
        return self._group(group).stage

    def set_input(self, name: str, value: Any) -> None:
        """Stage one input of the next :meth:`run`.

        Raises:
            InputError: no such input, or a value of the wrong dtype or shape.
        """
        spec = next((t for t in self.bundle.spec.inputs if t.name == name), None)
        if spec is None:
            raise InputError(f"unknown input '{name}'; {closest(name, (t.name for t in self.bundle.spec.inputs))}")
        self._staged[name] = check_inputs([spec], {name: value})[name]

    def _tvm_run(self) -> int:
        """TVM's ``run()``: submit the staged inputs as one request; its number (see ``Pipeline.run``)."""
        staged, self._staged = self._staged, {}
        rid, future = self._dispatch.submit(staged)
        self._run_queue.append(future)
        return rid

    def get_output(self, block: bool = True, timeout: float | None = None) -> Outputs | None:
        """The outputs of the oldest request submitted with :meth:`run` and not collected yet.

        Args:
            block: Wait for it; when false, return ``None`` if it is not finished.
            timeout: Wait at most this many seconds, then return ``None``.

        Returns:
            Its outputs by name, or ``None`` when nothing is ready (or nothing was run).

        Raises:
            StageError: that request failed; it is consumed, the next call moves on.
        """
        if not self._run_queue:
            return None
        future = self._run_queue[0]
        if not block and not future.done():
            return None
        try:
            result = future.result(timeout=timeout if block else 0)
        except TimeoutError:
            return None
        except BaseException:
            self._run_queue.popleft()
            raise
        self._run_queue.popleft()
        return result

    def set_params(self, group: str, values: Mapping[str, Any]) -> None:
        """Use new values for some of a parameter group's weights in every request submitted after
        this call; requests already submitted finish with the values they started with.

        Raises:
            InputError: unknown group or parameter, or a value of the wrong dtype or shape.
        """
        spec = self._group(group)
        names = {t.name for t in spec.params}
        for name in values:
            if name not in names:
                raise InputError(f"param group '{group}' has no parameter '{name}'; {closest(name, names)}")
        checked = check_inputs([t for t in spec.params if t.name in values], values, what="parameter")
        self._dispatch.use_params(spec.stage, checked)

    def _group(self, group: str) -> ParamGroup:
        spec = next((g for g in self.bundle.spec.param_groups if g.name == group), None)
        if spec is None:
            raise InputError(f"unknown param group '{group}'; {closest(group, (g.name for g in self.bundle.spec.param_groups))}")
        return spec
