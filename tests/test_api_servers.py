"""Several front ends on one port (`--api-servers`), as a real server: one queue and one cache for all of them,
/metrics and /stats of the whole server, drain on SIGTERM, a front end's death (started again) and a device's (the
server fails)."""

from __future__ import annotations

import base64
import glob
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from helpers import STARTUP_S, assert_served, b64_tensor, children, data_uri, png, posts, running, serving, wait_until
from test_server import IMAGES, MODEL, hold_device, log_of, metric, refuses, start_server

from vitserve.encoder import VisionEncoder
from vitserve.service.entry import launch
from vitserve.service.entry.supervisor import Restarts
from vitserve.service.ground.settings import Settings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def direct():
    return VisionEncoder.from_pretrained(MODEL, load_format="dummy")


def front(line: str) -> str | None:
    """Which front end logged an access line ("api0", "api1"), None for another line."""
    return line.split("vitserve.access[")[1].split("]")[0] if "vitserve.access[" in line else None


def roles(pid: int, url: str, fronts: int = 2) -> dict[str, list[int]]:
    """A server's processes by role, once each of its `fronts` front ends is up (answers its part of /stats; the
    first ready one answers /ready while another still starts): front ends and device processes (spawned; a front
    end has children, its decode pool's), the decode pools' fork servers, and the decode workers they forked."""
    if fronts > 1:
        wait_until(lambda: httpx.get(url + "/stats").json()["api_servers"] == fronts, 60, "every front end up")
    out: dict[str, list[int]] = {"front end": [], "device": [], "fork server": [], "decode worker": []}

    def walk(p: int, forked: bool) -> None:
        command, kids = Path(f"/proc/{p}/cmdline").read_bytes(), children(p)
        if b"forkserver" in command:
            out["decode worker" if forked else "fork server"].append(p)
        elif b"spawn_main" in command:
            out["front end" if kids else "device"].append(p)
        for kid in kids:
            walk(kid, b"forkserver" in command)

    for kid in children(pid):
        walk(kid, False)
    return out


