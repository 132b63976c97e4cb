"""The HTTP edge of errors: the one table from domain errors (errors.py) to HTTP statuses, and the two forms a
client reads an error in: OpenAI's envelope `{"error": {"message", "type", "param", "code"}}` and, on the SGLang
tier's routes, SGLang's `{"status": "error", "message", "req_id"}`."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from .errors import (ClientDisconnected, Conflict, DeliveryFailed, EngineError, InferenceFailed, InputRejected,
                     InputTooLarge, NotAllowed, NotReady, OutOfMemory, QueueFull, StorageFailed, TimedOut,
                     Unavailable)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "timeout_error", 409: "conflict_error", 413: "request_too_large", 422: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 501: "server_error", 503: "service_unavailable",
               507: "insufficient_storage"}

# the one place that turns domain errors into HTTP: status and, where retrying helps, Retry-After seconds
HTTP_STATUS: dict[type[EngineError], tuple[int, str | None]] = {
    InputRejected: (400, None), NotAllowed: (403, None), Conflict: (409, None), InputTooLarge: (413, None),
    QueueFull: (429, "1"), InferenceFailed: (500, None), DeliveryFailed: (502, None), NotReady: (503, "5"),
    Unavailable: (503, "5"), TimedOut: (504, None), OutOfMemory: (507, None), StorageFailed: (507, None),
    ClientDisconnected: (499, None)}


class ServiceError(Exception):
    """An HTTP error as the client sees it: status, message, code, the bad input (`param`) and headers. The edge's
    own errors (an unknown route's, a tier that is off) are raised as these; a domain error becomes one by `of`."""

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

    def sglang_response(self, req_id: str | None) -> JSONResponse:
        """The error as SGLang's encoder answers one: its language side reads `message` (and the status)."""
        return JSONResponse({"status": "error", "message": self.message, "req_id": req_id}, status_code=self.status)


def error_response(status: int, message: str, code: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)
