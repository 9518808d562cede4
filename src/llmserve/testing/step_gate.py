"""A test-only step gate: holds the engine-core process at a step boundary, so that lifecycle tests
(cancel, drain, kill, disconnect) assert on state instead of racing the model's speed.

Off unless the environment names a ZMQ address in `LLMSERVE_STEP_GATE` when the engine process starts
(`gate_from_env`); off, the engine loop pays one `is None` check per step. On, the loop asks
`may_step()` before each step, and a control thread answers JSON requests on a REP socket bound to that
address (`llmserve.testing.servers.StepGateClient` is the other end):

  {"cmd": "hold"}               no further step runs (a step under way finishes)
  {"cmd": "allow", "n": N}      N more steps may run, then the engine is held again
  {"cmd": "release"}            steps run freely (the state at start-up)
  {"cmd": "status"}             the counters below
  {"cmd": "wait", "timeout": T} the counters, once the engine stopped stepping (held with work, or idle)

An address with `{pid}` in it gets the engine process's pid there, so that one environment gates several
engines, each on its own socket (the replicas of a Ray Serve deployment: `llmserve.testing.servers.EngineGates`).

Counters: `steps` run, `state` ("running" | "held" | "idle"), requests `added` and `aborted` (as the
engine received them). While held the loop still takes inputs (adds, aborts, utility calls); aborted
requests report their end in the next step, so a test lets one step run after an abort.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import zmq

logger = logging.getLogger("llmserve.testing.step_gate")

GATE_ENV = "LLMSERVE_STEP_GATE"


class StepGate:
    """Engine side. `wake` nudges the engine loop (blocked on its input queue) to look again."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._cond = threading.Condition()
        self._wake = wake
        self._credits: int | None = None  # None: free-running
        self.state = "idle"
        self.num_steps = 0
        self.num_added = 0
        self.num_aborted = 0

    # ---- called by the engine loop ------------------------------------------------------------------

    def may_step(self) -> bool:
        """True (and counted) when the next step may run; else the engine is held."""
        with self._cond:
            if self._credits is not None and self._credits <= 0:
                self._set_state("held")
                return False
            if self._credits is not None:
                self._credits -= 1
            self.num_steps += 1
            self.state = "running"
            return True

    def on_idle(self) -> None:
        """No work: steps allowed but not taken lapse (a later request waits for its own `allow`)."""
        with self._cond:
            if self._credits is not None:
                self._credits = 0
            self._set_state("idle")

    def on_added(self, num: int) -> None:
        with self._cond:
            self.num_added += num

    def on_aborted(self, num: int) -> None:
        with self._cond:
            self.num_aborted += num

    def _set_state(self, state: str) -> None:
        if self.state != state:
            self.state = state
            self._cond.notify_all()

    # ---- control --------------------------------------------------------------------------------------

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        cmd = request.get("cmd")
        if cmd == "wait":
            return self._wait(float(request.get("timeout", 30.0)))
        with self._cond:
            if cmd in ("hold", "allow", "release"):
                self._credits = None if cmd == "release" else int(request.get("n", 0))
                self.state = "running"  # until the loop looks again
            elif cmd != "status":
                return {"error": f"unknown command {cmd!r}"}
            status = self._status()
        self._wake()
        return status

    def _wait(self, timeout: float) -> dict[str, Any]:
        with self._cond:
            self._cond.wait_for(lambda: self.state != "running", timeout)
            return self._status()

    def _status(self) -> dict[str, Any]:
        return {"steps": self.num_steps, "state": self.state, "added": self.num_added,
                "aborted": self.num_aborted}

    def serve(self, ctx: zmq.Context, addr: str) -> threading.Thread:
        """Answer control requests on `addr` from a daemon thread."""
        sock = ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(addr)
        thread = threading.Thread(target=self._serve_loop, args=(sock,), daemon=True, name="core-step-gate")
        thread.start()
        return thread

    def _serve_loop(self, sock: zmq.Socket) -> None:
        try:
            while True:
                sock.send_json(self.handle(sock.recv_json()))
        except zmq.ContextTerminated:
            pass  # the process is going down
        finally:
            sock.close(linger=0)


def gate_from_env(ctx: zmq.Context, wake: Callable[[], None]) -> StepGate | None:
    """The gate when LLMSERVE_STEP_GATE names an address (tests only), else None."""
    addr = os.environ.get(GATE_ENV)
    if not addr:
        return None
    addr = addr.replace("{pid}", str(os.getpid()))
    logger.warning("step gate on at %s (%s is for tests only)", addr, GATE_ENV)
    gate = StepGate(wake)
    gate.serve(ctx, addr)
    return gate
