"""Running an asyncio service: its socket bound before anything loads, logging set-up and uvloop when it is
installed; ending its process."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
from collections.abc import Coroutine
from typing import Any, NoReturn

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def run_service(main: Coroutine[Any, Any, int], log_level: str, logger: logging.Logger) -> int:
    """Run `main` to its exit code on uvloop (if available); a startup error is logged, exit code 1."""
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # uvloop is optional (uvicorn[standard] brings it)
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        try:
            return runner.run(main)
        except (RuntimeError, TimeoutError, ValueError) as e:
            logger.error("%s", e)
            return 1


def end_process(code: int) -> NoReturn:
    """End a service's process once `run_service` returned (its engine and children stopped): flush the logs
    and the standard streams, then skip the interpreter's teardown, as the engine core process does. With
    torch and transformers imported (the tokenizer brings them) that teardown's collections walk the whole
    heap again and again: 1.6-1.8 s of every `llmserve serve` stop on the tiny model, for nothing."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so that a taken port fails fast."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"cannot bind {host}:{port}: {e.strerror}") from e
    sock.set_inheritable(True)
    return sock