def resume(pids: list[int]) -> None:
    """SIGCONT to each process held with SIGSTOP that is still there."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_front_ends_share_one_queue_one_cache_and_report_the_whole_server(direct):
    expected = [r.embeddings.mean(0) for r in direct.encode(IMAGES)]
    # on the CPU wherever the test runs: a GPU runs the held image before the next images queue behind it
    images_total = 'vitserve_images_total{device="cpu"}'
    proc, url = start_server("--api-servers", "2", "--max-batch-wait-ms", "400", "--device", "cpu")
    try:
        stats = httpx.get(url + "/stats").json()
        assert stats["api_servers"] == 2 and stats["batching"]["api_servers"] == 2

        # distinct images from many connections while the device is busy: every answer is its own image's, and
        # the images of both front ends meet in batches
        held = hold_device(url)
        unique = [png(40 + 8 * i, 56, 100 + i) for i in range(16)]
        want = [r.embeddings.mean(0) for r in direct.encode(unique)]
        replies = posts(url, [{"input": [data_uri(x)]} for x in unique], connections=16)
        for r, w in zip(replies, want):
            assert r.status_code == 200, r.text
            assert_served(torch.tensor(r.json()["data"][0]["embedding"]), w, exact=False)
        assert held.result().status_code == 200
        stats = httpx.get(url + "/stats").json()
        assert max(int(k) for k in stats["batch_size_histogram"]) >= 2
        served = {front(line) for line in proc.log if "/v1/embeddings 200" in line}
        assert served == {"api0", "api1"}, served  # both front ends took requests

        # one image sent again and again on new connections: encoded once, every other answer from the core's
        # cache (or from the one computation, for those that came while it ran), whichever front end takes it
        before = [metric(url, name) for name in ("vitserve_cache_misses_total", images_total)]
        replies = posts(url, [{"input": [data_uri(IMAGES[3])]}] * 12, connections=4)
        for r in replies:
            assert r.status_code == 200, r.text
            assert_served(torch.tensor(r.json()["data"][0]["embedding"]), expected[3], exact=False)
        assert [metric(url, name) for name in ("vitserve_cache_misses_total", images_total)] == [
            before[0] + 1,
            before[1] + 1,
        ]
        computed_by = [front(line) for line in proc.log if "cache_hits=0" in line and "images=1" in line][-1]
        for _ in range(50):  # until a front end that did not compute it answers it from the cache
            posts(url, [{"input": [data_uri(IMAGES[3])]}] * 2, connections=2)
            if {front(line) for line in proc.log if "cache_hits=1" in line} - {computed_by}:
                break
        else:
            raise AssertionError("no other front end answered the image from the cache")
        assert metric(url, images_total) == before[1] + 1

        # a hit on an entry a front end has seen before is answered from its file, without asking the core
        known = metric(url, "vitserve_cache_known_hits_total")
        with httpx.Client(base_url=url, timeout=60) as one:  # one connection: one front end
            for _ in range(4):
                r = one.post("/v1/embeddings", json={"input": [data_uri(IMAGES[3])]})
                assert r.status_code == 200 and r.headers["x-cache-hits"] == "1", r.text
                assert_served(torch.tensor(r.json()["data"][0]["embedding"]), expected[3], exact=False)
        assert metric(url, "vitserve_cache_known_hits_total") >= known + 3
        assert metric(url, images_total) == before[1] + 1

        # an entry one front end computed is told to the other (Stored): its first hit there needs no Lookup either
        fresh = png(72, 48, 9)
        assert posts(url, [{"input": [data_uri(fresh)]}], connections=1)[0].status_code == 200
        time.sleep(0.5)  # (the record reached the other front end's pipe before the answer left: here it is read)
        computed_by = [front(line) for line in proc.log if "cache_hits=0" in line and "images=1" in line][-1]
        known, hits, start = metric(url, "vitserve_cache_known_hits_total"), 0, len(proc.log)
        for _ in range(50):  # new connections until the other front end answers a hit
            for r in posts(url, [{"input": [data_uri(fresh)]}] * 2, connections=2):
                assert r.status_code == 200 and r.headers["x-cache-hits"] == "1", r.text
            hits += 2
            if {front(line) for line in proc.log[start:] if "cache_hits=1" in line} - {computed_by}:
                break
        else:
            raise AssertionError("no other front end answered the fresh image from the cache")
        assert metric(url, "vitserve_cache_known_hits_total") == known + hits  # every hit answered without a Lookup

        # the same image twice in one request, and one claimed by a concurrent request: one answer each
        twice = posts(url, [{"input": [data_uri(IMAGES[5]), data_uri(IMAGES[5])]}] * 3, connections=3)
        for r in twice:
            assert r.status_code == 200
            for item in r.json()["data"]:
                assert_served(torch.tensor(item["embedding"]), expected[5], exact=False)

        # /metrics sums every process's series: each request counted once, by whichever front end took it
        ok = metric(url, 'vitserve_requests_total{code="200",endpoint="/v1/embeddings"}')
        assert ok == sum("/v1/embeddings 200" in line for line in proc.log), ok
        text = httpx.get(url + "/metrics").text
        assert text.count("vitserve_ready 1.0") == 1 and text.count("# TYPE vitserve_requests_total counter") == 1
        stats = httpx.get(url + "/stats").json()
        assert stats["cache"]["hits"] == metric(url, "vitserve_cache_hits_total")
        assert stats["cache"]["known_hits"] == metric(url, "vitserve_cache_known_hits_total") >= 3
        assert stats["latency"]["request"]["count"] >= 32 and stats["latency"]["inference"]["count"] >= 1

        # a bad image fails its own request, in either front end, and never its neighbours
        bad = posts(
            url, [{"input": ["%%%"]}, {"input": [data_uri(b"GIF89a broken")]}, {"input": [data_uri(IMAGES[0])]}]
        )
        assert [r.status_code for r in bad] == [400, 400, 200]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        output = log_of(proc)
    assert "Traceback" not in output, output


def test_sigterm_drains_every_front_end_then_exits_0_without_leftovers(direct):
    expected = [r.embeddings.mean(0) for r in direct.encode(IMAGES)]
    proc, url = start_server("--api-servers", "2", "--cache-bytes", "0", "--max-batch-wait-ms", "400")
    try:
        spool = glob.glob(f"/dev/shm/vitserve-{proc.pid}-*-lock")
        decoded = metric(url, "vitserve_preprocess_seconds_count")
        (device,) = roles(proc.pid, url)["device"]
        os.kill(device, signal.SIGSTOP)  # the requests wait for the device, however fast it would run them
        try:
            with ThreadPoolExecutor(8) as pool:
                futures = [
                    pool.submit(
                        httpx.post, url + "/v1/embeddings", json={"input": [data_uri(IMAGES[i % 8])]}, timeout=60
                    )
                    for i in range(8)
                ]
                wait_until(
                    lambda: metric(url, "vitserve_preprocess_seconds_count") == decoded + 8,
                    30,
                    "8 images decoded (each queued, or taken by the held device)",
                )
                proc.send_signal(signal.SIGTERM)
                wait_until(lambda: refuses(url), 10, "the drain to begin")
                assert not any(f.done() for f in futures)
                os.kill(device, signal.SIGCONT)
                replies = [f.result() for f in futures]
        finally:
            os.kill(device, signal.SIGCONT)
        for i, r in enumerate(replies):
            assert r.status_code == 200, r.text
            assert_served(torch.tensor(r.json()["data"][0]["embedding"]), expected[i % 8], exact=False)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(OSError):  # the port is free: nobody listens any more
            socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=2)
        if spool:  # the core's spool files, and each front end's, are gone
            assert not [
                p for p in glob.glob("/dev/shm/vitserve-*") if any(p.startswith(s.removesuffix("lock")) for s in spool)
            ]
    finally:
        if proc.poll() is None:
            proc.kill()
        output = log_of(proc)
    assert "Traceback" not in output, output


@pytest.mark.parametrize("fronts", ["1", "2"])
def test_sigterm_to_the_whole_group_answers_everything_admitted(direct, fronts):
    """systemd (KillMode=control-group), `kill -- -PGID` and timeout(1) signal every process of the server, timeout
    its main process twice: the decode workers, their fork servers, the device processes and the front ends leave
    the signal to the server, whose drain answers every admitted request, those being decoded included."""
    unique = [png(40 + 8 * i, 56, 100 + i) for i in range(16)]
    want = [r.embeddings.mean(0) for r in direct.encode(unique)]
    proc, url = launch.start_server(
        "--model",
        MODEL,
        "--load-format",
        "dummy",
        "--api-servers",
        fronts,
        "--device-processes",
        "--decode-workers",
        "2",
        "--cache-bytes",
        "0",
        timeout=STARTUP_S,
        capture_log=True,
        start_new_session=True,
    )
    try:
        parts = roles(proc.pid, url, int(fronts))
        assert len(parts["front end"]) == (int(fronts) if fronts != "1" else 0) and len(parts["device"]) == 1
        assert parts["decode worker"] and parts["fork server"]
        for pid in parts["device"] + parts["decode worker"] + parts["fork server"]:  # SIGTERM and SIGINT ignored
            ignored = int(
                next(
                    line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigIgn:")
                ).split()[1],
                16,
            )
            assert ignored >> (signal.SIGTERM - 1) & 1 and ignored >> (signal.SIGINT - 1) & 1, pid
        held = parts["device"] + parts["decode worker"]
        for pid in held:  # the images wait in the decode workers and for the device when the signal comes
            os.kill(pid, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(16) as pool:
                futures = [
                    pool.submit(httpx.post, url + "/v1/embeddings", json={"input": [data_uri(x)]}, timeout=60)
                    for x in unique
                ]
                wait_until(
                    lambda: httpx.get(url + "/stats").json()["requests_in_flight"] == 16, 30, "16 requests admitted"
                )
                os.killpg(proc.pid, signal.SIGTERM)  # every process of the group
                proc.send_signal(signal.SIGTERM)  # and the main one again, as timeout(1) does
                wait_until(lambda: refuses(url), 10, "the drain to begin")
                for pid in held:
                    os.kill(pid, signal.SIGCONT)
                replies = [f.result() for f in futures]
        finally:
            resume(held)
        for r, w in zip(replies, want):
            assert r.status_code == 200, r.text
            assert_served(torch.tensor(r.json()["data"][0]["embedding"]), w, exact=False)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        output = log_of(proc)
    assert "Traceback" not in output and "decode worker died" not in output, output


def connections(pid: int, port: int) -> int:
    """Established TCP connections on `port` that process `pid` has accepted."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()  # sl, local address:port, remote, state (01: established), ..., inode (10th)
            count += int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01" and fields[9] in inodes
    return count


