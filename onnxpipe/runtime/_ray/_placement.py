"""Placement: what each stage replica asks Ray for, whether the cluster can take it, starting the
stage actors and finding out where they run (see Note: placement, ``_ray._engine``)."""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
import zipfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from onnxpipe._errors import BundleError, ConfigError
from onnxpipe.runtime._ortapi import SessionFacts
from onnxpipe.runtime._ray._actor import _StageActor
from onnxpipe.runtime._ray._options import HOST_LABEL, RayOptions
from onnxpipe.runtime._stage import StagePlan
from onnxpipe.runtime.bundle import MANIFEST_NAME, Bundle, sha256_file

__all__ = ["Placement", "WAIT_S"]

_GPU_PROVIDERS = {"CUDAExecutionProvider", "TensorrtExecutionProvider", "ROCMExecutionProvider", "MIGraphXExecutionProvider"}
#: How long the driver waits for actors to answer a control call (remove their files, say where they are).
WAIT_S = 2.0


class Placement:
    """Where the stage actors run: their asks, the cluster's nodes, starting the actors.

    Args:
        ray: The ``ray`` module (connected).
        plans: The stage plans, in pipeline order.
        options: The engine's options (shipping, placement timeout, restarts).
    """

    def __init__(self, ray: Any, plans: Sequence[StagePlan], options: RayOptions) -> None:
        self.ray = self._ray = ray
        self._plans = list(plans)
        self._options = options
        self.actors: list[list[Any]] = []  # per stage, per replica, once started
        #: Names the actors' private folders: onnxpipe-ray-{run_id}-{stage}-{replica} (see :meth:`folder`).
        self.run_id = uuid.uuid4().hex
        self._payload: Any = None

    def asks(self, plan: StagePlan) -> tuple[dict[str, float], dict[str, str]]:
        """The resources and labels one replica of a stage asks Ray for."""
        s = plan.stage.settings
        resources = {"CPU": float(max(s.intra_op_threads, 1))}
        if s.provider in _GPU_PROVIDERS:
            resources["GPU"] = 1.0
        return resources, ({HOST_LABEL: s.host} if s.host else {})

    def nodes(self) -> list[dict[str, Any]]:
        """The cluster's live nodes (``ray.nodes()``)."""
        return [n for n in self._ray.nodes() if n.get("Alive")]

    def cluster(self) -> str:
        """Each live node's address, labels and resources, for error messages."""
        rows = []
        for n in self.nodes():
            labels = {k: v for k, v in (n.get("Labels") or {}).items() if not k.startswith("ray.io/")}
            res = {k: v for k, v in n.get("Resources", {}).items() if k in ("CPU", "GPU")}
            rows.append(f"{n.get('NodeManagerAddress')} labels {labels or '{}'} resources {res or '{}'}")
        return "; ".join(rows) or "no live node"

    def can_place(self, plan: StagePlan) -> bool:
        """Whether a live node has the labels and resources a replica of the stage asks for."""
        resources, labels = self.asks(plan)
        for n in self.nodes():
            have = n.get("Resources", {})
            node_labels = n.get("Labels") or {}
            if all(node_labels.get(k) == v for k, v in labels.items()) and all(have.get(k, 0) >= v for k, v in resources.items()):
                return True
        return False

    def describe_ask(self, plan: StagePlan) -> str:
        """What a replica of the stage asks for, in words."""
        resources, labels = self.asks(plan)
        ask = ", ".join(f"{k} {v:g}" for k, v in resources.items())
        return ask + (f" on a node labelled {HOST_LABEL}={labels[HOST_LABEL]}" if labels else "")

    def check_feasible(self) -> None:
        """Refuse at once a stage no live node can take.

        Raises:
            ConfigError: naming the stage, what it asks for and what the cluster has.
        """
        for plan in self._plans:
            if not self.can_place(plan):
                raise ConfigError(f"stage '{plan.stage.name}' asks for {self.describe_ask(plan)}; no node of the cluster can take it. "
                                  f"The cluster has: {self.cluster()}")

    def folder(self, i: int, r: int) -> str:
        """The private folder of replica ``r`` of stage ``i`` on its node (in its temporary folder)."""
        return f"onnxpipe-ray-{self.run_id}-{i}-{r}"

    def start(self, bundle: Bundle, target: str | None, source: str | os.PathLike[str] | None, returns: Sequence[Sequence[str]]) -> list[list[dict[str, Any]]]:
        """Start every replica's actor (see Note: the bundle an actor reads) and wait until each is
        ready; what each said about itself (``_StageActor.ready``). ``returns``: per stage, the
        outputs its actors return.

        Raises:
            ConfigError: a stage was not placed within ``placement_timeout_s``.
            BundleError: an actor refused the bundle or could not make its session.
        """
        ray = self._ray
        manifest_sha = sha256_file(bundle.root / MANIFEST_NAME)
        if self._options.shared:
            if source is None:
                raise ConfigError("RayOptions(shared=True) needs the bundle's path: load it with runtime.load(path, ...)")
            payload, path = None, os.path.abspath(source)
        else:
            # One object for every node: Ray copies it to a node once, however many actors read it there.
            payload, path = ray.put(np.frombuffer(_pack(bundle), np.uint8)), None
        self._payload = payload  # kept for as long as the engine runs: a restarting actor reads it again
        remote = ray.remote(concurrency_groups={"control": 1})(_StageActor)  # ready/diagnose/shutdown answer while a run is in progress
        limits = dataclasses.asdict(bundle.limits)
        for i, plan in enumerate(self._plans):
            resources, labels = self.asks(plan)
            options: dict[str, Any] = {"num_cpus": resources["CPU"], "num_gpus": resources.get("GPU", 0), "max_restarts": self._options.max_restarts,
                                       "max_task_retries": 0}
            if labels:
                options["label_selector"] = labels
            self.actors.append([remote.options(**options).remote(payload, path, manifest_sha, limits, i, r, target, self.folder(i, r), returns[i],
                                                                 list(bundle.allow_code), plan.stage.name, list(bundle.overrides))
                                for r in range(plan.stage.settings.replicas)])
        return self._ready()

    def _ready(self) -> list[list[dict[str, Any]]]:
        """Wait for every actor to answer; what each said."""
        calls = {self.ping(actor): (i, r) for i, row in enumerate(self.actors) for r, actor in enumerate(row)}
        ready, pending = self._ray.wait(list(calls), num_returns=len(calls), timeout=self._options.placement_timeout_s)
        if pending:
            late = sorted({calls[ref][0] for ref in pending})
            names = ", ".join(f"'{self._plans[i].stage.name}' (asks for {self.describe_ask(self._plans[i])})" for i in late)
            raise ConfigError(f"stage(s) {names} not placed within {self._options.placement_timeout_s:g} s "
                              f"(the nodes that could take them are busy). The cluster has: {self.cluster()}")
        infos: list[list[dict[str, Any]]] = [[{} for _ in row] for row in self.actors]
        for ref in ready:
            i, r = calls[ref]
            try:
                info = self._ray.get(ref)
            except self._ray.exceptions.RayError as e:
                raise BundleError(f"stage '{self._plans[i].stage.name}' replica {r}: its actor failed to start: {e}") from None
            if info["error"]:
                raise BundleError(f"stage '{self._plans[i].stage.name}' replica {r} on {info['host']}: {info['error']}")
            infos[i][r] = info
        return infos

    def ping(self, actor: Any) -> Any:
        """Ask an actor where it runs (``_StageActor.ready``), beside any run in progress."""
        return actor.ready.options(concurrency_group="control").remote()

    @staticmethod
    def session_facts(infos: Sequence[Sequence[dict[str, Any]]]) -> list[SessionFacts]:
        """The first replica's session facts of each ONNX stage, in pipeline order, from what the actors said."""
        return [SessionFacts.from_dict(row[0]["facts"]) for row in infos if row and row[0].get("facts") is not None]

    def diagnose(self, actors: Sequence[Any]) -> list[dict[str, Any] | None]:
        """Ask each actor where it runs and what it holds (``_StageActor.diagnose``), beside any run
        in progress; None for one that does not answer in time (it died, or is restarting)."""
        calls = [actor.diagnose.options(concurrency_group="control").remote() for actor in actors]
        ready, _ = self._ray.wait(calls, num_returns=len(calls), timeout=WAIT_S * 5)
        done = set(ready)
        answers: list[dict[str, Any] | None] = []
        for ref in calls:
            try:
                answers.append(self._ray.get(ref) if ref in done else None)
            except self._ray.exceptions.RayError:
                answers.append(None)  # died meanwhile: the next call to it finds out
        return answers

    def node_facts(self) -> dict[str, tuple[str | None, dict[str, str]]]:
        """Each node's address and labels (Ray's own ``ray.io/`` labels left out), by node id."""
        return {n["NodeID"]: (n.get("NodeManagerAddress"), {k: v for k, v in (n.get("Labels") or {}).items() if not k.startswith("ray.io/")})
                for n in self._ray.nodes()}

    def shut_down(self, actors: Sequence[Any]) -> None:
        """Have actors remove their files (waiting a little), then kill every actor."""
        if actors:
            self._ray.wait([actor.shutdown.options(concurrency_group="control").remote() for actor in actors], num_returns=len(actors), timeout=WAIT_S)
        self.kill_all()

    def kill_all(self) -> None:
        """Kill every actor started, for good (no restart)."""
        for row in self.actors:
            for actor in row:
                self._ray.kill(actor, no_restart=True)


def _pack(bundle: Bundle) -> bytes:
    """The checked bundle as one archive, for the object store: exactly the files its manifest lists."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as zf:
        zf.write(bundle.root / MANIFEST_NAME, MANIFEST_NAME)
        for rel in sorted(bundle.manifest.files):
            kept = bundle.in_archive.get(rel)
            if kept is None:
                zf.write(bundle.root / rel, rel)
                continue
            with open(kept.location, "rb") as src, zf.open(zipfile.ZipInfo(rel), "w", force_zip64=True) as dst:
                src.seek(kept.offset)
                left = kept.size
                while left:
                    chunk = src.read(min(left, 1 << 20))
                    if not chunk:
                        raise BundleError(f"bundle file '{rel}' ended early while it was packed for the cluster")
                    dst.write(chunk)
                    left -= len(chunk)
    return buffer.getvalue()
