"""The client against a scripted server (httpx's MockTransport): retries of 429 and 503 that wait as Retry-After
says and are bounded, typed errors with the server's code, requests split at the server's image limit."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from safetensors.torch import save

from vitserve.client import Client, VitserveError


def encode_reply(n: int) -> httpx.Response:
    tensors = {f"images.{i}.embeddings": torch.full((4, 8), float(i)) for i in range(n)}
    body = save(tensors, metadata={"grid_thw": json.dumps([[1, 4, 4]] * n), "model": "m", "dtype": "float32"})
    return httpx.Response(200, content=body)


def test_retries_honour_retry_after_and_are_bounded(monkeypatch):
    waits = []
    monkeypatch.setattr("vitserve.client.time.sleep", waits.append)
    answers = iter([httpx.Response(429, headers={"retry-after": "2"}, json={"error": {"code": "queue_full",
                                                                                      "message": "busy"}}),
                    httpx.Response(503, json={"error": {"code": "not_ready", "message": "loading"}}),
                    encode_reply(1)])
    with Client("http://vitserve", max_images_per_request=8, transport=httpx.MockTransport(lambda r: next(answers))) as c:
        (item,) = c.encode([b"img"])
    assert waits == [2.0, 1.0] and item.grid_thw == (1, 4, 4) and item.embeddings.shape == (4, 8)
    busy = httpx.MockTransport(lambda r: httpx.Response(429, json={"error": {"code": "queue_full", "message": "x"}}))
    with Client("http://vitserve", retries=2, max_images_per_request=8, transport=busy) as c:
        with pytest.raises(VitserveError) as e:
            c.encode([b"img"])
    assert e.value.status == 429 and e.value.code == "queue_full" and len(waits) == 4


def test_errors_carry_the_servers_code_and_param():
    bad = httpx.MockTransport(lambda r: httpx.Response(400, json={"error": {
        "code": "undecodable_image", "param": "images[0]", "message": "images[0]: not an image"}}))
    with Client("http://vitserve", max_images_per_request=8, transport=bad) as c:
        with pytest.raises(VitserveError) as e:
            c.encode([b"not an image"])
    assert (e.value.status, e.value.code, e.value.param) == (400, "undecodable_image", "images[0]")


def test_many_images_are_split_at_the_servers_limit():
    sizes = []

    def server(request: httpx.Request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_images_per_request": 3}]})
        n = request.content.count(b'name="images"')
        sizes.append(n)
        return encode_reply(n)

    with Client("http://vitserve", transport=httpx.MockTransport(server)) as c:
        items = c.encode([b"x"] * 7)
    assert sizes == [3, 3, 1] and len(items) == 7
