"""The event loop's busy time per image, by the size of its JSON body (issue 26: no per-byte work on any event loop).

Starts a real server (`vitserve serve --model tiny-qwen2.5-vl --load-format dummy --cache-bytes 0` on the CPU, its
decode workers in processes), sends it photo-like JPEGs as base64 in /v1/embeddings bodies of about 118 KB, 1.15 MB
and 4.6 MB (one image each, pooled, `max_pixels` 224x224 so that the tiny tower's work stays small), one request at a
time over one kept-alive connection, and reads the CPU time of the server's main thread (the event loop's: uvicorn
runs it there) from /proc/<pid>/task/<pid>/schedstat before and after: its busy time per request, every byte of work
the loop does for one image included (HTTP, the JSON scan and parse, header probe, hashing, the hand-off to a decode
worker, the answer). The rest of the server's process (its threads: the device's, the executor's) is reported beside
it, so that work moved off the loop shows where it went. `--health` requests (`GET /health`) are timed the same way
as the floor a request costs whatever its body.

    PYTHONPATH=$PWD python3 bench/loop_bytes.py --out loop_bytes.json
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np
from PIL import Image

SIZES = {"118KB": 118_000, "1.15MB": 1_150_000, "4.6MB": 4_600_000}  # JSON body bytes


def photo(pixels: int, seed: int = 0) -> bytes:
    """A 4:3 JPEG of about `pixels` pixels: gradients under noise (about 0.7 bytes a pixel at quality 90)."""
    w = int((pixels * 4 / 3) ** 0.5)
    h = w * 3 // 4
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // w, y * 255 // h, (x + y) * 255 // (w + h)], -1)
    out = io.BytesIO()
    Image.fromarray(np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def body_of(target: int) -> bytes:
    """A /v1/embeddings body of about `target` bytes (within 3%): one JPEG as a data URI."""
    pixels = target * 3 / 4 / 0.67
    for _ in range(8):
        image = photo(int(pixels))
        body = json.dumps(
            {
                "input": "data:image/jpeg;base64," + base64.b64encode(image).decode(),
                "pooling": "mean",
                "max_pixels": 224 * 224,
            }
        ).encode()
        if abs(len(body) - target) < 0.03 * target:
            return body
        pixels *= target / len(body)
    return body


def cpu_ns(pid: int, tid: int) -> int:
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])


def process_ns(pid: int) -> int:
    return sum(cpu_ns(pid, int(tid)) for tid in os.listdir(f"/proc/{pid}/task") if _alive(pid, tid))


def _alive(pid, tid) -> bool:
    return os.path.exists(f"/proc/{pid}/task/{tid}/schedstat")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(port: int, extra: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vitserve",
            "serve",
            "--model",
            "tiny-qwen2.5-vl",
            "--load-format",
            "dummy",
            "--device",
            "cpu",
            "--cache-bytes",
            "0",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            *extra,
        ]
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/ready")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode})")
        time.sleep(0.25)
    proc.kill()
    raise SystemExit("the server did not get ready")


def measure(pid: int, port: int, method: str, path: str, body: bytes | None, n: int) -> dict:
    """Main-thread and whole-process CPU ms per request over `n` requests (after 3 to warm up); wall ms median."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json"} if body else {}

    def one() -> float:
        start = time.perf_counter()
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        if response.status != 200:
            raise SystemExit(f"{path}: HTTP {response.status}")
        return time.perf_counter() - start

    for _ in range(3):
        one()
    time.sleep(0.2)
    main0, all0 = cpu_ns(pid, pid), process_ns(pid)
    walls = [one() for _ in range(n)]
    time.sleep(0.2)  # what the request left to threads (a spool file's removal, a timer) is counted too
    main1, all1 = cpu_ns(pid, pid), process_ns(pid)
    conn.close()
    return {
        "loop_ms": (main1 - main0) / n / 1e6,
        "process_ms": (all1 - all0) / n / 1e6,
        "wall_ms": statistics.median(walls) * 1e3,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40, help="requests timed per size")
    ap.add_argument("--label", default="", help="a name for this tree in the JSON")
    ap.add_argument("--out", default="loop_bytes.json")
    ap.add_argument("--serve-arg", action="append", default=[], help="another `vitserve serve` argument")
    args = ap.parse_args()
    bodies = {name: body_of(size) for name, size in SIZES.items()}
    port = free_port()
    proc = serve(port, args.serve_arg)
    rows = []
    try:
        floor = measure(proc.pid, port, "GET", "/health", None, args.requests)
        rows.append({"body": "GET /health", "bytes": 0, **floor})
        for name, body in bodies.items():
            rows.append(
                {
                    "body": name,
                    "bytes": len(body),
                    **measure(proc.pid, port, "POST", "/v1/embeddings", body, args.requests),
                }
            )
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"{'body':>12} {'bytes':>9} {'loop ms':>8} {'loop ms/MB':>10} {'process ms':>10} {'wall ms':>8}")
    for row in rows:
        per_mb = (row["loop_ms"] - floor["loop_ms"]) / (row["bytes"] / 1e6) if row["bytes"] else float("nan")
        row["loop_ms_per_mb_over_health"] = per_mb
        print(
            f"{row['body']:>12} {row['bytes']:>9} {row['loop_ms']:>8.3f} {per_mb:>10.3f} {row['process_ms']:>10.3f} "
            f"{row['wall_ms']:>8.2f}"
        )
    with open(args.out, "w") as f:
        json.dump({"label": args.label, "cpus": os.cpu_count(), "requests": args.requests, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
