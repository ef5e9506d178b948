"""A greedy decoder's streams as Triton sequences over HTTP: what ``tests.stateful_models.decode_in_threads``
steps against a served model (each ``stream()`` a sequence of its own)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import tritonclient.http as httpclient


class Sequences:
    """Each ``stream()`` a Triton sequence of ``model`` at ``url`` over HTTP (its first step starts
    it, its ``count``-th ends it), each step one request fed the int64 inputs in ``inputs`` (every
    input given, when ``None``); sequence ids from ``first_id`` on."""

    def __init__(self, url: str, count: int, model: str = "decoder", inputs: set[str] | None = None, first_id: int = 100) -> None:
        self.url, self.count, self.model, self.inputs = url, count, model, inputs
        self.ids = iter(range(first_id, first_id + 10_000))

    def stream(self) -> Sequence:
        return Sequence(self, next(self.ids))


class Sequence:
    """One sequence (see :class:`Sequences`); a context manager, as a stream is."""

    def __init__(self, owner: Sequences, sid: int) -> None:
        self.owner, self.sid, self.steps = owner, sid, 0
        self.client = httpclient.InferenceServerClient(owner.url)

    def step(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        inputs = []
        for name, value in feeds.items():
            if self.owner.inputs is None or name in self.owner.inputs:
                tensor = httpclient.InferInput(name, list(value.shape), "INT64")
                tensor.set_data_from_numpy(value)
                inputs.append(tensor)
        self.steps += 1
        result = self.client.infer(self.owner.model, inputs, sequence_id=self.sid, sequence_start=self.steps == 1,
                                   sequence_end=self.steps == self.owner.count)
        return {"logits": result.as_numpy("logits")}

    def __enter__(self) -> Sequence:
        return self

    def __exit__(self, *exc: object) -> None:
        pass
