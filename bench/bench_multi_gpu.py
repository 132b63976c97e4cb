"""Multi-GPU scaling (issue 6, on a 2-GPU machine): the real server with --devices cuda:0 and then cuda:0,cuda:1,
saturated by multi-process clients with the same image mix; reports images/s for each and the ratio (target ≥ 1.8).

    PYTHONPATH=$PWD python3 bench/bench_multi_gpu.py --out multi_gpu.json
"""

from __future__ import annotations

import argparse
import base64
import json
import signal
import sys
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_http import drive, image_files  # noqa: E402
from serving import start_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-VL-7B-Instruct")
    ap.add_argument("--requests", type=int, default=1536)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--client-processes", type=int, default=8)
    ap.add_argument("--out", default="multi_gpu.json")
    args = ap.parse_args()
    assert torch.cuda.device_count() >= 2, "needs two GPUs"
    uris = ["data:image/png;base64," + base64.b64encode(d).decode() for _, d in image_files()]
    results = {}
    for devices, port in (("cuda:0", 8781), ("cuda:0,cuda:1", 8782)):
        proc, url = start_server("--model", args.model, "--load-format", "dummy", "--devices", devices,
                                 "--log-level", "warning", port=port)
        try:
            drive(url, uris, args.model, 64, 16)  # warm
            results[devices] = drive(url, uris, args.model, args.requests, args.concurrency, args.client_processes)
            results[devices]["per_device"] = {d: v["images"] for d, v in
                                              httpx.get(url + "/stats").json()["devices"].items()}
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        print(devices, results[devices], flush=True)
    ratio = results["cuda:0,cuda:1"]["images_per_s"] / results["cuda:0"]["images_per_s"]
    print(f"two GPUs / one GPU: {ratio:.2f}x (target 1.8x)")
    json.dump(dict(model=args.model, results=results, ratio=ratio), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
