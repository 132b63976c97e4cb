"""The HTTP protocol the server speaks: uvicorn's h11, which caps a request's line and headers
(`--max-header-bytes`), with a deadline to receive them (`--header-timeout`, from the connection's start or the
request's first byte): a client that trickles its headers, or connects and sends nothing, is closed. The body's
deadline is the gate's (`--body-timeout`)."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class GuardedH11Protocol(H11Protocol):
    header_timeout = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._headers_of = self.cycle  # a new request is the cycle that replaces this one
        self._deadline: asyncio.TimerHandle | None = None
        self._arm()

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

    def data_received(self, data: bytes) -> None:
        waiting = self.cycle is self._headers_of
        if waiting and self._deadline is None:  # the first byte of the next request on a kept-alive connection
            self._arm()
        super().data_received(data)
        if self.cycle is not self._headers_of:  # its headers are in: the app has the request
            self._disarm()

    def on_response_complete(self) -> None:
        self._headers_of = self.cycle
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def guarded_h11(header_timeout: float) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn is given (it instantiates it per connection)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": header_timeout})
