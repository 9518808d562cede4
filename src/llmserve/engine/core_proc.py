"""The engine-core process: a ZMQ loop around EngineCore.

Wire (msgpack via msgspec, never pickle), each message two frames `[kind byte, payload]`:
  front -> core (PUSH -> PULL):  ADD EngineCoreRequest | ABORT list[str] | UTILITY UtilityCall | SHUTDOWN
  core -> front (PUSH -> PULL):  READY ReadyMessage | OUTPUTS EngineCoreOutputs | UTILITY UtilityResult
                                 | FAILED str (the core is going down with this error)

Threads: the input thread receives and decodes (and watches the parent), the main thread runs
`step()` while there is work, the output thread encodes and sends, so socket IO overlaps the forward.
The core follows its parent: it ignores SIGINT/SIGTERM (the front drains, then sends SHUTDOWN) and
exits on its own when the front process is gone.

Tests can hold the loop at a step boundary (testing/step_gate.py, loaded only when LLMSERVE_STEP_GATE is set).
"""

from __future__ import annotations

import enum
import logging
import os
import queue
import signal
import threading
from typing import Any

import msgspec
import zmq

from llmserve.config import EngineConfig
from llmserve.messages import EngineCoreRequest

logger = logging.getLogger("llmserve.engine.core_proc")

PARENT_POLL_MS = 500  # how often the input thread checks that the front is alive
IDLE_POLL_S = 1.0


class InKind(enum.IntEnum):
    ADD = 0
    ABORT = 1
    UTILITY = 2
    SHUTDOWN = 3
    WAKE = 4  # internal: the step gate changed (never on the wire)


class OutKind(enum.IntEnum):
    READY = 0
    OUTPUTS = 1
    UTILITY = 2
    FAILED = 3


class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    method: str
    args: list[Any] = []


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None


class ReadyMessage(msgspec.Struct):
    model_info: dict[str, Any]  # llmserve.model.loader.ModelInfo as builtins
    num_kv_blocks: int
    pid: int
    max_num_seqs: int  # resolved for the engine's device (the front's backpressure reads it)
    kv_port: int = 0  # a decode server's bound KV receiver port (--disaggregation-kv-port 0: the system's pick)


def frames(kind: int, payload: Any) -> list[bytes]:
    return [bytes((kind,)), msgspec.msgpack.encode(payload)]


_DECODERS = {
    InKind.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
    InKind.ABORT: msgspec.msgpack.Decoder(list[str]),
    InKind.UTILITY: msgspec.msgpack.Decoder(UtilityCall),
    InKind.SHUTDOWN: msgspec.msgpack.Decoder(),
}


def decode_input(kind_frame: bytes, payload: bytes) -> tuple[InKind, Any]:
    kind = InKind(kind_frame[0])
    return kind, _DECODERS[kind].decode(payload)


# ---- the process entry ----------------------------------------------------------------------------


