"""What is live between nodes: the tensors (and bytes) a cut at each position of an order would cross.

Both ``inspect`` (cut candidates) and the automatic splitter (crossing costs) sweep an order of
compute nodes once with a difference array: a tensor made at position i and last read at j > i
crosses every cut after positions i .. j-1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from onnx import ValueInfoProto

from onnxpipe._errors import ConfigError
from onnxpipe.builder import tensor_spec
from onnxpipe.runtime import TensorSpec
from onnxpipe.runtime._dims import dim_notes
from onnxpipe.splitter._graph import GraphIndex

__all__ = ["LiveSweep", "Sizer", "live_sweep"]


class Sizer:
    """Bytes of tensors by name; remembers which dims it had to guess."""

    def __init__(self, types: dict[str, ValueInfoProto], dims: dict[str, int], inputs: Sequence[TensorSpec] = ()) -> None:
        self.types, self.dims, self.inputs = types, dims, inputs
        self.defaulted: set[str] = set()
        self.unknown_dims = False
        self.unsized: list[str] = []

    def spec(self, name: str) -> TensorSpec | None:
        """The tensor's spec, or ``None`` when it is no typed tensor (it cannot cross a boundary)."""
        v = self.types.get(name)
        if v is None:
            return None
        try:
            return tensor_spec(v)
        except (ConfigError, ValueError):
            return None

    def size(self, name: str) -> int | None:
        spec = self.spec(name)
        if spec is None:
            return None
        if spec.shape is None:
            self.unsized.append(name)
            return 0
        for d in spec.shape:
            if isinstance(d, str) and d not in self.dims:
                self.defaulted.add(d)
            elif d is None:
                self.unknown_dims = True
        return spec.nbytes(self.dims, default=1)

    def notes(self) -> list[str]:
        out = dim_notes(self.defaulted, self.dims, self.inputs)
        if self.unknown_dims:
            out.append("some tensors have dims shape inference could not tell; counted as 1")
        if self.unsized:
            out.append(f"{len(self.unsized)} tensor(s) of unknown rank counted as 0 bytes, e.g. '{self.unsized[0]}'")
        return out


@dataclass(frozen=True)
class LiveSweep:
    """The result of :func:`live_sweep` over an order of ``n`` compute nodes.

    Attributes:
        crossing: ``crossing[p]`` bytes cross a cut placed before position ``p`` (``0 < p < n``).
        blocked: ``blocked[p]`` tensors that cannot cross a boundary (no tensor type) would cross it.
        live: For each tensor a later node reads: (position made, position last read).
    """

    crossing: list[int]
    blocked: list[int]
    live: dict[str, tuple[int, int]]


def live_sweep(index: GraphIndex, order: Sequence[int], sizer: Sizer) -> LiveSweep:
    """Sweep ``order`` (compute nodes in a topological order) once."""
    n = len(order)
    pos = {node: p for p, node in enumerate(order)}
    live: dict[str, tuple[int, int]] = {}
    for j, node in enumerate(order):
        for name in index.node_inputs[node]:
            p = index.producer.get(name)
            if p is not None and p in pos and pos[p] < j:
                live[name] = (pos[p], j)
    diff = [0] * (n + 1)
    blocked_diff = [0] * (n + 1)
    for name, (i, j) in live.items():
        size = sizer.size(name)
        if size is None:
            blocked_diff[i + 1] += 1
            blocked_diff[j + 1] -= 1
        else:
            diff[i + 1] += size
            diff[j + 1] -= size
    crossing = [0] * (n + 1)
    blocked = [0] * (n + 1)
    for p in range(1, n + 1):
        crossing[p] = crossing[p - 1] + diff[p]
        blocked[p] = blocked[p - 1] + blocked_diff[p]
    return LiveSweep(crossing, blocked, live)
