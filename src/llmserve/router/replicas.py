"""Local replicas for `--autoscale`: `llmserve serve` processes on free loopback ports, started and
stopped as the pure Autoscaler (autoscaler.py) decides. A new replica joins its pool as STARTING and
takes traffic once its first /health probe passes; a removed one is drained (no new requests) and
stopped (SIGTERM) once its last request finished."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import shlex
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass

from llmserve.router.autoscaler import AutoscalePolicy, Autoscaler, LoadSample, ScaleAction
from llmserve.router.backends import Backend, Pool
from llmserve.router.config import AutoscaleConfig, BackendSpec
from llmserve.router.gateway import Gateway
from llmserve.router.health import HealthState

logger = logging.getLogger("llmserve.router")

STEP_S = 0.5  # how often the scaler samples the load
STOP_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def replica_command(config: AutoscaleConfig, port: int) -> list[str]:
    """`llmserve serve` of one replica; with no --replica-model, the server's default (the demo model)."""
    model = ["--model", config.replica_model] if config.replica_model is not None else []
    return [sys.executable, "-m", "llmserve.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            *model, "--served-model-name", config.replica_pool, *shlex.split(config.replica_args)]


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the router dies, even by SIGKILL."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass(eq=False)
class Replica:
    backend: Backend
    proc: asyncio.subprocess.Process
    log_path: str
    started_at: float


def policy_of(config: AutoscaleConfig) -> AutoscalePolicy:
    return AutoscalePolicy(config.min_replicas, config.max_replicas, config.target_waiting_per_replica,
                           config.scale_up_window_s, config.scale_down_idle_s, config.scale_cooldown_s)


class ReplicaScaler:
    def __init__(self, gw: Gateway, config: AutoscaleConfig) -> None:
        self.gw = gw
        self.config = config
        self.pool: Pool = gw.pools[config.replica_pool]
        self.autoscaler = Autoscaler(policy_of(config))
        self.replicas: list[Replica] = []
        self.stopping: set[asyncio.Task] = set()

    @property
    def num_active(self) -> int:
        return sum(1 for b in self.pool.backends if not b.is_draining)

    async def run(self) -> None:
        while True:
            try:
                await self.step(time.monotonic())
            except Exception:  # noqa: BLE001 - keep scaling after one bad round
                logger.exception("autoscaler step failed")
            await asyncio.sleep(STEP_S)

    async def step(self, now: float) -> ScaleAction:
        self._reap(now)
        sample = LoadSample(now, self.num_active, self.pool.num_waiting(), self.pool.num_in_flight())
        action = self.autoscaler.observe(sample)
        if action is ScaleAction.UP:
            await self.launch()
        elif action is ScaleAction.DOWN:
            self._drain_one()
        if action is not ScaleAction.NONE:
            self.gw.metrics.scale_events.labels(self.pool.name, action.name.lower()).inc()
            logger.info("autoscale %s: %d replica(s), %.1f waiting", action.name.lower(), self.num_active,
                        sample.num_waiting)
        self.gw.metrics.replicas.labels(self.pool.name).set(self.num_active)
        return action

    async def launch(self) -> Replica:
        port = free_port()
        log = tempfile.NamedTemporaryFile("w", prefix=f"llmserve-replica-{port}-", suffix=".log", delete=False)
        proc = await asyncio.create_subprocess_exec(*replica_command(self.config, port), stdout=log,
                                                    stderr=asyncio.subprocess.STDOUT, preexec_fn=_die_with_parent)
        log.close()
        backend = self.gw.add_backend(self.pool, BackendSpec(f"http://127.0.0.1:{port}"), HealthState.STARTING)
        replica = Replica(backend, proc, log.name, time.monotonic())
        self.replicas.append(replica)
        logger.info("launched replica %s (pid %d, log %s)", backend.url, proc.pid, log.name)
        return replica

    def _drain_one(self) -> None:
        active = [r for r in self.replicas if not r.backend.is_draining]
        if active:  # the least busy; among equals the newest
            victim = min(reversed(active), key=lambda r: r.backend.num_in_flight)
            victim.backend.is_draining = True
            logger.info("draining replica %s", victim.backend.url)

    def _reap(self, now: float) -> None:
        """Drop replicas that exited, stop drained ones, kill ones that never came up."""
        for replica in list(self.replicas):
            b = replica.backend
            is_stuck = (b.health.state is HealthState.STARTING
                        and now - replica.started_at > self.config.replica_startup_timeout_s)
            if replica.proc.returncode is not None or (b.is_draining and b.num_in_flight == 0) or is_stuck:
                if replica.proc.returncode is not None:
                    logger.warning("replica %s exited with %s (log %s)", b.url, replica.proc.returncode,
                                   replica.log_path)
                self._remove(replica)

    def _remove(self, replica: Replica) -> None:
        self.replicas.remove(replica)
        self.gw.remove_backend(self.pool, replica.backend)
        task = asyncio.ensure_future(stop_process(replica.proc))
        self.stopping.add(task)
        task.add_done_callback(self.stopping.discard)

    async def close(self) -> None:
        for replica in list(self.replicas):
            self._remove(replica)
        await asyncio.gather(*self.stopping, return_exceptions=True)


async def stop_process(proc: asyncio.subprocess.Process, timeout: float = STOP_TIMEOUT_S) -> int:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
    return proc.returncode

