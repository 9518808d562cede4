"""The engine's test-only step gate, without a process: what the loop may do after each control request."""

import os
import threading

import zmq

from llmserve.testing.step_gate import GATE_ENV, StepGate, gate_from_env
from llmserve.testing.servers import EngineGates, StepGateClient


def make_gate() -> tuple[StepGate, list[int]]:
    wakes: list[int] = []
    return StepGate(lambda: wakes.append(1)), wakes


def test_free_running_until_held_then_exactly_the_allowed_steps():
    gate, wakes = make_gate()
    assert gate.may_step() and gate.may_step()
    assert gate.handle({"cmd": "hold"})["steps"] == 2 and wakes == [1]
    assert not gate.may_step() and gate.state == "held"
    gate.handle({"cmd": "allow", "n": 3})
    assert [gate.may_step() for _ in range(4)] == [True, True, True, False]
    assert gate.handle({"cmd": "wait", "timeout": 1})["state"] == "held"
    gate.handle({"cmd": "release"})
    assert all(gate.may_step() for _ in range(10))
    assert gate.handle({"cmd": "status"}) == {"steps": 15, "state": "running", "added": 0, "aborted": 0}


def test_allowed_steps_lapse_when_the_work_runs_out():
    gate, _ = make_gate()
    gate.handle({"cmd": "allow", "n": 5})
    assert gate.may_step()
    gate.on_idle()
    assert gate.handle({"cmd": "wait", "timeout": 1})["state"] == "idle"
    assert not gate.may_step()  # a new request waits for its own allow


def test_wait_answers_once_the_loop_stops_stepping():
    gate, _ = make_gate()
    gate.handle({"cmd": "allow", "n": 2})
    answers = []
    waiter = threading.Thread(target=lambda: answers.append(gate.handle({"cmd": "wait", "timeout": 30})))
    waiter.start()
    while gate.may_step():  # the engine loop's side
        pass
    waiter.join(30)
    assert answers == [{"steps": 2, "state": "held", "added": 0, "aborted": 0}]


def test_counts_and_unknown_commands():
    gate, _ = make_gate()
    gate.on_added(2)
    gate.on_aborted(1)
    assert gate.handle({"cmd": "status"})["added"] == 2 and gate.handle({"cmd": "status"})["aborted"] == 1
    assert "error" in gate.handle({"cmd": "nope"})


def test_a_pid_address_gives_each_engine_process_its_own_socket(monkeypatch):
    """EngineGates' environment names one socket per engine process; `live()` finds this one's."""
    gates = EngineGates()
    ctx = zmq.Context()
    try:
        monkeypatch.setenv(GATE_ENV, gates.env[GATE_ENV])
        gate = gate_from_env(ctx, lambda: None)
        assert gate is not None
        [addr] = gates.live()
        assert addr.endswith(f"/gate-{os.getpid()}")
        with StepGateClient(5, addr) as client:
            assert client.status()["state"] == "idle"
    finally:
        ctx.term()
        gates.close()
