"""The ingress of `llmserve serve-ray --pd-disaggregation`: router/pd.py's two calls over Ray Serve handles.

For a completion or chat request it asks a decode replica (Ray's pick through our request router: the least
loaded) for its KV receiver's address, sends a prefill replica the request's one-token copy naming that
address (router/pd.prefill_body; the prefill replica answers once the prompt's blocks are at the decode
replica), then forwards the client's request to that same decode replica, pinned by its id; the decode
replica loads the blocks and streams the answer. Other requests go to the decode replicas.

A prefill replica that fails costs only time (the decode replica computes the whole prompt); its 4xx is the
client's error and goes back as it is. A decode replica that dies between the two calls is no longer a
candidate, so the pin falls through to another one, which computes the prompt itself. A client that leaves
during the prefill cancels it there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from llmserve.rayserve.ingress import Ingress
from llmserve.rayserve.messages import ForwardedRequest, ResponseHead
from llmserve.router.pd import GENERATION_PATHS, prefill_body

if TYPE_CHECKING:
    from llmserve.rayserve.config import Deployment

logger = logging.getLogger("llmserve.rayserve")


def generation_body(request: ForwardedRequest) -> dict | None:
    """The JSON object of a completion or chat request; None for anything else (forwarded as it is: a body
    that is not JSON gets its 400 from the decode replica)."""
    if request.method != "POST" or request.path not in GENERATION_PATHS:
        return None
    try:
        body = json.loads(request.body)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def prefill_request(request: ForwardedRequest, body: dict, decode_kv_address: str) -> ForwardedRequest:
    """The prefill replica's copy of `request`: its body router/pd.py's, its old content-length dropped."""
    raw = json.dumps(prefill_body(body, decode_kv_address)).encode()
    headers = tuple((k, v) for k, v in request.headers if k.lower() != b"content-length")
    return dataclasses.replace(request, body=raw, headers=(*headers, (b"content-length", str(len(raw)).encode())),
                               pinned_replica=None)


class PDIngress(Ingress):
    def __init__(self, decodes, prefills, deployment: Deployment) -> None:
        """`decodes`, `prefills`: the two engine deployments' handles (Ray resolves the bound deployments)."""
        super().__init__(decodes, deployment)
        self.kv_addresses = decodes.options(method_name="kv_address")
        self.prefills = prefills.options(method_name="forward", stream=True)

    async def __call__(self, request: Request) -> Response:
        forwarded = await self.forwarded(request)
        body = generation_body(forwarded)
        if body is not None:
            decode_replica, error = await self.prefill(forwarded, body)
            if error is not None:
                return error
            forwarded = dataclasses.replace(forwarded, pinned_replica=decode_replica)
        return await self.respond(forwarded)

    async def prefill(self, request: ForwardedRequest, body: dict) -> tuple[str | None, Response | None]:
        """(the decode replica the prompt's blocks went to, None: any; the prefill replica's answer when it
        is the client's error). Failures are logged and cost the decode replica its own prefill."""
        try:
            decode_replica, address = await self.kv_addresses.remote()
        except Exception as e:  # no decode replica answered: the forward fails or finds one itself
            logger.warning("%s: no decode replica gave its KV address (%r): no prefill replica", request.path, e)
            return None, None
        stream = self.prefills.remote(prefill_request(request, body, address))
        try:
            head, answer = await _read_all(stream)
        except asyncio.CancelledError:  # the client left: stop the prefill too
            stream.cancel()
            raise
        except Exception as e:
            logger.warning("%s: the prefill replica failed (%r): the decode replica computes the prompt",
                           request.path, e)
            return decode_replica, None
        if 400 <= head.status < 500:
            return decode_replica, Response(answer, head.status, media_type="application/json")
        if head.status != 200:
            logger.warning("%s: the prefill replica answered HTTP %d: the decode replica computes the prompt",
                           request.path, head.status)
        return decode_replica, None


async def _read_all(stream) -> tuple[ResponseHead, bytes]:
    """A replica's whole (non-streamed) answer: its head and body."""
    head = await stream.__anext__()
    chunks = [head.body]
    async for chunk in stream:
        chunks.append(chunk)
    return head, b"".join(chunks)
