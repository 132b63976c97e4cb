"""Request bodies that land from the socket in the app's own buffer: the part of the HTTP protocol (http.py) that
reads through `get_buffer`.

An app that has a buffer for a request's body of known length (a body file's mapping: json_body.read_json) hands it
over through the scope's `vitserve.land` extension, and from then on the socket's bytes are received straight into
it (`get_buffer` is that buffer, bounded to what is left of the body, so a pipelined request after it never lands
there); the app's messages are views of the buffer where they landed. The bytes take no other copy: not h11's
receive buffer, not its events, not uvicorn's body buffer, not the app's copy into its buffer (five copies of a 6 MB
body otherwise), and the event loop steps once per read, not per event. What arrived before the buffer was handed
over comes as usual, first; h11 is told the landed bytes (its Content-Length reader's count), so it ends the request
as it would have, and each landed read counts as a piece of the body as h11's events do. Where h11 lacks that reader
(a private part of it), the protocol reads as before. A read that lands nowhere goes into one buffer shared by the
process's connections: each read's bytes are taken out before the next read (uvloop and asyncio call `get_buffer`,
read, then `buffer_updated`, in turn).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, cast

import h11

try:
    from h11._readers import ContentLengthReader

    _LANDS = all(hasattr(ContentLengthReader(0), name) for name in ("_length", "_remaining")) and all(
        hasattr(h11.Connection(h11.SERVER), name) for name in ("_reader", "_receive_buffer")
    )
except ImportError:  # pragma: no cover
    ContentLengthReader, _LANDS = type(None), False  # type: ignore[misc, assignment]

LAND = "vitserve.land"  # the scope's extension through which an app hands over its body's buffer
READ_BYTES = 256 * 2**10  # the shared buffer of the reads that land nowhere
_read_buffer = bytearray(READ_BYTES)


class Guarded(Protocol):
    """What landing uses of a connection's protocol (http.GuardedH11Protocol)."""

    cycle: Any  # uvicorn's RequestResponseCycle of the request being read
    landing: Landing

    @property
    def parser(self) -> h11.Connection: ...

    def data_received(self, data: bytes) -> None: ...

    def received(self, nbytes: int) -> None: ...

    def counted_piece(self, nbytes: int, event=None): ...

    def handle_events(self) -> None: ...

    def connection_made(self, transport) -> None: ...

    def connection_lost(self, exc: Exception | None) -> None: ...

    def eof_received(self) -> None: ...

    def pause_writing(self) -> None: ...

    def resume_writing(self) -> None: ...


class Landing:
    """One connection's landing of its requests' bodies (`protocol`: the connection's GuardedH11Protocol, whose h11
    connection, cycle and piece count it uses)."""

    def __init__(self, protocol: Guarded):
        self.protocol = protocol
        self.land: memoryview | None = None  # the request's body buffer, where the app handed one over
        self.landing = False  # whether the read under way lands in it
        self.given = self.landed = 0  # the body's bytes given to the app; those in the buffer or given to h11

    def begin(self) -> None:
        """A request has begun (the protocol's new cycle): offer it the extension, its receive giving landed views."""
        cycle = self.protocol.cycle
        self.land, self.landing = None, False
        cycle.scope.setdefault("extensions", {})[LAND] = self.hand_over
        cycle.receive = self.landed_receive(cycle.receive)

    def get_buffer(self) -> memoryview:
        """Where the next read goes: the rest of the request's body buffer when it lands there (`lands_now`), else
        the shared read buffer."""
        self.landing = self.lands_now()
        if self.landing:
            reader = self.protocol.parser._reader
            assert self.land is not None and isinstance(reader, ContentLengthReader)  # (lands_now)
            at = reader._length - reader._remaining  # the body's bytes given to h11 or landed before
            return self.land[at : at + reader._remaining]
        return memoryview(_read_buffer)

    def buffer_updated(self, nbytes: int) -> None:
        protocol = self.protocol
        if not self.landing:
            protocol.data_received(bytes(_read_buffer[:nbytes]))
            return
        reader = cast(ContentLengthReader, protocol.parser._reader)
        reader._remaining -= nbytes
        self.landed = reader._length - reader._remaining
        protocol.received(nbytes)
        if protocol.counted_piece(nbytes) is h11.PAUSED:
            return
        protocol.cycle.message_event.set()
        if reader._remaining == 0:  # h11 ends the request: its EndOfMessage, as for bytes it read itself
            protocol.handle_events()

    def lands_now(self) -> bool:
        """A read lands in the body's buffer while the body of known length is being read, once nothing received
        waits in h11 or in uvicorn's body buffer (those bytes come first); then the rest of the body lands too, also
        after an answer (the app's buffer stays valid while this view of it lives: see bodies.Body.release)."""
        if self.land is None:
            return False
        conn = self.protocol.parser
        return (
            isinstance(conn._reader, ContentLengthReader)
            and conn._reader._remaining > 0
            and (self.landed > self.given or (not conn._receive_buffer and not self.protocol.cycle.body))
        )

    def hand_over(self, buffer) -> bool:
        """The app's `vitserve.land`: the rest of this request's body goes into `buffer` (writable, at least the
        body's length; byte i of the body at buffer[i]); False where it cannot (the app then reads as before)."""
        if not _LANDS:
            return False
        reader = self.protocol.parser._reader
        view = memoryview(buffer).cast("B")
        if view.readonly or not isinstance(reader, ContentLengthReader) or len(view) < reader._length:
            return False
        self.land = view
        self.given = self.landed = reader._length - reader._remaining
        return True

    def landed_receive(self, receive):
        """The cycle's `receive`, where the landed bytes not yet given come as the view of the buffer that holds
        them (what uvicorn's own buffer held comes first: nothing lands while it holds anything)."""

        async def landed_receive():
            message = await receive()
            if self.land is None or message["type"] != "http.request" or message["body"]:
                return message
            if self.landed > self.given:
                message["body"], self.given = self.land[self.given : self.landed], self.landed
            if not message["more_body"]:
                self.land = None  # the whole body is given: the app's buffer is its own again
            return message

        return landed_receive


class Reads(asyncio.BufferedProtocol):
    """What the transport drives for a connection: its GuardedH11Protocol, reading through `get_buffer` (uvloop reads
    into a protocol's buffer only where the protocol is no asyncio.Protocol, which uvicorn's is)."""

    __slots__ = ("protocol",)

    def __init__(self, protocol: Guarded):
        self.protocol = protocol

    def connection_made(self, transport) -> None:
        self.protocol.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.protocol.landing.land = None
        self.protocol.connection_lost(exc)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.protocol.landing.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.protocol.landing.buffer_updated(nbytes)

    def eof_received(self) -> None:
        self.protocol.eof_received()

    def pause_writing(self) -> None:
        self.protocol.pause_writing()

    def resume_writing(self) -> None:
        self.protocol.resume_writing()
