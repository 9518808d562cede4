"""What travels between the ingress and a replica over the DeploymentHandle (pickled by Ray): the HTTP
request as the ingress read it, with what the request router needs already extracted, and the replica's
answer as one `ResponseHead` (status, headers and the body's first chunk: all of it when not streamed) followed
by the rest of the body in chunks (bytes)."""

from __future__ import annotations

from dataclasses import dataclass

REPLICA_HEADER = "x-llmserve-replica"  # response: the replica that answered; request: pin to that replica


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    prefix: bytes = b""  # the prompt's leading blocks (router/requests.prefix_key); b"": none
    pinned_replica: str | None = None  # a replica's unique id: route there when it is a candidate
    model: str = ""  # the body's `model` (an adapter's name: replicas serving it are preferred); "": none


@dataclass(frozen=True)
class ResponseHead:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes = b""  # the body's first chunk
    is_complete: bool = False  # the body ends with it
