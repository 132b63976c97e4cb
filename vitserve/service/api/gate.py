"""The ASGI gate in front of the app: request id, API key, admission, body size limit, memory and deadline, and per
request one access log line and its metrics.

Pure ASGI (not BaseHTTPMiddleware, which breaks disconnect detection and streaming limits). An encoding request is
admitted (503 while not ready, 429 over `--max-concurrent-requests`) as soon as its headers are in, before its body
is read: a slow or unfinished body counts. The body limit is enforced at once from Content-Length, else while the
body streams in (a body is never read whole first), and the body must arrive within `--body-timeout` (408).

Bodies held count against `--body-memory` (a `MemoryBudget`), twice each: the body as received and the images
parsed from it live as long as the request. A body's first `FREE_BODY_BYTES` are not counted (every request may
hold that much, --max-concurrent-requests bounds it), so an ordinary request never waits on large ones, and a body
takes its share only once it has sent them. A body of known length then takes all of its share at once: one that
does not fit waits holding none (bodies that each held a part and waited for the rest would wait on each other),
read no further (the client's sends stall), and is answered 429 if no room comes within the body deadline. A chunked
body takes its share a step (`CHARGE_STEP`) ahead of what is read, and for the same reason never waits: a step that
does not fit is a 429 at once. The share is given back when the request is answered, and what the route left in
the request's state under `on_end` (a shared body file to give back, bodies.py) is called then, whatever the
outcome. Routes leave what the access line reports (images, tokens, queue and inference time) in the request's
state.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import re
import time
import uuid

from ..decoding.budget import MemoryBudget
from ..ground.errors import EngineError
from ..ground.flags import format_size
from ..ground.metrics import Metrics, outcome
from ..ground.settings import Settings
from ..ground.timeline import mark
from .http_errors import ServiceError, error_response

OPEN_PATHS = {"/health", "/ready", "/metrics"}  # no API key needed
API_PATHS = {"/v1/embeddings", "/v1/encode", "/v1/models", "/v1/chat/completions"}
TIER_PATHS = {"/encode", "/scheduler_receive_url"}  # SGLang's encoder tier: counted as the API paths are
ENCODE_PATHS = {"/v1/embeddings", "/v1/encode", "/v1/chat/completions", "/encode"}  # admitted by the gate
# paths whose bodies are a few fields: their own body limit (a registration is not admitted: an admitted /encode
# waits for it)
SMALL_BODIES = {"/scheduler_receive_url": 64 * 2**10}
REQUEST_ID = re.compile(rb"[\w.:/+=@-]{1,128}")  # a client's x-request-id is echoed only when it looks like one

access = logging.getLogger("vitserve.access")


def payload_message(limit: int) -> str:
    """A 413 payload_too_large's words: the flag that sets the limit, in the unit it takes."""
    return f"request body over --payload-limit ({format_size(limit)}, {limit} bytes)"


class PayloadTooLarge(Exception):
    pass


class BodyTimeout(Exception):
    pass


class NoBodyMemory(Exception):
    pass


HELD_PER_BODY_BYTE = 2  # the body as received, and the images parsed from it
CHARGE_STEP = 2**20  # a chunked body's share grows in steps of this many bytes, one step ahead of what is read
FREE_BODY_BYTES = 2**20  # of each body, not counted


def endpoint_label(path: str) -> str:
    """The metrics label of a /v1/ or tier path: its route, or "other" (a label per unknown path would grow without
    end)."""
    return path if path in API_PATHS or path in TIER_PATHS else "other"