def test_a_front_end_that_dies_is_started_again_while_the_other_serves(direct):
    """A front end killed with requests in flight on both (their decode workers held): the other's are answered
    (they waited on the image the dead one was decoding: the core lets that claim go and they compute it), the dead
    one's connections are cut, and the core starts it again on the same socket; the server serves on and drains to
    exit 0."""
    image = IMAGES[2]
    want = direct.encode([image])[0].embeddings.mean(0)
    proc, url = start_server("--api-servers", "2")
    port = int(url.rsplit(":", 1)[1])

    def post():
        try:
            return httpx.post(url + "/v1/embeddings", json={"input": [data_uri(image)]}, timeout=60)
        except httpx.TransportError as e:  # a connection of the killed front end
            return e

    try:
        parts = roles(proc.pid, url)
        fronts, held = parts["front end"], parts["decode worker"]
        for pid in held:  # the first request decodes the image for all of them, and nothing decodes
            os.kill(pid, signal.SIGSTOP)
        pool, futures = ThreadPoolExecutor(32), []
        try:
            futures.append(pool.submit(post))
            wait_until(lambda: metric(url, "vitserve_cache_misses_total") == 1, 30, "the image claimed")
            (victim,) = [f for f in fronts if connections(f, port)]  # the front end computing the image
            (survivor,) = [f for f in fronts if f != victim]
            while not connections(survivor, port) and len(futures) < 32:  # requests until the other has some
                futures.append(pool.submit(post))
                wait_until(lambda: sum(connections(f, port) for f in fronts) == len(futures), 30, "accepted")
            accepted = {f: connections(f, port) for f in fronts}
            assert accepted[survivor], accepted
            wait_until(
                lambda: httpx.get(url + "/stats").json()["requests_in_flight"] == len(futures),
                30,
                "every request admitted",
            )
            time.sleep(0.5)  # their cache lookups answered: the survivor's wait on the victim's claim
            os.kill(victim, signal.SIGKILL)
        finally:
            resume(held)
        replies = [f.result() for f in futures]
        pool.shutdown()
        answered = [r for r in replies if isinstance(r, httpx.Response)]
        assert len(answered) == accepted[survivor] and len(replies) - len(answered) == accepted[victim], (
            accepted,
            replies,
        )
        for r in answered:
            assert r.status_code == 200, r.text
            assert_served(torch.tensor(r.json()["data"][0]["embedding"]), want, exact=False)
        wait_until(lambda: httpx.get(url + "/stats").json()["api_servers_replaced"] == 1, 30, "a new front end")
        wait_until(lambda: httpx.get(url + "/stats").json()["api_servers"] == 2, 60, "the new front end up")
        assert posts(url, [{"input": [data_uri(x)]} for x in IMAGES], connections=4)[-1].status_code == 200
        assert httpx.get(url + "/ready").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        output = log_of(proc)
    assert "exited (exit code -9); starting it again" in output and "Traceback" not in output, output


