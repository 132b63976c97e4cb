"""Hostile load against a real server (tiny model, CPU): every case gets a clear answer or a closed connection, no
5xx, within bounds of time; a normal request beside each is still served. Bounded: short deadlines are set by
flags, so the whole suite takes seconds. (bench/hostile.py measures the memory and latency side.)"""

from __future__ import annotations

import functools
import io
import json
import os
import socket
import time

import httpx
import pytest
from helpers import STARTUP_S, data_uri, png, serving, wait_until
from PIL import Image

from vitserve.service.decoding import spool
from vitserve.service.entry.launch import start_server

pytestmark = pytest.mark.slow
# one front end: these are the limits of one (on a GPU machine the default is several, each with a share of them)
FLAGS = (
    "--model",
    "tiny-qwen2.5-vl",
    "--load-format",
    "dummy",
    "--api-servers",
    "1",
    "--body-timeout",
    "1",
    "--header-timeout",
    "1",
    "--max-concurrent-requests",
    "4",
    "--decode-memory-per-request",
    str(256 * 2**20),
    "--allow-url-fetch",
    "--max-connections",
    "48",
    "--body-memory",
    str(8 * 2**20),
)
NORMAL = {"input": [data_uri(png(64, 48, 9))]}


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **options)
    return buf.getvalue()


@functools.cache
def bombs() -> dict[str, bytes]:
    """Small files that declare far more pixels than --max-image-pixels (50 M); the BMP a header alone."""
    big = Image.new("RGBA", (8000, 8000))
    return {
        "webp 8000² transparent": encoded(big, "WEBP", lossless=True),
        "png 8000²": encoded(Image.new("L", (8000, 8000)), "PNG"),
        "gif 8000²": encoded(Image.new("P", (8000, 8000)), "GIF"),
        "tiff 8000²": encoded(Image.new("L", (8000, 8000)), "TIFF", compression="tiff_deflate"),
        "bmp 8000²": encoded(Image.new("1", (8000, 8000)), "BMP")[:4096],
        "jpeg 8000²": encoded(Image.new("L", (8000, 8000)), "JPEG", quality=10),
    }


@pytest.fixture(scope="module")
def server():
    yield from serving(*FLAGS)


