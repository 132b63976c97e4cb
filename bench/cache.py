"""The embedding cache's worth (issue 18): the time of a request for one 448² image when it is a miss (a new image:
decoded, encoded on the device) against a hit (the same image again: answered from host memory), as `/v1/encode`
JSON in, float32 token features (and deepstack) as safetensors out, through httpx (what a Python client meets) and
through a lean client (the server's own time). Prints a table, writes JSON.
bench/frontend.py runs the same measurement (`measure`) on its server with the cache on.

    PYTHONPATH=$PWD python3 bench/cache.py --model Qwen/Qwen2.5-VL-7B-Instruct --device cuda:0 --out cache.json
    # the server from another checkout of the project (the client stays this one):
    PYTHONPATH=$PWD python3 bench/cache.py --model Qwen/Qwen2.5-VL-7B-Instruct --device cuda:0 --server-tree ../old
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
from PIL import Image

from vitserve.service.entry.launch import start_server

ROOT = Path(__file__).resolve().parents[1]


def image(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (448, 448, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def serve_from(tree: str | None) -> Path | None:
    """Make the servers this process starts import the project from checkout `tree` (their PYTHONPATH; this
    checkout dropped from it); its resolved path, for their working directory, or None for this checkout."""
    if not tree:
        return None
    path = Path(tree).resolve()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(path), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]]
    )
    return path


def lean_times(url: str, uris: list[str]) -> dict[str, list[float]]:
    """Each image sent twice (a miss, then a hit) as prebuilt bytes over one keep-alive `http.client` connection,
    then once more over a new connection (`new_hit`: with several front ends, the kernel gives it to any of them,
    most often one that did not compute the image), each timed from the request's first byte to the answer's last
    (the new connection made before): the server's time, with a client that costs microseconds a request (httpx's
    own handling of a 12.8 MB answer is milliseconds)."""
    parts = urlsplit(url)
    conn, times = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120), {"miss": [], "hit": []}
    times["new_hit"] = []
    headers = {"content-type": "application/json", "accept": "application/octet-stream"}

    def timed(connection, body: bytes, kind: str) -> None:
        start = time.perf_counter()
        connection.request("POST", "/v1/encode", body=body, headers=headers)
        r = connection.getresponse()
        data = r.read()
        times[kind].append(time.perf_counter() - start)
        assert r.status == 200 and r.getheader("x-cache-hits") == ("0" if kind == "miss" else "1"), data[:200]

    try:
        for uri in uris:
            body = json.dumps({"images": [uri]}).encode()
            timed(conn, body, "miss")
            timed(conn, body, "hit")
            other = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
            try:
                other.connect()
                timed(other, body, "new_hit")
            finally:
                other.close()
    finally:
        conn.close()
    return times


def measure(url: str, requests: int) -> dict:
    """`requests` new 448² images, each sent twice (a miss, then a hit) by httpx (what a Python client such as
    vitserve.client meets), and as many more by `lean_times` (the server's own time): p50 and p99 of each, ms."""
    times = {"miss": [], "hit": []}
    with httpx.Client(base_url=url, timeout=120) as client:
        for seed in range(5):  # warm
            client.post(
                "/v1/encode", json={"images": [image(10_000 + seed)]}, headers={"accept": "application/octet-stream"}
            )
        for seed in range(requests):
            uri = image(seed)
            for kind in ("miss", "hit"):
                start = time.perf_counter()
                r = client.post("/v1/encode", json={"images": [uri]}, headers={"accept": "application/octet-stream"})
                elapsed = time.perf_counter() - start
                assert r.status_code == 200 and r.headers["x-cache-hits"] == ("1" if kind == "hit" else "0"), (
                    r.status_code,
                    r.headers.get("x-cache-hits"),
                    r.text[:200],
                )
                times[kind].append(elapsed)
    lean = lean_times(url, [image(requests + seed) for seed in range(requests)])
    result = {
        "requests": requests,
        **{
            f"{prefix}{k}_{q}_ms": float(np.percentile(v, p) * 1e3)
            for prefix, measured in (("", times), ("lean_", lean))
            for k, v in measured.items()
            for q, p in (("p50", 50), ("p99", 99))
        },
    }
    result["miss_over_hit_p50"] = result["miss_p50_ms"] / result["hit_p50_ms"]
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-qwen2.5-vl")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--server-flags", default="", help="extra `vitserve serve` flags")
    ap.add_argument("--server-tree", default=None, help="serve from this checkout of the project instead")
    ap.add_argument("--out", default="cache.json")
    args = ap.parse_args()
    cwd = serve_from(args.server_tree)
    proc, url = start_server(
        "--model",
        args.model,
        "--load-format",
        "dummy",
        "--device",
        args.device,
        "--max-batch-wait-ms",
        "0",
        *args.server_flags.split(),
        timeout=600,
        cwd=cwd,
    )
    try:
        result = measure(url, args.requests)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    result = {
        "model": args.model,
        "device": args.device,
        "server_flags": args.server_flags,
        "server_tree": args.server_tree,
        **result,
    }
    print(f"{'448² image, one per request':34s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for prefix, client in (("", "httpx"), ("lean_", "lean client")):
        for kind in ("miss", "hit", "new_hit") if prefix else ("miss", "hit"):
            name = f"{kind.replace('new_hit', 'hit, new connection')}, {client}"
            print(f"{name:34s} {result[f'{prefix}{kind}_p50_ms']:8.2f} {result[f'{prefix}{kind}_p99_ms']:8.2f}")
    print(f"a hit answers {result['miss_over_hit_p50']:.1f}x faster at the median")
    json.dump(result, open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
