"""One engine replica of the Ray Serve deployment: our FastAPI app (server/api_server.py) over the replica's
own engine, answering forwarded requests in-process (asgi.py). Ray restarts a replica whose actor died or
whose health check fails; its engine process follows its parent out (engine/core_proc.py)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from llmserve.engine.async_llm import AsyncLLM
from llmserve.rayserve.asgi import call_asgi
from llmserve.rayserve.config import Deployment
from llmserve.rayserve.messages import REPLICA_HEADER, ForwardedRequest, ResponseHead
from llmserve.server.api_server import build_app
from llmserve.server.launcher import serving_context

logger = logging.getLogger("llmserve.rayserve")


class LLMReplica:
    """Ray Serve calls `forward` (streaming) for each request, `check_health` and `record_routing_stats`
    periodically."""

    async def __init__(self, deployment: Deployment) -> None:  # Ray Serve awaits an async constructor
        from ray import serve
        from ray.util import get_node_ip_address

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node_ip = get_node_ip_address()  # where prefill replicas reach a decode replica's KV receiver
        server = deployment.server
        self.engine = await AsyncLLM.from_config(deployment.engine, startup_timeout=server.engine_startup_timeout,
                                                 stream_interval=server.stream_interval,
                                                 request_timeout=server.request_timeout)
        self.ctx = serving_context(self.engine, server, deployment.engine.lora)  # --lora-modules served here too
        self.app = build_app(self.ctx)
        self.headers = ((REPLICA_HEADER.encode(), self.replica_id.encode()),)
        logger.info("replica %s serving %s", self.replica_id, self.ctx.model_name)

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
        async for item in call_asgi(self.app, request, self.headers):
            yield item

    def kv_address(self) -> tuple[str, str]:
        """(this replica's id, its KV receiver's address): --pd-disaggregation's ingress asks a decode replica
        before it sends the request's prompt to a prefill replica (pd_ingress.py)."""
        kv = self.engine.kv_transfer
        if kv.disaggregation_mode != "decode":
            raise RuntimeError(f"replica {self.replica_id} is no decode replica ({kv.disaggregation_mode})")
        return self.replica_id, f"tcp://{self.node_ip}:{kv.disaggregation_kv_port}"

    def record_routing_stats(self) -> dict:
        """What Ray hands the request router about this replica (every ROUTING_STATS_PERIOD_S): the adapters it
        serves (--lora-modules and those loaded here at run time) and those resident in its engine's slots."""
        return {"adapters": sorted(self.ctx.loras.adapters), "resident": sorted(self.ctx.metrics.resident_loras)}

    def check_health(self) -> None:
        """Raising marks the replica unhealthy: Ray replaces it."""
        if self.engine.is_dead:
            raise RuntimeError(f"the engine is dead: {self.engine.client.dead_reason}")

    async def __del__(self) -> None:
        """Ray's graceful shutdown (scale-down, redeploy): it stopped routing here and waited for the
        requests already here; stop the engine process."""
        await self.engine.shutdown()
