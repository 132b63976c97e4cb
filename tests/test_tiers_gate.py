"""The encoder tiers' endpoints behind the same gate as /v1/encode, and their figures where an operator looks: a
real server with both tiers on and room for one request at a time, real sockets and HTTP clients."""

from __future__ import annotations

import socket

import httpx
import pytest
from helpers import IMAGES, data_uri, serving, wait_until

zmq = pytest.importorskip("zmq")
MODEL = "tiny-qwen3-vl"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ec")
    for proc, url in serving(
        "--model",
        MODEL,
        "--load-format",
        "dummy",
        "--ec-shared-storage",
        str(directory),
        "--sglang-encoder",
        "--sglang-receivers",
        "127.0.0.1",
        "--sglang-timeout",
        "5",
        "--max-concurrent-requests",
        "1",
    ):
        yield proc, url, int(url.rsplit(":", 1)[1])


def stalled(port: int, path: str, start: bytes) -> socket.socket:
    """A connection that has sent a POST's headers (a body of 100,000 bytes) and only the `start` of its body."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n"
        % path.encode()
        + start
    )
    return sock


def in_flight(url: str) -> int:
    return httpx.get(url + "/stats", timeout=10).json()["requests_in_flight"]


def chat(uuid: str = "a") -> dict:
    return {
        "model": MODEL,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": data_uri(IMAGES[0])}, "uuid": uuid}],
            }
        ],
    }


def sglang_part(req_id: str, port: int) -> dict:
    return {
        "req_id": req_id,
        "num_parts": 1,
        "part_idx": 0,
        "modality": "IMAGE",
        "mm_items": [data_uri(IMAGES[0])],
        "prefill_host": "127.0.0.1",
        "embedding_port": port,
    }


@pytest.mark.slow
def test_the_tier_endpoints_are_admitted_and_counted(server):
    """A chat or /encode body that has not arrived holds the one place of --max-concurrent-requests 1, in /stats,
    so every other encoding request is a 429 (a registration, which an admitted /encode may wait for, is not
    admitted); /metrics counts the tier endpoints under their own names."""
    _, url, port = server
    for path, start in (("/v1/chat/completions", b'{"messages": ['), ("/encode", b'{"req_id": "')):
        sock = stalled(port, path, start)
        try:
            wait_until(lambda: in_flight(url) == 1, 10, f"the stalled {path} admitted")
            for other, body in (
                ("/v1/chat/completions", chat()),
                ("/encode", sglang_part("p_local_part_0", 9)),
                ("/v1/encode", {"images": [data_uri(IMAGES[0])]}),
            ):
                r = httpx.post(url + other, json=body, timeout=30)
                assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", (path, other, r.text)
            r = httpx.post(
                url + "/scheduler_receive_url",
                json={"req_id": "q", "receive_count": 1, "receive_url": "127.0.0.1:9"},
                timeout=30,
            )
            assert r.status_code == 200, r.text
        finally:
            sock.close()
        wait_until(lambda: in_flight(url) == 0, 10, f"the stalled {path} gone")
    metrics = httpx.get(url + "/metrics", timeout=10).text
    for endpoint, code in (("/v1/chat/completions", 429), ("/encode", 429), ("/scheduler_receive_url", 200)):
        assert f'vitserve_requests_total{{code="{code}",endpoint="{endpoint}"}}' in metrics, endpoint


@pytest.mark.slow
def test_a_registration_body_is_a_few_fields(server):
    _, url, _ = server
    body = {"req_id": "r", "receive_count": 1, "receive_url": "127.0.0.1:9", "modality": "IMAGE", "x": "y" * 70000}
    r = httpx.post(url + "/scheduler_receive_url", json=body, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large", r.text


@pytest.mark.slow
def test_the_tiers_figures_are_in_stats_metrics_and_the_log(server):
    """Each tier says it is on at startup; /stats's `tiers` and /metrics count the encoder-cache files (bytes,
    files, writes) and the SGLang deliveries."""
    proc, url, _ = server
    log = "".join(proc.log)
    assert "vLLM encoder tier on" in log and "SGLang encoder tier on" in log
    before = httpx.get(url + "/stats", timeout=10).json()["tiers"]
    assert set(before) == {"ec_storage", "sglang"}
    assert httpx.post(url + "/v1/chat/completions", json=chat("figures"), timeout=60).status_code == 200
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        r = httpx.post(url + "/encode", json=sglang_part("figures_local_part_0", port), timeout=60)
        assert r.status_code == 200, r.text
        assert pull.poll(10000)
    finally:
        pull.close(linger=0)
        context.term()
    after = httpx.get(url + "/stats", timeout=10).json()["tiers"]
    ec, sglang = after["ec_storage"], after["sglang"]
    assert ec["files"] == before["ec_storage"]["files"] + 1 and ec["writes"] == before["ec_storage"]["writes"] + 1
    assert ec["bytes"] > before["ec_storage"]["bytes"] and ec["write_failures"] == 0
    assert sglang["deliveries"] == before["sglang"]["deliveries"] + 1 and sglang["delivery_timeouts"] == 0
    metrics = httpx.get(url + "/metrics", timeout=10).text
    for line in (
        f"vitserve_ec_files {float(ec['files'])}",
        f"vitserve_ec_bytes {float(ec['bytes'])}",
        f"vitserve_sglang_deliveries_total {float(sglang['deliveries'])}",
    ):
        assert line in metrics, line