def run_engine_core(config_bytes: bytes, input_addr: str, output_addr: str, parent_pid: int) -> None:
    """Entry of the spawned process. `config_bytes` is the msgpack of an EngineConfig."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [engine] %(message)s")
    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    ctx = zmq.Context()
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.SNDHWM, 0)
    out_sock.setsockopt(zmq.LINGER, 5000)
    out_sock.connect(output_addr)
    try:
        exit_code = _build_and_run(config, ctx, input_addr, out_sock, parent_pid)
    finally:
        out_sock.close(linger=2000)
        ctx.term()
    os._exit(exit_code)  # skip interpreter teardown (torch threads); sockets are flushed above


def _build_and_run(config: EngineConfig, ctx: zmq.Context, input_addr: str, out_sock: zmq.Socket,
                   parent_pid: int) -> int:
    """0 after SHUTDOWN (or the front's death); 1 after telling the front why it failed."""
    try:
        core = _build_core(config)
    except ValueError as e:  # a bad flag or model: the front prints the message once, as its own error
        out_sock.send_multipart(frames(OutKind.FAILED, f"{type(e).__name__}: {e}"))
        return 1
    except Exception as e:  # noqa: BLE001 - report it to the front, then die
        logger.exception("engine core failed to start")
        out_sock.send_multipart(frames(OutKind.FAILED, f"{type(e).__name__}: {e}"))
        return 1
    try:
        EngineCoreProc(core, ctx, input_addr, out_sock, parent_pid).run()
    except Exception as e:  # noqa: BLE001 - report it to the front, then die
        logger.exception("engine core failed")
        out_sock.send_multipart(frames(OutKind.FAILED, f"{type(e).__name__}: {e}"))
        return 1
    finally:
        core.shutdown()  # the other tensor-parallel ranks, if any
    return 0


def _build_core(config: EngineConfig):
    from llmserve.engine.engine_core import EngineCore

    return EngineCore(config, is_served=True)


class EngineCoreProc:
    """The busy loop: drain inputs, step while there is work, block on inputs when idle."""

    def __init__(self, core, ctx: zmq.Context, input_addr: str, out_sock: zmq.Socket, parent_pid: int) -> None:
        self.core = core
        self.inputs: queue.Queue[tuple[InKind, Any]] = queue.Queue()
        self.outputs: queue.Queue[list[bytes] | None] = queue.Queue()
        self.parent_pid = parent_pid
        self.is_stopping = False
        self.is_integrity_checked = True
        self.gate = None  # tests only: a gate that holds the loop at step boundaries
        if os.environ.get("LLMSERVE_STEP_GATE"):
            from llmserve.testing.step_gate import gate_from_env

            self.gate = gate_from_env(ctx, lambda: self.inputs.put((InKind.WAKE, None)))
        self._utilities = {
            "reset_prefix_cache": core.reset_prefix_cache,
            "check_integrity": self._check_integrity,
            "ping": lambda: True,
        }
        self.input_thread = threading.Thread(target=self._input_loop, args=(ctx, input_addr), daemon=True,
                                             name="core-input")
        self.output_thread = threading.Thread(target=self._output_loop, args=(out_sock,), daemon=True,
                                              name="core-output")
        if core.tp_executor is not None:
            core.tp_executor.on_failure = self._fail_fast
        core.interrupt_windows_on_input(lambda: not self.inputs.empty())  # arrivals end a multi-step early

    def _fail_fast(self, reason: str) -> None:
        """A tensor-parallel rank died (the executor's monitor thread calls this): tell the front and exit
        now, since the step loop may be waiting in a collective that would only end at its timeout."""
        self.outputs.put(frames(OutKind.FAILED, f"WorkerDied: {reason}"))
        self.outputs.put(None)
        self.output_thread.join(timeout=5)
        self.core.tp_executor.kill_ranks()
        os._exit(1)

    def run(self) -> None:
        self.output_thread.start()
        info = self.core.model_info
        config = self.core.config
        self.outputs.put(frames(OutKind.READY, ReadyMessage(msgspec.to_builtins(info), self.core.num_blocks,
                                                            os.getpid(), config.scheduler.max_num_seqs,
                                                            config.kv_transfer.disaggregation_kv_port)))
        self.input_thread.start()
        try:
            while not self.is_stopping:
                self._wait_for_work()
                self._drain_inputs()
                if not self.core.has_unfinished_requests():
                    continue
                if self.gate is not None and not self.gate.may_step():
                    self._wait_for_input()  # held at the step boundary (tests only)
                    continue
                self.is_integrity_checked = False
                self.outputs.put(frames(OutKind.OUTPUTS, self.core.step()))
        finally:
            self.outputs.put(None)
            self.output_thread.join(timeout=5)

    def _wait_for_work(self) -> None:
        """Block on the input queue while idle (checking the cache's invariants once per idle period)."""
        while not self.is_stopping and not self.core.has_unfinished_requests():
            if not self.is_integrity_checked:
                self._check_integrity()
                self.is_integrity_checked = True
            if self.gate is not None:
                self.gate.on_idle()
            self._wait_for_input()

    def _wait_for_input(self) -> None:
        try:
            self._handle(*self.inputs.get(timeout=IDLE_POLL_S))
        except queue.Empty:
            pass

    def _drain_inputs(self) -> None:
        while True:
            try:
                self._handle(*self.inputs.get_nowait())
            except queue.Empty:
                return

    def _handle(self, kind: InKind, payload: Any) -> None:
        if kind == InKind.ADD:
            self.core.add_request(payload)
        elif kind == InKind.ABORT:
            self.core.abort_requests(payload)
        elif kind == InKind.UTILITY:
            self.outputs.put(frames(OutKind.UTILITY, self._call_utility(payload)))
        elif kind == InKind.SHUTDOWN:
            self.is_stopping = True
        if self.gate is not None:
            self._count_input(kind, payload)

    def _count_input(self, kind: InKind, payload: Any) -> None:
        if kind == InKind.ADD:
            self.gate.on_added(1)
        elif kind == InKind.ABORT:
            self.gate.on_aborted(len(payload))

    def _call_utility(self, call: UtilityCall) -> UtilityResult:
        method = self._utilities.get(call.method)
        if method is None:
            return UtilityResult(call.call_id, error=f"unknown utility {call.method!r}")
        try:
            return UtilityResult(call.call_id, msgspec.to_builtins(method(*call.args)))
        except Exception as e:  # noqa: BLE001 - the caller gets the error text
            logger.exception("utility %s failed", call.method)
            return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")

    def _check_integrity(self) -> bool:
        """Invariants broken mean corrupted outputs: fail loudly (the front sees the core die)."""
        self.core.check_integrity()
        return True

    # ---- IO threads -------------------------------------------------------------------------------

    def _input_loop(self, ctx: zmq.Context, input_addr: str) -> None:
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(input_addr)
        try:
            self._receive_inputs(sock)
        except zmq.ContextTerminated:
            pass  # the process is going down
        finally:
            sock.close(linger=0)

    def _receive_inputs(self, sock: zmq.Socket) -> None:
        while True:
            if sock.poll(PARENT_POLL_MS) == 0:
                if os.getppid() != self.parent_pid:
                    logger.error("the front process is gone; the engine core exits")
                    self.inputs.put((InKind.SHUTDOWN, None))
                    return
                continue
            kind_frame, payload = sock.recv_multipart()
            kind, msg = decode_input(kind_frame, payload)
            self.inputs.put((kind, msg))
            if kind == InKind.SHUTDOWN:
                return

    def _output_loop(self, sock: zmq.Socket) -> None:
        while True:
            item = self.outputs.get()
            if item is None:
                return
            sock.send_multipart(item, copy=False)

