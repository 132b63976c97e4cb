"""The real thing: `vitserve serve` as a subprocess (uvicorn) on a free loopback port, a real HTTP client, the
official OpenAI SDK, concurrent requests of mixed sizes, and SIGTERM with requests in flight."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from helpers import SERVED_REL_ERR, SERVER_ON_GPU, STARTUP_S, children, data_uri, png, rel_err, running, wait_until
from PIL import Image

from vitserve.encoder import VisionEncoder
from vitserve.service.entry import launch
from vitserve.service.ground.signals import REPEAT_SECONDS

pytestmark = pytest.mark.slow
MODEL = "tiny-qwen2.5-vl"


def start_server(*extra: str) -> tuple[subprocess.Popen, str]:
    """A tiny server (its log captured), ready within `STARTUP_S`."""
    return launch.start_server("--model", MODEL, "--load-format", "dummy", *extra, timeout=STARTUP_S, capture_log=True)


def log_of(proc: subprocess.Popen) -> str:
    """Everything the exited server wrote (its log reader has drained the pipe)."""
    proc.log_reader.join(10)
    return "".join(proc.log)


@pytest.fixture(scope="module")
def direct():
    return VisionEncoder.from_pretrained(MODEL, load_format="dummy")


IMAGES = [
    png(w, h, seed)
    for seed, (w, h) in enumerate(
        [(64, 64), (300, 200), (90, 700), (512, 384), (33, 47), (640, 480), (128, 1024), (200, 200)]
    )
]


LARGE = png(1344, 1344, 99)  # 9216 patches: seconds of a CPU device (the tiny tower), whatever the machine


def hold_device(url: str) -> Future:
    """Keep the device busy with one large image, so that the requests sent next wait behind it: a CPU device runs a
    batch as it launches it, and the large image fills a batch alone. Returns the future of its reply."""
    decoded = metric(url, "vitserve_preprocess_seconds_count")
    pool = ThreadPoolExecutor(1)
    reply = pool.submit(httpx.post, url + "/v1/embeddings", json={"input": [data_uri(LARGE)]}, timeout=120)
    pool.shutdown(wait=False)
    wait_until(lambda: metric(url, "vitserve_preprocess_seconds_count") == decoded + 1, 30, "the large image decoded")
    # queued as it was decoded (no await between the two), then taken by the device
    wait_until(lambda: metric(url, "vitserve_queue_depth") == 0, 30, "the large image on the device")
    return reply


def test_concurrent_mixed_sizes_then_sigterm_with_requests_in_flight(direct):
    """Requests of mixed sizes share batches and each gets its own answer; SIGTERM with requests waiting answers them
    all, refuses new ones and exits 0. Both steps hold the device busy first, so that the requests are really in
    flight together on a machine of any speed (an idle device launches at once; the device is the CPU, which runs
    a batch as it launches it, wherever the test runs: a GPU's would be done before the queue fills)."""
    expected = [r.embeddings.mean(0) for r in direct.encode(IMAGES)]
    proc, url = start_server("--device", "cpu", "--max-batch-wait-ms", "400", "--cache-bytes", "0")  # encoded anew
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            assert client.get("/health").json() == {"status": "ok"}

            def post(i):
                return i, client.post("/v1/embeddings", json={"model": MODEL, "input": [data_uri(IMAGES[i])]})

            held = hold_device(url)
            with ThreadPoolExecutor(16) as pool:
                futures = [pool.submit(post, i % len(IMAGES)) for i in range(32)]
                replies = [f.result() for f in futures]
            for i, r in replies:
                assert r.status_code == 200, r.text
                assert rel_err(torch.tensor(r.json()["data"][0]["embedding"]), expected[i]) <= SERVED_REL_ERR
            assert held.result().status_code == 200
            hist = client.get("/stats").json()["batch_size_histogram"]
            assert max(int(k) for k in hist) >= 2  # concurrent requests really shared batches

            # SIGTERM while requests wait in the batcher: every one is answered, new ones get 503, exit code 0
            held = hold_device(url)
            with ThreadPoolExecutor(12) as pool:
                futures = [pool.submit(post, i % len(IMAGES)) for i in range(12)]
                wait_until(lambda: metric(url, "vitserve_queue_depth") == 12, 30, "12 images queued")
                proc.send_signal(signal.SIGTERM)
                wait_until(lambda: refuses(url), 10, "the drain to begin")
                try:  # a new request is refused: 503 on a kept-alive connection, or no connection at all (refused,
                    # or the idle kept-alive connection closed under it: a reset when the close crosses the request)
                    late = client.post("/v1/embeddings", json={"model": MODEL, "input": [data_uri(IMAGES[0])]})
                    assert late.status_code == 503
                except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                    pass
                results = [f.result() for f in futures]
            for i, r in results:
                assert r.status_code == 200, r.text
                assert rel_err(torch.tensor(r.json()["data"][0]["embedding"]), expected[i]) <= SERVED_REL_ERR
            assert held.result().status_code == 200
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        output = log_of(proc)
    assert "Traceback" not in output, output


def refuses(url: str) -> bool:
    """Whether a new request is turned away (503, or no connection): the server is draining."""
    try:
        return httpx.get(url + "/ready", timeout=5).status_code == 503
    except httpx.HTTPError:
        return True


def test_openai_sdk_and_second_sigterm(direct):
    openai = pytest.importorskip("openai")
    proc, url = start_server("--api-key", "k3y", "--served-model-name", "qwen-vision")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="k3y", max_retries=0)
        # the SDK asks for base64 by default and decodes it back to floats itself
        reply = client.embeddings.create(model="qwen-vision", input=[data_uri(IMAGES[1]), data_uri(IMAGES[4])])
        for item, r in zip(reply.data, direct.encode([IMAGES[1], IMAGES[4]])):
            assert rel_err(torch.tensor(item.embedding), r.embeddings.mean(0)) <= SERVED_REL_ERR
        assert reply.usage.prompt_tokens == sum(r.num_tokens for r in direct.encode([IMAGES[1], IMAGES[4]]))
        floats = client.embeddings.create(model="qwen-vision", input=data_uri(IMAGES[1]), encoding_format="float")
        assert np.allclose(floats.data[0].embedding, reply.data[0].embedding)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).embeddings.create(
                model="qwen-vision", input=data_uri(IMAGES[1])
            )
        with pytest.raises(openai.NotFoundError):
            client.embeddings.create(model="other", input=data_uri(IMAGES[1]))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_model_load_failure_exits_nonzero(tmp_path):
    port = launch.free_port()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vitserve",
            "serve",
            "--model",
            str(tmp_path / "nothing"),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "model load failed" in proc.stderr and "does not exist" in proc.stderr


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return 0.0


