"""Hostile load, the memory and latency side (issue 17): a real `vitserve serve` (tiny model, default flags), its
resident memory (the server and its child processes) sampled every 20 ms, /health probed every 50 ms, and a normal
one-image request timed unloaded and beside each attack. Prints a table against the targets, writes JSON.

    PYTHONPATH=$PWD python3 bench/hostile.py --out hostile.json
"""

from __future__ import annotations

import argparse
import io
import json
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from vitserve.service.launch import start_server

NORMAL = {"input": ["data:image/png;base64," + __import__("base64").b64encode(
    (lambda b: (Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 400, 3), dtype=np.uint8)).save(
        b, "PNG"), b.getvalue())[1])(io.BytesIO())).decode()]}


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and all its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            pass
    return total


class Sampler(threading.Thread):
    def __init__(self, pid: int, url: str):
        super().__init__(daemon=True)
        self.pid, self.url, self.stop = pid, url, threading.Event()
        self.rss: list[tuple[float, int]] = []
        self.health: list[tuple[float, float, int]] = []

    def run(self):
        client, last = httpx.Client(timeout=10), 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            self.rss.append((now, rss_bytes(self.pid)))
            if now - last >= 0.05:
                last = now
                start = time.perf_counter()
                try:
                    status = client.get(self.url + "/health").status_code
                except httpx.HTTPError:
                    status = 0
                self.health.append((now, time.perf_counter() - start, status))
            time.sleep(0.02)

    def peak_since(self, t: float) -> int:
        return max((r for when, r in self.rss if when >= t), default=0)

    def health_p99_ms(self, t0: float, t1: float) -> float:
        lat = [s for when, s, _ in self.health if t0 <= when <= t1]
        return float(np.percentile(lat, 99) * 1e3) if lat else float("nan")


