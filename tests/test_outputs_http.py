"""Big answers over a real server (tiny model, CPU): the pieces of a multi-megabyte answer reach the client whole and
in order, the request ends once its answer is handed to the transport (not once the client has read it), and the
next answer on that connection waits until the first has drained (a connection holds one answer at a time)."""

from __future__ import annotations

import base64
import io
import json
import re
import socket
import time

import h11
import httpx
import numpy as np
import pytest
import torch
from helpers import data_uri, serving, wait_until
from PIL import Image
from safetensors.torch import load as safetensors_load

pytestmark = pytest.mark.slow
SIDE, COPIES = 1448, 16  # 2025 tokens x 32 x 3 tensors in float32 each: 12.4 MB for the request (its copies share)


def smooth_png(side: int) -> bytes:
    y, x = np.mgrid[0:side, 0:side]
    buf = io.BytesIO()
    Image.fromarray(np.stack([x % 256, y % 256, (x + y) % 256], -1).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def server():
    yield from serving("--model", "tiny-qwen3-vl", "--load-format", "dummy")


def answered(url: str) -> int:
    """Requests answered 200 so far (the gate counts a request once the app has returned)."""
    metrics = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        int(float(n)) for n in re.findall(r'vitserve_requests_total\{code="200",endpoint="[^"]+"\} ([\d.]+)', metrics)
    )


def request_bytes(path: str, body: bytes) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        b"accept: application/octet-stream\r\ncontent-length: %d\r\n\r\n" % (path.encode(), len(body))
    ) + body


def read_responses(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    conn, out, body = h11.Connection(h11.CLIENT), [], []
    conn.send(h11.Request(method="POST", target="/", headers=[("host", "t"), ("content-length", "0")]))
    conn.send(h11.EndOfMessage())
    while len(out) < count:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(sock.recv(2**20))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body.append(event.data)
        elif isinstance(event, h11.EndOfMessage):
            out.append((status, b"".join(body)))
            body = []
            if len(out) < count:  # the client's next request, as h11 needs it to read the next response
                conn.start_next_cycle()
                conn.send(h11.Request(method="POST", target="/", headers=[("host", "t"), ("content-length", "0")]))
                conn.send(h11.EndOfMessage())
    return out


def test_a_big_answer_is_handed_over_whole_and_the_next_waits_for_it(server):
    """A client that reads nothing: its first answer (12 MB, more than the socket buffers hold) is handed over and
    its request ends; its second request on the connection (a pooled vector) waits, unfinished, until the first
    answer has drained (with the transport's limit left raised for the first, the second would fit under it and be
    buffered too: a client could pile up answers by never reading). Then both arrive whole, as the same requests
    answer on their own, and as the first answers in JSON (base64 of the same bytes)."""
    _, url = server
    uri = data_uri(smooth_png(SIDE))
    body, small = json.dumps({"images": [uri] * COPIES}).encode(), json.dumps({"input": [uri]}).encode()
    reference, reference_small = (
        httpx.post(
            url + path,
            content=b,
            timeout=120,
            headers={"content-type": "application/json", "accept": "application/octet-stream"},
        )
        for path, b in (("/v1/encode", body), ("/v1/embeddings", small))
    )
    assert reference.status_code == 200 and len(reference.content) > 12 * 10**6
    start = answered(url)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 2**10)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        sock.connect((host, int(port)))
        sock.sendall(request_bytes("/v1/encode", body))
        wait_until(lambda: answered(url) == start + 1, 30, "the first request to end while its client reads nothing")
        sock.sendall(request_bytes("/v1/embeddings", small))
        time.sleep(1.0)
        assert answered(url) == start + 1  # the second waits for the first's answer to drain
        replies = read_responses(sock, 2)
    assert replies[0] == (200, reference.content) and replies[1][0] == 200
    assert json.loads(replies[1][1])["data"] == reference_small.json()["data"]
    wait_until(lambda: answered(url) == start + 2, 30, "the second request to end")
    tensors = safetensors_load(reference.content)
    js = httpx.post(url + "/v1/encode", json={"images": [uri] * 2}, timeout=60).json()["data"]
    for i in range(COPIES):
        for key, want in [("embeddings", js[i % 2]["embeddings"])] + [
            (f"deepstack.{j}", d) for j, d in enumerate(js[i % 2]["deepstack"])
        ]:
            got = tensors[f"images.{i}.{key}"]
            assert got.dtype == torch.float32 and got.numpy().tobytes() == base64.b64decode(want)
