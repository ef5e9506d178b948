"""Stage hand-offs as ``OrtValue``: a stage on a device leaves what the next stage on it reads there.

Note: hand-offs as OrtValues.
    A stage whose provider keeps its tensors in device memory (CUDA, TensorRT, ROCm, MIGraphX,
    DirectML, CANN, WebGPU: :data:`DEVICE_TYPES`) runs its session call through a
    :class:`Handoff`: the call's inputs are bound with IOBinding (an ``OrtValue`` as it is, a numpy
    array in place), and each output is bound either on the stage's device or in host memory. An
    output goes on the device, and into the request's bag as an ``OrtValue``, when every stage
    that reads it is an ONNX stage on the same kind of device that does not batch
    (:func:`handoff_for`); so a CUDA -> CUDA hop on one device never touches the host. A hop to
    another device of the same kind binds the ``OrtValue`` as the next session's input, and
    onnxruntime copies it device to device when it is bound (``IOBinding::BindInput`` copies an
    input across devices with the session's data transfer: for CUDA a ``cudaMemcpy`` device to
    device). Everything else is bound in host memory and goes on as numpy: the pipeline's outputs
    (the caller's), what a code stage or a batching stage reads (slicing and stacking rows is
    numpy's), a stage's state (it stays in its runner: issue 38's first part), and, on the Ray
    engine, whatever crosses the object store (:func:`host` where an actor returns its values).
    The exit turns any ``OrtValue`` still in the bag into numpy (:func:`host`), so a caller never
    sees one (``run_with_ort_values`` and ``io_binding()`` of the drop-in give them back as
    ``OrtValue`` again).

Note: bytes across the edge.
    Each :class:`Handoff` counts what it binds across its session's edge (:class:`Transfers`,
    summed over a process by :func:`transfers`): host arrays bound as inputs of a session on a
    device (onnxruntime copies them host -> device, unless only nodes it placed on the CPU read
    them), outputs bound in host memory (device -> host), and ``OrtValue`` inputs on another kind
    of device. Copies inside a session (``MemcpyToHost`` / ``MemcpyFromHost`` nodes around nodes
    that fell back to the CPU) are not at its edge: onnxruntime's profile lists them with their
    sizes, and ``benchmarks/gpu_check.py`` reads both. onnxruntime's Python cannot tell an
    ``OrtValue``'s device number, so a hop between two devices of one kind is not counted here
    (onnxruntime copies it device to device when it is bound, ``IOBinding::BindInput`` ->
    ``CopyOneInputAcrossDevices``; the check times the stage call that reads it).

Note: why a CPU stage keeps numpy.
    On the CPU there is nothing to save: ``session.run`` reads a contiguous numpy input in place
    and returns numpy arrays over the buffers onnxruntime allocated (they do not own their memory:
    no copy), and a CPU ``OrtValue``'s ``numpy()`` is a view. Measured on a 100 MB float32 tensor
    through a ``Relu`` (1 thread, medians of 5; ``python -m benchmarks.gpu_check`` prints it on any
    host): a numpy copy of it 10.4 ms, ``session.run`` 7.3 ms, the same fed a strided view, which
    onnxruntime must copy first, 24.2 ms, the call through IOBinding (a :class:`Handoff` on device
    ``cpu``) 6.5 ms, ``ortvalue_from_numpy`` and ``numpy()`` under 0.01 ms. A CPU stage therefore
    keeps ``session.run`` and numpy, the path with the least Python per call; :data:`DEVICE_TYPES`
    is the one place that says which providers hand on ``OrtValue`` (a test adds the CPU provider
    to it to run the ``OrtValue`` path for real).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

from onnxpipe.runtime._spec import Endpoint, PipelineSpec, StageSpec

__all__ = ["DEVICE_TYPES", "Device", "Handoff", "Transfers", "handoff_for", "host", "session_device", "transfers"]

#: Provider -> the ``OrtDevice`` type its outputs live on (onnxruntime's ``bind_output`` names).
#: A provider not here (CPU, OpenVINO, QNN, CoreML, DNNL, ...) gives its outputs in host memory.
DEVICE_TYPES: dict[str, str] = {
    "CUDAExecutionProvider": "cuda",
    "TensorrtExecutionProvider": "cuda",
    "NvTensorRTRTXExecutionProvider": "cuda",
    "ROCMExecutionProvider": "gpu",
    "MIGraphXExecutionProvider": "gpu",
    "DmlExecutionProvider": "dml",
    "CANNExecutionProvider": "cann",
    "WebGpuExecutionProvider": "webgpu",
}


@dataclass(frozen=True)
class Device:
    """Where an ``OrtValue`` lives: an ``OrtDevice`` type (``"cuda"``, ``"cpu"``, ...) and its number."""

    type: str
    id: int = 0

    def __str__(self) -> str:
        return f"{self.type}:{self.id}"


@dataclass
class Transfers:
    """Bytes that crossed between host and device memory at a session's edge, as bound (Note:
    bytes across the edge): ``to_device``, host arrays bound as a device session's inputs;
    ``to_host``, a device session's outputs bound in host memory; ``across``, ``OrtValue`` inputs
    on another device than the session's (copied device to device); ``calls``, session calls."""

    to_device: int = 0
    to_host: int = 0
    across: int = 0
    calls: int = 0

    def __add__(self, other: Transfers) -> Transfers:
        return Transfers(self.to_device + other.to_device, self.to_host + other.to_host, self.across + other.across, self.calls + other.calls)


