"""The HTTP ingress: takes each request from Ray's HTTP proxy, reads what the request router needs (the
prompt's prefix key, a pinned replica), and forwards the request to an engine replica through a streaming
DeploymentHandle; the replica's bytes come back unchanged.

A replica that dies before answering anything costs the client nothing: the request goes to another replica
(up to --max-attempts tries; Ray's router no longer offers a dead replica). One that dies mid-answer ends
the response early: a stream gets an error event, as when our server's engine dies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from llmserve.http.errors import error_response, service_unavailable
from llmserve.http.sse import SSE_DONE, sse_error
from llmserve.rayserve.messages import REPLICA_HEADER, ForwardedRequest, ResponseHead
from llmserve.router.requests import decode_body, route_request

if TYPE_CHECKING:  # the deployment's record carries the replicas' server config; the ingress reads only its Ray part
    from llmserve.rayserve.config import Deployment

logger = logging.getLogger("llmserve.rayserve")

_DROPPED_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}  # the proxy frames the response


class Ingress:
    def __init__(self, replicas, deployment: Deployment) -> None:
        """`replicas`: the engine deployment's DeploymentHandle (Ray resolves the bound deployment)."""
        self.replicas = replicas.options(method_name="forward", stream=True)
        self.config = deployment.ray

    async def __call__(self, request: Request) -> Response:
        return await self.respond(await self.forwarded(request))

    async def respond(self, forwarded: ForwardedRequest) -> Response:
        """The client's response: a replica's answer, streamed when it streams."""
        answer = await self.first_answer(forwarded)
        if answer is None:
            return error_response(service_unavailable(
                f"no replica answered after {self.config.max_attempts} tries (replicas died); retry later",
                retry_after=5))
        stream, head = answer
        headers = [(k, v) for k, v in head.headers if k.lower() not in _DROPPED_HEADERS]
        if head.is_complete:
            response = Response(head.body, status_code=head.status)
        else:
            response = StreamingResponse(_body(stream, forwarded.path, head), status_code=head.status)
        response.raw_headers = [*headers, *[(k, v) for k, v in response.raw_headers if k == b"content-length"]]
        return response

    async def first_answer(self, forwarded: ForwardedRequest):
        """(the replica's stream, its ResponseHead); another replica when one dies before answering; None
        after --max-attempts such deaths. Cancelled (the client left): the replica's call is cancelled too."""
        from ray.exceptions import ActorUnavailableError, RayActorError

        for attempt in range(1, self.config.max_attempts + 1):
            stream = self.replicas.remote(forwarded)
            try:
                head = await stream.__anext__()
            except (RayActorError, ActorUnavailableError) as e:
                logger.warning("%s %s: replica lost before answering (try %d of %d): %s", forwarded.method,
                               forwarded.path, attempt, self.config.max_attempts, type(e).__name__)
                continue
            except asyncio.CancelledError:
                stream.cancel()
                raise
            assert isinstance(head, ResponseHead), "a replica answers its head first"
            return stream, head
        return None

    async def forwarded(self, request: Request) -> ForwardedRequest:
        body = await request.body()
        prefix, model = b"", ""
        if request.method == "POST" and body:
            try:
                routed = route_request(decode_body(body), self.config.prefix)
                prefix, model = routed.prefix, routed.model
            except ValueError:
                pass  # the replica answers the 400
        return ForwardedRequest(request.method, _app_path(request.scope), request.scope.get("query_string", b""),
                                tuple(request.scope["headers"]), body, prefix,
                                request.headers.get(REPLICA_HEADER), model)


def _app_path(scope: dict) -> str:
    """The path below the application's route prefix (Ray's proxy puts the prefix in root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


async def _body(stream, path: str, head: ResponseHead) -> AsyncIterator[bytes]:
    from ray.exceptions import ActorUnavailableError, RayActorError

    yield head.body
    try:
        async for chunk in stream:
            yield chunk
    except (RayActorError, ActorUnavailableError) as e:
        logger.warning("%s: replica lost mid-response: %s", path, type(e).__name__)
        if not _is_event_stream(head):
            raise
        yield sse_error(service_unavailable("the replica serving this request died", retry_after=5))
        if path.startswith("/v1/"):
            yield SSE_DONE
    except (asyncio.CancelledError, GeneratorExit):  # the client left: stop the replica's work
        stream.cancel()
        raise


def _is_event_stream(head: ResponseHead) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in head.headers)
