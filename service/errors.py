"""One error type for everything a client can be told, rendered in the OpenAI envelope."""

from __future__ import annotations

from fastapi.responses import JSONResponse

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable", 507: "insufficient_storage"}


class ServiceError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers or {}

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.code, self.param, self.headers)


def error_response(status: int, message: str, code: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)
