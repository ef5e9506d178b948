"""What the build checks before a stage may batch (``max_batch`` above 1): docs/batching.md.

Note: the batching probe.
    A stage batches only where it is known to be safe, never by guessing:

    1. Every input and output of the stage has dim 0 as its batch axis: a symbolic (or unnamed)
       dim 0. A fixed dim 0 refuses the stage, naming the port.
    2. For a stage keeping state that grows (a KV cache: a state link with an ``empty_axis``),
       the pipeline must have an attention mask input (``attention_mask``, int or bool, over past
       and current positions): without one, a padded position cannot be hidden (a model with
       absolute positions only) and the stage is refused, saying so.
    3. Which ports grow with the past is *measured*, not read from dim names (exporters name
       them differently, or not at all, and the mask made from ``attention_mask`` in one stage
       and read in the next has no name): two synthetic streams with pasts of 3 and 5 run one
       decode step alone, and every port of the stage whose length along an axis differs by
       exactly 2 grows along it (every batching stage's ports, whether or not the stage keeps a
       growing state: a later stage may read a cache an earlier one made). Its inputs are
       *padded* (state inputs with 0, pipeline inputs as guessed below), its outputs
       *stripped*. A value a stage hands on padded (a mask made from the attention mask; keys,
       values, scores or softmax weights where a cut falls inside an attention) is padded with
       what the batched call itself puts at the padded positions: measured in the streams'
       first decode step run batched (``_Probe._fills``), where they hold one finite value
       (0 in keys, values, scores and weights; the lowest float in an additive mask). Else the
       guess: 0 for int / bool, the dtype's lowest value for a float (an additive mask). The
       fill is what a stage that ran the members one by one joins their outputs with (step 4),
       so the next stage reads what a batched call would have handed it; a guessed lowest float
       in the softmax weights and the values made inf, then NaN, there (issue 38). A stage whose state feeds
       onnxruntime's ``GroupQueryAttention`` as its past keeps that state padded on the right
       (``Batching.state_padding``): the op reads each row's past from position 0 up to the
       row's ``seqlens_k`` (the attention mask's sum), so a left-padded past would put the padding
       where it reads; step 4 checks the choice like any other. (A module saved in onnxruntime's
       ORT format cannot be read for its ops: its state is measured padded on the left, then, if
       that differs from alone, on the right.)
    4. The same streams then run three decode steps batched, as the runtime runs them: their
       inputs stacked once at the entry (``scheduling.stack_steps``), one request through the
       runners the engines use, split at the exit; in the second and third, every other stage
       runs the members one by one and joins their outputs again with the record's pad values,
       as after a failed batched call, for the next stage to read batched. Every output must
       equal the alone run's within 1e-4
       (fp32; 1e-2 for 16-bit floats), as optimum validates exports; otherwise the stage is
       refused with the largest difference and where it was.

    A stateless pipeline's stages are probed the same way with two random requests, each
    symbolic dim but dim 0 sized as the pipeline's ``input_dims`` metadata says (the sizes its
    split was made for: ``split --dim``, the planner's dims), else 2. Sizes matter: an image
    model fed 2 x 2 pixels runs on degenerate shapes, where onnxruntime-openvino 1.24.1 returned
    one row for a batch of two (a refusal) or crashed the process (the planner building a
    batching pipeline of two OpenVINO stages of PP-OCR rec); at 48 x 320 it batches. A probe
    that cannot run at all (random inputs the model refuses) leaves the stage batching on the
    strength of step 1, and the record says it was not probed and why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from onnxpipe._errors import BuildError, ConfigError, InputError, OnnxpipeError
from onnxpipe.runtime import Batching, Endpoint, PipelineSpec, StageSpec, TensorSpec, numpy_dtype
from onnxpipe.runtime._inputs import MASK_NAMES, DecoderInputs, random_array
from onnxpipe.runtime._overrides import check_stream_batching
from onnxpipe.runtime._session import make_session
from onnxpipe.runtime._stage import Request, StageRunner, passes, plan_stages
from onnxpipe.runtime._stream import bind_dims, state_dims
from onnxpipe.runtime._values import INPUT_DIMS_KEY, format_dims, named_values, parse_dims, spec_values
from onnxpipe.runtime.scheduling import StepBatch, bag_pads, batch_length, member_outputs, stack_steps

__all__ = ["INPUT_DIMS_KEY", "MASK_NAMES", "check_batching", "format_dims", "mark_shared_states", "parse_dims"]

_PASTS = (3, 5)  # the probe streams' pasts at their first decode step
_ENCODED = 4  # the symbolic dims of the probe streams' first-step inputs (an encoder's input length)
_PROMPTS = (3, 5)


def check_batching(spec: PipelineSpec, folder: Path) -> PipelineSpec:
    """``spec`` with a :class:`Batching` record on each stage whose ``max_batch`` is above 1.

    Args:
        spec: The built pipeline (its modules in ``folder``).
        folder: The build folder the stage modules are in.

    Raises:
        BuildError: a stage cannot batch (a fixed batch dim, no attention mask for a growing
            state, batched results that differ from alone), naming the stage and why.
    """
    batching = [s for s in spec.stages if s.settings.max_batch > 1]
    if not batching:
        return spec
    try:
        check_stream_batching(spec)  # the runtime checks deploy-time settings with the same rule
    except ConfigError as e:
        raise BuildError(str(e)) from None
    for stage in batching:
        _check_batch_axes(stage, {f.input for f in spec.flags_of(stage.name)})
    # A state set once never grows (StateLink's Note: a state set once), though it starts empty.
    growing = [s for s in batching if any(link.empty_axis is not None and not link.once for link in spec.states_of(s.name))]
    for stage in spec.stages:
        if stage.settings.batch_pad and stage not in growing:
            raise BuildError(f"stage '{stage.name}': batch_pad is for a stage that batches streams whose state grows (max_batch above 1 "
                             "and a state link with an empty axis); this one has none to pad")
    mask = DecoderInputs.of(_every_step_inputs(spec)).mask if spec.states else None
    equal = bool(growing) and all(s.settings.batch_lengths == "equal" for s in growing)  # nothing padded: no mask needed
    if growing and mask is None and not equal:
        names = ", ".join(t.name for t in spec.inputs)
        raise BuildError(
            f"stage '{growing[0].name}' keeps state that grows with each step ({_growing_state(spec, growing[0])}), and the pipeline has no "
            f"attention mask input to mark padded positions (looked for {', '.join(MASK_NAMES)}; inputs: {names}): a model with absolute "
            "positions only cannot batch streams of different lengths; set max_batch=1 for it, or batch_lengths=\"equal\" to batch only "
            "streams whose pasts are equally long"
        )
    probe = _Probe(spec, folder, mask, equal)
    try:
        records = probe.run(batching, growing)
    except _NotProbed as e:
        why = f"not probed: {e}"
        records = {s.name: Batching(probe="" if s in growing else why) for s in batching}
        if growing:
            raise BuildError(f"stage '{growing[0].name}': cannot check that its streams batch ({e}); set max_batch=1 for it") from None
    stages = tuple(dataclasses.replace(s, batching=records[s.name]) if s.name in records else s for s in spec.stages)
    return dataclasses.replace(spec, stages=stages)


def _encoded(spec: TensorSpec, sizes: Mapping[str, int], rng: np.random.Generator) -> np.ndarray:
    """A probe stream's first-step input: one length for every stream (``sizes``, else
    :data:`_ENCODED`), so that what the later stages keep of it lines up."""
    return random_array(spec, [1 if axis == 0 else d if isinstance(d, int) else sizes.get(d or "", _ENCODED) for axis, d in enumerate(spec.shape or ())], rng)


def _every_step_inputs(spec: PipelineSpec) -> list[TensorSpec]:
    """The pipeline inputs a stream gives on every step: not an encoder's (``first_step_inputs``),
    whose mask is not the decoder's attention mask."""
    return [t for t in spec.inputs if t.name not in spec.first_step_inputs]


