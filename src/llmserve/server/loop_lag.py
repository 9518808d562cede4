"""Event-loop lag: how late a periodic timer wakes up on the server's event loop.

Everything the front does runs on that loop (HTTP parsing, engine-output processing, detokenizing, SSE
writes); one turn of the loop that runs long delays every stream and /health alike. The probe sleeps
`interval` seconds again and again and reports how much later than asked each wake-up came.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

PROBE_INTERVAL_S = 0.02


async def probe_loop_lag(on_lag: Callable[[float], None], interval: float = PROBE_INTERVAL_S) -> None:
    """Run until cancelled, calling `on_lag(seconds late)` after each wake-up."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval
        await asyncio.sleep(interval)
        on_lag(max(0.0, loop.time() - due))