def normal_ok(url: str) -> None:
    r = httpx.post(url + "/v1/embeddings", json=NORMAL, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("name", list(bombs()))
def test_bombs_in_every_format_are_413_from_their_header(server, name):
    _, url = server
    data = bombs()[name]
    assert len(data) < 2**20
    start = time.monotonic()
    r = httpx.post(url + "/v1/embeddings", json={"input": [data_uri(data)]}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "image_too_large", r.text
    assert time.monotonic() - start < 2  # refused from the header: nothing decoded
    normal_ok(url)


def test_sixteen_bombs_in_one_request_and_the_request_decode_limit(server):
    _, url = server
    webp = bombs()["webp 8000² transparent"]
    start = time.monotonic()
    r = httpx.post(url + "/v1/embeddings", json={"input": [data_uri(webp)] * 16}, timeout=30)
    assert r.status_code == 413 and time.monotonic() - start < 2
    # under the pixel limit each, but 8 x 3000² transparent images take over the 256 MiB of one request's decoding
    medium = [data_uri(encoded(Image.new("RGBA", (3000 + i, 3000)), "PNG")) for i in range(8)]
    r = httpx.post(url + "/v1/embeddings", json={"input": medium}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "decode_memory", r.text
    normal_ok(url)


@pytest.mark.parametrize("fmt", ["EPS", "JPEG2000", "PCX", "TGA", "ICO"])
def test_formats_off_the_allow_list_are_400(server, fmt):
    _, url = server
    r = httpx.post(url + "/v1/embeddings", json={"input": [data_uri(encoded(Image.new("RGB", (32, 32)), fmt))]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_format", r.text


def stats(url: str) -> dict:
    return httpx.get(url + "/stats", timeout=10).json()


def posting(port: int, framing: bytes, start: bytes = b'{"input": ["') -> socket.socket:
    """A connection that has sent the headers of a POST /v1/embeddings (`framing`: its Content-Length or
    Transfer-Encoding header) and the `start` of its body."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" + framing + b"\r\n\r\n" + start
    )
    return sock


def unfinished(port: int, length: int) -> socket.socket:
    return posting(port, b"content-length: %d" % length)


def test_unfinished_bodies_count_time_out_and_are_closed(server):
    """Bodies that never finish count against the request limit from their headers (the 5th request is a 429),
    get a 408 at the body deadline, and their connections are closed."""
    _, url = server
    port = int(url.rsplit(":", 1)[1])
    socks = [posting(port, b"content-length: 1000000", b'{"input": ["' + b"A" * 5000) for _ in range(4)]
    wait_until(lambda: stats(url)["requests_in_flight"] == 4, 5, "4 unfinished bodies admitted")
    r = httpx.post(url + "/v1/embeddings", json=NORMAL, timeout=30)
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    start = time.monotonic()
    for sock in socks:
        sock.settimeout(5)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]  # then closed (recv returned b"")
        sock.close()
    assert time.monotonic() - start < 3
    wait_until(lambda: stats(url)["requests_in_flight"] == 0, 5, "the slots given back")
    normal_ok(url)


def test_half_sent_headers_and_silent_connections_are_closed(server):
    _, url = server
    port = int(url.rsplit(":", 1)[1])
    half = socket.create_connection(("127.0.0.1", port))
    half.sendall(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\nx-slow: ")
    silent = socket.create_connection(("127.0.0.1", port))
    start = time.monotonic()
    for sock in (half, silent):
        sock.settimeout(5)
        assert sock.recv(1) == b""  # closed by the server
        sock.close()
    assert time.monotonic() - start < 3


def test_huge_lists_and_headers_are_refused_at_once(server):
    _, url = server
    body = b'{"input": [' + b",".join([b'"a"'] * 4_000_000) + b"]}"  # 16 MB of one-character images
    start = time.monotonic()
    r = httpx.post(url + "/v1/embeddings", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_images"
    assert time.monotonic() - start < 2
    port = int(url.rsplit(":", 1)[1])
    for path in (b"/health", b"/v1/embeddings"):
        sock = socket.create_connection(("127.0.0.1", port))
        start = time.monotonic()
        try:
            sock.sendall(b"GET " + path + b" HTTP/1.1\r\nhost: x\r\nx-big: " + b"A" * (8 * 2**20) + b"\r\n\r\n")
        except OSError:  # the server closed the connection while we were still sending
            pass
        sock.settimeout(5)
        try:
            reply = sock.recv(65536)
        except OSError:
            reply = b""
        assert reply == b"" or reply.startswith(b"HTTP/1.1 400"), reply[:200]
        assert time.monotonic() - start < 2
        sock.close()
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_errors_echo_nothing_large_and_no_decoder_text(server):
    _, url = server
    r = httpx.post(url + "/v1/embeddings", json={"model": "m" * 30000, "input": NORMAL["input"]}, timeout=30)
    assert r.status_code == 404 and len(r.content) < 1000
    truncated = png(200, 150, 3)[:300]
    r = httpx.post(url + "/v1/embeddings", json={"input": [data_uri(truncated)]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "undecodable_image"
    # the service's own words only: PIL's ("image file is truncated", "broken data stream", ...) stay in the log
    assert r.json()["error"]["message"] == "input[0]: could not decode image data (truncated or corrupt file?)"


@pytest.mark.parametrize(
    "target",
    [
        "http://example.com:99999/",
        "http://example.com:-1/",
        "http://[::1/",
        "http://exa\\r\\nmple.com/x",
        "http://[::ffff:127.0.0.1]/x",
        "http://[2002:7f00:1::1]/x",
    ],
)
def test_malformed_and_disguised_urls_are_400(server, target):
    _, url = server
    r = httpx.post(url + "/v1/embeddings", json={"input": [target.replace("\\\\r\\\\n", "\\r\\n")]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] in ("invalid_url", "forbidden_url"), r.text


def test_planted_lock_files_are_left_alone(tmp_path, monkeypatch):
    """A spool sweep removes only a dead server's files: named as servers name them and owned by this user; a
    planted file with another name, or a file of another user, stays."""
    planted = [
        tmp_path / name
        for name in (
            "vitserve-x-lock",
            "vitserve-1-2-3-lock",
            "vitserve-12-zzzzzzzz-lock",
            "vitserve-12-0123abcd-lock.bak",
        )
    ]
    for path in planted:
        path.write_bytes(b"")
    dead = tmp_path / "vitserve-12-0123abcd-lock"
    dead.write_bytes(b"")
    (tmp_path / "vitserve-12-0123abcd-7").write_bytes(b"pixels")
    theirs = tmp_path / "vitserve-13-0123abce-lock"
    theirs.write_bytes(b"")
    real_uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real_uid)
    monkeypatch.setattr(os, "fstat", lambda fd, real=os.fstat: _as_other(real(fd), theirs, real_uid))
    spool.sweep(str(tmp_path))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([*(p.name for p in planted), theirs.name]), left


def _as_other(st, theirs, uid):
    """fstat as if `theirs` (told apart by its inode) belonged to another user."""
    return os.stat_result((*st[:4], uid + 1, *st[5:])) if st.st_ino == os.stat(theirs).st_ino else st


def health_ms(url: str) -> float:
    start = time.perf_counter()
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    return (time.perf_counter() - start) * 1e3


def reply_of(sock: socket.socket, timeout: float = 5) -> bytes:
    """Everything the server sends on `sock` until it closes the connection."""
    sock.settimeout(timeout)
    reply = b""
    try:
        while chunk := sock.recv(65536):
            reply += chunk
    except OSError:
        pass
    return reply


@pytest.mark.parametrize("item", [b"0", b"null", b"{}", b"[]", b"true", b'{"a":1}', b"1.5e3"])
def test_a_list_of_anything_but_strings_is_refused_before_parsing(server, item):
    """3.8 MB of numbers (or nulls, objects, lists, booleans) in a list held the event loop 10 s and took 1.7 GB:
    pydantic built one error per item. Any value counts toward the bound, whatever its type."""
    _, url = server
    n = 3_800_000 // (len(item) + 1)
    for path, key in (("/v1/embeddings", b"input"), ("/v1/encode", b"images")):
        body = b'{"' + key + b'": [' + b",".join([item] * n) + b"]}"
        start = time.monotonic()
        r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_images", r.text
        assert time.monotonic() - start < 1.5
    assert health_ms(url) < 500
    normal_ok(url)


def test_the_same_image_twice_over_http(server):
    """The reproduction of a 500: the same image twice in one request, cache on (the default), float32 safetensors
    from multipart, and JSON with the same data URI three times."""
    _, url = server
    image = png(80, 60, 21)
    files = [("images", ("a.png", image, "image/png")), ("images", ("b.png", image, "image/png"))]
    for _ in range(2):  # then every item from the cache
        r = httpx.post(url + "/v1/encode", files=files, headers={"accept": "application/octet-stream"}, timeout=30)
        assert r.status_code == 200, r.text
        r = httpx.post(url + "/v1/encode", json={"images": [data_uri(image)] * 3}, timeout=30)
        assert r.status_code == 200 and len({item["embeddings"] for item in r.json()["data"]}) == 1


def test_unknown_field_names_are_clipped_in_errors(server):
    _, url = server
    body = {"input": NORMAL["input"], "k" * (4 * 2**20): 1}
    r = httpx.post(url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 422 and len(r.content) < 1000, len(r.content)
    assert r.json()["error"]["param"].endswith("...")


def test_content_length_and_transfer_encoding_together_are_refused_and_closed(server):
    """A request with both headers is how one is smuggled past a proxy (RFC 9112 6.3): a 400, the connection closed,
    and what follows its body never answered."""
    _, url = server
    port = int(url.rsplit(":", 1)[1])
    body = b'{"input": []}'
    smuggled = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n%s"
        % (len(body), len(body), body, smuggled)
    )
    reply = reply_of(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 400") and b"invalid_framing" in reply, reply[:300]
    assert reply.count(b"HTTP/1.1") == 1  # the smuggled request got no answer: the connection closed


def test_pipelined_requests_each_count_their_own_bytes(server):
    """Two requests in one packet, a small body then a large one: each is answered (the bytes h11 has not parsed yet
    are the next request's, not the first one's framing), and a one-byte-chunk body after them is still refused."""
    _, url = server
    port = int(url.rsplit(":", 1)[1])
    small = b'{"input": []}'
    large = json.dumps({"input": [data_uri(png(600, 600, 5))]}).encode()
    assert len(large) > 2**20

    def post(body: bytes, close: bool = False) -> bytes:
        return (
            b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n%s\r\n%s" % (len(body), b"connection: close\r\n" if close else b"", body)
        )

    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(post(small) + post(large, close=True))
    reply = reply_of(sock, timeout=30)
    sock.close()
    assert reply.count(b"HTTP/1.1 ") == 2, reply[:300]
    assert reply.startswith(b"HTTP/1.1 422") or reply.startswith(b"HTTP/1.1 400"), reply[:300]  # an empty list
    assert b"HTTP/1.1 200" in reply and b"body_pieces" not in reply, reply[:600]


def test_a_body_in_one_byte_chunks_is_refused_at_once(server):
    """Four connections sending 1-byte chunks took normal requests from 18 ms to 12.8 s: each chunk costs the event
    loop the same as a large one. A body in too many pieces for its size is a 400 within a few dozen chunks."""
    _, url = server
    port = int(url.rsplit(":", 1)[1])
    socks = [posting(port, b"transfer-encoding: chunked", b"") for _ in range(4)]
    start = time.monotonic()
    for sock in socks:
        try:
            for byte in b'{"input": ["' + b"A" * 4000:
                sock.sendall(b"1\r\n%c\r\n" % byte)
        except OSError:  # closed by the server while we sent
            pass
    for sock in socks:
        reply = reply_of(sock)
        sock.close()
        assert reply.startswith(b"HTTP/1.1 400") and b"body_pieces" in reply, reply[:300]
    assert time.monotonic() - start < 5
    normal_ok(url)
    # a chunked body in reasonable pieces is served
    data = ('{"input": ["%s"]}' % NORMAL["input"][0]).encode()
    r = httpx.post(
        url + "/v1/embeddings",
        content=(data[i : i + 4096] for i in range(0, len(data), 4096)),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 200, r.text


def test_idle_connections_make_room_and_probes_always_answer(server):
    """1030 open connections made uvicorn answer every request, /health included, with a plain-text 503. Past
    --max-connections (48 here) the longest-idle connections are closed to make room: kept-alive ones first."""
    _, url = server
    port = int(url.rsplit(":", 1)[1])
    kept = []
    for _ in range(40):  # kept alive after an answer: idle
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        sock.settimeout(5)
        answer = b""
        while not answer.endswith(b'{"status":"ok"}'):
            answer += sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200")
        kept.append(sock)
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]  # connected, saying nothing
    for _ in range(3):
        assert health_ms(url) < 1000
        normal_ok(url)
    closed = 0
    for sock in kept:
        sock.settimeout(0.5)
        try:
            closed += sock.recv(1) == b""
        except OSError:
            pass
        sock.close()
    for sock in silent:
        sock.close()
    assert closed >= 30, closed  # the longest idle made room for the newer ones


@pytest.fixture
def small_server():
    proc, url = start_server(
        "--model",
        "tiny-qwen2.5-vl",
        "--load-format",
        "dummy",
        "--api-servers",
        "1",
        "--max-connections",
        "4",
        "--max-concurrent-requests",
        "16",
        "--body-timeout",
        "3",
        "--body-memory",
        "4MiB",
        timeout=STARTUP_S,
        capture_log=True,
    )
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    proc.log_reader.join(10)
    assert "Traceback" not in "".join(proc.log)


def test_with_every_connection_busy_the_probes_still_answer(small_server):
    """Every connection busy with a request (4 unfinished bodies, --max-connections 4): a new connection's request is
    answered 503 too_many_connections in JSON, but /health, /ready and /metrics answer as always."""
    url = small_server
    port = int(url.rsplit(":", 1)[1])
    busy = [unfinished(port, 1000) for _ in range(4)]

    def in_flight():  # read from /metrics (/stats is not a probe)
        return next(
            float(line.split()[-1])
            for line in httpx.get(url + "/metrics", timeout=5).text.splitlines()
            if line.startswith("vitserve_requests_in_flight ")
        )

    wait_until(lambda: in_flight() == 4, 5, "4 requests in flight")
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(url + path, timeout=5).status_code == 200, path
    r = httpx.post(url + "/v1/embeddings", json=NORMAL, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections", r.text
    for sock in busy:
        sock.close()
    wait_until(lambda: in_flight() == 0, 5, "the requests gone")
    normal_ok(url)


def test_request_bodies_count_against_the_body_memory(small_server):
    """Bodies held count twice, beyond their first MiB, against --body-memory (4 MiB here), all at once when that
    MiB has come: a 3 MB body that does not fit beside another waits holding nothing, read no further than its free
    MiB, while small requests pass; it takes the room once the other is gone, and gives it back when it ends.
    (tests/test_api.py has the 429s of bodies that find no room.)"""
    url = small_server
    port = int(url.rsplit(":", 1)[1])
    held = lambda: stats(url)["memory"]["bodies"]["bytes"]  # noqa: E731
    share = 2 * (3_000_000 - 2**20)
    first = unfinished(port, 3_000_000)
    assert held() == 0  # a declared length reserves nothing
    first.sendall(b"A" * 2_500_000)
    wait_until(lambda: held() == share, 5, "the first body's share held as it arrived")
    second = unfinished(port, 3_000_000)
    second.sendall(b"A" * 2_500_000)  # does not fit: waits holding nothing, read no further than its first MiB
    time.sleep(0.3)
    assert held() == share
    normal_ok(url)  # a small one never waits
    first.close()
    wait_until(lambda: held() == share and stats(url)["requests_in_flight"] == 1, 5, "the second's share taken")
    reply = reply_of(second)  # its body never ends
    assert reply.startswith(b"HTTP/1.1 408"), reply[:300]
    second.close()
    wait_until(lambda: held() == 0, 5, "every share given back")
    metrics = httpx.get(url + "/metrics", timeout=5).text
    assert 'vitserve_memory_held_bytes{use="bodies"} 0.0' in metrics
