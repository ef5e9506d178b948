"""The command line's stage settings: ``--set``'s help names the settings a host may change."""

from __future__ import annotations

import re
from dataclasses import fields

from onnxpipe.cli import main
from onnxpipe.cli._stageopts import STAGE_KEYS
from onnxpipe.runtime import DeploySettings


def test_set_help_names_every_deploy_time_setting_and_no_other() -> None:
    # The help is written out (onnxpipe --help imports no onnxruntime, so it cannot ask DeploySettings): this keeps it true.
    deploy = {f.name for f in fields(DeploySettings)}
    keys = {key for key, (name, _) in STAGE_KEYS.items() if name in deploy}
    for command in ("serve", "run", "bench", "verify", "inspect", "rebundle"):
        (option,) = [p for p in main.commands[command].params if p.name == "settings"]
        listed = re.search(r"keys \(KEY=VALUE,KEY=VALUE\.\.\.\): (.*?)\. SEL", option.help or "")
        assert listed is not None, command
        assert {re.sub(r" \(.*\)$", "", k) for k in listed.group(1).split(", ")} == keys, command
