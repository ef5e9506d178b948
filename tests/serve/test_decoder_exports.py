"""Decoders as users export them, served (issue 27): every export of tests/data/decoders split by
hand between its layers, its stages batching, behind one ``onnxpipe serve`` process as Triton
sequences over HTTP: 4 sequences per model, each greedy-decoded by a client thread of its own,
prompts of different lengths started apart; every sequence's tokens equal the whole export alone
(:class:`tests.decoder_exports.WholeModel`), and the sequences of each model met in batches."""

from __future__ import annotations

from pathlib import Path

import tritonclient.http as httpclient

from onnxpipe.splitter import split
from tests.decoder_exports import EXPORTS, HAND_CUTS, WholeModel, model_path, prompts
from tests.models import bundle_of
from tests.serve.process import ServerProcess
from tests.serve.sequences import Sequences
from tests.stateful_models import decode_in_threads


def test_every_export_served_as_triton_sequences_decodes_the_tokens_of_the_whole_export(tmp_path: Path) -> None:
    bundles = []
    for name in EXPORTS:
        plan = split(str(model_path(name)), [HAND_CUTS[name]], states="auto")
        for stage in plan.config.stages:
            # The longest wait (a minute): a step waits for the other sequences' however busy the
            # machine (theirs always come, or they end), so the sequences meet in batches for certain.
            stage.configure(max_batch=4, max_delay_ms=60_000)
        bundles.append(f"{name}={bundle_of(plan, tmp_path / name)}")
    starts = prompts(4)
    count = 10
    with ServerProcess(*bundles) as proc:
        proc.start(tmp_path / "serve.log")
        for k, name in enumerate(EXPORTS):
            model = WholeModel(name)
            got = decode_in_threads(Sequences(proc.http, count, name, model.inputs, 100 * (k + 1)), starts, [count] * len(starts), apart=0.003)
            for j, prompt in enumerate(starts):
                assert got[j][0] == model.generate(prompt, count)[0], f"{name}: sequence {j}"
            stats = httpclient.InferenceServerClient(proc.http).get_inference_statistics(name)["model_stats"][0]
            assert stats["inference_count"] == len(starts) * count, (name, stats)
            assert stats["execution_count"] < stats["inference_count"], (name, stats)
        assert proc.stop() == 0
