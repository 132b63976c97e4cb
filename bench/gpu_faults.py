"""GPU fault check (issue 7): out-of-memory on an oversize request fails only that request (507, a clear message)
and the next request is served. The server runs with a capped share of GPU memory so that a single huge image runs
the eager fallback out of memory. Writes JSON.

    PYTHONPATH=$PWD python3 bench/gpu_faults.py --out gpu_faults.json
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import signal
import sys
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vitserve.service.entry.launch import start_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def jpeg(side: int) -> str:
    rng = np.random.default_rng(side)
    small = rng.integers(0, 256, (side // 16, side // 16, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(small).resize((side, side), Image.BILINEAR).save(buf, "JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-VL-7B-Instruct")
    ap.add_argument(
        "--fraction", type=float, default=0.08, help="of GPU memory: weights + graphs fit, a huge image not"
    )
    ap.add_argument("--port", type=int, default=8767)
    ap.add_argument("--server-flags", default="", help="extra `vitserve serve` flags (e.g. --device-processes)")
    ap.add_argument("--out", default="gpu_faults.json")
    args = ap.parse_args()
    server, url = start_server(
        "--model",
        args.model,
        "--load-format",
        "dummy",
        "--device",
        "cuda:0",
        "--gpu-memory-fraction",
        str(args.fraction),
        "--max-pixels",
        "400000000",
        "--max-image-pixels",
        "400000000",
        "--payload-limit",
        str(256 * 2**20),
        *args.server_flags.split(),
        port=args.port,
    )
    rows = []
    try:
        small = jpeg(448)
        for side in (448, 2048, 4096, 6144, 8192, 12288):
            r = httpx.post(url + "/v1/embeddings", json={"input": [jpeg(side)]}, timeout=600)
            after = httpx.post(url + "/v1/embeddings", json={"input": [small]}, timeout=120)
            error = r.json().get("error", {}) if r.status_code != 200 else {}
            rows.append(
                dict(
                    side=side,
                    status=r.status_code,
                    code=error.get("code"),
                    message=error.get("message"),
                    next_request_status=after.status_code,
                )
            )
            print(rows[-1], flush=True)
            if r.status_code == 507:
                break
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=120)
    passed = (
        any(r["status"] == 507 for r in rows)
        and all(r["next_request_status"] == 200 for r in rows)
        and all(r["status"] in (200, 507) for r in rows)
    )
    json.dump(dict(rows=rows, exit_code=code, passed=passed), open(args.out, "w"), indent=1)
    print("PASS" if passed else "FAIL")


if __name__ == "__main__":
    main()
