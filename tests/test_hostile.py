"""Hostile load against a real server (tiny model, CPU): every case gets a clear answer or a closed connection, no
5xx, within bounds of time; a normal request beside each is still served. Bounded: short deadlines are set by
flags, so the whole suite takes seconds. (bench/hostile.py measures the memory and latency side.)"""

from __future__ import annotations

import functools
import io
import os
import socket
import time

import httpx
import pytest
from helpers import data_uri, png, wait_until
from PIL import Image

from vitserve.service import spool
from vitserve.service.launch import start_server

pytestmark = pytest.mark.slow
FLAGS = ("--model", "tiny-qwen2.5-vl", "--load-format", "dummy", "--body-timeout", "1", "--header-timeout", "1",
         "--max-concurrent-requests", "4", "--decode-memory-per-request", str(256 * 2**20), "--allow-url-fetch")
NORMAL = {"input": [data_uri(png(64, 48, 9))]}


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **options)
    return buf.getvalue()


@functools.cache
def bombs() -> dict[str, bytes]:
    """Small files that declare far more pixels than --max-image-pixels (50 M); the BMP a header alone."""
    big = Image.new("RGBA", (8000, 8000))
    return {"webp 8000² transparent": encoded(big, "WEBP", lossless=True),
            "png 8000²": encoded(Image.new("L", (8000, 8000)), "PNG"),
            "gif 8000²": encoded(Image.new("P", (8000, 8000)), "GIF"),
            "tiff 8000²": encoded(Image.new("L", (8000, 8000)), "TIFF", compression="tiff_deflate"),
            "bmp 8000²": encoded(Image.new("1", (8000, 8000)), "BMP")[:4096],
            "jpeg 8000²": encoded(Image.new("L", (8000, 8000)), "JPEG", quality=10)}


@pytest.fixture(scope="module")
def server():
    proc, url = start_server(*FLAGS, timeout=60, capture_log=True)
    yield proc, url
    proc.terminate()
    proc.wait(timeout=30)
    proc.log_reader.join(10)
    assert "Traceback" not in "".join(proc.log)


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


def test_unfinished_bodies_count_time_out_and_are_closed(server):
    """Bodies that never finish count against the request limit from their headers (the 5th request is a 429),
    get a 408 at the body deadline, and their connections are closed."""
    _, url = server
    port = int(url.rsplit(":", 1)[1])
    socks = []
    for _ in range(4):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 1000000\r\n\r\n{\"input\": [\"" + b"A" * 5000)
        socks.append(sock)
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


@pytest.mark.parametrize("target", ["http://example.com:99999/", "http://example.com:-1/", "http://[::1/",
                                    "http://exa\\r\\nmple.com/x", "http://[::ffff:127.0.0.1]/x",
                                    "http://[2002:7f00:1::1]/x"])
def test_malformed_and_disguised_urls_are_400(server, target):
    _, url = server
    r = httpx.post(url + "/v1/embeddings", json={"input": [target.replace("\\\\r\\\\n", "\\r\\n")]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] in ("invalid_url", "forbidden_url"), r.text


def test_planted_lock_files_are_left_alone(tmp_path, monkeypatch):
    """A spool sweep removes only a dead server's files: named as servers name them and owned by this user; a
    planted file with another name, or a file of another user, stays."""
    planted = [tmp_path / name for name in ("vitserve-x-lock", "vitserve-1-2-3-lock", "vitserve-12-zzzzzzzz-lock",
                                            "vitserve-12-0123abcd-lock.bak")]
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
