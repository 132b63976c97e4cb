"""Soak test (issue 7; not in CI's default run): a real server, N requests of mixed sizes at high concurrency, then a
report of what came back — answered, 429s, 5xx (must be 0), lost (must be 0), latency percentiles, the server's
resident memory at start and end (growth must stay under a bound), and the spool files left in /dev/shm once every
answer is in (must be 0: each decoded image's file goes when its device reads it, or when it is dropped).

    PYTHONPATH=$PWD python3 bench/soak.py --requests 10000 --concurrency 128 --out soak.json           # tiny, CPU
    PYTHONPATH=$PWD python3 bench/soak.py --model Qwen/Qwen2.5-VL-7B-Instruct --device cuda:0 ...       # GPU
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import glob
import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vitserve.service.entry.launch import start_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIZES = [(32, 32), (224, 224), (300, 200), (640, 480), (90, 700), (1024, 768)]


def rss_mib(pid: int) -> float:
    """Resident memory of the server and its children (the decode workers)."""
    total = 0
    for p in [pid, *map(int, subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split())]:
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except FileNotFoundError:
            pass
    return total / 1024


def spool_files(pid: int) -> list[str]:
    """The server's spool files (decoded images and batch outputs), its lock file aside."""
    return [f for f in glob.glob(f"/dev/shm/vitserve-{pid}-*") if not f.endswith("-lock")]


def images() -> list[str]:
    out = []
    for i, (w, h) in enumerate(SIZES):
        rng = np.random.default_rng(i)
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG" if i % 2 else "PNG")
        out.append(f"data:image/{'jpeg' if i % 2 else 'png'};base64," + base64.b64encode(buf.getvalue()).decode())
    return out


async def drive(url: str, uris: list[str], requests: int, concurrency: int) -> dict:
    counts: dict[str, int] = {}
    latencies = []
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=concurrency)) as c:

        async def one(i):
            async with sem:
                t = time.perf_counter()
                try:
                    r = await c.post(
                        "/v1/embeddings", json={"input": [uris[i % len(uris)]], "encoding_format": "base64"}
                    )
                    key = str(r.status_code)
                    if r.status_code == 200 and len(base64.b64decode(r.json()["data"][0]["embedding"])) == 0:
                        key = "empty"
                except httpx.HTTPError as e:
                    key = f"lost ({type(e).__name__})"
                latencies.append(time.perf_counter() - t)
                counts[key] = counts.get(key, 0) + 1

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        wall = time.perf_counter() - start
    lat = np.array(latencies) * 1e3
    return dict(counts=counts, seconds=wall, p50_ms=float(np.percentile(lat, 50)), p99_ms=float(np.percentile(lat, 99)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-qwen2.5-vl")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--max-concurrent-requests", type=int, default=96, help="the server's 429 threshold")
    ap.add_argument("--rss-growth-bound-mib", type=float, default=256)
    ap.add_argument("--out", default="soak.json")
    args = ap.parse_args()
    server, url = start_server(
        "--model",
        args.model,
        "--load-format",
        "dummy",
        "--device",
        args.device,
        "--max-concurrent-requests",
        str(args.max_concurrent_requests),
        "--log-level",
        "warning",
    )
    try:
        uris = images()
        asyncio.run(drive(url, uris, 64, 16))  # warm: workers forked, caches filled
        rss_start = rss_mib(server.pid)
        result = asyncio.run(drive(url, uris, args.requests, args.concurrency))
        rss_end = rss_mib(server.pid)
        stats = httpx.get(url + "/stats").json()
        left = spool_files(server.pid)
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=120)
    counts = result["counts"]
    answered, throttled = counts.get("200", 0), counts.get("429", 0)
    server_errors = sum(v for k, v in counts.items() if k.startswith("5"))
    lost = (
        args.requests
        - answered
        - throttled
        - server_errors
        - sum(v for k, v in counts.items() if k.startswith("4") and k != "429")
    )
    report = dict(
        model=args.model,
        requests=args.requests,
        concurrency=args.concurrency,
        answered=answered,
        status_429=throttled,
        status_5xx=server_errors,
        lost=lost,
        other=counts,
        seconds=result["seconds"],
        requests_per_s=args.requests / result["seconds"],
        p50_ms=result["p50_ms"],
        p99_ms=result["p99_ms"],
        rss_start_mib=rss_start,
        rss_end_mib=rss_end,
        rss_growth_bound_mib=args.rss_growth_bound_mib,
        spool_files_left=len(left),
        device_processes=stats["device_processes"],
        decode_workers_replaced=stats["decode_workers_replaced"],
        exit_code=code,
        batch_size_histogram=stats["batch_size_histogram"],
    )
    report["passed"] = (
        server_errors == 0 and lost == 0 and code == 0 and not left and rss_end - rss_start <= args.rss_growth_bound_mib
    )
    print(json.dumps(report, indent=1))
    json.dump(report, open(args.out, "w"), indent=1)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
