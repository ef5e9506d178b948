"""The runtime's stream errors said in a client's terms (serve/_models.py, Note: a client's terms),
rendered from the errors' fields: every kind of stream error, including those the server tests
cannot provoke through a served model (a state an engine lost, a refusal after it, a closed
pipeline), pinned to the words a client reads. The texts the server tests see are the same
(tests/serve/test_messages.py, test_sequences.py, test_sequence_state.py)."""

from __future__ import annotations

from onnxpipe import Closure, StageError, StateDimError, StreamError
from onnxpipe._errors import said
from onnxpipe.serve._models import _SEQUENCE_TERMS, _SequenceTerms


class _Held:
    """What the terms ask of the stream a sequence is held in: its id."""

    id = 3


def test_every_stream_error_is_said_in_a_clients_terms() -> None:
    failure = StageError("stage 'stage1' failed on request 7: boom", stage="stage1", request=7)
    lost = StreamError.state_lost("stage1", [3], "the actor holding it (replica 0) died (killed)", request=7)
    bad = StreamError.step_failed(failure, 2, ["stage0"])
    terms = _SequenceTerms(_Held(), "user-7")  # type: ignore[arg-type]
    again = "start it again with 'sequence_start': true"
    said_as = {
        StreamError.closed(3, Closure("idle", 0.3)):
            f"sequence_id 'user-7' is closed (it was idle for more than --stream-timeout 0.3 s, and its state was freed); {again}",
        StreamError.refused(3, 2, bad):
            f"sequence_id 'user-7' cannot take more steps: step 2 failed in stage 'stage1' after stage(s) 'stage0' had updated their state; {again}",
        StreamError.refused(3, 2, lost):
            "sequence_id 'user-7' cannot take more steps: step 2 failed: stage 'stage1' lost the state of stream 3: the actor holding it (replica 0) "
            f"died (killed); start the sequence again with 'sequence_start': true; {again}",
        StreamError.step_failed(failure, 2, []):
            "stage 'stage1' failed on request 7: boom; the sequence's state is unchanged (as after step 1): the sequence can go on",
        bad: "stage 'stage1' failed on request 7: boom; the sequence's state is no longer valid: stage(s) 'stage0' took step 2 and stage 'stage1' "
             "did not; start the sequence again with 'sequence_start': true",
        lost: "stage 'stage1' lost the state of stream 3: the actor holding it (replica 0) died (killed); start the sequence again with 'sequence_start': true",
        StateDimError(stream=3, step=1, name="x", dim="batch", size=2, bound=1):
            "sequence_id 'user-7', step 1: input 'x' has batch=2, but the sequence's state was made with batch=1 on its first step; "
            "start a new sequence ('sequence_start': true) for another batch",
        StreamError("the pipeline is closed"): "the pipeline is closed",
        failure: "stage 'stage1' failed on request 7: boom",
    }
    for error, text in said_as.items():
        assert said(error, terms) == text
    # Another stream than the sequence's, or no sequence named: the stream keeps its number.
    assert said(StreamError.closed(4, Closure("owner")), terms) == f"stream 4 is closed (closed by its owner); {again}"
    assert said(StreamError.closed(3, Closure("pipeline")), _SEQUENCE_TERMS) == f"stream 3 is closed (its pipeline was closed); {again}"
    assert _SEQUENCE_TERMS.closure(Closure("idle", 5.0)) == "it was idle for more than --stream-timeout 5 s, and its state was freed"
