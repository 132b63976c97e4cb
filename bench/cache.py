"""The embedding cache's worth (issue 18): the time of a request for one 448² image when it is a miss (a new image:
decoded, encoded on the device) against a hit (the same image again: answered from host memory). Prints a table,
writes JSON.

    PYTHONPATH=$PWD python3 bench/cache.py --model Qwen/Qwen2.5-VL-7B-Instruct --device cuda:0 --out cache.json
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import time

import httpx
import numpy as np
from PIL import Image

from vitserve.service.launch import start_server


def image(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (448, 448, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-qwen2.5-vl")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--out", default="cache.json")
    args = ap.parse_args()
    proc, url = start_server("--model", args.model, "--load-format", "dummy", "--device", args.device,
                             "--max-batch-wait-ms", "0", timeout=600)
    times = {"miss": [], "hit": []}
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            for seed in range(5):  # warm
                client.post("/v1/encode", json={"images": [image(10_000 + seed)]},
                            headers={"accept": "application/octet-stream"})
            for seed in range(args.requests):
                uri = image(seed)
                for kind in ("miss", "hit"):
                    start = time.perf_counter()
                    r = client.post("/v1/encode", json={"images": [uri]}, headers={"accept": "application/octet-stream"})
                    elapsed = time.perf_counter() - start
                    assert r.status_code == 200 and r.headers["x-cache-hits"] == ("1" if kind == "hit" else "0")
                    times[kind].append(elapsed)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    result = {"model": args.model, "device": args.device, "requests": args.requests,
              **{f"{k}_{q}_ms": float(np.percentile(v, p) * 1e3) for k, v in times.items()
                 for q, p in (("p50", 50), ("p99", 99))}}
    result["miss_over_hit_p50"] = result["miss_p50_ms"] / result["hit_p50_ms"]
    print(f"{'448² image, one per request':30s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for kind in ("miss", "hit"):
        print(f"{kind:30s} {result[f'{kind}_p50_ms']:8.2f} {result[f'{kind}_p99_ms']:8.2f}")
    print(f"a hit answers {result['miss_over_hit_p50']:.1f}x faster at the median")
    json.dump(result, open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
