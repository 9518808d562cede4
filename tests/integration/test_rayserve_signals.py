"""`llmserve serve-ray` stopped by SIGTERM while it starts (the engine replica still loading): it stops what
it started and exits 128 + 15, with no stack dump from Ray's signal handler and no process of its session
left behind (Ray's agents used to outlive it). Polls with deadlines, no sleeps."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("ray.serve")

from llmserve.testing.router_servers import shared_tiny_model  # noqa: E402
from llmserve.testing.servers import read_log, wait_until  # noqa: E402

STARTUP_TIMEOUT_S = 240.0  # Ray and its controller on 2 shared cores
STOP_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_processes(sid: int) -> dict[int, str]:
    """Live (not zombie) processes of session `sid`: pid -> command line (Ray's actors name themselves there)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name: state, ppid, pgrp, session
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            found[int(entry)] = cmdline
    return found


def test_sigterm_while_starting_stops_everything(tmp_path_factory):
    model = shared_tiny_model(str(tmp_path_factory.getbasetemp()))
    ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    cmd = [sys.executable, "-m", "llmserve.cli", "serve-ray", "--model", model, "--dtype", "float32",
           "--max-model-len", "256", "--num-kv-blocks", "32", "--host", "127.0.0.1", "--port", str(free_port()),
           "--num-replicas", "1", "--num-cpus", "2", "--replica-num-cpus", "1", "--log-level", "warning"]
    env = {**os.environ, "RAY_TMPDIR": ray_dir, "TMPDIR": ray_dir}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            # the engine replica's actor exists: Ray is up, the application is being deployed, not served yet
            wait_until(lambda: proc.poll() is not None or
                       any("ServeReplica:llmserve:LLMReplica" in cmd for cmd in session_processes(proc.pid).values()),
                       STARTUP_TIMEOUT_S, "the replica's actor", poll_s=0.1)
            assert proc.poll() is None, read_log(log.fileno())
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(STOP_TIMEOUT_S) == 128 + signal.SIGTERM, read_log(log.fileno())
            output = read_log(log.fileno())
            assert "SIGTERM while starting: stopping" in output and "SIGTERM received" not in output, output
            wait_until(lambda: not session_processes(proc.pid), STOP_TIMEOUT_S, "no process of the session left")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pid in session_processes(proc.pid):
                os.kill(pid, signal.SIGKILL)
            shutil.rmtree(ray_dir, ignore_errors=True)
