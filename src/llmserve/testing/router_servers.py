"""A real `llmserve route` in a subprocess, for tests and benchmarks (like testing/servers.py's ServerProcess);
its log and the temporary files of the replicas it launches are removed when it is stopped."""

from __future__ import annotations

import os
import re

import httpx

from llmserve.testing.servers import ChildServer

_PORT_RE = re.compile(r"routing .* on http://[^:\s]+:(\d+)")


class RouterProcess(ChildServer):
    """`with RouterProcess([...flags]) as router:` -> router.url; the replicas it launches are its children."""

    command = ("llmserve.router.cli", "route")
    port_re = _PORT_RE
    ready_path = "/v1/models"

    def __init__(self, args: list[str], env: dict[str, str] | None = None, startup_timeout: float = 60.0) -> None:
        super().__init__(args, env, startup_timeout)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text


def sample_value(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include all of `labels` (0.0 when none)."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head = line.rsplit(" ", 1)[0]
            if all(w in head for w in wanted):
                total += float(line.rsplit(" ", 1)[1])
    return total


def shared_tiny_model(base_dir: str) -> str:
    """One tiny checkpoint per test session (under pytest's base temp dir), made on first use."""
    from llmserve.testing.servers import tiny_model

    path = os.path.join(base_dir, "router-tiny-model")
    if not os.path.exists(os.path.join(path, "config.json")):
        tiny_model(path)
    return path


class Chunks(httpx.AsyncByteStream):
    """A body that arrives as a stream, as over a socket (a `content=` body would count as read already)."""

    def __init__(self, *chunks):
        self.chunks = chunks

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
