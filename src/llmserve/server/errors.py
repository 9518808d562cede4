"""The server's errors: the shared OpenAI-shaped ones (http/errors.py) plus the engine's own, mapped to
their statuses (a request past --request-timeout: 504; a dead engine: 503 with a long Retry-After)."""

from __future__ import annotations

from fastapi import FastAPI

from llmserve.engine.async_llm import EngineDeadError, RequestTimeoutError
from llmserve.http import errors as http_errors
from llmserve.http.errors import APIError, service_unavailable


def to_api_error(exc: BaseException) -> APIError:
    """Classify any exception raised while serving a request, the engine's included."""
    if isinstance(exc, RequestTimeoutError):
        return APIError(504, f"{exc} (--request-timeout)", code="request_timeout")
    if isinstance(exc, EngineDeadError):
        return service_unavailable(f"the engine is not running: {exc}", retry_after=30)
    return http_errors.to_api_error(exc)


def error_payload(exc: BaseException) -> bytes:
    return http_errors.error_payload(exc, to_api_error)


def error_response(exc: BaseException):
    return http_errors.error_response(exc, to_api_error)


def install_error_handlers(app: FastAPI) -> None:
    http_errors.install_error_handlers(app, to_api_error)
