"""Running an asyncio service: logging set-up and uvloop when it is installed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

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
