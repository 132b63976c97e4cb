"""OpenAI's error envelope, the one shape of every error this server answers in JSON (but SGLang's routes):
`{"error": {"message", "type", "param", "code"}}`, its type by the status. No web framework here: the port's early
probes answer in it before the app is imported."""

from __future__ import annotations

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "server_error",
    503: "service_unavailable",
    507: "insufficient_storage",
}


def envelope(status: int, message: str, code: str, param: str | None = None) -> dict:
    """An error in OpenAI's envelope: `{"error": {"message", "type", "param", "code"}}`, its type by the status."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }
