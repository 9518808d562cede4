"""Async plumbing of the routes: SSE framing, merging per-prompt streams, client-disconnect watching."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from llmserve.server.errors import error_payload
from llmserve.server.protocol import encode_json

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientDisconnected(Exception):
    """The client went away before the response was ready (its request was aborted)."""


def sse_event(obj: Any) -> bytes:
    return b"data: " + encode_json(obj) + b"\n\n"


def sse_error(exc: BaseException) -> bytes:
    return b"data: " + error_payload(exc) + b"\n\n"


def sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


async def with_error_event(events: AsyncIterator[bytes], done: bytes | None = SSE_DONE) -> AsyncIterator[bytes]:
    """Pass events through; an error after the stream started becomes `data: {"error": ...}` then [DONE]."""
    try:
        async for event in events:
            yield event
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as e:  # noqa: BLE001 - classified (and internal ones logged) by error_payload
        yield sse_error(e)
    if done is not None:
        yield done


async def merge_async_iterators(iterators: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the iterator's index.

    Closing (or cancelling) the merged iterator cancels the readers, which closes every input.
    """
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def drain(index: int, iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                queue.put_nowait((index, item, None, False))
        except Exception as e:  # noqa: BLE001 - re-raised in the consumer
            queue.put_nowait((index, None, e, True))
            return
        queue.put_nowait((index, None, None, True))

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        num_open = len(tasks)
        while num_open:
            index, item, error, is_end = await queue.get()
            if error is not None:
                raise error
            if is_end:
                num_open -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work` (the body was read already); cancel it if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watcher.cancel()
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
