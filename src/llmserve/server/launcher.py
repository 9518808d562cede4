"""Run the server: bind, start the engine process, serve with uvicorn, drain on SIGTERM, exit cleanly.

Exit codes: 0 after a signal-initiated drain, 1 when the engine died or failed to start.
SIGTERM/SIGINT: stop taking requests (503), let in-flight ones finish up to --shutdown-timeout, abort
the rest (finish_reason abort), stop the engine process, exit 0. A second signal exits at once: every
open request ends with a 503 error (a stream with an error event, then [DONE]) and the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import time

import uvicorn

from llmserve.http.launch import bind_socket, run_service
from llmserve.config import EngineConfig, LoRAConfig
from llmserve.engine.async_llm import AsyncLLM
from llmserve.heap import freeze_startup_heap
from llmserve.http.errors import APIError, service_unavailable
from llmserve.server.api_server import build_app
from llmserve.server.config import ServerConfig
from llmserve.server.lora_registry import LoRARegistry
from llmserve.server.grpc_service.service import bind_grpc, start_grpc
from llmserve.server.loop_lag import probe_loop_lag
from llmserve.server.metrics import ServerMetrics
from llmserve.server.serving_common import ServingContext, TokenTexts

logger = logging.getLogger("llmserve.server")

ABORT_GRACE_S = 3.0  # after aborting, how long responses get to carry finish_reason abort out
DEAD_GRACE_S = 3.0  # after the engine died, how long in-flight requests get to receive their error
FORCE_GRACE_S = 1.0  # after a second signal, how long open requests get to send their error out


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains instead of closing connections."""

    def __init__(self, config: uvicorn.Config, ctx: ServingContext) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.exit_code = 0
        self.num_signals = 0
        self.stopping: asyncio.Task | None = None
        self.loop = asyncio.get_running_loop()

    def handle_exit(self, sig: int, frame) -> None:
        """Runs in the signal handler: counts the signal, hands the work to the event loop."""
        self.num_signals += 1
        if self.num_signals == 1:
            logger.info("signal %s: draining (up to %.0f s)", signal.Signals(sig).name,
                        self.ctx.config.shutdown_timeout)
            self.loop.call_soon_threadsafe(self._start, self._drain())
        elif self.num_signals == 2:
            logger.warning("second signal: ending open requests, exiting now")
            self.loop.call_soon_threadsafe(self._exit_now)

    def _exit_now(self) -> None:
        if self.stopping is not None:
            self.stopping.cancel()
        self.stopping = self.loop.create_task(self._end_requests_then_exit())

    async def _end_requests_then_exit(self) -> None:
        """Fail every open request (its generator aborts it in the engine, its response carries the error
        out), then exit without waiting for anything else."""
        self.ctx.is_draining = True
        num = self.ctx.engine.fail_all(service_unavailable("the server is shutting down now", retry_after=5))
        if num:
            logger.warning("ended %d open request(s)", num)
        self.force_exit = True
        await self._wait_then_exit(FORCE_GRACE_S)

    def on_engine_dead(self, reason: str) -> None:
        self.exit_code = 1
        if self.stopping is None:
            self._start(self._wait_then_exit(DEAD_GRACE_S))

    def _start(self, coro) -> None:
        if self.stopping is None:
            self.stopping = self.loop.create_task(coro)
        else:
            coro.close()

    async def _drain(self) -> None:
        ctx = self.ctx
        ctx.is_draining = True
        deadline = time.monotonic() + ctx.config.shutdown_timeout
        while self._is_busy() and time.monotonic() < deadline and not ctx.engine.is_dead:
            await asyncio.sleep(0.05)
        if ctx.engine.num_unfinished_requests and not ctx.engine.is_dead:
            num = ctx.engine.abort_all()
            logger.warning("shutdown timeout: aborted %d request(s)", num)
        await self._wait_then_exit(ABORT_GRACE_S)

    def _is_busy(self) -> bool:
        return self.ctx.num_http_in_flight > 0 or self.ctx.engine.num_unfinished_requests > 0

    async def _wait_then_exit(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        while self.ctx.num_http_in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.should_exit = True


def _uvicorn_config(app, config: ServerConfig) -> uvicorn.Config:
    return uvicorn.Config(app, log_level=config.log_level, access_log=config.access_log,
                          timeout_keep_alive=config.timeout_keep_alive, timeout_graceful_shutdown=5,
                          backlog=4096, lifespan="off")


async def serve(engine_config: EngineConfig, config: ServerConfig, sock: socket.socket | None = None) -> int:
    """Serve until a signal or the engine's death; `sock`: bound already (the CLI binds before loading)."""
    engine_config.validate()  # before binding or spawning anything (the CLI has checked already)
    sock = sock or bind_socket(config.host, config.port)
    grpc_server, grpc_port = (None, None) if config.grpc_port is None else bind_grpc(config.host, config.grpc_port)
    engine = await AsyncLLM.from_config(engine_config, startup_timeout=config.engine_startup_timeout,
                                        stream_interval=config.stream_interval,
                                        request_timeout=config.request_timeout)
    try:
        ctx = serving_context(engine, config, engine_config.lora)
        model_name = ctx.model_name
        server = DrainingServer(_uvicorn_config(build_app(ctx), config), ctx)
        engine.dead_callbacks.append(server.on_engine_dead)
        if engine.is_dead:
            return 1
        if grpc_server is not None:
            await start_grpc(grpc_server, ctx)
            print(f"llmserve: gRPC on {config.host}:{grpc_port}", file=sys.stderr, flush=True)
        # Printed whatever the log level: with --port 0 this line is how one learns the port.
        print(f"llmserve: serving {model_name} on http://{config.host}:{sock.getsockname()[1]}", file=sys.stderr,
              flush=True)
        freeze_startup_heap()
        lag_probe = asyncio.create_task(probe_loop_lag(ctx.metrics.on_loop_lag), name="loop-lag-probe")
        try:
            await server.serve(sockets=[sock])
        finally:
            lag_probe.cancel()
        return server.exit_code
    finally:
        sock.close()
        if grpc_server is not None:
            await grpc_server.stop(grace=None)  # the drain above has let its calls finish
        await engine.shutdown()


def serving_context(engine: AsyncLLM, config: ServerConfig, lora: LoRAConfig = LoRAConfig()) -> ServingContext:
    """The routes' state around a started engine, its metrics hooked to the engine's steps, and the adapters
    of --lora-modules (each checked: a bad one stops the start with its error)."""
    model_name = config.served_model_name or engine.model_info.name
    metrics = ServerMetrics(model_name)
    metrics.set_cache_size(engine.client.num_kv_blocks)
    engine.stat_logger = metrics
    loras = LoRARegistry(lora.enable_lora, lora.max_lora_rank, engine.model_info.path,
                         (model_name, engine.model_info.name), metrics.num_lora_adapters.set)
    for name, path in lora.modules().items():
        try:
            loras.add(name, path)
        except APIError as e:
            raise ValueError(f"--lora-modules: {e.message}") from None
    return ServingContext(engine, config, metrics, model_name, engine.client.max_num_seqs, TokenTexts(engine.tokenizer),
                          loras)


def run(engine_config: EngineConfig, config: ServerConfig, sock: socket.socket | None = None) -> int:
    return run_service(serve(engine_config, config, sock), config.log_level, logger)
