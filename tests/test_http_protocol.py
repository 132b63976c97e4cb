"""The guarded h11 protocol (service/api/http.py, landing.py) fed by hand, read by read as a transport feeds it
(`get_buffer`, then `buffer_updated`): one read that holds two requests, so that what h11 has not parsed yet is in the
connection's buffer when the first request's body is checked; and bodies received in place, into the buffer an app
hands over."""

from __future__ import annotations

import asyncio

import uvicorn
from uvicorn.server import ServerState

from vitserve.service.api import landing
from vitserve.service.api.http import guarded_h11
from vitserve.service.api.landing import LAND


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


def feed(reads, data: bytes, piece: int = 2**30) -> None:
    """What a transport does with `data` arriving in reads of at most `piece` bytes: each read goes into the buffer
    the protocol gives (it may be smaller), then buffer_updated."""
    while data:
        buffer = reads.get_buffer(-1)
        n = min(len(buffer), len(data), piece)
        assert n > 0
        buffer[:n] = data[:n]
        reads.buffer_updated(n)
        data = data[n:]


def connection(app, transport):
    config = uvicorn.Config(app, log_config=None, lifespan="off")
    config.load()
    reads = guarded_h11(10)(config=config, server_state=ServerState(), app_state={}, _loop=asyncio.get_running_loop())
    reads.connection_made(transport)
    return reads


async def answered(t: Transport, count: int) -> bytes:
    for _ in range(300):
        await asyncio.sleep(0.01)
        if t.out.count(b"HTTP/1.1 ") >= count:
            break
    return bytes(t.out)


def test_one_read_holding_two_requests_counts_each_requests_own_bytes():
    """A small body then a 300 KB one in the same read: both are answered. Counting the bytes received instead of
    those h11 parsed charged the second request's 300 KB to the first one's framing: a 400 body_pieces."""

    async def main():
        t = Transport()
        feed(connection(app, t), request(b"x" * 10) + request(b"y" * 300_000))
        return await answered(t, 2)

    out = asyncio.run(main())
    assert out.count(b"HTTP/1.1 200") == 2, out[:400]
    assert out.endswith(b"300000"), out[-50:]


class LandingApp:
    """Hands the protocol a buffer for its body once the first message has come (as read_json does once its body file
    is mapped), copies in only what did not land there, and answers how many bytes came as views of the buffer."""

    def __init__(self, hand_over: bool = True):
        self.hand_over, self.bodies, self.in_place, self.handed = hand_over, [], [], []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        length = int(dict(scope["headers"])[b"content-length"])
        buffer, size, in_place, first = bytearray(length + 4096), 0, 0, True  # (a body file is larger)
        while True:
            m = await receive()
            chunk = m.get("body", b"")
            if isinstance(chunk, memoryview) and chunk.obj is buffer:
                in_place += len(chunk)
            else:
                buffer[size : size + len(chunk)] = chunk
            size += len(chunk)
            if first and self.hand_over:
                self.handed.append(scope["extensions"][LAND](buffer))
            first = False
            if not m.get("more_body"):
                break
        self.bodies.append(bytes(buffer[:size]))
        self.in_place.append(in_place)
        body = str(size).encode()
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]}
        )
        await send({"type": "http.response.body", "body": body})


def test_a_body_lands_in_the_apps_buffer_after_what_came_before_and_the_next_request_is_read_as_usual():
    """The bytes that arrived before the hand-over come first, the rest lands in place, nothing past the body's end
    lands (a pipelined request in the same read is parsed by h11). Landing at the wrong offset, past the end, or
    before what h11 held would make the app's body differ from the one sent, or lose the second request."""
    body = bytes(range(251)) * 8000  # 2 MB, no run repeats at a piece's stride
    app = LandingApp()

    async def main():
        t = Transport()
        reads = connection(app, t)
        wire = request(body) + request(b"z" * 1000)
        feed(reads, wire[:300_000], piece=70_000)  # the headers and a first part, before the app runs
        await asyncio.sleep(0.01)  # the app takes its first message and hands its buffer over
        feed(reads, wire[300_000:], piece=300_000)  # the rest, and the next request in the last read
        return await answered(t, 2)

    out = asyncio.run(main())
    assert out.count(b"HTTP/1.1 200") == 2 and out.endswith(b"1000"), out[-200:]
    assert app.bodies == [body, b"z" * 1000]
    assert 1_500_000 < app.in_place[0] < len(body) and app.in_place[1] == 0
    assert app.handed == [True, False]  # the second body was read whole before its app ran: nothing left to land


def test_without_the_readers_count_nothing_lands_and_the_body_is_the_same(monkeypatch):
    """Where h11's Content-Length reader is not as the protocol knows it, the hand-over says no and the app copies
    the body in itself."""
    monkeypatch.setattr(landing, "_LANDS", False)
    body = bytes(range(251)) * 4000
    app = LandingApp()

    async def main():
        t = Transport()
        reads = connection(app, t)
        feed(reads, request(body)[:100_000])
        await asyncio.sleep(0.01)
        feed(reads, request(body)[100_000:], piece=200_000)
        return await answered(t, 1)

    assert asyncio.run(main()).endswith(str(len(body)).encode())
    assert app.bodies == [body] and app.in_place == [0] and app.handed == [False]


def test_a_body_landing_in_tiny_pieces_is_refused_as_one_read_by_h11_would_be():
    """Each read that lands counts as a piece of the body: a body trickled in 100-byte reads is a 400 body_pieces
    after a few dozen, landed or not."""
    app = LandingApp()

    async def main():
        t = Transport()
        reads = connection(app, t)
        wire = request(b"q" * 200_000)
        feed(reads, wire[:1000])
        await asyncio.sleep(0.01)
        feed(reads, wire[1000:20_000], piece=100)
        return t, await answered(t, 1)

    t, out = asyncio.run(main())
    assert b"400" in out.split(b"\r\n")[0] and b"body_pieces" in out and t.closed
