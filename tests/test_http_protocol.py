"""The guarded h11 protocol (service/http.py) fed by hand: one read that holds two requests, so that what h11 has
not parsed yet is in the connection's buffer when the first request's body is checked."""

from __future__ import annotations

import asyncio

import uvicorn
from uvicorn.server import ServerState

from vitserve.service.api.http import guarded_h11


class Transport(asyncio.Transport):
    """What uvicorn's protocol asks of a transport; the bytes it writes collect in `out`."""

    def __init__(self):
        super().__init__()
        self.out, self.closed = bytearray(), False

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 1), "peername": ("127.0.0.1", 2)}.get(name, default)

    def write(self, data):
        self.out += data

    def writelines(self, pieces):
        for p in pieces:
            self.out += p

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass

    def set_write_buffer_limits(self, high=None, low=None):
        pass

    def get_write_buffer_size(self):
        return 0


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    size = 0
    while True:
        m = await receive()
        size += len(m.get("body", b""))
        if not m.get("more_body"):
            break
    body = str(size).encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]}
    )
    await send({"type": "http.response.body", "body": body})


def request(body: bytes) -> bytes:
    return b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


def test_one_read_holding_two_requests_counts_each_requests_own_bytes():
    """A small body then a 300 KB one in the same read: both are answered. Counting the bytes received instead of
    those h11 parsed charged the second request's 300 KB to the first one's framing: a 400 body_pieces."""

    async def main():
        config = uvicorn.Config(app, log_config=None, lifespan="off")
        config.load()
        protocol = guarded_h11(10)(
            config=config, server_state=ServerState(), app_state={}, _loop=asyncio.get_running_loop()
        )
        t = Transport()
        protocol.connection_made(t)
        protocol.data_received(request(b"x" * 10) + request(b"y" * 300_000))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if t.out.count(b"HTTP/1.1 ") >= 2:
                break
        return bytes(t.out)

    out = asyncio.run(main())
    assert out.count(b"HTTP/1.1 200") == 2, out[:400]
    assert out.endswith(b"300000"), out[-50:]
