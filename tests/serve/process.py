"""A real ``onnxpipe serve`` process on loopback ports, for the tests to drive with real clients."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
_START_S = 90.0
_STOP_S = 60.0


def free_ports(count: int) -> list[int]:
    """Ports nothing listens on now (the OS's choice), distinct."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class ServerProcess:
    """``onnxpipe serve ARGS`` in a subprocess (cwd: the repository, so ``tests.*`` code stages import).

    Args:
        args: What follows ``onnxpipe serve`` (bundles, options); the ports are added unless given.
        env: Extra environment variables.
        root: The checkout whose onnxpipe runs (``benchmarks.serve_faults --against`` runs an older one).
    """

    def __init__(self, *args: object, env: dict[str, str] | None = None, grpc: bool = True, root: Path = ROOT) -> None:
        self.root = root
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        self.args = [str(a) for a in args]
        if "--http-port" not in self.args:
            self.args += ["--http-port", str(self.http_port)]
        if "--grpc-port" not in self.args:
            self.args += ["--grpc-port", str(self.grpc_port if grpc else 0)]
        if "--metrics-port" not in self.args:  # a free one each: parallel servers would all take 8002
            self.args += ["--metrics-port", str(self.metrics_port)]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.log_path: Path | None = None

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics(self) -> str:
        return f"127.0.0.1:{self.metrics_port}"

    def start(self, log: Path, wait: bool = True) -> ServerProcess:
        """Start it, its output going to ``log``; with ``wait``, until ready (or fail with its log)."""
        self.log_path = log
        handle = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "onnxpipe.cli", "serve", *self.args], cwd=self.root, env=self.env, stdout=handle, stderr=subprocess.STDOUT, text=True
        )
        handle.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + _START_S
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"onnxpipe serve exited with {self.proc.returncode}:\n{self.log()}")
            if self.get("/v2/health/ready")[0] == 200:
                return
            time.sleep(0.05)
        raise AssertionError(f"onnxpipe serve was not ready within {_START_S:g} s:\n{self.log()}")

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """``GET path``: (status, body); status 0 when nothing answers."""
        return self.request("GET", path, headers=headers)

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None, timeout: float = 30,
                port: int | None = None) -> tuple[int, bytes]:
        """``METHOD path`` on the HTTP port (or ``port``): (status, body); status 0 when nothing answers."""
        where = self.http if port is None else f"127.0.0.1:{port}"
        req = urllib.request.Request(f"http://{where}{path}", data=body, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, b""

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path is not None and self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, within: float = _STOP_S) -> int:
        """Send ``sig``, wait for the exit (``within`` seconds at most: a test gives less to tell an
        exit that did not wait for one of the server's timeouts from one that did); its exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(within)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"onnxpipe serve did not exit within {within:g} s of signal {sig}:\n{self.log()}") from None

    def __enter__(self) -> ServerProcess:
        return self

    def kill(self) -> None:
        """Kill the server if it is still running (no drain), and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __exit__(self, *exc: Any) -> None:
        self.kill()


def read_head(sock: socket.socket) -> bytes:
    """What ``sock`` receives up to the end of an HTTP answer's head (less where it closes first)."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(65536)
        if not chunk:
            break
        answer += chunk
    return answer


def unread_bytes(sock: socket.socket) -> int:
    """What this connected client socket sent that the process at its other end has not read yet:
    its own send queue plus the peer's receive queue (both on loopback, from /proc/net/tcp; a byte
    the peer took but has not acknowledged yet counts twice, so it is never less than the truth)."""
    here, there = sock.getsockname()[1], sock.getpeername()[1]
    queued = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16)
        tx, rx = (int(v, 16) for v in fields[4].split(":"))
        if (local, remote) == (here, there):
            queued += tx
        elif (local, remote) == (there, here):
            queued += rx
    return queued
