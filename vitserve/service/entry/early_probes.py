"""The port answers from the moment it is bound: `EarlyProbes` answers on the listening socket while the server's
processes start (torch imported, the front ends' apps built), until the app takes the socket over.

`/health` is 200 (the process is alive), `/ready` 503 `loading` (its reason: the processes are starting), and anything
else 503 `not_ready` in OpenAI's envelope with a Retry-After: what the app answers while it loads, without the app.
Each connection gets one answer and is closed. A thread of its own (no event loop runs yet) serves the connections
side by side, each bounded in size (a request line and headers of at most `MAX_HEAD_BYTES`) and time (`TIMEOUT`
seconds to send them), at most `MAX_CONNECTIONS` at once (a new one closes the oldest), so that clients that send
nothing hold no probe back. `stop` is called before the app accepts on the socket, so that no connection is answered
by both.
"""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time

from ..api.envelope import envelope

MAX_HEAD_BYTES = 16384
TIMEOUT = 2.0
MAX_CONNECTIONS = 256  # open at once; a new one closes the oldest
READY_REASON = "starting: the server's processes are starting"


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound to `host`:`port` (OSError: the port is taken, or the address is not
    this machine's), inheritable by the front ends' processes."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def answer(head: bytes) -> bytes:
    """The whole response to a request whose line and headers are `head`."""
    method, _, rest = head.partition(b" ")
    path = rest.partition(b" ")[0].partition(b"?")[0]
    body: dict
    if path == b"/health" and method in (b"GET", b"HEAD"):
        status, body, extra = b"200 OK", {"status": "ok"}, b""
    elif path == b"/ready" and method in (b"GET", b"HEAD"):
        status, body, extra = b"503 Service Unavailable", {"status": "loading", "reason": READY_REASON}, b""
    else:
        message = "the server is starting; try again once /ready answers 200"
        status, body, extra = b"503 Service Unavailable", envelope(503, message, "not_ready"), b"retry-after: 1\r\n"
    data = json.dumps(body).encode()
    head_out = (
        b"HTTP/1.1 "
        + status
        + b"\r\ncontent-type: application/json\r\ncontent-length: "
        + str(len(data)).encode()
        + b"\r\nconnection: close\r\n"
        + extra
        + b"\r\n"
    )
    return head_out + (b"" if method == b"HEAD" else data)


class EarlyProbes:
    """Answers on `sock` (a listening socket) from a thread of its own until `stop`."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._stopping = threading.Event()
        self._wake, self._waker = socket.socketpair()  # `stop` wakes the thread's wait at once
        self._thread = threading.Thread(target=self._serve, name="vitserve-early-probes", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No more answers from here: returns once the thread has let go of the socket (its open connections are
        closed); the socket stays open, for the app."""
        if not self._stopping.is_set():
            self._stopping.set()
            self._waker.send(b"x")
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        self.sock.setblocking(False)  # (what the app's event loop makes it too)
        selector.register(self.sock, selectors.EVENT_READ, None)
        selector.register(self._wake, selectors.EVENT_READ, False)
        pending: dict[socket.socket, tuple[bytearray, float]] = {}  # connection -> (what it sent, its deadline)
        try:
            while not self._stopping.is_set():
                for key, _ in selector.select(0.5):
                    if key.data is False:
                        break  # stop
                    if key.data is None:
                        self._accept(selector, pending)
                    else:
                        self._read(key.fileobj, selector, pending)  # type: ignore[arg-type]
                now = time.monotonic()
                for conn in [c for c, (_, deadline) in pending.items() if deadline < now]:
                    self._close(conn, selector, pending)
        finally:
            for conn in list(pending):
                self._close(conn, selector, pending)
            selector.close()
            self._wake.close()
            self._waker.close()

    def _accept(self, selector: selectors.BaseSelector, pending: dict) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:  # gone before it was taken, or no file descriptor left (the deadlines free some)
            return
        if len(pending) >= MAX_CONNECTIONS:
            self._close(next(iter(pending)), selector, pending)  # the oldest: the one nearest its deadline
        conn.setblocking(False)
        pending[conn] = (bytearray(), time.monotonic() + TIMEOUT)
        selector.register(conn, selectors.EVENT_READ, True)

    def _read(self, conn: socket.socket, selector: selectors.BaseSelector, pending: dict) -> None:
        if conn not in pending:  # closed for a newer one since the wait
            return
        received, _ = pending[conn]
        try:
            data = conn.recv(MAX_HEAD_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        received += data
        end = received.find(b"\r\n\r\n")
        if data and end < 0 and len(received) < MAX_HEAD_BYTES:
            return  # more of the head to come
        if end >= 0:
            try:
                conn.setblocking(True)
                conn.settimeout(TIMEOUT)
                conn.sendall(answer(bytes(received[:end])))
            except OSError:
                pass
        self._close(conn, selector, pending)

    @staticmethod
    def _close(conn: socket.socket, selector: selectors.BaseSelector, pending: dict) -> None:
        pending.pop(conn, None)
        selector.unregister(conn)
        conn.close()
