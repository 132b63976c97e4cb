"""The ASGI gate in front of the app: request id, API key, body size limit, and per request one access log line and
its metrics.

Pure ASGI (not BaseHTTPMiddleware, which breaks disconnect detection and streaming limits). The body limit is
enforced at once from Content-Length, else while the body streams in: a body is never read whole first. Routes
leave what the access line reports (images, tokens, queue and inference time) in the request's state.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
import uuid

from .errors import error_response
from .metrics import Metrics, outcome
from .settings import Settings

OPEN_PATHS = {"/health", "/ready", "/metrics"}  # no API key needed
API_PATHS = {"/v1/embeddings", "/v1/encode", "/v1/models"}
REQUEST_ID = re.compile(rb"[\w.:/+=@-]{1,128}")  # a client's x-request-id is echoed only when it looks like one

access = logging.getLogger("vitserve.access")


class PayloadTooLarge(Exception):
    pass


def endpoint_label(path: str) -> str:
    """The metrics label of a /v1/ path: its route, or "other" (a label per unknown path would grow without end)."""
    return path if path in API_PATHS else "other"


class Gate:
    def __init__(self, app, settings: Settings, metrics: Metrics):
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        headers, path, limit = dict(scope["headers"]), scope["path"], self.settings.payload_limit
        given = headers.get(b"x-request-id", b"")
        request_id = given.decode() if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        status = [0]

        async def tracking_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        failed = True
        try:
            await self._gated(scope, receive, tracking_send, headers, path, limit)
            failed = False
        finally:  # no response at all: the app raised (500), or the client left first (499)
            self._account(scope, status[0] or (500 if failed else 499), time.perf_counter() - start)

    async def _gated(self, scope, receive, send, headers, path, limit):
        key = self.settings.api_key
        if key and path not in OPEN_PATHS:
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
                return await error_response(401, "missing or invalid API key (Authorization: Bearer <key>)",
                                            "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await error_response(413, f"request body over the {limit}-byte limit", "payload_too_large")(
                scope, receive, send)
        seen, started = 0, [False]

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise PayloadTooLarge()
            return message

        async def started_send(message):
            started[0] = started[0] or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, started_send)
        except PayloadTooLarge:
            if started[0]:
                raise
            await error_response(413, f"request body over the {limit}-byte limit", "payload_too_large")(
                scope, receive, send)

    def _account(self, scope, status: int, seconds: float) -> None:
        """The request's metrics and its access line (every request but the scrapes and probes, which would drown
        the log: /metrics, /health and /ready are logged at debug level)."""
        path, state = scope["path"], scope["state"]
        if path.startswith("/v1/"):
            endpoint = endpoint_label(path)
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.request_seconds.labels(endpoint, outcome(status)).observe(seconds)
            if status < 400 and "images" in state:
                self.metrics.record("request", seconds)
        level = logging.DEBUG if path in OPEN_PATHS else logging.INFO
        if not access.isEnabledFor(level):
            return
        fields = {"method": scope.get("method"), "path": path, "status": status, "ms": round(seconds * 1e3, 2),
                  "images": state.get("images"), "tokens": state.get("tokens"),
                  "queue_ms": state.get("queue_ms"), "inference_ms": state.get("inference_ms"),
                  "request_id": state["request_id"]}
        text = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None and k not in ("method", "path",
                                                                                           "status"))
        access.log(level, "%s %s %s %s", fields["method"], path, status, text, extra={"fields": fields})
