"""The PUSH sockets a part's message leaves by (pyzmq, imported here: the `sglang` extra; docs/sglang.md, Waiting and
bounds). A scheduler rank's socket is kept (one per address, at most `MAX_SOCKETS`, closed after `KEPT_IDLE` unused);
an `embedding_port`'s is opened for its message; at most `MAX_OPEN_SOCKETS` are open at once (a 429 beyond). A message
goes only to a peer that completed ZMTP 3's handshake: each socket's monitor fences off a port where no ZMQ receiver
listens (a 502 at once), and a receiver that cannot be reached within the timeout is a 502 too."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict

from ..ground.errors import DeliveryFailed, InputRejected, QueueFull

MAX_SOCKETS = 64  # persistent sockets (one per scheduler rank's address), least recently used closed beyond
MAX_OPEN_SOCKETS = 128  # sockets open at once, kept or handing over a message (a 429 beyond)
LINGER_MS = 5000  # how long a closed socket still sends what it holds
HANDSHAKE_MS = 5000  # how long a receiver may take to answer ZMQ's handshake (one that does not speaks no ZMQ)
ZAP_DOMAIN = b"vitserve"  # set on every socket: libzmq then refuses peers that speak no ZMTP 3 (see _open)
KEPT_IDLE = 600.0  # seconds a kept socket may go unused before it is closed
COUNTED = ("deliveries", "delivery_failures", "delivery_timeouts")  # what `counts` holds, in the figures' order


def pyzmq():
    """pyzmq's module, with zmq.asyncio loaded; an ImportError saying which extra brings it where it is missing."""
    try:
        import zmq
        import zmq.asyncio
    except ImportError:
        raise ImportError("--sglang-encoder pushes over ZMQ: pip install 'vitserve[sglang]' (pyzmq)") from None
    return zmq


