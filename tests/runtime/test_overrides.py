"""Deploy-time settings (issue 29, item 4): ``load(..., overrides=...)`` changes the settings that do
not make a stage's module (threads, cores, replicas, batch sizes up to the build's), checked as the
build and the bundle's own settings are; the bundle's files stay as they were."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from onnxpipe import BundleError, ConfigError
from onnxpipe.builder import PipelineConfig
from onnxpipe.runtime import StageOverrides, StageSettings, load, read_bundle
from onnxpipe.runtime._settings import host_cores
from onnxpipe.runtime.bundle import MANIFEST_NAME, sha256_file
from onnxpipe.splitter import split
from tests import models
from tests.stateful_models import recurrent

X = {"x": np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)}


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One stage that batches, built with max_batch=4 (the probe checked it)."""
    config = PipelineConfig("mlp")
    stage = config.add_stage(models.embed_mlp(), "mlp", settings=StageSettings(max_batch=4, max_delay_ms=1))
    config.input("ids").connect(stage.input("ids"))
    stage.output("y").connect(config.output("y"))
    return models.bundle_of(config, tmp_path_factory.mktemp("mlp"))


def _lacking_core() -> int:
    """A CPU this process may not run on."""
    return max(os.sched_getaffinity(0)) + 1


def test_overrides_change_the_settings_in_effect_and_stats_show_them(hand: Path) -> None:
    core = min(os.sched_getaffinity(0))
    before = sha256_file(hand / MANIFEST_NAME)
    overrides = [
        StageOverrides("*", {"affinity": [core]}),
        StageOverrides("twin", {"replicas": 2, "intra_op_threads": 2}),
        StageOverrides(2, {"spinning": True}),
    ]
    with load(hand, overrides=overrides) as pipe:
        want = pipe(X)["y"]
        stages = {s.stage: s for s in pipe.stats().stages}
        assert pipe.spec.stage("tail").settings.spinning is True
        assert pipe.bundle.overrides == tuple(overrides)
    assert (stages["twin"].replicas, stages["twin"].intra_op_threads, stages["twin"].affinity) == (2, 2, (core,))
    assert (stages["head"].replicas, stages["head"].intra_op_threads, stages["head"].affinity) == (1, 1, (core,))
    assert "threads 2" in str(pipe.stats())
    with load(hand) as pipe:  # the bundle itself is unchanged
        assert {s.stage: s.affinity for s in pipe.stats().stages} == {"head": None, "twin": None, "tail": None}
        np.testing.assert_allclose(pipe(X)["y"], want)
    assert sha256_file(hand / MANIFEST_NAME) == before


def test_a_mapping_applies_star_first_then_in_order_later_winning(hand: Path) -> None:
    bundle = read_bundle(hand, overrides={"head": {"replicas": 3}, "*": {"replicas": 2}, "1": {"replicas": 1, "intra_op_threads": 0}})
    with bundle:
        assert [s.settings.replicas for s in bundle.spec.stages] == [3, 1, 2]
        assert bundle.spec.stage("twin").settings.intra_op_threads == 0


def test_an_affinity_this_host_lacks_is_refused_as_the_bundles_own_is(hand: Path) -> None:
    core = _lacking_core()
    allowed = sorted(os.sched_getaffinity(0))
    message = rf"stage 'head': affinity names core\(s\) \[{core}\] this process may not use; allowed cores: {re.escape(str(allowed))}; choose others at load"
    with pytest.raises(ConfigError, match=message):
        load(hand, overrides={"head": {"affinity": [core]}})


def test_every_core_an_affinity_names_is_checked_not_only_the_first(hand: Path) -> None:
    # Issue 36, item 12: with one thread a replica uses only the first core of its list, and only
    # that one was checked; 0-20000 then loaded on a 2-core host. A long list is named in short.
    core, lacking = min(os.sched_getaffinity(0)), _lacking_core()
    with pytest.raises(ConfigError, match=rf"^stage 'head': affinity names core\(s\) \[{lacking}\] this process may not use"):
        load(hand, overrides={"head": {"affinity": [core, lacking], "intra_op_threads": 1}})
    many = [core, *range(lacking, lacking + 4000)]
    shown = re.escape(f"[{', '.join(str(c) for c in range(lacking, lacking + 8))}, ...] (4000 in all)")
    with pytest.raises(ConfigError, match=rf"^stage 'head': affinity names core\(s\) {shown} this process may not use; allowed cores: "):
        load(hand, overrides={"*": {"affinity": many}})


def test_a_core_number_past_the_largest_is_refused_at_once() -> None:
    with pytest.raises(ConfigError, match=r"^affinity names core 8192; core numbers go from 0 to 8191 \(Linux's most CPUs\)$"):
        StageSettings(affinity=(0, 8192))
    assert StageSettings(affinity=(8191,)).affinity == (8191,)  # a number only: whether this host has it is checked at load


def test_a_bad_value_gets_the_message_the_build_gives(hand: Path) -> None:
    config = models.hand_wired()
    with pytest.raises(ConfigError) as built:
        config.stage("head").configure(affinity=[-1])
    with pytest.raises(ConfigError) as loaded:
        load(hand, overrides=[StageOverrides("head", {"affinity": [-1]}, origin="--set head:affinity=-1")])
    assert str(loaded.value) == f"--set head:affinity=-1: {built.value}"
    assert str(built.value) == "stage 'head': affinity must be a non-empty list of core numbers >= 0, got (-1,)"
    with pytest.raises(ConfigError, match=r"^stage 'twin': replicas must be an integer >= 1, got 0$"):
        load(hand, overrides={"twin": {"replicas": 0}})


