"""Async plumbing of the routes: SSE framing, merging per-prompt streams, client-disconnect watching.

A response that does not reach its end is logged with its request id and why: WARNING when the server
cut it (shutdown, an error ending the stream early), INFO when the client left first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from llmserve.http import sse
from llmserve.http.sse import SSE_DONE, data_event
from llmserve.server.errors import to_api_error
from llmserve.server.protocol import encode_json

T = TypeVar("T")

logger = logging.getLogger("llmserve.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientDisconnected(Exception):
    """The client went away before the response was ready (its request was aborted)."""


def sse_event(obj: Any) -> bytes:
    return data_event(encode_json(obj))


def sse_error(exc: BaseException) -> bytes:
    return sse.sse_error(exc, to_api_error)


def sse_response(events: AsyncIterator[bytes], request_id: str,
                 is_shutting_down: Callable[[], bool]) -> StreamingResponse:
    return StreamingResponse(logged_stream(events, request_id, is_shutting_down), media_type="text/event-stream",
                             headers=SSE_HEADERS)


async def logged_stream(events: AsyncIterator[bytes], request_id: str,
                        is_shutting_down: Callable[[], bool]) -> AsyncIterator[bytes]:
    """Pass events through; log a stream that is cut before its end (cancelled, closed, or failing)."""
    num_events = 0
    try:
        async for event in events:
            num_events += 1
            yield event
    except (asyncio.CancelledError, GeneratorExit):
        if is_shutting_down():
            logger.warning("stream %s cut short after %d events: the server is shutting down", request_id,
                           num_events)
        else:
            logger.info("stream %s cut short after %d events: the client disconnected", request_id, num_events)
        raise
    except BaseException as e:
        logger.warning("stream %s cut short after %d events: %s: %s", request_id, num_events, type(e).__name__, e)
        raise


async def with_error_event(events: AsyncIterator[bytes], request_id: str,
                           done: bytes | None = SSE_DONE) -> AsyncIterator[bytes]:
    """Pass events through; an error after the stream started becomes `data: {"error": ...}` then [DONE]."""
    try:
        async for event in events:
            yield event
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as e:  # noqa: BLE001 - classified (and internal ones logged) by to_api_error
        err = to_api_error(e)
        log_error_event(request_id, err.message)
        yield sse_error(err)
    if done is not None:
        yield done


def log_error_event(request_id: str, message: str) -> None:
    logger.warning("stream %s ended early with an error event: %s", request_id, message)


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


async def until_disconnect(request: Request, work: Awaitable[T], request_id: str) -> T:
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
        logger.info("request %s cut short: the client disconnected before the response", request_id)
        raise ClientDisconnected()
    return task.result()
