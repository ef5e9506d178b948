"""Iteration-level scheduling: which streams' steps travel the pipeline together, as one request.

The policy (:class:`StepScheduler`: groups of streams, micro-batches, when a batch leaves) and the
batch's layout (:class:`StepBatch`: made once at the entry by :func:`stack_steps`, split once at
the exit by :func:`member_outputs`). What a stage does with a batch is the stage runner's
(``onnxpipe/runtime/_stage.py``, Note: state blocks); every engine carries a batch as one request.
See docs/batching.md.
"""

from onnxpipe.runtime.scheduling._batch import Failed, StepBatch, bag_pads, batch_length, member_outputs, member_rows, pad_stack, stack_steps, take_rows
from onnxpipe.runtime.scheduling._scheduler import Step, StepScheduler, step_key

__all__ = [
    "Failed", "Step", "StepBatch", "StepScheduler", "bag_pads", "batch_length", "member_outputs", "member_rows", "pad_stack", "stack_steps", "step_key",
    "take_rows",
]
