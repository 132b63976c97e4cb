"""The HTTP edge of errors: the one table from domain errors (errors.py) to HTTP statuses, and the two forms a
client reads an error in: OpenAI's envelope `{"error": {"message", "type", "param", "code"}}` and, on the SGLang
tier's routes, SGLang's `{"status": "error", "message", "req_id"}`."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..ground.errors import (
    ClientDisconnected,
    Conflict,
    DeliveryFailed,
    EngineError,
    InferenceFailed,
    InputRejected,
    InputTooLarge,
    NotAllowed,
    NotReady,
    NotServed,
    OutOfMemory,
    QueueFull,
    StorageFailed,
    TimedOut,
    Unavailable,
    Unsupported,
    clip,
)
from .envelope import envelope

log = logging.getLogger("vitserve.app")
TYPE_TAGS = {"str", "int", "float", "bool", "bytes", "list", "dict", "none"}  # pydantic's union-member tags in `loc`

# the one place that turns domain errors into HTTP: status and, where retrying helps, Retry-After seconds
HTTP_STATUS: dict[type[EngineError], tuple[int, str | None]] = {
    InputRejected: (400, None),
    NotAllowed: (403, None),
    NotServed: (404, None),
    Conflict: (409, None),
    InputTooLarge: (413, None),
    Unsupported: (501, None),
    QueueFull: (429, "1"),
    InferenceFailed: (500, None),
    DeliveryFailed: (502, None),
    NotReady: (503, "5"),
    Unavailable: (503, "5"),
    TimedOut: (504, None),
    OutOfMemory: (507, None),
    StorageFailed: (507, None),
    ClientDisconnected: (499, None),
}


class ServiceError(Exception):
    """An HTTP error as the client sees it: status, message, code, the bad input (`param`) and headers. The edge's
    own errors (a body the HTTP layer refuses: its framing, its JSON, its values' count, a multipart form's fields)
    are raised as these; a domain error becomes one by `of`."""

    def __init__(
        self, status: int, message: str, code: str, param: str | None = None, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers or {}

    @classmethod
    def of(cls, error: EngineError) -> ServiceError:
        status, retry_after = next(HTTP_STATUS[c] for c in type(error).__mro__ if c in HTTP_STATUS)
        return cls(
            status, error.message, error.code, error.param, {"Retry-After": retry_after} if retry_after else None
        )

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.code, self.param, self.headers)

    def sglang_response(self, req_id: str | None) -> JSONResponse:
        """The error as SGLang's encoder answers one: its language side reads `message` (and the status)."""
        return JSONResponse({"status": "error", "message": self.message, "req_id": req_id}, status_code=self.status)


def error_response(
    status: int, message: str, code: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(envelope(status, message, code, param), status_code=status, headers=headers)


def where(loc: tuple) -> str:
    """A validation error's field as the client wrote it: `images[1]`, `input` (not pydantic's `input.str`)."""
    out = ""
    for part in loc:
        if part == "body" or isinstance(part, str) and (part in TYPE_TAGS or not part.isidentifier()):
            continue
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else part
    return out


def validation_error(exc: RequestValidationError, status: int = 422) -> ServiceError:
    """A body that does not validate, as its first error: the field (clipped: a field name is the client's value
    too, an unknown key) and pydantic's words."""
    first = exc.errors()[0] if exc.errors() else {}
    field = clip(where(tuple(first.get("loc", ()))))
    return ServiceError(
        status, f"{field or 'body'}: {clip(first.get('msg', 'invalid request'))}", "invalid_request", field or None
    )


def add_error_handlers(app: FastAPI) -> None:
    """The app's answers to what its routes raise: the edge's own errors and domain errors in OpenAI's envelope
    (a departed client gets a bodiless 499), the framework's (unknown routes, 405, multipart limits) as
    `http_error`, an invalid body as a 422 `invalid_request`."""

    @app.exception_handler(ServiceError)
    async def on_service_error(request: Request, exc: ServiceError):
        return exc.response()

    @app.exception_handler(EngineError)
    async def on_engine_error(request: Request, exc: EngineError):
        if isinstance(exc, ClientDisconnected):  # nobody reads it; nothing to log either
            return Response(status_code=499)
        return ServiceError.of(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), "http_error", headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def on_client_disconnect(request: Request, exc: ClientDisconnect):  # while it sent its body
        log.info("client disconnected while sending its request (%s %s)", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return validation_error(exc).response()
