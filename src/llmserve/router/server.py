"""Run the router: bind, start the background loops (probes, scrapes, autoscaler), serve with uvicorn,
and on exit stop the replicas it launched."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import uvicorn

from llmserve.http.launch import bind_socket, run_service
from llmserve.router.app import build_app
from llmserve.router.config import RouterSetup
from llmserve.router.direct_write import RouterHttpProtocol
from llmserve.router.gateway import Gateway
from llmserve.router.monitor import probe_all, run_monitors
from llmserve.router.replicas import ReplicaScaler

logger = logging.getLogger("llmserve.router")


class _Server(uvicorn.Server):
    """uvicorn.Server that handles SIGINT/SIGTERM without re-raising them after it stopped, so that the
    router's clean-up (stopping the replicas it launched) runs before the process exits."""

    @contextlib.contextmanager
    def capture_signals(self):
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


def _uvicorn_config(app, setup: RouterSetup) -> uvicorn.Config:
    # The event loop is the one run_service made (uvloop when installed); uvicorn's `loop` is not used.
    return uvicorn.Config(app, log_level=setup.router.log_level, access_log=False, backlog=4096, lifespan="off",
                          http=RouterHttpProtocol, ws="none", proxy_headers=False, timeout_graceful_shutdown=5)


async def serve(setup: RouterSetup) -> int:
    sock = bind_socket(setup.router.host, setup.router.port)
    gw = Gateway(setup)
    await probe_all(gw)  # health and served model names known before the first request
    scaler = ReplicaScaler(gw, setup.autoscale) if setup.autoscale.autoscale else None
    tasks = [asyncio.create_task(run_monitors(gw))]
    if scaler is not None:
        tasks.append(asyncio.create_task(scaler.run()))
    try:
        server = _Server(_uvicorn_config(build_app(gw), setup))
        logger.info("routing %s on http://%s:%d (%s loop, httptools, direct writes)", ", ".join(gw.model_names()),
                    setup.router.host, sock.getsockname()[1],
                    type(asyncio.get_running_loop()).__module__.split(".")[0])
        await server.serve(sockets=[sock])
        return 0
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        if scaler is not None:
            await scaler.close()
        await gw.close()
        sock.close()


def run(setup: RouterSetup) -> int:
    return run_service(serve(setup), setup.router.log_level, logger)
