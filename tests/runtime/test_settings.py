"""Stage settings split by when they may change (issue 37, item 8): ``BuildSettings`` make the module,
``DeploySettings`` are what a host may change, and ``StageSettings`` holds both as it always did (its
keyword arguments, its attributes and its ``pipeline.json`` form)."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from onnxpipe import ConfigError
from onnxpipe.runtime import BuildSettings, DeploySettings, StageOverrides, StageSettings

BUILD = [f.name for f in fields(BuildSettings)]
DEPLOY = [f.name for f in fields(DeploySettings)]
#: Every setting, as pipeline.json has listed them since its first version.
JSON_ORDER = ["target", "provider_options", "fallback", "intra_op_threads", "inter_op_threads", "execution_mode", "spinning", "affinity", "optimization",
              "session_config", "replicas", "custom_ops", "host", "max_batch", "max_delay_ms", "batch_pad", "ep_package", "ep_device", "batch_lengths"]


def test_a_stages_settings_are_its_build_settings_and_its_deploy_settings() -> None:
    assert not set(BUILD) & set(DEPLOY)
    assert sorted(f.name for f in fields(StageSettings)) == sorted(BUILD + DEPLOY) == sorted(JSON_ORDER)
    settings = StageSettings(target="cpu", intra_op_threads=2, max_batch=8)
    assert isinstance(settings, BuildSettings) and isinstance(settings, DeploySettings)
    assert (settings.target, settings.intra_op_threads, settings.max_batch, settings.replicas) == ("cpu", 2, 8, 1)


def test_what_a_host_may_change_is_the_deploy_settings_and_nothing_else() -> None:
    for name in DEPLOY:
        assert StageOverrides("*", {name: None}).settings == {name: None}  # the key is taken; its value is checked on a stage
    for name in BUILD:
        with pytest.raises(ConfigError, match=rf"^'{name}' cannot change at deploy time: .* Deploy-time settings: {', '.join(DEPLOY)}$"):
            StageOverrides("*", {name: None})


def test_pipeline_json_lists_the_settings_in_its_own_order() -> None:
    every = StageSettings(
        target="cpu", provider_options={"a": "b"}, fallback=False, intra_op_threads=2, inter_op_threads=2, execution_mode="parallel", spinning=True,
        affinity=(0, 1), optimization="basic", session_config={"session.set_denormal_as_zero": "1"}, replicas=2, custom_ops=("onnxruntime_extensions",),
        host="gpu-node", max_batch=4, max_delay_ms=1.5, batch_pad={"mask": -1.0}, batch_lengths="equal",
    )
    assert list(every.to_dict()) == [k for k in JSON_ORDER if k not in ("ep_package", "ep_device")]
    assert json.loads(json.dumps(every.to_dict())) == every.to_dict()
    assert StageSettings.from_dict(every.to_dict()) == every
    # A setting newer than the format is written only when it is set: a bundle that does not use it reads as before.
    assert list(StageSettings().to_dict()) == ["target", "provider_options", "fallback", "intra_op_threads", "inter_op_threads", "execution_mode",
                                               "spinning", "affinity", "optimization", "session_config", "replicas"]


@pytest.mark.parametrize(
    ("part", "changes", "message"),
    [
        (DeploySettings, {"max_batch": 0}, r"^max_batch must be an integer from 1 \(no batching\) to 1024, got 0$"),
        (DeploySettings, {"affinity": [-1]}, r"^affinity must be a non-empty list of core numbers >= 0, got \[-1\]$"),
        (DeploySettings, {"intra_op_threads": True}, r"^intra_op_threads must be an integer >= 0, got True$"),
        (DeploySettings, {"host": "-x"}, r"^host must be a node label value"),
        (BuildSettings, {"target": "nope"}, r"^unknown execution provider 'nope'"),
        (BuildSettings, {"optimization": "max"}, r"^unknown optimization level 'max'; valid: disable, basic, extended, all$"),
        (BuildSettings, {"session_config": {"session.intra_op.allow_spinning": "1"}}, r"^session_config key 'session.intra_op.allow_spinning' is what"),
    ],
)
def test_each_part_checks_its_own_settings_as_stage_settings_does(part: type, changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        part(**changes)
    with pytest.raises(ConfigError, match=message):
        StageSettings(**changes)  # type: ignore[arg-type]


def test_a_replicas_settings_are_stage_settings() -> None:
    settings = StageSettings(affinity=(0, 1, 2, 3), intra_op_threads=2, replicas=2, max_batch=4)
    first, second = settings.for_replica(0), settings.for_replica(1)
    assert type(first) is StageSettings and (first.affinity, second.affinity) == ((0, 1), (2, 3))
    assert first == settings.replace(affinity=(0, 1))