def test_overrides_are_checked_against_the_hosts_caps(hand: Path) -> None:
    over = 4 * host_cores() + 1
    with pytest.raises(BundleError, match=rf"stage 'head': intra_op_threads {over} is over this host's cap of {over - 1} .*"
                       r"or lower it at load: load\(\.\.\., overrides=\.\.\.\)"):
        load(hand, overrides={"head": {"intra_op_threads": over}})


def test_max_batch_goes_up_to_what_the_build_accepted(mlp: Path) -> None:
    ids = {"ids": np.array([[1, 2, 3]], np.int64)}
    with load(mlp, overrides={"mlp": {"max_batch": 2, "max_delay_ms": 0}}) as pipe:
        pipe(ids)
        assert pipe.stats().stages[0].max_batch == 2
    with pytest.raises(ConfigError, match=r"^stage 'mlp': max_batch 5 is above the 4 its build accepted \(the most it allows\); give 1 to 4, "
                       r"or rebuild with onnxpipe build \(--stage mlp:max_batch=5\)"):
        load(mlp, overrides={"*": {"max_batch": 5}})


def test_a_stage_built_without_batching_may_not_batch(hand: Path) -> None:
    with pytest.raises(ConfigError, match=r"^stage 'twin': max_batch 2: the stage was built without batching, so no probe checked that it can batch; "
                       r"the most it allows is 1; rebuild with onnxpipe build"):
        load(hand, overrides={"twin": {"max_batch": 2}})


def test_streams_batch_in_every_stage_or_in_none(tmp_path: Path) -> None:
    plan = split(recurrent(), ["state1N"], states="auto")
    for stage in plan.config.stages:
        stage.configure(max_batch=4)
    bundle = models.bundle_of(plan, tmp_path)
    first = plan.config.stages[0].name
    with pytest.raises(ConfigError, match=rf"stage\(s\) '{first}' of this pipeline with state have max_batch=1: .* every stage must batch them"):
        load(bundle, overrides={"0": {"max_batch": 1}})
    with load(bundle, overrides={"*": {"max_batch": 1}}) as pipe, pipe.stream() as stream:  # none batches: each step alone
        assert not pipe.streams.batched
        stream.step({"x": np.ones((1, 4), np.float32)})


def test_an_unknown_stage_is_refused_naming_the_valid_ones(hand: Path) -> None:
    with pytest.raises(ConfigError, match=r"^no stage 'twins'; closest: 'twin'; valid: 'head', 'tail', 'twin' \(or a position 0\.\.2, or \* for all\)$"):
        load(hand, overrides={"twins": {"replicas": 2}})
    with pytest.raises(ConfigError, match=r"^--set 3:replicas=2: no stage at position 3: the pipeline has 3 stage\(s\), at positions 0\.\.2$"):
        load(hand, overrides=[StageOverrides(3, {"replicas": 2}, origin="--set 3:replicas=2")])


@pytest.mark.parametrize("key", ["optimization", "target", "provider_options", "custom_ops", "session_config", "fallback", "ep_package", "batch_pad"])
def test_a_setting_that_makes_the_module_is_refused_pointing_to_build(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^'{key}' cannot change at deploy time: it makes the stage's module, or is what the build checked about it; "
                       r".*with onnxpipe build\. Deploy-time settings: intra_op_threads, inter_op_threads, execution_mode"):
        StageOverrides("*", {key: "x"})


def test_a_misspelt_setting_is_refused_naming_the_closest() -> None:
    with pytest.raises(ConfigError, match=r"^unknown stage setting 'replica'; closest: 'replicas'"):
        StageOverrides("*", {"replica": 2})


def test_malformed_overrides_are_refused_before_the_bundle_is_read(tmp_path: Path) -> None:
    missing = tmp_path / "nothing"
    with pytest.raises(ConfigError, match=r"^overrides must be StageOverrides, a list of them, or a mapping"):
        read_bundle(missing, overrides="replicas=2")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^overrides entry 'head' must map setting names to values, got 2$"):
        read_bundle(missing, overrides={"head": 2})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match=r"^stage must be '\*', a stage name or a position \(an integer >= 0\), got -1$"):
        StageOverrides(-1, {"replicas": 2})


@pytest.mark.xdist_group("ray")
def test_ray_actors_read_the_bundle_with_the_same_overrides(ray_cluster: object, tmp_path: Path) -> None:
    config = PipelineConfig("one")
    head = config.add_stage(models.stage_head(), "head", settings=StageSettings(affinity=(_lacking_core(),)))  # as built, no actor could start here
    config.input("x").connect(head.input("x"))
    head.output("h").connect(config.output("h"))
    bundle = models.bundle_of(config, tmp_path)
    core = min(os.sched_getaffinity(0))
    with load(bundle, engine="ray", overrides={"*": {"affinity": [core], "replicas": 2}}) as pipe:
        assert pipe(X)["h"].shape == (2, 4)
        assert [len(s.replicas) for s in pipe.diagnostics().stages] == [2]
        assert [(s.replicas, s.affinity) for s in pipe.stats().stages] == [(2, (core,))]
