"""What a client can be told: the engine's domain errors, the one table that maps them to HTTP, and the OpenAI
error envelope `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from fastapi.responses import JSONResponse

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "timeout_error", 409: "conflict_error", 413: "request_too_large", 422: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 501: "server_error", 503: "service_unavailable",
               507: "insufficient_storage"}


CLIP = 200  # characters of a client's value that an error message repeats


def clip(value: str) -> str:
    """A client's value as an error message repeats it: its first `CLIP` characters."""
    return value if len(value) <= CLIP else value[:CLIP] + "..."


class EngineError(Exception):
    """A request the engine could not serve, and why: `code` (machine-readable) and `param` (the bad input)."""

    code = "error"

    def __init__(self, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param
        if code is not None:
            self.code = code


class InputRejected(EngineError):
    """Something the client sent cannot be encoded: bad bytes, not an image, an unusable URL."""


class InputTooLarge(EngineError):
    """Over a limit: pixels of an image, images in a request, bytes at a URL."""


class QueueFull(EngineError):
    code = "queue_full"


class NotReady(EngineError):
    code = "not_ready"


class Unavailable(EngineError):
    """A part the server cannot run without is gone (a device process, every decode worker): it is restarting."""


class OutOfMemory(EngineError):
    code = "out_of_memory"


class InferenceFailed(EngineError):
    """A fault inside a batch: only that batch's requests fail."""

    code = "inference_failed"


class ClientDisconnected(EngineError):
    """The client went away while its images waited: they were dropped from the queue (answered 499)."""

    code = "client_disconnected"


# the one place that turns domain errors into HTTP: status and, where retrying helps, Retry-After seconds
HTTP_STATUS: dict[type[EngineError], tuple[int, str | None]] = {
    InputRejected: (400, None), InputTooLarge: (413, None), QueueFull: (429, "1"), InferenceFailed: (500, None),
    NotReady: (503, "5"), Unavailable: (503, "5"), OutOfMemory: (507, None), ClientDisconnected: (499, None)}


class ServiceError(Exception):
    """An HTTP error as the client sees it: status, message, code, the bad input (`param`) and headers."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers or {}

    @classmethod
    def of(cls, error: EngineError) -> ServiceError:
        status, retry_after = next(HTTP_STATUS[c] for c in type(error).__mro__ if c in HTTP_STATUS)
        return cls(status, error.message, error.code, error.param,
                   {"Retry-After": retry_after} if retry_after else None)

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.code, self.param, self.headers)


def error_response(status: int, message: str, code: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)