#: Every hand-off alive in this process, for :func:`transfers` (the lock: runners are made on several threads).
_LIVE: weakref.WeakSet[Handoff] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def transfers() -> Transfers:
    """The bytes every hand-off alive in this process moved across a session's edge, summed (a
    diagnostic: ``benchmarks/gpu_check.py`` reads it before and after a hop or a decode step)."""
    total = Transfers()
    with _LIVE_LOCK:
        live = list(_LIVE)
    for handoff in live:
        total = total + handoff.moved
    return total


def session_device(session: ort.InferenceSession) -> Device | None:
    """The device a session's first provider keeps its tensors on, or ``None`` for host memory."""
    provider = session.get_providers()[0]
    kind = DEVICE_TYPES.get(provider)
    if kind is None:
        return None
    given = session.get_provider_options().get(provider, {}).get("device_id") or 0
    return Device(kind, int(given))


def host(value: Any) -> Any:
    """``value`` as numpy where it is an ``OrtValue`` (a view for one in host memory, a copy to the
    host for one on a device); anything else as it is."""
    return value.numpy() if isinstance(value, ort.OrtValue) else value


class Handoff:
    """One session call through IOBinding: inputs numpy or ``OrtValue``, each output bound on a
    given device (an ``OrtValue`` comes back) or in host memory (numpy comes back).

    A new binding per call: onnxruntime writes a run's outputs into those a binding already holds
    when the shapes match, so outputs handed on earlier would change under their reader.

    Args:
        session: The stage's session.
        outputs: The outputs to fetch, in the order the call returns them.
        devices: For each output, the device to leave it on (``None``: host memory, as numpy).
        run_options: The stage's run options.
        device: The session's device (default: the first of ``devices`` given; else ``cpu``).
    """

    def __init__(self, session: ort.InferenceSession, outputs: Sequence[str], devices: Sequence[Device | None],
                 run_options: ort.RunOptions | None = None, device: Device | None = None) -> None:
        if len(outputs) != len(devices):
            raise ValueError(f"{len(outputs)} outputs but {len(devices)} devices")
        self.session = session
        self.outputs = tuple(outputs)
        self.devices = tuple(devices)
        self.run_options = run_options
        self._bound = tuple((name, d or Device("cpu")) for name, d in zip(outputs, devices, strict=True))
        self._host = tuple(d is None for d in devices)
        self._inputs = frozenset(i.name for i in session.get_inputs())
        #: The session's own device (given, or where its outputs handed on are); ``cpu`` counts nothing.
        self.device = device or next((d for d in devices if d is not None), Device("cpu"))
        #: What this hand-off's calls moved across the session's edge (Note: bytes across the edge).
        self.moved = Transfers()
        with _LIVE_LOCK:
            _LIVE.add(self)

    def __call__(self, feeds: Mapping[str, Any]) -> list[Any]:
        """Run once: the outputs in ``outputs`` order, an ``OrtValue`` where a device was given, numpy where not.

        A call that feeds an initializer (a parameter override: IOBinding binds graph inputs only)
        runs through ``session.run``, its outputs all numpy.
        """
        if not self._inputs.issuperset(feeds):
            return self._run_plain(feeds)
        binding = self.session.io_binding()
        for name, value in feeds.items():
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            else:
                binding.bind_cpu_input(name, value)
        for name, device in self._bound:
            binding.bind_output(name, device.type, device.id)
        self.session.run_with_iobinding(binding, self.run_options)
        values = binding.get_outputs()
        self.moved.calls += 1
        if self.device.type != "cpu":
            self._count(feeds, values)
        return [v.numpy() if on_host else v for v, on_host in zip(values, self._host, strict=True)]

    def _run_plain(self, feeds: Mapping[str, Any]) -> list[Any]:
        results: list[Any] = self.session.run(self.outputs, dict(feeds), self.run_options)
        self.moved.calls += 1
        if self.device.type != "cpu":
            self.moved.to_device += sum(getattr(v, "nbytes", 0) for v in feeds.values() if not isinstance(v, ort.OrtValue))
            self.moved.to_host += sum(r.nbytes for r in results if isinstance(r, np.ndarray))
        return results

    def _count(self, feeds: Mapping[str, Any], values: Sequence[ort.OrtValue]) -> None:
        moved, here = self.moved, self.device.type
        for value in feeds.values():
            if not isinstance(value, ort.OrtValue):
                moved.to_device += getattr(value, "nbytes", 0)
            elif value.device_name() != here:  # Python cannot read an OrtValue's device number: another kind of device only
                moved.across += _nbytes(value)
        moved.to_host += sum(_nbytes(v) for v, on_host in zip(values, self._host, strict=True) if on_host)

    def on_device(self) -> tuple[str, ...]:
        """The outputs this hand-off leaves on a device."""
        return tuple(name for name, d in zip(self.outputs, self.devices, strict=True) if d is not None)


