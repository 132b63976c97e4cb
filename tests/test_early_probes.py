"""The port answers from the moment it is bound (service/entry/early_probes.py): /health 200, /ready 503 starting,
anything else 503 not_ready, one answer a connection, none held back by a client that sends nothing, and nothing
answered once the app takes the socket over."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from helpers import wait_until

from vitserve.service.entry import launch
from vitserve.service.entry.early_probes import (
    MAX_CONNECTIONS,
    MAX_HEAD_BYTES,
    READY_REASON,
    TIMEOUT,
    EarlyProbes,
    listening_socket,
)


@pytest.fixture
def probed():
    sock = listening_socket("127.0.0.1", 0)
    probes = EarlyProbes(sock)
    try:
        yield sock, probes, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        probes.stop()
        sock.close()


def test_the_port_answers_its_probes_before_the_app(probed):
    _, _, url = probed
    health = httpx.get(url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert health.headers["connection"] == "close"
    ready = httpx.get(url + "/ready?verbose=1")
    assert ready.status_code == 503 and ready.json() == {"status": "loading", "reason": READY_REASON}
    head = httpx.head(url + "/health")
    assert head.status_code == 200 and head.content == b""
    refused = httpx.post(url + "/v1/embeddings", json={"input": ["x"]})
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["code"] == "not_ready" and error["type"] == "service_unavailable" and error["param"] is None


def test_a_client_that_sends_nothing_holds_no_probe_back(probed):
    """Connections are served side by side: an idle one (and one sending a head too large to be a request, which is
    closed unanswered) does not delay another's /health."""
    sock, _, url = probed
    idle = socket.create_connection(sock.getsockname())
    huge = socket.create_connection(sock.getsockname())
    try:
        huge.sendall(b"GET /health HTTP/1.1\r\nX-Pad: " + b"a" * MAX_HEAD_BYTES)
        start = time.perf_counter()
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        assert time.perf_counter() - start < 1
        huge.settimeout(5)
        try:
            got = huge.recv(100)
        except ConnectionResetError:  # closed with its bytes unread
            got = b""
        assert got == b""  # closed, no answer
    finally:
        idle.close()
        huge.close()


def test_connections_past_the_bound_close_the_oldest(probed):
    """As many idle connections as the bound allows, then a probe: it is answered (the oldest idle one is closed to
    make room) rather than left waiting behind them, and the responder's open connections stay bounded."""
    sock, _, url = probed
    idle = [socket.create_connection(sock.getsockname()) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # all taken by the responder
        start = time.perf_counter()
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        assert time.perf_counter() - start < 1
        idle[0].settimeout(TIMEOUT / 4)  # well before its own deadline would close it
        try:
            got = idle[0].recv(100)
        except ConnectionResetError:
            got = b""
        assert got == b""  # the oldest, closed unanswered to make room
    finally:
        for conn in idle:
            conn.close()


def test_once_stopped_the_socket_is_the_apps(probed):
    """After `stop`, a connection waits for whoever accepts next (the app) instead of being answered here."""
    sock, probes, _ = probed
    probes.stop()
    client = socket.create_connection(sock.getsockname())
    try:
        client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        client.settimeout(0.3)
        with pytest.raises(TimeoutError):
            client.recv(100)
        sock.setblocking(True)
        sock.settimeout(5)
        accepted, _ = sock.accept()  # still in the backlog: the app's to take
        accepted.close()
    finally:
        client.close()


def starting(fronts: str) -> tuple[subprocess.Popen, str]:
    """A real `vitserve serve` (the tiny tower on the CPU; with several front ends, a device process), just
    launched, and its URL."""
    port = launch.free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vitserve", "serve", "--model", "tiny-qwen3-vl", "--load-format", "dummy"]
        + ["--device", "cpu", "--api-servers", fronts, "--host", "127.0.0.1", "--port", str(port)]
        + (["--device-processes", "true"] if fronts != "1" else []),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc, f"http://127.0.0.1:{port}"


@pytest.mark.slow
@pytest.mark.parametrize("fronts", ["1", "2"])
def test_a_server_answers_its_probes_while_it_starts(fronts):
    """A real server answers /ready (503, starting) as soon as its port is bound, before its app (with several front
    ends: before any front end) is up, then answers as the app once it is (ready, and a request served)."""
    proc, url = starting(fronts)
    answers: list[httpx.Response] = []
    try:

        def answered(path: str) -> bool:
            try:
                answers.append(httpx.get(url + path, timeout=5))
                return True
            except httpx.HTTPError:
                return False

        wait_until(lambda: answered("/ready"), 60, "the port answering")
        first = answers[-1]
        assert first.status_code == 503 and first.json() == {"status": "loading", "reason": READY_REASON}
        wait_until(lambda: answered("/ready") and answers[-1].status_code == 200, 120, "the server ready")
        # every new connection is the app's now (were the probes still accepting, about half would be theirs)
        assert [httpx.get(url + "/v1/models").status_code for _ in range(20)] == [200] * 20
    finally:
        proc.terminate()
        assert proc.wait(60) == 0


@pytest.mark.slow
@pytest.mark.parametrize("fronts", ["1", "2"])
def test_sigterm_while_only_the_probes_answer_exits_0(fronts):
    """SIGTERM to a server whose port answers but whose app is not up yet (a supervisor may stop it once /health
    answers): nothing has been admitted, so it exits 0 at once (it was killed by the signal: -15)."""
    proc, url = starting(fronts)
    try:

        def healthy() -> bool:
            try:
                return httpx.get(url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 60, "the port answering")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