def _shared_pasts(stage: StageSpec, folder: Path) -> set[tuple[str, str]] | None:
    """The (past, present) pairs of a stage's module that onnxruntime's ``GroupQueryAttention``
    reads and makes (its inputs 3, 4 and outputs 1, 2): a past it may share its buffer with its
    present; ``None`` when the module is no ONNX file this can read (onnxruntime's ORT format)."""
    assert stage.module is not None
    try:
        model = onnx.load(str(folder / stage.module), load_external_data=False)
    except Exception:  # an ORT-format module (protobuf's DecodeError, or onnx's own error)
        return None
    return {(node.input[3 + k], node.output[1 + k]) for node in model.graph.node
            if node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft" and len(node.input) > 4 and len(node.output) > 2 for k in (0, 1)}


def mark_shared_states(spec: PipelineSpec, folder: Path) -> PipelineSpec:
    """The spec with ``StateLink.shared`` set on each state whose input and output are the past and
    present of one ``GroupQueryAttention`` (their buffer may be one: the runtime keeps the state in
    place, ``_stage``, Note: state in place)."""
    links = []
    for link in spec.states:
        stage = spec.stage(link.stage)
        shared = _shared_pasts(stage, folder) if stage.module is not None and link.empty_axis is not None and not link.once else None
        links.append(dataclasses.replace(link, shared=bool(shared) and (link.input, link.output) in shared))  # type: ignore[operator]
    return dataclasses.replace(spec, states=tuple(links))


def _check_batch_axes(stage: StageSpec, flags: set[str]) -> None:
    """Every port of the stage has a symbolic dim 0, but its step flags (one value for a whole call)."""
    if stage.is_code:
        raise BuildError(f"code stage '{stage.name}': max_batch {stage.settings.max_batch}: code stages run one request at a time; set max_batch=1")
    for what, ports in (("input", stage.inputs), ("output", stage.outputs)):
        for port in ports:
            if port.name in flags and what == "input":
                continue
            if port.shape is None:
                raise BuildError(f"stage '{stage.name}' cannot batch: the rank of {what} '{port.name}' is unknown, so it has no batch axis; set max_batch=1")
            if not port.shape:
                raise BuildError(f"stage '{stage.name}' cannot batch: {what} '{port.name}' is a scalar, with no batch axis; set max_batch=1")
            if isinstance(port.shape[0], int):
                raise BuildError(
                    f"stage '{stage.name}' cannot batch: dim 0 of {what} '{port.name}' {_fmt(port.shape)} is fixed at {port.shape[0]}; "
                    "batching stacks requests along dim 0, which must be symbolic (export the model with a dynamic batch dim) -- or set max_batch=1"
                )


def _growing_state(spec: PipelineSpec, stage: StageSpec) -> str:
    link = next(link for link in spec.states_of(stage.name) if link.empty_axis is not None and not link.once)
    return f"'{link.input}' along axis {link.empty_axis}"


def _fmt(shape: Sequence[object]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _tolerance(dtype: np.dtype) -> float:
    return 1e-2 if dtype.kind == "f" and dtype.itemsize <= 2 else 1e-4


class _NotProbed(Exception):
    """The probe's inputs could not run through the pipeline alone."""


class _Probe:
    """Runs synthetic streams or requests through the built stages, alone and batched."""

    def __init__(self, spec: PipelineSpec, folder: Path, mask: TensorSpec | None, equal: bool = False) -> None:
        self.spec = spec
        # The streams' prompts: of different lengths, or, for stages batching equal lengths only (batch_lengths), equal.
        self.prompts = (_PROMPTS[0],) * 2 if equal else _PROMPTS
        self.folder = folder
        self.mask = mask
        self.positions = DecoderInputs.of(_every_step_inputs(spec)).positions
        self.first_inputs = frozenset(spec.first_step_inputs)
        self.plans, self.finals = plan_stages(spec)
        self.sessions: dict[str, ort.InferenceSession] = {}
        for plan in self.plans:
            stage = plan.stage
            if stage.module is None:
                continue
            target = None if stage.settings.provider in ort.get_available_providers() else "cpu"
            self.sessions[stage.name] = make_session(folder / stage.module, stage, target)
        self.dims = state_dims(spec)
        self.sizes = parse_dims(spec.metadata.get(INPUT_DIMS_KEY, ""))  # a stateless request's dims (see Note: the batching probe)
        # A state set once (an encoder's KV) keeps the sizes of its first step: its dims take one size in every step of every stream.
        self.once = {d: 2 for link in spec.states if link.once for d in (spec.stage(link.stage).input(link.input).shape or ())[1:] if isinstance(d, str)}
        self.rng = np.random.default_rng(0)
        self.values = {**named_values(spec.inputs), **spec_values(spec)}  # what the inputs' values mean (Note: sample values, runtime/_values.py)

    # -- what runs ----------------------------------------------------------------------------

    def _runners(self, records: Mapping[str, Batching]) -> list[StageRunner]:
        """A runner per stage, as a pipeline with these records makes them (stages without one do not batch)."""
        stages = []
        for stage in self.spec.stages:
            if stage.name not in self.sessions:
                raise _NotProbed(f"stage '{stage.name}' is a code stage")
            batching = records.get(stage.name)
            settings = stage.settings if batching is not None else stage.settings.replace(max_batch=1)
            stages.append(dataclasses.replace(stage, batching=batching, settings=settings))
        spec = dataclasses.replace(self.spec, stages=tuple(stages))
        self.pads = bag_pads(spec)
        return [StageRunner(plan, self.sessions[plan.stage.name]) for plan in plan_stages(spec)[0]]

    def _feeds(self, past: int, new: int, seed: int, sizes: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
        """A step's pipeline inputs: the mask over past + new positions, positions counted from
        the past, every other symbolic dim ``new`` long (the step's tokens) unless ``sizes`` has it
        (by name, or ``input.axis``), values seeded."""
        sizes = {**self.once, **(sizes or {})}
        rng = np.random.default_rng(seed)
        feeds = {}
        for t in self.spec.inputs:
            dtype = numpy_dtype(t.dtype)
            if t.name in self.first_inputs:  # an encoder's input (PipelineSpec, Note: first-step stages): on a stream's first step only
                if not past:
                    feeds[t.name] = _encoded(t, sizes, rng)
                continue
            if self.mask is not None and t.name == self.mask.name:
                feeds[t.name] = np.ones((1, past + new), dtype)
                continue
            if t is self.positions:
                feeds[t.name] = np.arange(past, past + new, dtype=dtype)[None, :]
                continue
            if t.shape is None:
                raise _NotProbed(f"input '{t.name}' has no known rank")
            shape = [1 if axis == 0 else d if isinstance(d, int) else sizes.get(d or "", sizes.get(f"{t.name}.{axis}", new))
                     for axis, d in enumerate(t.shape)]
            try:
                feeds[t.name] = random_array(t, shape, rng, self.values.get(t.name))
            except InputError as e:
                raise _NotProbed(str(e)) from None
        return feeds

    def _request(self, rid: int, feeds: Mapping[str, np.ndarray], stream: int | None, step: int) -> Request:
        request = Request(rid, {Endpoint(None, k): v for k, v in feeds.items()}, {}, 0.0, stream=stream, step=step)
        if stream is not None:
            request.dims = {d: size for d, (size, _) in bind_dims(self.spec.inputs, feeds, self.dims).items()}
        return request

    def _through(self, runners: Sequence[StageRunner], group: list[Request], seen: dict[str, list[dict[str, tuple[int, ...]]]] | None = None,
                 batched: bool = False) -> None:
        """``group`` through every stage in order (batched where a runner batches); raises the
        first member's error. ``seen``: per stage, each member's port shapes (inputs and outputs).
        ``batched``: every stage that batches must run the group as one call."""
        for runner in runners:
            if seen is not None:
                seen.setdefault(runner.name, [])
                shapes = [{name: np.shape(v) for name, v in runner._feeds(r).items()} if not passes(runner.plan, r) else {} for r in group]
            calls = runner.run_many(group)
            for call in calls:
                for failure in call.failures:
                    if runner.max_batch > 1:
                        raise _Differs(runner.name, f"a request that runs alone failed batched: {failure.cause}")
                    raise _NotProbed(f"stage '{runner.name}' failed on the probe's request: {failure.cause}")
            if batched and runner.max_batch > 1 and len(calls) != 1:
                raise _Differs(runner.name, f"its requests did not run as one call ({runner.unbatched or 'they did not fit together'})")
            if seen is not None:
                for member, mine in zip(group, shapes, strict=True):
                    mine.update({o: np.shape(member.values[Endpoint(runner.name, o)]) for o in runner.plan.outputs
                                 if Endpoint(runner.name, o) in member.values})
                    seen[runner.name].append(mine)

    def _batched(self, runners: Sequence[StageRunner], group: list[Request], replay: set[int],
                 bags: list[tuple[StepBatch, dict[Endpoint, np.ndarray]]] | None = None) -> list[dict[str, np.ndarray]]:
        """Streams' steps as the runtime batches them: stacked at the entry, one request through
        every stage, split at the exit; each member's outputs. Raises :class:`_Differs` where a
        stage did not run them as one call. The stages in ``replay`` run the members one by one
        and join their outputs again, padded with the record's fills, as after a failed batched
        call, for the next stage to read batched (so a fill that would let it attend a padded
        position is caught too). ``bags``: gets the batch and its bag after each stage."""
        entry = {key.tensor: pad for key, pad in self.pads.items() if key.stage is None}
        arrays = [{key.tensor: value for key, value in r.values.items()} for r in group]
        stacked = stack_steps(arrays, entry)
        if stacked is None:
            raise _Differs(runners[0].name, "the steps' growing inputs do not line up when padded")
        values, rows, shifts = stacked
        batch = StepBatch(tuple(r.id for r in group), tuple(r.stream for r in group), tuple(r.step for r in group),  # type: ignore[misc]
                          tuple(r.dims for r in group), (0.0,) * len(group), rows, shifts, length=batch_length(values, entry))
        request = Request(group[0].id, {Endpoint(None, k): v for k, v in values.items()}, {}, 0.0, batch=batch)
        for k, runner in enumerate(runners):
            runner.unbatched = None
            if passes(runner.plan, request):
                pass  # a later step at a first-step stage: no run, as in the engines
            elif k in replay:
                runner._replay(request)
            else:
                runner(request)
            assert request.batch is not None
            if request.batch.failed:
                raise _Differs(runner.name, f"a request that runs alone failed batched: {request.batch.failed[0].error}")
            if runner.unbatched:
                raise _Differs(runner.name, f"its requests did not run as one call ({runner.unbatched})")
            if bags is not None:
                bags.append((request.batch, dict(request.values)))
        outputs = {name: np.asarray(request.values[key]) for name, key in self.finals.items()}
        exit_pads = {name: self.pads[key] for name, key in self.finals.items() if key in self.pads}
        done = request.batch
        assert done is not None
        return [member_outputs(outputs, done, j, exit_pads) for j in range(len(group))]

    def _outputs(self, request: Request) -> dict[str, np.ndarray]:
        return {name: np.asarray(request.values[key]) for name, key in self.finals.items()}

    # -- the probe ----------------------------------------------------------------------------

    def run(self, batching: Sequence[StageSpec], growing: Sequence[StageSpec]) -> dict[str, Batching]:
        if self.spec.states:
            return self._streams(batching, growing)
        return self._requests(batching)

    def _requests(self, batching: Sequence[StageSpec]) -> dict[str, Batching]:
        feeds = [self._feeds(0, 2, seed, self.sizes) for seed in (1, 2)]
        alone = self._runners({})
        want = []
        for rid, f in enumerate(feeds):
            request = self._request(rid, f, None, 0)
            self._through(alone, [request])
            want.append(self._outputs(request))
        records = {s.name: Batching() for s in batching}
        group = [self._request(rid, f, None, 0) for rid, f in enumerate(feeds)]
        try:
            self._through(self._runners(records), group, batched=True)
        except _Differs as e:
            raise BuildError(f"stage '{e.stage}' cannot batch: {e.why}; set max_batch=1 for it") from None
        worst = self._compare(want, [self._outputs(r) for r in group], batching)
        return {s.name: Batching(probe=f"2 requests batched and alone agree: {worst}") for s in batching}

    def _streams(self, batching: Sequence[StageSpec], growing: Sequence[StageSpec]) -> dict[str, Batching]:
        # Alone: each stream's prompt, then three decode steps; the first decode step's shapes say what grows.
        alone = self._runners({})
        steps = 3
        seen: dict[str, list[dict[str, tuple[int, ...]]]] = {}
        want = self._alone(alone, _PROMPTS, steps, seen)
        if self.prompts != _PROMPTS:  # measured on pasts of different lengths, batched on equal ones (batch_lengths "equal")
            want = self._alone(self._runners({}), self.prompts, steps)
        # Every stage's ports measured, not only those of stages with a growing state: a later stage may read a cache a stage before it made.
        records = {s.name: self._grown(s, seen[s.name]) for s in batching}
        hints = {s.name: self._state_padding(s) for s in growing}
        first = self._fills({name: dataclasses.replace(r, state_padding=hints.get(name) or "left") for name, r in records.items()})
        try:
            worst = self._batched_streams(first, want, steps, batching)
            records = first
        except BuildError:
            if not any(hint is None for hint in hints.values()):
                raise
            # A module the probe cannot read (ORT format): its state measured padded on the right too.
            records = self._fills({name: dataclasses.replace(r, state_padding="right") if name in hints and hints[name] is None else r
                                   for name, r in first.items()})
            try:
                worst = self._batched_streams(records, want, steps, batching)
            except BuildError:
                self._batched_streams(first, want, steps, batching)  # the first failure is the one to report
                raise
        pasts = f"2 streams (prompts of {self.prompts[0]} and {self.prompts[1]}, {steps} steps) batched and alone agree: {worst}"
        return {name: dataclasses.replace(r, probe=pasts) for name, r in records.items()}

    def _alone(self, runners: Sequence[StageRunner], prompts: Sequence[int], steps: int,
               seen: dict[str, list[dict[str, tuple[int, ...]]]] | None = None) -> list[list[dict[str, np.ndarray]]]:
        """Each probe stream alone: its prompt, then ``steps`` decode steps; each one's outputs of
        each step. ``seen``: the first decode step's port shapes per stage (what grows)."""
        want = []
        for sid, prompt in enumerate(prompts):
            outs = []
            for step in range(steps + 1):
                past, new = (0, prompt) if step == 0 else (prompt + step - 1, 1)
                request = self._request(sid * 10 + step, self._feeds(past, new, 100 * sid + step), sid, step)
                self._through(runners, [request], seen if step == 1 else None)
                outs.append(self._outputs(request))
            want.append(outs)
        return want

    def _batched_streams(self, records: Mapping[str, Batching], want: list[list[dict[str, np.ndarray]]], steps: int,
                         batching: Sequence[StageSpec]) -> str:
        """The probe's streams batched with these records (the prompts of different lengths alone,
        then the decode steps together), compared with ``want``: how well they agree.

        Raises:
            BuildError: they do not.
        """
        runners = self._runners(records)
        got: list[list[dict[str, np.ndarray]]] = [[], []]
        try:
            self._steps(runners, steps, got)
        except _Differs as e:
            raise BuildError(f"stage '{e.stage}' cannot batch streams: {e.why}; set max_batch=1 for it") from None
        return self._compare([o for outs in want for o in outs], [o for outs in got for o in outs], batching)

    def _steps(self, runners: Sequence[StageRunner], steps: int, got: list[list[dict[str, np.ndarray]]],
               bags: list[tuple[StepBatch, dict[Endpoint, np.ndarray]]] | None = None) -> None:
        """The probe's streams through ``runners``: their prompts alone, then ``steps`` decode
        steps batched; each stream's outputs of each step into ``got``, the first decode step's
        bags into ``bags``. Raises :class:`_Differs`."""
        for step in range(steps + 1):
            group = []
            for sid, prompt in enumerate(self.prompts):
                past, new = (0, prompt) if step == 0 else (prompt + step - 1, 1)
                group.append(self._request(sid * 10 + step, self._feeds(past, new, 100 * sid + step), sid, step))
            if step == 0:
                self._through(runners, group)
                for sid, request in enumerate(group):
                    got[sid].append(self._outputs(request))
                continue
            # Step 1 batched throughout; steps 2 and 3 replayed by every other stage (Note: the batching probe, 4).
            replay = {k for k in range(len(runners)) if step > 1 and k % 2 == step % 2}
            for sid, outputs in enumerate(self._batched(runners, group, replay, bags if step == 1 else None)):
                got[sid].append(outputs)

    def _fills(self, records: Mapping[str, Batching]) -> dict[str, Batching]:
        """``records`` with the fill of each value a stage hands on padded (not a state, not a
        pipeline input, not the stage's ``batch_pad``) measured: what the batched call itself
        puts at the padded positions, where that is one finite value (Note: the batching probe, 3).
        The records as they are where the batched step cannot run (the check reports why)."""
        bags: list[tuple[StepBatch, dict[Endpoint, np.ndarray]]] = []
        try:
            self._steps(self._runners(records), 1, [[], []], bags)
        except _Differs:
            return dict(records)
        measured: dict[Endpoint, float] = {}
        for batch, bag in bags:
            for key, (axis, _) in self.pads.items():
                fill = _padding_holds(np.asarray(bag[key]), batch, axis) if key.stage is not None and key in bag else None
                if fill is not None:
                    measured.setdefault(key, fill)
        out = {}
        for name, record in records.items():
            stage = self.spec.stage(name)
            states = {link.input for link in self.spec.states_of(name)}
            padded = {port: (axis, measured.get(self.spec.source_of(Endpoint(name, port)), fill))
                      if port not in states and port not in stage.settings.batch_pad else (axis, fill)
                      for port, (axis, fill) in record.padded.items()}
            out[name] = dataclasses.replace(record, padded=padded)
        return out

    def _grown(self, stage: StageSpec, shapes: list[dict[str, tuple[int, ...]]]) -> Batching:
        """Which of the stage's ports grow with the past: their lengths differ by the pasts' difference."""
        a, b = shapes
        grow = _PASTS[1] - _PASTS[0]
        inputs = {t.name: t for t in stage.inputs}
        states = {link.input for link in self.spec.states_of(stage.name)}
        once = {n for link in self.spec.states_of(stage.name) if link.once for n in (link.input, link.output)}
        padded: dict[str, tuple[int, float]] = {}
        stripped: dict[str, int] = {}
        for name in a:
            if name in once:
                continue  # set once: the same sizes in every stream
            axes = [ax for ax, (x, y) in enumerate(zip(a[name], b.get(name, ()), strict=False)) if y - x == grow and ax > 0]
            if not axes:
                continue
            if len(axes) > 1:
                raise BuildError(f"stage '{stage.name}' cannot batch streams: '{name}' grows along axes {axes}, not one; set max_batch=1 for it")
            if name in inputs:
                dtype = numpy_dtype(inputs[name].dtype)
                value = 0.0 if name in states or dtype.kind in "iub" else float(np.finfo(dtype).min)
                padded[name] = (axes[0], stage.settings.batch_pad.get(name, value))
            else:
                stripped[name] = axes[0]
        unknown = sorted(set(stage.settings.batch_pad) - set(padded))
        if unknown:
            raise BuildError(f"stage '{stage.name}': batch_pad names '{unknown[0]}', which is not an input that grows with a stream's past; "
                             f"those are: {', '.join(repr(n) for n in padded) or 'none'}")
        for link in self.spec.states_of(stage.name):
            if link.once:
                continue  # set once, never grows (StateLink's Note: a state set once)
            if link.empty_axis is not None:
                stripped[link.output] = link.empty_axis  # the state a step commits, never in the bag to be measured
            if link.empty_axis is not None and padded.get(link.input, (None,))[0] != link.empty_axis:
                raise BuildError(f"stage '{stage.name}' cannot batch streams: its state '{link.input}' did not grow along its empty axis "
                                 f"{link.empty_axis} from a past of {_PASTS[0]} to {_PASTS[1]}; set max_batch=1 for it")
        return Batching(padded, stripped)

    def _state_padding(self, stage: StageSpec) -> str | None:
        """``"right"`` for a stage whose state feeds onnxruntime's ``GroupQueryAttention`` as its
        past (Note: the batching probe, 3), ``"left"`` for another, ``None`` when its module is no
        ONNX file the probe can read (onnxruntime's ORT format)."""
        pasts = {link.input for link in self.spec.states_of(stage.name) if link.empty_axis is not None and not link.once}
        shared = _shared_pasts(stage, self.folder)
        if shared is None:
            return None
        return "right" if pasts & {past for past, _ in shared} else "left"

    def _compare(self, want: Sequence[Mapping[str, np.ndarray]], got: Sequence[Mapping[str, np.ndarray]], batching: Sequence[StageSpec]) -> str:
        worst, where, tol = 0.0, "", 1e-4
        for w, g in zip(want, got, strict=True):
            for name, ref in w.items():
                out = g[name]
                if ref.dtype.kind not in "fc":
                    if ref.shape != out.shape or not np.array_equal(ref, out):
                        raise BuildError(self._refusal(batching, f"output '{name}' batched differs from alone (exact for {ref.dtype})"))
                    continue
                if ref.shape != out.shape:
                    raise BuildError(self._refusal(batching, f"output '{name}' batched has shape {out.shape}, alone {ref.shape}"))
                tol = max(tol, _tolerance(ref.dtype))
                diff = float(np.max(np.abs(ref.astype(np.float64) - out.astype(np.float64)), initial=0.0))
                if not diff <= _tolerance(ref.dtype):
                    raise BuildError(self._refusal(batching, f"output '{name}' batched differs from alone by {diff:.3g} (tolerance {_tolerance(ref.dtype):g})"))
                if diff >= worst:
                    worst, where = diff, name
        return f"max abs diff {worst:.2g} on '{where}' <= {tol:g}" if where else "exact"

    def _refusal(self, batching: Sequence[StageSpec], why: str) -> str:
        names = ", ".join(f"'{s.name}'" for s in batching)
        hint = (" (a model that mixes the rows of a batch is one cause; for streams, a mask applied other than as an additive bias or a 0/1 keep mask"
                " is another)") if self.spec.states else " (a model that mixes the rows of a batch, e.g. a mean over dim 0, is one cause)"
        return f"stage(s) {names} cannot batch: {why}; set max_batch=1{hint}"


def _padding_holds(value: np.ndarray, batch: StepBatch, axis: int) -> float | None:
    """The one finite value at every padded position of a batched ``value`` (padded on the left
    of ``axis`` by each member's shift), or ``None`` where they hold several, or none is padded."""
    seen = [np.moveaxis(value[batch.rows[j]:batch.rows[j + 1]], axis, 0)[:shift].ravel() for j, shift in enumerate(batch.shifts) if shift]
    held = np.unique(np.concatenate(seen)) if seen else np.zeros(0)
    return float(held[0]) if len(held) == 1 and np.isfinite(held[0]) else None


class _Differs(OnnxpipeError):
    """A batched run failed where the same requests ran alone."""

    def __init__(self, stage: str, why: str) -> None:
        super().__init__(why)
        self.stage = stage
        self.why = why
