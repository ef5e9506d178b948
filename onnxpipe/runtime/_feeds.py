"""StreamFeeds: the sample steps of a stream, for a pipeline with state links that no caller gave
inputs for: what ``verify`` feeds a split with state (and the whole model beside it) and what
``benchmark`` times.

Note: a stream's sample steps.
    A pipeline with state has no stateless request to make: its stages feed themselves their past,
    so a step's inputs depend on the steps before. The steps are a decoder's (Note: a decoder's
    sample inputs, ``_inputs.py``): a prompt of ``prompt`` tokens, then steps of one token each,
    the greedy token of the ``logits`` output at the step before; the attention mask is as wide as
    the past and the new tokens, the positions count on from the past. The past is the length of
    the state outputs of the step before where the caller has them (``verify`` runs the whole model
    beside the stream), else the tokens fed so far (a pipeline's outputs hold no state). A model
    that is no decoder takes random inputs at every step (Note: sample values), at the sizes
    ``dims`` gives. The inputs a first-step stage reads (``PipelineSpec.first_step_inputs``: an
    encoder's) are given on the first step only, as a stream takes them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np

from onnxpipe.runtime._dtypes import numpy_dtype
from onnxpipe.runtime._inputs import DecoderInputs, check_dims, defaulted_dims, dim_key, dims_hint, random_inputs
from onnxpipe.runtime._spec import PipelineSpec, StateLink, TensorSpec
from onnxpipe.runtime._stream import bind_dims
from onnxpipe.runtime._values import spec_values

__all__ = ["PROMPT", "StreamFeeds"]

PROMPT = 3  # the first step's tokens by default (Note: a stream's sample steps)


class StreamFeeds:
    """The sample steps of a stream (Note: a stream's sample steps), made by :func:`random_inputs`
    over the pipeline's inputs and its state inputs (what the whole model takes), each step sized
    by the one before.

    Args:
        spec: The pipeline's spec (with state links).
        dims: Sizes of symbolic dims; those the stream sizes (the past, the mask's width) are
            ignored, and the token ids' dim 1 is the prompt's length unless ``prompt`` gives it.
        prompt: The first step's tokens (default: ``dims`` for the token ids' dim 1, else :data:`PROMPT`).

    Raises:
        InputError: a key of ``dims`` is no dim of the inputs.
    """

    def __init__(self, spec: PipelineSpec, dims: Mapping[str, int], prompt: int | None = None) -> None:
        self.links = spec.states
        self.inputs = spec.inputs
        self.flags = {f.input: (f.first, _fixed(spec.stage(f.stage).input(f.input))) for f in spec.step_flags}
        self.kept: dict[str, np.ndarray] = {}  # the states set once, of the stream running (StateLink's Note: a state set once)
        state_specs = tuple(spec.stage(link.stage).input(link.input) for link in spec.states)
        self.specs: tuple[TensorSpec, ...] = spec.inputs + state_specs
        self.first_only = frozenset(spec.first_step_inputs)
        roles = DecoderInputs.of(self.specs)
        self.tokens = roles.tokens
        #: Per growing state's output: the dims key of its past and the axis it grows along; the
        #: stream sizes them (a size ``dims`` gives is no past a stream has), as it does the mask's width.
        self.pasts = _pasts(spec.states, state_specs)
        width = roles.mask_width_key({})
        stream_sized = {*(key for key, _ in self.pasts.values()), *([width] if width is not None else [])}
        self.dims = {k: v for k, v in dims.items() if k not in stream_sized}
        self.new = dim_key(self.tokens, 1) if self.tokens is not None else None
        self.prompt = (prompt if prompt is not None else dims.get(self.new, PROMPT)) if self.new is not None else 0
        #: The output whose greedy token is the next step's token, or ``None`` (no decoder, or token
        #: ids given on the first step only, an encoder's: random tokens).
        self.logits = _logits(spec) if self.tokens is not None and self.tokens.name not in self.first_only else None
        self.notes: list[str] = []
        #: The dims keys the steps so far sized 1 because no one gave them (``defaulted_dims``), each once.
        self.defaulted: list[str] = []
        self.values = spec_values(spec)  # Note: sample values
        check_dims(self.specs, dims)  # a dims key no input has is refused before any step runs

    def step(self, step: int, before: Mapping[str, np.ndarray], seed: int, only: Collection[str] | None = None) -> tuple[dict[str, np.ndarray], str]:
        """The inputs of step ``step`` (pipeline and state inputs: the state is replaced by
        :meth:`state`; ``only`` these, as :func:`random_inputs` takes it), given the outputs of the
        step before, and the hint for a failure."""
        dims = dict(self.dims)
        for output, (key, axis) in self.pasts.items():
            dims[key] = 0 if step == 0 else before[output].shape[axis] if output in before else self.prompt + step - 1
        if self.new is not None:
            dims[self.new] = self.prompt if step == 0 else 1
        feeds, notes = random_inputs(self.specs, dims, seed, self.values, only)
        self.notes.extend(n for n in notes if n not in self.notes)
        defaulted = defaulted_dims(self.specs, dims)
        self.defaulted.extend(k for k in defaulted if k not in self.defaulted)
        if step > 0 and self.logits is not None and self.tokens is not None:
            feeds[self.tokens.name] = np.argmax(before[self.logits][:, -1:, :], axis=-1).astype(feeds[self.tokens.name].dtype)
        return feeds, dims_hint(defaulted)

    def pipeline_step(self, step: int, before: Mapping[str, np.ndarray], seed: int) -> tuple[dict[str, np.ndarray], str]:
        """:meth:`step`'s pipeline inputs only, as a stream takes them (the first-step inputs on
        the first step only), given the pipeline's outputs of the step before."""
        # Only the pipeline's inputs are made: a decoder's random past (its KV cache) would cost the
        # thread feeding the pipeline more than the stages' step.
        return self.step(step, before, seed, [t.name for t in self.inputs if step == 0 or t.name not in self.first_only])

    def state(self, feeds: Mapping[str, np.ndarray], before: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The whole model's state inputs: the state outputs of the step before, or on the first
        step (``before`` empty) zeros sized as the pipeline sizes them (Note: initial values, in
        ``runtime/_spec.py``): a symbolic dim from the pipeline input naming it, the empty axis 0;
        a state set once is the first step's output on every later step; a step flag as the
        runtime feeds it (``StepFlag``)."""
        flags = {name: np.full(shape, first != bool(before), np.bool_) for name, (first, shape) in self.flags.items()}
        if before:
            return {**flags, **{link.input: self.kept.setdefault(link.input, before[link.output]) if link.once else before[link.output] for link in self.links}}
        self.kept = {}
        names = frozenset(d for t in self.inputs for d in t.shape or () if isinstance(d, str))
        sizes = {d: size for d, (size, _) in bind_dims(self.inputs, feeds, names).items()}
        state = {}
        for link, spec in zip(self.links, self.specs[len(self.inputs):], strict=True):
            assert spec.shape is not None
            shape = [0 if axis == link.empty_axis else d if isinstance(d, int) else sizes.get(str(d), 1) for axis, d in enumerate(spec.shape)]
            state[link.input] = np.zeros(shape, numpy_dtype(spec.dtype))
        return {**flags, **state}


def _fixed(spec: TensorSpec) -> tuple[int, ...]:
    """The fixed dims of ``spec``'s shape (a step flag's shape)."""
    return tuple(d for d in spec.shape or () if isinstance(d, int))


def _pasts(links: Sequence[StateLink], specs: Sequence[TensorSpec]) -> dict[str, tuple[str, int]]:
    """Per growing state's output (``links``, their inputs ``specs``): the dims key of its past and the axis it grows along."""
    pasts = {}
    for link, spec in zip(links, specs, strict=True):
        key = dim_key(spec, link.empty_axis) if link.empty_axis is not None else None
        if key is not None and link.empty_axis is not None:
            pasts[link.output] = (key, link.empty_axis)
    return pasts


def _logits(spec: PipelineSpec) -> str | None:
    """The pipeline's ``logits`` output of rank 3 (``[batch, tokens, vocab]``), if any."""
    return next((t.name for t in spec.outputs if t.name == "logits" and t.shape is not None and len(t.shape) == 3), None)