def test_a_front_end_that_does_not_come_up_is_tried_again_then_fails_the_server():
    restarts = Restarts((1.0, 4.0))
    assert [restarts.after(0, up=False) for _ in range(3)] == [1.0, 4.0, None]  # then the server fails
    assert restarts.after(1, up=False) == 1.0  # counted per front end
    assert restarts.after(1, up=True) == 0.0 and restarts.after(1, up=False) == 1.0  # one that was up: at once


def test_a_device_that_dies_fails_the_server():
    proc, url = start_server("--api-servers", "2", "--cache-bytes", "0")
    try:
        assert httpx.post(url + "/v1/embeddings", json={"input": [data_uri(IMAGES[0])]}, timeout=30).status_code == 200
        kids = [p for p in children(proc.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        (device,) = roles(proc.pid, url)["device"]
        os.kill(device, signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        wait_until(
            lambda: (
                not any(
                    Path(f"/proc/{p}").exists() and b"Z" not in Path(f"/proc/{p}/stat").read_bytes().split(b")")[1][:3]
                    for p in kids
                )
            ),
            30,
            "every child gone",
        )
    finally:
        if proc.poll() is None:
            proc.kill()


def test_front_ends_whose_core_is_killed_answer_503_and_exit():
    """The core killed (SIGKILL, the OOM killer) with requests waiting for the device: each front end answers them
    503 `core_lost` at once, instead of waiting for answers that never come, and exits, its decode workers with it:
    nothing is left holding the port for the restarted server."""
    proc, url = start_server("--api-servers", "2", "--cache-bytes", "0")
    parts = roles(proc.pid, url)
    everyone = [pid for pids in parts.values() for pid in pids]
    (device,) = parts["device"]
    gone = False
    try:
        os.kill(device, signal.SIGSTOP)  # the images wait for the device
        decoded = metric(url, "vitserve_preprocess_seconds_count")
        with ThreadPoolExecutor(8) as pool:
            futures = [
                pool.submit(httpx.post, url + "/v1/embeddings", json={"input": [data_uri(IMAGES[i])]}, timeout=60)
                for i in range(8)
            ]
            wait_until(lambda: metric(url, "vitserve_preprocess_seconds_count") == decoded + 8, 30, "8 images decoded")
            proc.kill()
            proc.wait(timeout=10)
            os.kill(device, signal.SIGCONT)  # its server gone, it exits on its own
            replies = [f.result() for f in futures]
        for r in replies:
            assert r.status_code == 503 and r.json()["error"]["code"] == "core_lost", r.text
        wait_until(lambda: not any(running(p) for p in everyone), 30, "every process of the server gone")
        gone = True
        with pytest.raises(OSError):  # nobody listens any more
            socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in [] if gone else everyone:  # left behind: this test's own processes, still running
            try:
                if b"multiprocessing" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


def test_api_servers_default_and_checks(monkeypatch):
    assert Settings.of(model=MODEL, device="cpu").api_server_count() == 1  # the CPU: one front end
    assert Settings.of(model=MODEL, device="cpu", api_servers=3).api_server_count() == 3
    with pytest.raises(ValueError, match="--device-processes"):
        Settings.of(model=MODEL, api_servers=2, device_processes=False)
    from vitserve.service.ground import settings as settings_module
    from vitserve.service.ground import settings_groups

    monkeypatch.setattr(settings_groups, "resolve_devices", lambda *given: (["cuda:0"], "bfloat16"))
    monkeypatch.setattr(settings_module, "available_cpus", lambda: 16)
    assert Settings.of(model=MODEL).api_server_count() == 4  # a GPU and 16 CPUs
    monkeypatch.setattr(settings_module, "available_cpus", lambda: 2)
    assert Settings.of(model=MODEL).api_server_count() == 2
    assert Settings.of(model=MODEL, device_processes=False).api_server_count() == 1


def test_images_resized_on_the_devices_are_answered_the_same(direct):
    """--image-resize device behind two front ends and a device process: the decode workers hand the images on full
    size through spool files, the device process resizes them with Pillow's arithmetic (CPU tensors here, CUDA's
    where it runs); each answer is the library's, whose PIL resizes them (one image shrinks in height by more than
    twice what its width grows: the installed Pillow resizes it rows first)."""
    images = [png(250, 335, 1), png(97, 61, 2), png(64, 64, 3), png(300, 200, 4)]
    flags = ("--api-servers", "2", "--device-processes", "true", "--image-resize", "device", "--cache-bytes", "0")
    for _, url in serving("--model", MODEL, "--load-format", "dummy", *flags):
        r = httpx.post(url + "/v1/encode", json={"images": [data_uri(x) for x in images]}, timeout=60)
        assert r.status_code == 200, r.text
        for item, want in zip(r.json()["data"], direct.encode(images)):
            assert_served(b64_tensor(item["embeddings"], item["shape"]), want.embeddings)


def test_a_bfloat16_server_widens_float32_answers_on_its_device_and_caches_each_dtype_as_answered():
    """A bfloat16 tower behind two front ends and a device process: a float32 request's tokens are widened by the
    device (WorkItem.float32, through the core, to the device process's batch), so its cache entry, which is the
    device's answer as written, holds 4 bytes a value (a lost flag leaves 2, the host widening each answer). A
    bfloat16 request for the same image has an entry of its own (2 bytes a value: a hit sends its bytes as they lie,
    converting nothing), whose values are the same bits; a hit answers each dtype from its own entry."""
    from safetensors.torch import load as safetensors_load

    flags = ("--api-servers", "2", "--device-processes", "true", "--dtype", "bfloat16")
    accept = {"accept": "application/octet-stream"}
    for _, url in serving("--model", "tiny-qwen3-vl", "--load-format", "dummy", *flags):

        def encode(image: bytes, dtype: str) -> dict:
            r = httpx.post(
                url + "/v1/encode", json={"images": [data_uri(image)], "dtype": dtype}, headers=accept, timeout=120
            )
            assert r.status_code == 200, r.text
            return safetensors_load(r.content) | {"hits": r.headers["x-cache-hits"]}

        def cached() -> int:
            return httpx.get(url + "/stats", timeout=30).json()["cache"]["bytes"]

        wide = encode(IMAGES[0], "float32")
        values = sum(t.numel() for name, t in wide.items() if name != "hits")
        assert wide["hits"] == "0" and cached() == 4 * values
        narrow = encode(IMAGES[0], "bfloat16")
        assert narrow["hits"] == "0" and cached() == 6 * values  # an entry of its own, 2 bytes a value
        assert len(wide) == len(narrow) >= 3  # the tokens and the deepstack features
        for name, t in wide.items():
            if name != "hits":
                assert t.dtype == torch.float32 and narrow[name].dtype == torch.bfloat16
                assert torch.equal(t, narrow[name].float())  # exact: bfloat16 values either way
        again_wide, again_narrow = encode(IMAGES[0], "float32"), encode(IMAGES[0], "bfloat16")
        assert (again_wide["hits"], again_narrow["hits"]) == ("1", "1") and cached() == 6 * values
        for name, t in wide.items():
            if name != "hits":
                assert torch.equal(again_wide[name], t) and torch.equal(again_narrow[name], narrow[name])


@pytest.mark.slow
@pytest.mark.parametrize("fronts", ["1", "2"])
def test_a_port_in_use_is_one_line_and_ends_the_server_at_once(fronts):
    """A port another socket holds: the server says so in one line and exits 3, with one front end or several (they
    raised a traceback), and at once: the device process started ahead of its imports is not waited for (the
    server hung at exit, that process waiting for a device)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "vitserve", "serve", "--model", MODEL, "--load-format", "dummy", "--device", "cpu"]
            + ["--device-processes", "true", "--api-servers", fronts, "--host", "127.0.0.1"]
            + ["--port", str(taken.getsockname()[1])],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 3 and "Traceback" not in proc.stdout, proc.stdout
    assert "error while attempting to bind on address" in proc.stdout and "Address already in use" in proc.stdout
    assert time.perf_counter() - start < 30, proc.stdout  # an interpreter and its imports, not a hang


@pytest.mark.slow
def test_sigterm_while_its_device_loads_ends_the_server():
    """SIGTERM to a server whose device process is still loading (held there with SIGSTOP, as a slow load of real
    weights would keep it): the server drains and exits 0, its device process killed (it ignores SIGTERM, and the
    server's exit waited for it forever)."""
    port = launch.free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vitserve", "serve", "--model", MODEL, "--load-format", "dummy", "--device", "cpu"]
        + ["--device-processes", "true", "--api-servers", "2", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    device: list[int] = []
    try:

        def spawned() -> bool:  # the device process is the server's first spawned child (started before the rest)
            kids = [p for p in children(proc.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
            device.extend(kids[:1])
            return bool(kids)

        wait_until(spawned, 30, "the device process started")
        os.kill(device[0], signal.SIGSTOP)
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:  # a front end's answer (the port's early probes answer /stats 503)
            try:
                return httpx.get(url + "/stats", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, 60, "a front end up")
        assert httpx.get(url + "/ready").json()["status"] in ("loading", "capturing")  # not ready: the device holds
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not running(device[0])
    finally:
        resume(device)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_server_without_pyav_says_so_once_and_each_front_end_answers_501(tmp_path, monkeypatch):
    """Without PyAV (an `av` that cannot be imported in any of the server's processes) the log says so once, not
    once per front end, and a video request is the server's 501 videos_unavailable whichever front end takes it."""
    (tmp_path / "av.py").write_text("raise ImportError('no PyAV in this test')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    video = "data:video/mp4;base64," + base64.b64encode(b"\x00\x00\x00\x20ftypisom" + bytes(600)).decode()
    for proc, url in serving("--model", MODEL, "--load-format", "dummy", "--api-servers", "2"):
        wait_until(lambda: httpx.get(url + "/stats").json()["api_servers"] == 2, 60, "both front ends up")
        # rounds of 8 connections at once until each front end has answered one: the kernel hands a connection to
        # whichever front end accepts it first, so connections made one after another may all go to the same one
        for _ in range(10):
            for r in posts(url, [{"videos": [video]}] * 8, path="/v1/encode"):
                assert (r.status_code, r.json()["error"]["code"]) == (501, "videos_unavailable"), r.text
            if answered_501(proc.log) == {"api0", "api1"}:
                break
    lines = [line for line in proc.log if "videos cannot be decoded here" in line]
    assert len(lines) == 1 and "no PyAV in this test" in lines[0], lines
    assert answered_501(proc.log) == {"api0", "api1"}


def answered_501(log: list[str]) -> set[str | None]:
    """The front ends whose access lines show a video request answered 501."""
    return {front(line) for line in log if "/v1/encode 501" in line}
