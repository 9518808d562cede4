"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, never a traceback.

User errors are ValueError (-> 400) or an APIError with its status; anything else is an internal
fault: logged with its traceback here, answered 500 with a generic message. A front with errors of its
own (the server: the engine's) passes its `classify` that maps them first, then falls back on `to_api_error`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from http import HTTPStatus

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("llmserve.http")

Classify = Callable[[BaseException], "APIError"]

_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                   405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error",
                   504: "timeout_error"}
_PARAM_RE = re.compile(r"at `\$\.?([^`]*)`")
_UNKNOWN_FIELD_RE = re.compile(r"unknown field `([^`]*)`")


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorInfo


class APIError(Exception):
    """An error with its HTTP status, raised anywhere below a route."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def info(self) -> ErrorInfo:
        return ErrorInfo(self.message, _TYPE_BY_STATUS.get(self.status, "server_error"), self.param, self.code)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def service_unavailable(message: str, retry_after: int = 1) -> APIError:
    return APIError(503, message, code="service_unavailable", headers={"Retry-After": str(retry_after)})


def internal_error() -> APIError:
    return APIError(500, "internal server error (see the server log)", code="internal_error")


def _validation_error(text: str) -> APIError:
    """A msgspec validation message -> 400 naming the field (`param`: its dotted path)."""
    where = _PARAM_RE.search(text)
    path = where.group(1) if where else ""
    unknown = _UNKNOWN_FIELD_RE.search(text)
    if unknown is None:
        return bad_request(f"invalid request: {text}", param=path or None)
    param = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
    return APIError(400, f"unsupported parameter `{param}`: this server does not implement it "
                         f"(unknown fields are refused rather than ignored)", param=param,
                    code="unsupported_parameter")


def to_api_error(exc: BaseException) -> APIError:
    """Classify any exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, msgspec.ValidationError):
        return _validation_error(str(exc))
    if isinstance(exc, msgspec.DecodeError):
        return bad_request(f"malformed JSON body: {exc}")
    if isinstance(exc, ValueError):
        return bad_request(str(exc), param=getattr(exc, "param", None))  # structured_fields.FieldError names it
    logger.error("internal error while serving a request", exc_info=exc)
    return internal_error()


def error_payload(exc: BaseException, classify: Classify = to_api_error) -> bytes:
    return msgspec.json.encode(ErrorBody(classify(exc).info()))


def error_response(exc: BaseException, classify: Classify = to_api_error) -> Response:
    err = classify(exc)
    return Response(msgspec.json.encode(ErrorBody(err.info())), status_code=err.status,
                    media_type="application/json", headers=err.headers)


def status_error_response(status: int, message: str, **kwargs) -> Response:
    return error_response(APIError(status, message, **kwargs))


def install_error_handlers(app: FastAPI, classify: Classify = to_api_error) -> None:
    """Every exception a route raises answers in OpenAI's shape; `classify` maps it to its status."""
    async def on_exception(_: Request, exc: Exception) -> Response:
        return error_response(exc, classify)

    async def on_http_exception(request: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        if exc.status_code in (404, 405) and message == HTTPStatus(exc.status_code).phrase:  # the router's own
            message = _no_route_message(request, exc.status_code)
        return status_error_response(exc.status_code, message, headers=dict(exc.headers or {}))

    async def on_validation(_: Request, exc: RequestValidationError) -> Response:
        return error_response(bad_request(f"invalid request: {exc.errors()}"))

    app.add_exception_handler(APIError, on_exception)
    app.add_exception_handler(ValueError, on_exception)
    app.add_exception_handler(msgspec.MsgspecError, on_exception)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(Exception, on_exception)


def _no_route_message(request: Request, status: int) -> str:
    """What a client reads for a path or method the server has no route for: the route it asked for."""
    route = f"{request.method} {request.url.path}"
    if status == 405:
        return f"method not allowed: {route} (see /docs for this server's routes)"
    return f"no route {route} (see /docs for this server's routes)"
