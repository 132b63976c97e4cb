"""The ASGI gate in front of the app: API key, body size limit, and request counting by outcome.

Pure ASGI (not BaseHTTPMiddleware, which breaks disconnect detection and streaming limits). The body limit is
enforced at once from Content-Length, else while the body streams in: a body is never read whole first.
"""

from __future__ import annotations

import hmac
import time

from .errors import error_response
from .metrics import Metrics
from .settings import Settings

OPEN_PATHS = {"/health", "/ready", "/metrics"}  # no API key needed
API_PATHS = {"/v1/embeddings", "/v1/encode", "/v1/models"}


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
        headers, path, limit = dict(scope["headers"]), scope["path"], self.settings.payload_limit
        key = self.settings.api_key
        if key and path not in OPEN_PATHS:
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
                return await self._reply(scope, receive, send, error_response(
                    401, "missing or invalid API key (Authorization: Bearer <key>)", "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"}))
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await self._reply(scope, receive, send, error_response(
                413, f"request body over the {limit}-byte limit", "payload_too_large"))
        seen, status = 0, [0]

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise PayloadTooLarge()
            return message

        async def tracking_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        start = time.perf_counter()
        try:
            await self.app(scope, limited_receive, tracking_send)
        except PayloadTooLarge:
            if status[0]:
                raise
            await error_response(413, f"request body over the {limit}-byte limit", "payload_too_large")(
                scope, receive, tracking_send)
        if path.startswith("/v1/"):
            endpoint = endpoint_label(path)
            self.metrics.requests.labels(endpoint, "ok" if status[0] < 400 else str(status[0])).inc()
            self.metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - start)

    async def _reply(self, scope, receive, send, response):
        if scope["path"].startswith("/v1/"):
            self.metrics.requests.labels(endpoint_label(scope["path"]), str(response.status_code)).inc()
        await response(scope, receive, send)
