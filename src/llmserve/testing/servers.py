"""A real `llmserve serve` in a subprocess, for tests and benchmarks: free loopback port, waits for
/health, finds the engine child, stops with a signal and reports the exit code. Leaves no file behind,
even when a test kills it: its log is an anonymous temporary file, and its temporary files (the
engine's sockets) go to a folder of its own, removed when it is stopped. `StepGateClient` holds its
engine at a step boundary (testing/step_gate.py); `wait_until` polls a condition with a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import zmq

from llmserve.testing.step_gate import GATE_ENV

_PORT_RE = re.compile(r"serving .* on http://[^:\s]+:(\d+)")


def wait_until(condition: Callable[[], Any], timeout: float = 30.0, what: str = "the condition",
               poll_s: float = 0.02) -> Any:
    """Poll `condition` until it returns something true (returned), or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll_s)


async def until(condition: Callable[[], Any], timeout: float = 10.0, what: str = "the condition",
                poll_s: float = 0.0) -> Any:
    """`wait_until` inside an event loop: re-checks after each turn of the loop (or every `poll_s`)."""
    async def poll() -> Any:
        while not (value := condition()):
            await asyncio.sleep(poll_s)
        return value

    try:
        return await asyncio.wait_for(poll(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}") from None


class StepGateClient:
    """Holds a server's engine at step boundaries. Start the server with `env=gate.env`, then:
    `gate.hold()`, `gate.run_steps(n)` (exactly n steps, then held), `gate.release()`, `gate.status()`."""

    def __init__(self, timeout: float = 30.0, addr: str | None = None) -> None:
        """addr: an engine's gate that is already there (`EngineGates.live`); else a new one of its own."""
        # The socket file's folder, removed on exit (even when a test kills the engine that bound it).
        self._dir = tempfile.mkdtemp(prefix="llmserve-gate-") if addr is None else None
        self.addr = addr or f"ipc://{self._dir}/gate"
        self.timeout = timeout
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None

    @property
    def env(self) -> dict[str, str]:
        return {GATE_ENV: self.addr}

    def _call(self, cmd: str, **args: Any) -> dict[str, Any]:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.REQ)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.addr)
        self._sock.send_json({"cmd": cmd, **args})
        if self._sock.poll(int((self.timeout + args.get("timeout", 0)) * 1000)) == 0:
            self.close()  # a REQ socket without its answer is stuck: the next call opens a new one
            raise TimeoutError(f"the engine's step gate did not answer {cmd!r}")
        answer = self._sock.recv_json()
        assert "error" not in answer, answer
        return answer

    def hold(self) -> dict[str, Any]:
        """No step after the one under way; returns once the engine stopped stepping."""
        self._call("hold")
        return self.wait()

    def release(self) -> dict[str, Any]:
        return self._call("release")

    @contextlib.contextmanager
    def held(self) -> Iterator[dict[str, Any]]:
        """`with gate.held() as start:` the engine steps only when told; released on the way out."""
        try:
            yield self.hold()
        finally:
            self.release()

    def run_steps(self, num: int) -> dict[str, Any]:
        """Let exactly `num` steps run (fewer if the work runs out), then hold; returns the status."""
        self._call("allow", n=num)
        return self.wait()

    def wait(self) -> dict[str, Any]:
        """The status once the engine stopped stepping (held with work, or idle)."""
        status = self._call("wait", timeout=self.timeout)
        assert status["state"] != "running", f"the engine kept stepping: {status}"
        return status

    def status(self) -> dict[str, Any]:
        return self._call("status")

    def wait_for(self, key: str, num: int) -> dict[str, Any]:
        """Wait until the engine received `num` requests (key "added") or aborts (key "aborted")."""
        return wait_until(lambda: (s := self.status())[key] >= num and s, self.timeout, f"{num} {key}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def __enter__(self) -> StepGateClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


class EngineGates:
    """Step gates for every engine process started with `env` (several engines under one environment:
    the replicas of a Ray Serve deployment), each on a socket named by its pid. `live()`: the addresses of
    the engine processes still running, for `StepGateClient(addr=...)`. `close()` removes the folder."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="llmserve-gates-")
        self.env = {GATE_ENV: f"ipc://{self._dir}/gate-{{pid}}"}

    def live(self) -> list[str]:
        pids = sorted(int(name.removeprefix("gate-")) for name in os.listdir(self._dir) if name.startswith("gate-"))
        return [f"ipc://{self._dir}/gate-{pid}" for pid in pids if is_alive(pid)]

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


def child_pids(pid: int) -> list[int]:
    """Direct children of a process (Linux /proc)."""
    pids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                pids.extend(int(p) for p in f.read().split())
    except FileNotFoundError:
        pass
    return pids


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class ChildServer:
    """A `llmserve <command>` HTTP server in a subprocess on a free loopback port: started and waited for
    until its log names the port and `ready_path` answers 200; stopped with a signal (then SIGKILL, with its
    children, if it does not exit in time). Its temporary files go to a folder of its own."""

    command: tuple[str, ...] = ()  # the module and subcommand after `python -m`
    port_re: re.Pattern = re.compile("")
    ready_path = "/health"

    def __init__(self, args: list[str], env: dict[str, str] | None = None, startup_timeout: float = 180.0) -> None:
        self.args = args
        self.tmp = tempfile.TemporaryDirectory(prefix=f"llmserve-{self.command[-1]}-")
        self.env = {**os.environ, "TMPDIR": self.tmp.name, **(env or {})}
        self.startup_timeout = startup_timeout
        self.log_file = tempfile.TemporaryFile("w+")  # no name: gone when closed, whatever happens
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return read_log(self.log_file.fileno())

    def start(self):
        cmd = [sys.executable, "-m", *self.command, "--host", "127.0.0.1", "--port", "0", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.command[-1]} exited with {self.proc.returncode} during startup:\n"
                                   f"{self.log()}")
            if self.port is None:
                match = self.port_re.search(self.log())
                self.port = int(match.group(1)) if match else None
            if self.port is not None and self._is_ready():
                return self
            time.sleep(0.05)  # polls the log and the ready path until the deadline
        self.stop(signal.SIGKILL)
        raise TimeoutError(f"{self.command[-1]} not ready within {self.startup_timeout} s:\n{self.log()}")

    def _is_ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}{self.ready_path}", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def send_signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Signal and wait; SIGKILL (the process and its children) if it does not exit in time."""
        if self.proc is None:
            self.tmp.cleanup()
            return None
        if self.proc.poll() is None:
            children = child_pids(self.proc.pid)
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                for pid in children:
                    _kill(pid)
                self.proc.kill()
                self.proc.wait()
        self.tmp.cleanup()
        return self.proc.returncode

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log_file.close()


class ServerProcess(ChildServer):
    """`with ServerProcess([...flags]) as server:` -> server.url, server.base_url (…/v1)."""

    command = ("llmserve.server.cli", "serve")
    port_re = _PORT_RE

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def engine_pid(self) -> int:
        """The engine-core child (multiprocessing's resource tracker is a child too)."""
        assert self.proc is not None
        pids = [pid for pid in child_pids(self.proc.pid) if b"spawn_main" in _cmdline(pid)]
        assert len(pids) == 1, f"expected one engine child, found {pids}"
        return pids[0]

    def children(self) -> list[int]:
        assert self.proc is not None
        return child_pids(self.proc.pid)


def read_log(fd: int) -> str:
    """All a child process has written to the file `fd` so far (without moving the shared offset)."""
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


SMALL_ENGINE_ARGS = ("--max-model-len", "512", "--num-kv-blocks", "512", "--max-num-seqs", "64")


def tiny_model(out_dir: str) -> str:
    """A tiny random llama checkpoint (byte-level tokenizer, ChatML template) written to out_dir."""
    from llmserve.testing.maker import make_model

    return make_model("llama", "tiny", out_dir)


def start_tiny_server(out_dir: str, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    """A server on a fresh tiny model with small engine settings; later args override earlier ones."""
    return ServerProcess(["--model", tiny_model(out_dir), *SMALL_ENGINE_ARGS, *args], env=env).start()


def metric_value(metrics_text: str, name: str) -> float:
    """The value of one unlabelled-or-single-series metric in Prometheus text (sum over its series)."""
    total, found = 0.0, False
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise KeyError(name)
    return total