def _nbytes(value: ort.OrtValue) -> int:
    """Bytes of a tensor ``OrtValue`` (0 for a non-tensor one)."""
    return int(value.tensor_size_in_bytes()) if value.is_tensor() else 0


def handoff_for(spec: PipelineSpec, stage: StageSpec, outputs: Sequence[str], session: ort.InferenceSession, run_options: ort.RunOptions | None,
                batches: bool, target: str | None = None) -> Handoff | None:
    """The hand-off of one stage's runner, or ``None`` for ``session.run`` and numpy (Note: hand-offs as OrtValues).

    Every ONNX stage on a device that does not batch gets one (so what it binds across its edge is
    counted), with the outputs that every reader takes on the same kind of device left there.

    Args:
        spec: The pipeline's spec (who reads each output).
        stage: The stage.
        outputs: Its outputs, in the runner's order.
        session: Its session (its first provider says its device).
        run_options: Its run options.
        batches: The stage batches (its rows are sliced and stacked as numpy).
        target: The target every stage runs on instead of its own, if any.
    """
    device = session_device(session)
    if device is None or batches:
        return None
    readers: dict[str, list[Endpoint]] = {}
    for link in spec.links:
        if link.src.stage == stage.name:
            readers.setdefault(link.src.tensor, []).append(link.dst)
    states = {s.output for s in spec.states_of(stage.name)}
    devices = [device if o not in states and _all_on(spec, readers.get(o, []), device.type, target) else None for o in outputs]
    return Handoff(session, outputs, devices, run_options, device)


def _all_on(spec: PipelineSpec, readers: Sequence[Endpoint], kind: str, target: str | None) -> bool:
    """Every reader is an ONNX stage on a device of type ``kind`` that does not batch (none is the pipeline's exit)."""
    if not readers:
        return False
    for reader in readers:
        if reader.stage is None:
            return False
        stage = spec.stage(reader.stage)
        settings = stage.settings if target is None else stage.settings.replace(target=target, provider_options={}, ep_package=None, ep_device=None)
        if stage.is_code or stage.batching is not None or DEVICE_TYPES.get(settings.provider) != kind:
            return False
    return True
