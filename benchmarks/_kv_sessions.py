"""A decoder's whole model in one plain onnxruntime session, stepping S streams in lockstep, with
its KV cache handled three ways: what ``benchmarks.batching`` measures onnxpipe against.

- :class:`NumpyKV`: pasts fed as numpy arrays, presents taken back as new arrays (``session.run``):
  each step the session copies the whole past into a present it allocates;
- :class:`SharedKV`: one preallocated ``OrtValue`` per cache, of capacity context + tokens, bound
  with IOBinding as both past and present (onnxruntime-genai's export: ``GroupQueryAttention``'s
  ``past_present_share_buffer``, as onnxruntime-genai binds it), so a step writes one row per layer;
- :class:`FedBackKV`: presents bound as outputs and fed back as the next step's past ``OrtValue``\\ s,
  with no numpy between (an export whose KV grows by ``Concat``, optimum's).

:func:`lockstep` drives any of them: greedy, all streams' prompts (equal lengths) as one batch,
then one token per stream per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import onnxruntime as ort

#: A step of the whole batch: (tokens not fed yet, S x n; tokens fed before) -> each stream's last logits, S x vocab.
Step = Callable[[np.ndarray, int], np.ndarray]
PAST = "past_key_values."


def present(past: str) -> str:
    """The present output that continues a past input (``past_key_values.0.key`` -> ``present.0.key``)."""
    return past.replace(PAST, "present.")


def _feeds(inputs: set[str], ids: np.ndarray, done: int) -> dict[str, np.ndarray]:
    """The inputs beside the caches: every stream's mask all ones (equal prompts, right-aligned
    with nothing to pad), positions where the export reads them."""
    streams, seq = ids.shape
    feeds = {"input_ids": ids, "attention_mask": np.ones((streams, done + seq), np.int64)}
    if "position_ids" in inputs:
        feeds["position_ids"] = np.broadcast_to(np.arange(done, done + seq, dtype=np.int64), (streams, seq)).copy()
    return feeds


class _Caches:
    """What the three share: the session, its inputs and the shape of an empty cache."""

    def __init__(self, session: ort.InferenceSession, streams: int, head_size: int) -> None:
        self.session = session
        self.inputs = {i.name for i in session.get_inputs()}
        self.pasts = [i.name for i in session.get_inputs() if i.name.startswith(PAST)]
        heads = {i.name: i.shape[1] for i in session.get_inputs()}
        self.shape = {n: (streams, heads[n], 0, head_size) for n in self.pasts}


class NumpyKV(_Caches):
    """Pasts in as numpy, presents out as new numpy arrays."""

    def __init__(self, session: ort.InferenceSession, streams: int, head_size: int) -> None:
        super().__init__(session, streams, head_size)
        self.names = [o.name for o in session.get_outputs()]
        self.cache = {n: np.zeros(self.shape[n], np.float32) for n in self.pasts}

    def __call__(self, ids: np.ndarray, done: int) -> np.ndarray:
        out = dict(zip(self.names, self.session.run(self.names, {**_feeds(self.inputs, ids, done), **self.cache}), strict=True))
        self.cache = {n: out[present(n)] for n in self.pasts}
        return np.asarray(out["logits"][:, -1])


class SharedKV(_Caches):
    """One buffer per cache, of ``capacity`` positions, bound as past and present at once."""

    def __init__(self, session: ort.InferenceSession, streams: int, head_size: int, capacity: int) -> None:
        super().__init__(session, streams, head_size)
        self.binding = session.io_binding()
        self.binding.bind_output("logits", "cpu")  # bound first: get_outputs()[0] (a name bound again keeps its place)
        self.buffers = [np.zeros((*self.shape[n][:2], capacity, head_size), np.float32) for n in self.pasts]
        for n, buffer in zip(self.pasts, self.buffers, strict=True):
            value = ort.OrtValue.ortvalue_from_numpy(buffer)  # over the array's memory: the buffer is the cache
            self.binding.bind_ortvalue_input(n, value)
            self.binding.bind_ortvalue_output(present(n), value)

    def __call__(self, ids: np.ndarray, done: int) -> np.ndarray:
        for name, value in _feeds(self.inputs, ids, done).items():
            self.binding.bind_cpu_input(name, value)
        self.binding.bind_output("logits", "cpu")  # its shape changes from the prompt's step to the next
        self.session.run_with_iobinding(self.binding)
        return np.asarray(self.binding.get_outputs()[0].numpy()[:, -1])


class FedBackKV(_Caches):
    """Presents bound as outputs (onnxruntime allocates them) and bound as the next step's pasts."""

    def __init__(self, session: ort.InferenceSession, streams: int, head_size: int) -> None:
        super().__init__(session, streams, head_size)
        self.outputs = [o.name for o in session.get_outputs()]
        self.values = {n: ort.OrtValue.ortvalue_from_numpy(np.zeros(self.shape[n], np.float32)) for n in self.pasts}

    def __call__(self, ids: np.ndarray, done: int) -> np.ndarray:
        binding = self.session.io_binding()
        for name, value in _feeds(self.inputs, ids, done).items():
            binding.bind_cpu_input(name, value)
        for name, past in self.values.items():
            binding.bind_ortvalue_input(name, past)
        for name in self.outputs:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        out = dict(zip(self.outputs, binding.get_outputs(), strict=True))
        self.values = {n: out[present(n)] for n in self.pasts}
        return np.asarray(out["logits"].numpy()[:, -1])


def lockstep(step: Step, prompts: np.ndarray, count: int) -> dict[str, Any]:
    """``count`` greedy tokens per stream after ``prompts`` (S x n): each stream's tokens, the last
    step's logits, the prompt step's seconds (``first``) and each later step's (``times``)."""
    ids, done = prompts, 0
    first: list[float] = []
    times: list[float] = []
    chosen = []
    for n in range(count):
        start = time.perf_counter()
        logits = step(ids, done)
        done += ids.shape[1]
        ids = np.argmax(logits, axis=-1)[:, None].astype(np.int64)
        (times if n else first).append(time.perf_counter() - start)
        chosen.append(ids[:, 0])
    return {"tokens": np.stack(chosen, axis=1).tolist(), "logits": logits, "first": first, "times": times}