def normal_latencies(url: str, n: int, stop: threading.Event | None = None) -> tuple[list[float], list[int]]:
    out, codes = [], []
    with httpx.Client(timeout=120) as client:
        for _ in range(n):
            if stop is not None and stop.is_set():
                break
            start = time.perf_counter()
            r = client.post(url + "/v1/embeddings", json=NORMAL)
            out.append(time.perf_counter() - start)
            codes.append(r.status_code)
    return out, codes


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99) * 1e3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="hostile.json")
    ap.add_argument("--server-flags", default="", help="extra flags for the server (default: none, its defaults)")
    args = ap.parse_args()
    proc, url = start_server("--model", "tiny-qwen2.5-vl", "--load-format", "dummy", *args.server_flags.split(),
                             timeout=120, capture_log=True)
    port = int(url.rsplit(":", 1)[1])
    sampler = Sampler(proc.pid, url)
    sampler.start()
    statuses, result = [], {}
    try:
        normal_latencies(url, 5)  # warm
        unloaded, codes = normal_latencies(url, 40)
        statuses += codes
        result["unloaded_p50_ms"], result["unloaded_p99_ms"] = float(np.median(unloaded) * 1e3), p99(unloaded)

        # 1. sixteen 8000² transparent WebP images (each ~2 KB) in one request, beside normal requests
        buf = io.BytesIO()
        Image.new("RGBA", (8000, 8000)).save(buf, "WEBP", lossless=True)
        bomb = "data:image/webp;base64," + __import__("base64").b64encode(buf.getvalue()).decode()
        base, t0 = rss_bytes(proc.pid), time.monotonic()
        done = threading.Event()
        beside: list = []
        runner = threading.Thread(target=lambda: beside.append(normal_latencies(url, 200, done)))
        runner.start()
        start = time.perf_counter()
        r = httpx.post(url + "/v1/embeddings", json={"input": [bomb] * 16}, timeout=300)
        bomb_s = time.perf_counter() - start
        time.sleep(1.0)
        done.set()
        runner.join()
        statuses += [r.status_code, *beside[0][1]]
        result["bomb"] = dict(status=r.status_code, code=r.json().get("error", {}).get("code"), seconds=bomb_s,
                              rss_growth_mb=(sampler.peak_since(t0) - base) / 2**20,
                              normal_beside_p99_ms=p99(beside[0][0]), normal_beside_requests=len(beside[0][0]))

        # 2. ten connections each sending all but one byte of a 32 MiB body
        limit = 32 * 2**20
        base, t0 = rss_bytes(proc.pid), time.monotonic()
        socks = []
        for _ in range(10):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"POST /v1/encode HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n" % limit)
            socks.append(sock)
        chunk = b"A" * 2**20
        for sock in socks:
            for _ in range(31):
                sock.sendall(chunk)
            sock.sendall(chunk[:-1])
        sent = time.monotonic()
        in_flight = httpx.get(url + "/stats").json()["requests_in_flight"]
        closed = []
        for sock in socks:
            sock.settimeout(300)
            reply = b""
            try:
                while data := sock.recv(65536):
                    reply += data
            except OSError:
                pass
            closed.append((time.monotonic() - sent, reply.split(b"\r\n", 1)[0].decode(errors="replace")))
            sock.close()
        time.sleep(1.0)
        settled = rss_bytes(proc.pid)
        statuses += [int(line.split()[1]) for _, line in closed if line.startswith("HTTP/1.1")]
        result["unfinished_bodies"] = dict(in_flight_while_sending=in_flight,
                                           peak_rss_growth_mb=(sampler.peak_since(t0) - base) / 2**20,
                                           rss_after_mb=(settled - base) / 2**20,
                                           closed_after_s=max(s for s, _ in closed),
                                           replies=sorted({line for _, line in closed}))

        # 3. a 120 MB header
        t0 = time.monotonic()
        sock = socket.create_connection(("127.0.0.1", port))
        start = time.perf_counter()
        reply = b""
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ")
            piece = b"A" * 2**20
            for _ in range(120):
                sock.sendall(piece)
        except OSError:
            pass
        refused_s = time.perf_counter() - start
        sock.settimeout(5)
        try:
            reply = sock.recv(65536)
        except OSError:
            pass
        sock.close()
        time.sleep(0.5)
        result["huge_header"] = dict(refused_after_s=refused_s, reply=reply.split(b"\r\n", 1)[0].decode(errors="replace"),
                                     health_p99_ms=sampler.health_p99_ms(t0, time.monotonic()))
        result["health_p99_ms_throughout"] = sampler.health_p99_ms(0, time.monotonic())
        result["health_failures"] = sum(1 for _, _, s in sampler.health if s != 200)
        result["statuses"] = {str(s): statuses.count(s) for s in sorted(set(statuses))}
        result["any_5xx"] = any(500 <= s < 600 for s in statuses)
    finally:
        sampler.stop.set()
        proc.terminate()
        proc.wait(timeout=30)
    b, u, h = result["bomb"], result["unfinished_bodies"], result["huge_header"]
    rows = [
        ("16 x 8k² transparent WebP", f"{b['status']} {b['code']} in {b['seconds']:.2f} s, RSS +{b['rss_growth_mb']:.0f} MB",
         "RSS growth <= 1 GB or a clean 413", b["rss_growth_mb"] <= 1024 or b["status"] == 413),
        ("normal request beside it", f"p99 {b['normal_beside_p99_ms']:.1f} ms vs unloaded {result['unloaded_p99_ms']:.1f}",
         "p99 <= 2x unloaded", b["normal_beside_p99_ms"] <= 2 * result["unloaded_p99_ms"]),
        ("10 unfinished 32 MiB bodies", f"closed after {u['closed_after_s']:.1f} s ({', '.join(u['replies'])}); RSS peak "
         f"+{u['peak_rss_growth_mb']:.0f} MB, after +{u['rss_after_mb']:.0f} MB; in flight {u['in_flight_while_sending']}",
         "released and closed within the body deadline", u["closed_after_s"] <= 61 and u["rss_after_mb"] < 100),
        ("120 MB header", f"refused after {h['refused_after_s']:.2f} s ({h['reply'] or 'closed'})", "within 1 s",
         h["refused_after_s"] <= 1.0),
        ("/health throughout", f"p99 {result['health_p99_ms_throughout']:.1f} ms, {result['health_failures']} failed",
         "p99 <= 50 ms", result["health_p99_ms_throughout"] <= 50 and not result["health_failures"]),
        ("every case", f"statuses {result['statuses']}", "no 5xx", not result["any_5xx"]),
    ]
    print(f"\n{'case':30s} {'measured':95s} {'target':45s} ok")
    for case, measured, target, ok in rows:
        print(f"{case:30s} {measured:95s} {target:45s} {'PASS' if ok else 'FAIL'}")
    result["rows"] = [dict(case=c, measured=m, target=t, passed=bool(ok)) for c, m, t, ok in rows]
    result["all_passed"] = all(r["passed"] for r in result["rows"])
    json.dump(result, open(args.out, "w"), indent=1)
    return 0 if result["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