class PushSockets:
    """One front end's PUSH sockets (on `zmq`, `pyzmq()`) and what they delivered (`counts`, by `COUNTED`).
    `timeout`: how long a message may wait for its receiver's connection."""

    def __init__(self, zmq, timeout: float):
        self.zmq, self.timeout = zmq, timeout
        self.context = zmq.asyncio.Context()
        self.kept: OrderedDict[str, object] = OrderedDict()  # by address
        self.busy: dict[object, int] = {}  # every open socket: the messages it is handing over now
        self.watches: dict[object, tuple] = {}  # every open socket's monitor and the task that reads it
        self.used: dict[object, float] = {}  # when each kept socket last took a message
        self.counts: Counter[str] = Counter()

    async def push(self, target: str, frames: list, keep: bool) -> None:
        """Hand the message to `target`'s socket (its frames by reference, not copied), which sends only to a peer
        that completed ZMTP 3's handshake; a socket that cannot take it within the timeout (no connection), or whose
        peer speaks no ZMQ (`_watch`: at once, not retried until the timeout), is closed, a 502. A socket opened for
        this message alone is closed after it, sending what it holds for up to `LINGER_MS`."""
        sock = self._socket(target, keep)
        self.busy[sock] += 1
        send = asyncio.ensure_future(sock.send_multipart(frames, copy=False))
        try:
            failed = self.watches[sock][1]
            await asyncio.wait((send, failed), timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
            if not send.done():
                send.cancel()
                if failed.done():
                    raise self._broken(target, sock, "delivery_failures", "no ZMQ there (a failed handshake)")
                raise self._broken(target, sock, "delivery_timeouts", f"no connection within {self.timeout:g} s")
            try:
                send.result()
            except self.zmq.ZMQError as e:
                raise self._broken(target, sock, "delivery_failures", str(e)) from None
            self.counts["deliveries"] += 1
        except BaseException:
            send.cancel()
            raise
        finally:
            if sock in self.busy:
                self.busy[sock] -= 1
                if not keep:
                    self._close(sock, LINGER_MS)

    def _socket(self, target: str, keep: bool):
        """A PUSH socket connected to `target`: the kept one (`keep`), or a new one (kept if `keep`). Any call
        closes the kept sockets unused for `KEPT_IDLE` seconds; beyond `MAX_OPEN_SOCKETS` open, the idle kept ones
        are closed first, and a 429 where that is not enough."""
        now = time.monotonic()
        for old in [t for t, s in self.kept.items() if not self.busy[s] and now - self.used[s] > KEPT_IDLE]:
            self._close(self.kept.pop(old), LINGER_MS)
        sock = self.kept.get(target) if keep else None
        if sock is not None:
            self.kept.move_to_end(target)
            self.used[sock] = now
            return sock
        if len(self.busy) >= MAX_OPEN_SOCKETS:  # the idle kept ones go first
            idle = [t for t, s in self.kept.items() if not self.busy[s]]
            for old in idle[: len(self.busy) - MAX_OPEN_SOCKETS + 1]:
                self._close(self.kept.pop(old), LINGER_MS)
            if len(self.busy) >= MAX_OPEN_SOCKETS:
                raise QueueFull(f"{MAX_OPEN_SOCKETS} deliveries are under way; retry shortly", "too_many_deliveries")
        sock = self._open(target)
        if keep:
            self._keep(target, sock, now)
        return sock

    def _open(self, target: str):
        """A new PUSH socket connecting to `target`, with its monitor read by `_watch`, which tells a peer that
        speaks no ZMQ from a connection to come; an address ZMQ cannot connect to is a 400 and leaves no socket."""
        zmq = self.zmq
        sock = self.context.socket(zmq.PUSH)
        self.busy[sock] = 0
        try:
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # a message waits for a connection, not in a pipe to nowhere
            sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
            # libzmq takes a peer whose first bytes are not ZMTP 3's greeting (an HTTP server's answer among them)
            # for a ZMTP 1.0 one and sends to it; with a ZAP domain it refuses ZMTP 1.0 and 2.0 peers, so with
            # IMMEDIATE a message goes only to a peer that completed ZMTP 3's handshake. This context has no ZAP
            # handler: ZMTP 3 peers are not authenticated (SGLang's receivers speak ZMTP 3, mechanism NULL).
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
            if target.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            monitor = sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED
                | zmq.EVENT_DISCONNECTED
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            )
            self.watches[sock] = (monitor, asyncio.ensure_future(self._watch(monitor)))
            sock.connect(target)
        except zmq.ZMQError as e:
            self._close(sock, 0)
            raise InputRejected(f"cannot connect to {target}: {e}", "invalid_receiver") from None
        return sock

    def _keep(self, target: str, sock, now: float) -> None:
        """Keep `sock` for `target`; beyond `MAX_SOCKETS` kept, the least recently used that send nothing now are
        closed."""
        self.kept[target] = sock
        self.used[sock] = now
        idle = [t for t, s in self.kept.items() if not self.busy[s] and s is not sock]
        for old in idle[: max(0, len(self.kept) - MAX_SOCKETS)]:
            self._close(self.kept.pop(old), LINGER_MS)

    async def _watch(self, monitor) -> int:
        """Read a socket's monitor until its peer proves to speak no ZMQ: a failed handshake, or a connection closed
        before ZMQ's handshake completed on it (a peer refused as ZMTP 1.0 or 2.0 is only disconnected, and never
        reconnected to); returns that event. A connection closed after a completed handshake is a receiver gone
        for now: the socket reconnects."""
        from zmq.utils.monitor import parse_monitor_message

        zmq, shaken = self.zmq, False
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                shaken = True
            elif event == zmq.EVENT_DISCONNECTED and shaken:
                shaken = False
            else:
                return event

    def _close(self, sock, linger: int) -> None:
        self.busy.pop(sock, None)
        self.used.pop(sock, None)
        monitor, failed = self.watches.pop(sock, (None, None))
        if monitor is not None:
            failed.cancel()
            sock.disable_monitor()
            monitor.close(linger=0)
        sock.close(linger=linger)

    def _broken(self, target: str, sock, count: str, why: str) -> DeliveryFailed:
        """A delivery that failed: counted under `count`, its socket closed (a kept one forgotten); the 502."""
        self.counts[count] += 1
        if self.kept.get(target) is sock:
            del self.kept[target]
        self._close(sock, 0)
        return DeliveryFailed(f"embedding delivery to {target} failed: {why}", "delivery_failed")

    async def close(self) -> None:
        """Close every socket (what they still hold is sent for up to `LINGER_MS`), then the context."""
        for sock in list(self.busy):
            self._close(sock, LINGER_MS)
        self.kept.clear()
        await asyncio.sleep(0)  # the monitors' reads see their cancellation
        await asyncio.to_thread(self.context.term)
