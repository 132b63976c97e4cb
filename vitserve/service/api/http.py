"""The HTTP protocol the server speaks: uvicorn's h11, guarded where a client can make it work or wait for nothing.

- Headers: a request's line and headers are capped (`--max-header-bytes`, h11's incomplete-event limit) and must
  arrive within `--header-timeout` (from the connection's start or the request's first byte): a client that
  trickles its headers, or connects and sends nothing, is closed. The body's deadline is the gate's
  (`--body-timeout`).
- Framing: a request with both Content-Length and Transfer-Encoding is refused and its connection closed (RFC 9112
  §6.3: the pair is how requests are smuggled past a proxy).
- Pieces: each piece of a body (a chunk, or a read of a Content-Length body) costs the event loop the same whatever
  its size, so a body may come in at most `FREE_PIECES` pieces plus one per `PIECE_BYTES` of data, and its framing
  may add at most `FRAMING_BYTES` plus an eighth of the data on the wire (chunk-size lines and their extensions):
  a body sent one byte per chunk is refused after a few dozen chunks (400 `body_pieces`) and its connection closed.
- Bodies in place: a request's body of known length lands from the socket in the buffer its app hands over
  (landing.py: the protocol is read through `get_buffer`).
- Answers: a body of known length goes to the socket as the pieces the app sends, never copied (h11 joins what it
  frames into new bytes: for a memoryview of a tensor, a full copy), and the whole of it may wait in the transport's
  buffer (its pieces are in memory already, views of the answer's tensors) rather than each piece waiting for the
  client to read the one before: the request ends (its admission and body budget are given back) once its answer is
  handed over, not once a slow client has read it. The buffer limit comes back to the default when the response is
  complete, so the connection's next response waits for this one to drain: a connection holds one answer at a time, as
  before.
- Connections: at `--max-connections` open, a new connection closes the longest-idle ones (waiting for a request, or
  still sending its headers) to make room; where every connection is busy, the new one is answered 503
  `too_many_connections` except on /health, /ready and /metrics, which always answer. (uvicorn's own limit answered
  every request 503, the probes too, while idle connections held their places.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from typing import cast

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .envelope import envelope
from .gate import OPEN_PATHS
from .landing import Landing, Reads

log = logging.getLogger("vitserve.http")

FREE_PIECES = 64  # pieces any body may come in
PIECE_BYTES = 512  # of data per piece beyond those
FRAMING_BYTES = 64 * 2**10  # bytes of chunk framing any body may add on the wire
RESERVED_FILES = 64  # descriptors the server keeps for itself: listening socket, logs, workers, spool files
HIGH_WATER = 64 * 2**10  # the transports' default write-buffer limit (asyncio's and uvloop's), in bytes


def error_bytes(conn: h11.Connection, status: int, message: str, code: str, headers=()) -> bytes:
    """A whole error response in the OpenAI envelope, closing the connection, as h11 frames it on `conn`."""
    body = json.dumps(envelope(status, message, code)).encode()
    head = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *headers,
    ]
    return b"".join(
        [
            conn.send(h11.Response(status_code=status, headers=head)),
            conn.send(h11.Data(data=body)),
            conn.send(h11.EndOfMessage()),
        ]
    )


class CountedConnection:
    """The h11 connection as uvicorn drives it, with each request's body pieces and wire bytes counted: the
    protocol's checks run on every event (uvicorn's handle_events loop is left as it is); answers' pieces pass
    through `send` uncopied."""

    def __init__(self, conn: h11.Connection, protocol: GuardedH11Protocol):
        self._conn, self._protocol = conn, protocol

    def __getattr__(self, name):
        return getattr(self._conn, name)

    def next_event(self):
        event = self._conn.next_event()
        return self._protocol.checked(event)

    def send(self, event):
        """h11's `send`, but a lone piece is returned as it is written (for a Content-Length body's Data: the very
        object the app sent, bytes or memoryview), not joined into new bytes; a Response's Content-Length sets how
        much the transport may buffer (`GuardedH11Protocol.sending`)."""
        if type(event) is h11.Response:
            self._protocol.sending(event)
        pieces = self._conn.send_with_data_passthrough(event)
        if pieces is None:  # ConnectionClosed
            return None
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


class GuardedH11Protocol(H11Protocol):
    header_timeout = 10.0
    max_connections = 1024

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.limit_concurrency = None  # our own limit, in connection_made: idle connections go first
        self.conn = CountedConnection(self.conn, self)
        self._pieces = self._data = 0  # of the request being read: its body's pieces and data bytes
        self._received = self._start = 0  # bytes received on the connection; where the request being read began
        self.landing = Landing(self)  # its bodies landing in their apps' buffers (landing.py)

    # ---- connections ---------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn's own
        super().connection_made(transport)
        self._headers_of = self.cycle  # a new request is the cycle that replaces this one
        self._deadline: asyncio.TimerHandle | None = None
        self._idle_since = time.monotonic()
        self._arm()
        if len(self.connections) > self.max_connections:
            self._make_room()

    @property
    def _counted(self) -> CountedConnection:
        return cast(CountedConnection, self.conn)  # what __init__ put in uvicorn's h11 connection's place

    @property
    def idle(self) -> bool:
        """Waiting for a request (or still sending its headers): nothing of the app's runs for it."""
        return self.cycle is self._headers_of and not self.transport.is_closing()

    def _make_room(self) -> None:
        """Close the longest-idle connections until this one fits; if every other one is busy, this connection's
        requests are answered 503, but for the probes."""
        idle = sorted(
            (c for c in self.connections if c is not self and getattr(c, "idle", False)),
            key=lambda c: cast(GuardedH11Protocol, c)._idle_since,  # (only ours are idle)
        )
        for other in idle[: len(self.connections) - self.max_connections]:
            other.transport.close()
            other.connections.discard(other)  # counted out now: its close completes on a later turn of the loop
        if len(self.connections) > self.max_connections:
            log.warning(
                "%d connections open, each busy with a request (--max-connections %d): answering a new one 503",
                len(self.connections),
                self.max_connections,
            )
            self.app = _over_limit(self.app)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        if not self.transport.is_closing():
            self.logger.info("closed a connection whose request headers took over %g s", self.header_timeout)
            self.transport.close()

    # ---- requests ------------------------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        waiting = self.cycle is self._headers_of
        if waiting and self._deadline is None:  # the first byte of the next request on a kept-alive connection
            self._arm()
        self._received += len(data)
        super().data_received(data)
        if self.cycle is not self._headers_of:  # its headers are in: the app has the request
            self._disarm()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and self.cycle is not None:  # a request has begun
            self.landing.begin()

    @property
    def parser(self) -> h11.Connection:
        """uvicorn's h11 connection itself (what CountedConnection wraps)."""
        return self._counted._conn

    def received(self, nbytes: int) -> None:
        """Bytes of the connection received other than through `data_received` (landed in place)."""
        self._received += nbytes

    def checked(self, event):
        """Every h11 event passes here before uvicorn acts on it: a request with ambiguous framing, or a body in
        too many pieces or too much framing, is refused (PAUSED: uvicorn stops reading; the connection closes)."""
        if isinstance(event, h11.Request):
            # the bytes h11 has parsed so far end with this request's headers; pipelined requests after it wait
            # in its buffer and count for themselves
            self._start, self._pieces, self._data = self._parsed(), 0, 0
            names = {name.lower() for name, _ in event.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                return self._refuse(
                    400, "a request may not have both Content-Length and Transfer-Encoding", "invalid_framing"
                )
        elif isinstance(event, h11.Data):
            return self.counted_piece(len(event.data), event)
        return event

    def counted_piece(self, nbytes: int, event=None):
        """A piece of the body (an h11 Data event, or a read that landed in place): refused where the body has come
        in too many pieces or too much framing (see the module's docstring)."""
        self._pieces += 1
        self._data += nbytes
        if self._pieces > FREE_PIECES + self._data // PIECE_BYTES:
            return self._refuse(
                400,
                f"the request body came in {self._pieces} pieces for {self._data} bytes; "
                f"send it in pieces of at least {PIECE_BYTES} bytes",
                "body_pieces",
            )
        if self._parsed() - self._start - self._data > FRAMING_BYTES + self._data // 8:
            return self._refuse(400, "the request body's framing takes more bytes than its data allows", "body_pieces")
        return event

    def _parsed(self) -> int:
        """Bytes of the connection h11 has parsed: those received but what waits in its buffer."""
        return self._received - len(self._counted._conn._receive_buffer)

    def _refuse(self, status: int, message: str, code: str):
        """Answer the request being read with an error and close the connection; what the app does with it is
        dropped (it reads a disconnect)."""
        cycle = self.cycle if self.cycle is not self._headers_of else None
        if cycle is not None:
            cycle.disconnected = True
            cycle.message_event.set()
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE) and (cycle is None or not cycle.response_started):
            try:
                self.transport.write(error_bytes(self._counted._conn, status, message, code))
            except h11.LocalProtocolError:
                pass
        self.logger.info("refused a request: %s", message)
        self.transport.close()
        return h11.PAUSED

    # ---- answers -------------------------------------------------------------------------------------------------
    def sending(self, response: h11.Response) -> None:
        """A response starts: the transport may buffer all of a body of known length (see the module's docstring)."""
        length = next((value for name, value in response.headers if name == b"content-length"), b"")
        if length.isdigit() and int(length) > HIGH_WATER and not self.transport.is_closing():
            self.transport.set_write_buffer_limits(high=int(length) + HIGH_WATER)

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self.transport.set_write_buffer_limits(high=HIGH_WATER)  # paused again while over it: see `sending`
        self._headers_of = self.cycle
        self._idle_since = time.monotonic()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def _over_limit(app):
    """The app for a connection over `--max-connections` that found no idle one to close: the probes as usual, every
    other request a 503."""

    async def answer(scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await app(scope, receive, send)
        body = json.dumps(
            envelope(503, "too many connections, each busy with a request; retry shortly", "too_many_connections")
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"retry-after", b"1"),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return answer


def connection_limit(max_connections: int) -> int:
    """The connections this process can hold open: `--max-connections`, within the file-descriptor limit. The soft
    limit is raised to the hard one where it is lower (a shell's default of 1024 would run out first); where even
    the hard limit leaves too few, the limit is lowered to fit and a warning says so."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + RESERVED_FILES
    if soft != resource.RLIM_INFINITY and soft < want:
        raised = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < want:
        fit = max(1, soft - RESERVED_FILES)
        log.warning(
            "--max-connections %d needs %d file descriptors, but this process may open %d (ulimit -n): "
            "holding at most %d connections",
            max_connections,
            want,
            soft,
            fit,
        )
        return fit
    return max_connections


def guarded_h11(header_timeout: float, max_connections: int = 1024):
    """What uvicorn is given as its protocol class: called per connection (with uvicorn's arguments), it makes a
    GuardedH11Protocol with these limits, read through `Reads`."""
    protocol = type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"header_timeout": header_timeout, "max_connections": max_connections},
    )

    def connection(*args, **kwargs) -> Reads:
        return Reads(protocol(*args, **kwargs))

    return connection
