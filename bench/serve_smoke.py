"""GPU smoke test of the real server (issue 4): start `vitserve serve` with a real-size dummy model, time startup
(weights, capture, ready), send concurrent requests of mixed sizes, report latency, then SIGTERM. Writes JSON.

    PYTHONPATH=$PWD python3 bench/serve_smoke.py --out serve_smoke.json
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
from PIL import Image


def jpeg(w, h, seed):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(base).resize((w, h), Image.BILINEAR).save(buf, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-VL-7B-Instruct")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--out", default="serve_smoke.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vitserve",
            "serve",
            "--model",
            args.model,
            "--load-format",
            "dummy",
            "--device",
            "cuda:0",
            "--host",
            "127.0.0.1",
            "--port",
            str(args.port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{args.port}"
    health_s = ready_s = None
    while time.perf_counter() - t0 < 300:
        try:
            if health_s is None and httpx.get(url + "/health", timeout=1).status_code == 200:
                health_s = time.perf_counter() - t0
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                ready_s = time.perf_counter() - t0
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    sizes = [(224, 224), (448, 448), (640, 480), (1024, 768), (336, 1008), (896, 896), (1280, 720), (300, 200)]
    images = [jpeg(w, h, i) for i, (w, h) in enumerate(sizes)]
    latencies, statuses = [], []

    def post(i):
        start = time.perf_counter()
        r = client.post("/v1/embeddings", json={"model": args.model, "input": [images[i % len(images)]]})
        latencies.append(time.perf_counter() - start)
        statuses.append(r.status_code)
        return r

    with httpx.Client(base_url=url, timeout=120, limits=httpx.Limits(max_connections=args.concurrency)) as client:
        post(0)  # first request (allocator warm)
        latencies.clear(), statuses.clear()
        single = []
        for i in range(8):
            start = time.perf_counter()
            client.post("/v1/embeddings", json={"model": args.model, "input": [images[1]]})
            single.append(time.perf_counter() - start)
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(post, range(args.requests)))
        wall = time.perf_counter() - start
        stats = client.get("/stats").json()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    log = proc.stdout.read()
    lat = np.array(latencies) * 1e3
    report = dict(
        model=args.model,
        health_s=health_s,
        ready_s=ready_s,
        load_log=[line for line in log.splitlines() if re.search(r"loaded in|captured \d+ budgets|ready in", line)],
        single_448_ms_p50=float(np.median(single) * 1e3),
        requests=args.requests,
        concurrency=args.concurrency,
        ok=statuses.count(200),
        p50_ms=float(np.percentile(lat, 50)),
        p99_ms=float(np.percentile(lat, 99)),
        images_per_s=args.requests / wall,
        exit_code=code,
        batch_size_histogram=stats["batch_size_histogram"],
        runner=next(iter(stats["devices"].values()))["runner"]["capture_seconds"],
    )
    print(json.dumps({k: v for k, v in report.items() if k != "runner"}, indent=1))
    json.dump(report | {"stats": stats}, open(args.out, "w"), indent=1)
    return 0 if code == 0 and report["ok"] == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