def test_clients_that_disconnect_are_dropped_without_leaking():
    """30 clients send a request and hang up while their images wait behind a busy device (a 16384-patch image,
    seconds on the CPU, which runs a batch as it launches it: the test's device is the CPU wherever it runs): none of
    theirs is run, nothing is left in flight or queued, and the server carries on."""
    proc, url = start_server("--device", "cpu", "--max-batch-wait-ms", "500", "--cache-bytes", "0")  # 30 queued
    try:
        port = int(url.rsplit(":", 1)[1])

        def raw(image: bytes) -> bytes:
            body = ('{"input": ["%s"]}' % data_uri(image)).encode()
            return (
                b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )

        busy = socket.create_connection(("127.0.0.1", port))
        gradient = np.broadcast_to(np.arange(1792, dtype=np.uint8)[:, None, None], (1792, 1792, 3))
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(gradient)).save(buf, "PNG")
        busy.sendall(raw(buf.getvalue()))
        wait_until(lambda: metric(url, "vitserve_preprocess_seconds_count") == 1, 20, "the large image decoded")
        # and taken by the device (alone: it fills a batch), which runs it for seconds as it launches it
        wait_until(lambda: metric(url, "vitserve_queue_depth") == 0, 20, "the large image on the device")
        request = raw(IMAGES[0])
        sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(30)]
        for sock in sockets:
            sock.sendall(request)
        wait_until(lambda: metric(url, "vitserve_queue_depth") == 30, 10, "30 images queued behind it")
        for sock in sockets:
            sock.close()
        wait_until(lambda: metric(url, "vitserve_dropped_images_total") >= 30, 10, "30 images dropped")
        assert metric(url, "vitserve_dropped_images_total") == 30.0 and metric(url, "vitserve_queue_depth") == 0
        assert httpx.get(url + "/stats").json()["requests_in_flight"] == 1  # the large one, still on the device
        busy.close()  # its batch runs to its end, unanswered
        wait_until(lambda: httpx.get(url + "/stats").json()["requests_in_flight"] == 0, 20, "the large request gone")
        wait_until(lambda: httpx.get(url + "/stats").json()["batch_size_histogram"], 30, "the large image's batch done")
        stats = httpx.get(url + "/stats").json()
        assert stats["queue_depth"] == 0 and stats["batch_size_histogram"] == {"1": 1}  # only the large one ran
        r = httpx.post(url + "/v1/embeddings", json={"input": [data_uri(IMAGES[0])]}, timeout=30)
        assert r.status_code == 200  # and the server carries on
        # several bad images in one request: one 400, and every decode failure is retrieved (no log noise)
        r = httpx.post(url + "/v1/embeddings", json={"input": ["!!!", data_uri(b"x" * 100), "###"]}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[0]"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert "Traceback" not in log_of(proc)  # neither a client going away nor bad input is an error


def test_burst_far_above_capacity_gets_answers_or_429s(direct):
    """A bounded burst (80 requests at once against a 4-request limit): each gets the right answer or a 429 with
    Retry-After; never a hang, a 5xx or a lost request."""
    expected = [r.embeddings.mean(0) for r in direct.encode(IMAGES)]
    proc, url = start_server("--max-concurrent-requests", "4", "--max-batch-wait-ms", "20")
    try:

        def post(i):
            with httpx.Client(base_url=url, timeout=60) as client:
                return i, client.post("/v1/embeddings", json={"input": [data_uri(IMAGES[i % len(IMAGES)])]})

        with ThreadPoolExecutor(80) as pool:
            replies = list(pool.map(post, range(80)))
        statuses = [r.status_code for _, r in replies]
        assert set(statuses) <= {200, 429} and statuses.count(200) >= 4 and statuses.count(429) >= 1, statuses
        for i, r in replies:
            if r.status_code == 200:
                vector = torch.tensor(r.json()["data"][0]["embedding"])
                assert rel_err(vector, expected[i % len(IMAGES)]) <= SERVED_REL_ERR
            else:
                assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_second_sigterm_exits_promptly():
    """A second SIGTERM a second or more after the first exits at once; one sooner is the same stop (timeout(1)
    signals its command twice) and the drain goes on."""
    proc, url = start_server("--device-processes", "--api-servers", "1")  # the main process's children: its device
    (device,) = [pid for pid in children(proc.pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    os.kill(device, signal.SIGSTOP)  # a drain waits for the device
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            lambda: httpx.post(url + "/v1/embeddings", json={"input": [data_uri(IMAGES[0])]}, timeout=30)
        )
        wait_until(lambda: httpx.get(url + "/stats").json()["requests_in_flight"] == 1, 10, "the request admitted")
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: refuses(url), 10, "the drain to begin")
        time.sleep(REPEAT_SECONDS)
        assert proc.poll() is None  # draining: still waiting for the admitted request
        start = time.time()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=10)
        assert time.time() - start < 3 and code != 0  # forced: not everything was answered
        try:
            pending.result()
        except httpx.HTTPError:
            pass
    wait_until(lambda: not running(device), 10, "the held device process killed")


