"""Shared test set-up. Tiny models live in tests/models.py; real ones in the onnx wheel. The one
real Ray cluster of the session is here, for the engine's tests and the server's on Ray (both in
xdist group "ray", so one worker holds it: see Note: xdist groups)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
import pytest

from tests import models
from tests.decoder_exports import LLAMA

# The onnx light models carry unused initializers; onnxruntime warns about each one.
ort.set_default_logger_severity(3)


ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """Note: bytecode once. The suite starts a few hundred Python processes that import onnxpipe from
    this checkout (``onnxpipe serve`` and CLI runs, the Ray cluster's workers, notebook kernels).
    Where ``PYTHONDONTWRITEBYTECODE`` is set none of them writes what it compiles, so each one
    compiled onnxpipe from source again (tests/serve/test_lifecycle.py, which starts servers, took a
    fifth less CPU time with the compiled files there). The controller compiles the checkout's own
    packages once, before the workers start, into the ``__pycache__`` folders any Python writes
    without that variable (git ignores them); every process then reads them, and Python checks each
    against its source's size and time, so a stale one is never used. Where the checkout cannot be
    written this does nothing."""
    if hasattr(config, "workerinput"):
        return
    import compileall
    import re

    test_modules = re.compile(r"[/\\](test_\w*|conftest)\.py$")  # pytest compiles these itself, rewriting their asserts
    for package in ("onnxpipe", "examples/onnxpipe_examples", "benchmarks", "tests"):
        compileall.compile_dir(ROOT / package, quiet=2, rx=test_modules)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Note: xdist groups. ``--dist loadgroup`` (pyproject's addopts) sends the tests of one
    ``xdist_group`` to one worker, so a module- or session-scoped fixture they share (the Ray cluster,
    the planner run of tests/planner/test_planner_concurrency.py, tests/serve/test_logs.py's servers)
    is made once. The group travels from the worker to the scheduler as a suffix of the test's id
    (``test_x@ray``), which pytest-xdist 3.8 writes into ``item._nodeid``; pytest 9.2 keeps the id in a
    structured ``item._id`` and ignores it, so every group was silently spread over both workers and
    each worker built the fixtures again (pytest-dev/pytest-xdist#1386). On a worker where xdist's
    suffix did not take, it is written here where pytest 9.2 reads it; tests/test_xdist_groups.py
    fails when neither took."""
    if not getattr(config.option, "loadgroup", False) or not hasattr(config, "workerinput"):
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # a pytest before 9.2: xdist's own suffix works there
        return
    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(groups)
        if groups and not item.nodeid.endswith(suffix) and hasattr(item, "_id"):
            item._id = NodeId.parse(item.nodeid + suffix)


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real Ray cluster on this machine: a driver-only head and two worker nodes labelled
    ``onnxpipe/host=a`` and ``b``, on loopback, quiet, with small object stores, its files under the
    test's tmp; shut down through Ray's API. Yields the ``ray.cluster_utils.Cluster``; the tests that
    need a node of their own add and remove it. Skips without ray (``pip install 'onnxpipe[ray]'``)."""
    # Short, private and removed at the end: Ray's Unix socket paths (temp_dir/session_.../sockets/...)
    # must stay under 108 bytes, which pytest's own tmp folders under xdist exceed.
    root = Path(tempfile.mkdtemp(prefix="onnxpipe-ray-"))
    # Set before ray is imported: it reads them then.
    env = {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # loopback node addresses, as Ray documents for local clusters
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "RAY_TMPDIR": str(root),  # ray_current_cluster and sessions go here, not /tmp/ray
        # The nodes' processes (and so the actors' private bundle folders) inherit it: a folder an
        # actor could not remove (its node was removed under it) goes with the cluster, not into /tmp.
        "TMPDIR": str(root / "nodes"),
    }
    (root / "nodes").mkdir()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    ray = pytest.importorskip("ray", reason="the Ray engine tests need Ray: pip install 'onnxpipe[ray]'")
    from ray.cluster_utils import Cluster

    (root / "ray").mkdir()
    common = {"node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20, "include_dashboard": False, "temp_dir": str(root / "ray")}
    # Nodes that stop answering are declared dead after about 1.5 s instead of Ray's default 30 s.
    health = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 3}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": health, **common})
    cluster.common_node_args = common  # type: ignore[attr-defined]
    try:
        for host in ("a", "b"):
            cluster.add_node(num_cpus=2, labels={"onnxpipe/host": host}, **common)
        ray.init(address=cluster.address, logging_level="error", log_to_driver=False)
        yield cluster
    finally:
        ours = cluster_processes(cluster)
        ray.shutdown()
        cluster.shutdown()
        deadline = time.monotonic() + 10
        while [p for p in ours if _alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    left = [p for p in ours if _alive(p)]
    shutil.rmtree(root, ignore_errors=True)
    assert left == [], f"Ray processes of the test cluster still running: {left}"


def cluster_processes(cluster: Any) -> set[int]:
    """The processes of a ``ray.cluster_utils.Cluster`` now: its nodes' own (GCS, raylets, ...) and
    every process below them, its workers and actors among them. Other Ray clusters on the machine
    (another test run's) are not in it."""
    return _descendants({p.process.pid for node in cluster.list_all_nodes() for ps in node.all_processes.values() for p in ps})


def _descendants(roots: set[int]) -> set[int]:
    """``roots`` and every process below them (read from /proc: never by name)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found = set(roots)
    grew = True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in found} - found
        grew = bool(more)
        found |= more
    return found


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def hand(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bundle of models.hand_wired() (head -> twin -> tail, x[N,4] -> y[N,4]), built with the
    defaults (1 thread, no pinning, 1 replica), once per module: do not modify it."""
    return models.bundle_of(models.hand_wired(), tmp_path_factory.mktemp("hand"))


@pytest.fixture(scope="module")
def failing(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bundle of models.failing_config() (head -> reshape, which fails for any N but 2), once per
    module: do not modify it."""
    return models.bundle_of(models.failing_config("failing"), tmp_path_factory.mktemp("failing"))


@pytest.fixture(scope="module")
def llama() -> onnx.ModelProto:
    """optimum's Llama export (tests/data/decoders/optimum-llama), loaded once per module."""
    return onnx.load(LLAMA)


@pytest.fixture(scope="module")
def squeezenet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the onnx wheel's squeezenet for the module, so the profile cache written
    next to it stays in a temporary folder and starts empty in each module."""
    folder = tmp_path_factory.mktemp("squeezenet")
    return Path(shutil.copy(models.light_model_path("squeezenet"), folder / "squeezenet.onnx"))