class BodyMeter:
    """One request's body as the app receives it: within `limit` bytes (PayloadTooLarge) and its `deadline`
    (BodyTimeout), its memory held in `bodies` as it arrives (NoBodyMemory where it cannot be: see the module's
    docstring); `charged`: what it holds, given back when the request ends."""

    def __init__(self, bodies: MemoryBudget, receive, limit: int, length: int | None, deadline: float):
        self.bodies, self._receive, self.limit, self.length, self.deadline = bodies, receive, limit, length, deadline
        self.seen = self.charged = 0
        self.done = False

    async def receive(self):
        if self.done:  # waiting for a disconnect while the images run: no deadline
            return await self._receive()
        await self._charge(ahead=True)
        try:
            message = await asyncio.wait_for(self._receive(), max(0.0, self.deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise BodyTimeout() from None
        self.seen += len(message.get("body", b""))
        if self.seen > self.limit:
            raise PayloadTooLarge()
        await self._charge(ahead=False)  # for what this message brought past the free part (a last one too)
        self.done = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    async def _charge(self, ahead: bool) -> None:
        """Hold the body memory for what came (and, `ahead`, for the step to come), once the free part has come."""
        if self.seen < FREE_BODY_BYTES:
            return
        if self.length is not None:
            want = HELD_PER_BODY_BYTE * (self.length - FREE_BODY_BYTES) - self.charged
            if want > 0:
                try:
                    self.charged += await asyncio.wait_for(
                        self.bodies.acquire(want), max(0.0, self.deadline - time.monotonic())
                    )
                except asyncio.TimeoutError:
                    raise NoBodyMemory() from None
            return
        steps = -(-self.seen // CHARGE_STEP) + ahead
        step = HELD_PER_BODY_BYTE * (min(self.limit, steps * CHARGE_STEP) - FREE_BODY_BYTES)
        if step > self.charged:
            if not self.bodies.try_acquire(step - self.charged):
                raise NoBodyMemory()
            self.charged = step


class Gate:
    def __init__(self, app, settings: Settings, metrics: Metrics, engine=None):
        self.app, self.settings, self.metrics, self.engine = app, settings, metrics, engine
        self.keys = [key.encode() for key in settings.server.api_keys()]
        self.bodies = (
            engine.bodies if engine is not None else MemoryBudget(settings.limits.body_memory, patience=math.inf)
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        headers, path = dict(scope["headers"]), scope["path"]
        limit = min(self.settings.limits.payload_limit, SMALL_BODIES.get(path, self.settings.limits.payload_limit))
        given = headers.get(b"x-request-id", b"")
        request_id = given.decode() if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["arrived"] = request_id, start
        if path in ENCODE_PATHS:
            mark("request")
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
        refused = self._refused(scope, headers, path, limit)
        if refused is not None:
            return await refused(scope, receive, send)
        length = headers.get(b"content-length")
        body = BodyMeter(
            self.bodies,
            receive,
            limit,
            None if length is None else int(length),
            time.monotonic() + self.settings.server.body_timeout,
        )
        started = [False]

        async def started_send(message):
            started[0] = started[0] or message["type"] == "http.response.start"
            await send(message)

        with contextlib.ExitStack() as admitted:
            if self.engine is not None and scope.get("method") == "POST" and path in ENCODE_PATHS:
                try:
                    admitted.enter_context(self.engine.admitted())
                except EngineError as e:
                    return await ServiceError.of(e).response()(scope, receive, send)
            admitted.callback(lambda: self.bodies.release(body.charged))
            admitted.callback(_run_on_end, scope["state"])
            try:
                await self.app(scope, body.receive, started_send)
            except (NoBodyMemory, PayloadTooLarge, BodyTimeout) as e:
                if started[0]:  # the answer had begun: it cannot become an error any more
                    raise
                await self._body_error(e, limit)(scope, receive, send)

    def _refused(self, scope, headers: dict, path: str, limit: int):
        """The answer to a request refused from its headers alone (a missing or wrong API key: 401; a declared body
        over the limit: 413), else None; an accepted key's index goes into the request's state."""
        if self.keys and path not in OPEN_PATHS:
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            matches = [hmac.compare_digest(token, key) for key in self.keys]  # all compared: the time names none
            if scheme.lower() != b"bearer" or not any(matches):
                return error_response(
                    401,
                    "missing or invalid API key (Authorization: Bearer <key>)",
                    "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            scope["state"]["client"] = matches.index(True)  # which key: the cache's scope (--cache-scope api-key)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return error_response(413, payload_message(limit), "payload_too_large")
        return None

    def _body_error(self, e: Exception, limit: int):
        """The answer to a body that did not fit its memory (429), its limit (413) or its deadline (408)."""
        if isinstance(e, NoBodyMemory):
            return error_response(
                429,
                "the server holds too many request bodies; retry shortly",
                "queue_full",
                headers={"Retry-After": "1", "Connection": "close"},
            )
        if isinstance(e, PayloadTooLarge):
            return error_response(413, payload_message(limit), "payload_too_large")
        return error_response(
            408,
            f"the request body did not arrive within {self.settings.server.body_timeout:g} s",
            "request_timeout",
            headers={"Connection": "close"},
        )

    def _account(self, scope, status: int, seconds: float) -> None:
        """The request's metrics and its access line (every request but the scrapes and probes, which would drown
        the log: /metrics, /health and /ready are logged at debug level)."""
        path, state = scope["path"], scope["state"]
        if path.startswith("/v1/") or path in TIER_PATHS:
            endpoint = endpoint_label(path)
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.request_seconds.labels(endpoint, outcome(status)).observe(seconds)
            if status < 400 and "images" in state:
                self.metrics.record("request", seconds)
        level = logging.DEBUG if path in OPEN_PATHS else logging.INFO
        if not access.isEnabledFor(level):
            return
        fields = {
            "method": scope.get("method"),
            "path": path,
            "status": status,
            "ms": round(seconds * 1e3, 2),
            "images": state.get("images"),
            "tokens": state.get("tokens"),
            "decode_ms": state.get("decode_ms"),
            "queue_ms": state.get("queue_ms"),
            "inference_ms": state.get("inference_ms"),
            "serialize_ms": state.get("serialize_ms"),
            "cache_hits": state.get("cache_hits"),
            "request_id": state["request_id"],
        }
        text = " ".join(
            f"{k}={v}" for k, v in fields.items() if v is not None and k not in ("method", "path", "status")
        )
        access.log(level, "%s %s %s %s", fields["method"], path, status, text, extra={"fields": fields})


def _run_on_end(state: dict) -> None:
    """What the request left to be done when it ends (`state["on_end"]`: a body file to give back), whatever its
    outcome."""
    for callback in state.pop("on_end", ()):
        callback()