def test_device_process_death_exits_nonzero():
    """--device-processes: when a device process dies, its batch gets a 503 (device_lost) and the server exits
    non-zero, for its supervisor to restart it."""
    proc, url = start_server(
        "--devices", "cpu,cpu", "--device-processes", "--max-batch-wait-ms", "1", "--cache-bytes", "0"
    )
    try:
        assert httpx.post(url + "/v1/embeddings", json={"input": [data_uri(IMAGES[0])]}, timeout=30).status_code == 200
        devices = [pid for pid in children(proc.pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(devices) == 2, children(proc.pid)
        os.kill(devices[0], signal.SIGKILL)
        codes = []
        for _ in range(40):  # the live device may take some: both take from one queue
            try:
                r = httpx.post(url + "/v1/embeddings", json={"input": [data_uri(IMAGES[0])]}, timeout=30)
            except httpx.HTTPError:
                break  # already shutting down
            codes.append((r.status_code, r.json()["error"]["code"] if r.status_code != 200 else None))
            if r.status_code != 200:
                break
        assert codes[-1] in ((503, "device_lost"), (503, "not_ready")), codes
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()


def test_idle_connections_are_closed_by_the_client_not_under_it():
    """A server that closes an idle connection at the moment a client reuses it loses that request (httpx keeps
    connections 5 s, as uvicorn did: 16 of 192 requests failed with a ReadError at 4.97-5 s of idle). The default
    keep-alive outlasts httpx's; `--timeout-keep-alive` is honored: open after 1 s idle, closed after 3 s at 2."""
    from vitserve.service.ground.settings import Settings

    assert Settings.of(model=MODEL).server.timeout_keep_alive > 2 * httpx.Limits().keepalive_expiry
    proc, url = start_server("--timeout-keep-alive", "2")
    host, port = url.removeprefix("http://").split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=10) as sock:

            def health() -> bytes:
                sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
                reply = b""
                while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    reply += chunk
                return reply

            assert health().startswith(b"HTTP/1.1 200")
            time.sleep(1)
            assert health().startswith(b"HTTP/1.1 200")  # the same connection, reused
            time.sleep(3)
            sock.settimeout(0.5)  # an open connection would time out here rather than read the end
            assert sock.recv(1) == b""  # closed by the server
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_json_logs_are_pure_json_and_a_half_sent_body_is_one_info_line():
    """With --log-format json every line the server writes is one JSON object (its own, uvicorn's, third-party
    ones); each request logs one access line with its request id, a 4xx too; a client that hangs up halfway through
    its body is one INFO line, not a traceback; no logger is named uvicorn.error; with two front ends each one's
    loggers say which it is (`vitserve.app[api1]`)."""
    import json
    import re

    proc, url = start_server("--log-format", "json", "--log-level", "info", "--api-servers", "2")
    try:
        port = int(url.rsplit(":", 1)[1])
        for _ in range(3):  # half a body, then gone
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(
                    b"POST /v1/encode HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                    b'content-length: 100000\r\n\r\n{"images": ["AAAA'
                )
        ok = httpx.post(url + "/v1/embeddings", json={"input": [data_uri(IMAGES[0])]}, headers={"x-request-id": "r-1"})
        bad = httpx.post(url + "/v1/embeddings", json={"input": ["%%%"]})
        assert ok.status_code == 200 and bad.status_code == 400
        wait_until(lambda: sum('"vitserve.app[api' in line for line in proc.log) >= 3, 10, "the disconnects logged")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    lines = [line for line in log_of(proc).splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # raises on any line that is not JSON
    assert not any("Traceback" in line for line in lines)
    if not SERVER_ON_GPU:  # a CPU server captures no graphs: it says nothing of them
        assert not any("CUDA" in r["message"] for r in records)
    front_ends = [r for r in records if r["logger"].startswith(("vitserve.app", "vitserve.access"))]
    assert {re.fullmatch(r"vitserve\.\w+\[(api\d)\]", r["logger"])[1] for r in front_ends} <= {"api0", "api1"}
    loggers = {re.sub(r"\[.*\]$", "", r["logger"]) for r in records}
    assert loggers.isdisjoint({"uvicorn.error", "uvicorn"}), loggers
    gone = [r for r in front_ends if r["logger"].startswith("vitserve.app") and "disconnected" in r["message"]]
    assert len(gone) == 3 and all(r["level"] == "INFO" for r in gone)
    access = [r for r in front_ends if r["logger"].startswith("vitserve.access")]
    mine = [r for r in access if r.get("request_id") == "r-1"]
    assert len(mine) == 1 and mine[0]["status"] == 200 and mine[0]["images"] == 1 and mine[0]["tokens"] > 0
    assert any(r["status"] == 400 and r["request_id"] == bad.headers["x-request-id"] for r in access)
