"""The front's client of the engine-core process (see core_proc for the wire).

Sends are non-blocking (unbounded PUSH queue); a background task reads outputs and awaits
`on_outputs` for each step's (which may yield to the event loop; the next step's wait meanwhile). The process's death is noticed through its sentinel (and a FAILED message when the core
could say why): `on_dead` runs once, every pending utility call fails, and `dead_reason` is set.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from llmserve.config import EngineConfig
from llmserve.engine.core_proc import (InKind, OutKind, ReadyMessage, UtilityCall, UtilityResult, frames,
                                       run_engine_core)
from llmserve.messages import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger("llmserve.engine.core_client")


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can be served any more."""


_OUTPUTS_DECODER = msgspec.msgpack.Decoder(EngineCoreOutputs)
_UTILITY_DECODER = msgspec.msgpack.Decoder(UtilityResult)
_READY_DECODER = msgspec.msgpack.Decoder(ReadyMessage)
_FAILED_DECODER = msgspec.msgpack.Decoder(str)


def _ipc_addr(tag: str) -> str:
    return f"ipc://{tempfile.gettempdir()}/llmserve-{os.getpid()}-{uuid.uuid4().hex[:8]}-{tag}"


class EngineCoreClient:
    """Owns the engine process and its two sockets. Create with `await EngineCoreClient.start(config)`."""

    def __init__(self, proc: multiprocessing.process.BaseProcess, ctx: zmq.asyncio.Context, in_sock: zmq.Socket,
                 out_sock: zmq.asyncio.Socket, ready: ReadyMessage) -> None:
        self.proc = proc
        self.ctx = ctx
        self.in_sock = in_sock
        self.out_sock = out_sock
        from llmserve.model.loader import ModelInfo  # imports torch: only once the core is spawned

        self.model_info = msgspec.convert(ready.model_info, ModelInfo)
        self.num_kv_blocks = ready.num_kv_blocks
        self.max_num_seqs = ready.max_num_seqs
        self.kv_port = ready.kv_port
        self.on_outputs: Callable[[EngineCoreOutputs], Awaitable[None]] = _ignore_outputs
        self.on_dead: Callable[[str], None] = lambda reason: None
        self.dead_reason: str | None = None
        self.last_output_time = time.monotonic()
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._is_shutting_down = False
        self._reader: asyncio.Task | None = None

    @classmethod
    async def start(cls, config: EngineConfig, startup_timeout: float = 600.0) -> EngineCoreClient:
        ctx = zmq.asyncio.Context()
        in_addr, out_addr = _ipc_addr("in"), _ipc_addr("out")
        in_sock = zmq.Context.shadow(ctx.underlying).socket(zmq.PUSH)
        in_sock.setsockopt(zmq.SNDHWM, 0)
        in_sock.setsockopt(zmq.LINGER, 0)
        in_sock.bind(in_addr)
        out_sock = ctx.socket(zmq.PULL)
        out_sock.setsockopt(zmq.RCVHWM, 0)
        out_sock.setsockopt(zmq.LINGER, 0)
        out_sock.bind(out_addr)
        # A tensor-parallel core spawns its ranks, which a daemonic process may not; it still exits when the
        # front is gone (core_proc watches its parent) and shutdown() kills it when it does not.
        proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(msgspec.msgpack.encode(config), in_addr, out_addr, os.getpid()),
            name="llmserve-engine-core", daemon=config.parallel.tensor_parallel_size == 1)
        proc.start()
        try:
            ready = await _wait_ready(proc, out_sock, startup_timeout)
        except BaseException:
            _kill(proc)
            in_sock.close()
            out_sock.close()
            ctx.term()
            raise
        client = cls(proc, ctx, in_sock, out_sock, ready)
        client._start_watching()
        return client

    # ---- sending ------------------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def _send(self, kind: InKind, payload: Any) -> None:
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        if self._is_shutting_down:
            raise EngineDeadError("the engine is shutting down")
        self.in_sock.send_multipart(frames(kind, payload), flags=zmq.NOBLOCK, copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(InKind.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Fire and forget; nothing to abort once the engine is dead or shutting down (it frees all)."""
        if request_ids and not self.is_dead and not self._is_shutting_down:
            self._send(InKind.ABORT, request_ids)

    async def call_utility(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self._send(InKind.UTILITY, UtilityCall(call_id, method, list(args)))
            result: UtilityResult = await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)
        if result.error is not None:
            raise RuntimeError(f"engine utility {method} failed: {result.error}")
        return result.result

    # ---- receiving and watching ---------------------------------------------------------------------

    def _start_watching(self) -> None:
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read_loop(), name="engine-core-reader")
        loop.add_reader(self.proc.sentinel, self._on_process_exit)

    async def _read_loop(self) -> None:
        try:
            while True:
                kind_frame, payload = await self.out_sock.recv_multipart(copy=False)
                self.last_output_time = time.monotonic()
                await self._dispatch(OutKind(kind_frame.bytes[0]), payload.buffer)
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as e:
            if not self._is_shutting_down:
                self._mark_dead(f"engine output socket failed: {e}")
        except Exception as e:  # noqa: BLE001 - a bug in output handling must not hang every request
            logger.exception("error while handling engine outputs")
            self._mark_dead(f"error while handling engine outputs: {type(e).__name__}: {e}")

    async def _dispatch(self, kind: OutKind, payload: memoryview) -> None:
        if kind == OutKind.OUTPUTS:
            await self.on_outputs(_OUTPUTS_DECODER.decode(payload))
        elif kind == OutKind.UTILITY:
            result = _UTILITY_DECODER.decode(payload)
            future = self._calls.get(result.call_id)
            if future is not None and not future.done():
                future.set_result(result)
        elif kind == OutKind.FAILED:
            self._mark_dead(f"engine core failed: {_FAILED_DECODER.decode(payload)}")

    def _on_process_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self.proc.sentinel)
        if not self._is_shutting_down:
            # Let a FAILED message that is already on its way arrive first; it says why.
            asyncio.get_running_loop().call_later(0.2, self._on_unexpected_exit)

    def _on_unexpected_exit(self) -> None:
        self.proc.join(1.0)  # the sentinel closes a moment before the exit status exists
        self._mark_dead(f"engine core process exited unexpectedly (exit code {self.proc.exitcode})")

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        logger.error("%s", reason)
        self.dead_reason = reason
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self.on_dead(reason)

    # ---- shutdown -----------------------------------------------------------------------------------

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the core to exit, wait for it, kill it if it does not; close the sockets."""
        self._is_shutting_down = True
        if self.proc.is_alive() and not self.is_dead:
            self.in_sock.send_multipart(frames(InKind.SHUTDOWN, None), flags=zmq.NOBLOCK)
        deadline = time.monotonic() + timeout
        while self.proc.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        _kill(self.proc)
        if self._reader is not None:
            self._reader.cancel()
        try:
            asyncio.get_running_loop().remove_reader(self.proc.sentinel)
        except (ValueError, OSError):
            pass
        self.in_sock.close(linger=0)
        self.out_sock.close(linger=0)
        self.ctx.term()


async def _wait_ready(proc, out_sock: zmq.asyncio.Socket, timeout: float) -> ReadyMessage:
    deadline = time.monotonic() + timeout
    while True:
        is_alive = proc.is_alive()  # before polling: a FAILED sent just before exiting is still read
        if await out_sock.poll(200) != 0:
            kind_frame, payload = await out_sock.recv_multipart()
            kind = OutKind(kind_frame[0])
            if kind == OutKind.READY:
                return _READY_DECODER.decode(payload)
            if kind == OutKind.FAILED:
                raise RuntimeError(f"the engine core failed to start: {_FAILED_DECODER.decode(payload)}")
        elif not is_alive:
            raise RuntimeError(f"the engine core process exited during startup (exit code {proc.exitcode})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine core did not start within {timeout:.0f} s")


async def _ignore_outputs(outputs: EngineCoreOutputs) -> None:
    pass


def _kill(proc) -> None:
    if proc.is_alive():
        proc.kill()
    proc.join(timeout=5)
