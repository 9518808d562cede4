"""A real `llmserve route` in a subprocess, for tests and benchmarks (like server/testing.py's ServerProcess);
its log and the temporary files of the replicas it launches are removed when it is stopped."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from llmserve.server.testing import read_log

_PORT_RE = re.compile(r"routing .* on http://[^:\s]+:(\d+)")


class RouterProcess:
    def __init__(self, args: list[str], startup_timeout: float = 60.0) -> None:
        self.args = args
        self.startup_timeout = startup_timeout
        self.tmp = tempfile.TemporaryDirectory(prefix="llmserve-router-")  # its replicas' logs and sockets
        self.env = {**os.environ, "TMPDIR": self.tmp.name}
        self.log_file = tempfile.TemporaryFile("w+")  # no name: gone when closed, whatever happens
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return read_log(self.log_file.fileno())

    def start(self) -> RouterProcess:
        cmd = [sys.executable, "-m", "llmserve.router.cli", "route", "--host", "127.0.0.1", "--port", "0", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log()}")
            match = _PORT_RE.search(self.log())
            if match and self._answers(int(match.group(1))):
                self.port = int(match.group(1))
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"router not up within {self.startup_timeout} s:\n{self.log()}")

    @staticmethod
    def _answers(port: int) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.tmp.cleanup()
        return None if self.proc is None else self.proc.returncode

    def __enter__(self) -> RouterProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log_file.close()


def sample_value(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include all of `labels` (0.0 when none)."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head = line.rsplit(" ", 1)[0]
            if all(w in head for w in wanted):
                total += float(line.rsplit(" ", 1)[1])
    return total


def shared_tiny_model(base_dir: str) -> str:
    """One tiny checkpoint per test session (under pytest's base temp dir), made on first use."""
    from llmserve.server.testing import tiny_model

    path = os.path.join(base_dir, "router-tiny-model")
    if not os.path.exists(os.path.join(path, "config.json")):
        tiny_model(path)
    return path


class Chunks(httpx.AsyncByteStream):
    """A body that arrives as a stream, as over a socket (a `content=` body would count as read already)."""

    def __init__(self, *chunks):
        self.chunks = chunks

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
