"""How fast an item's vLLM encoder-cache file lands (service/ec_storage.py), for issue 28's target (a Qwen3-VL-8B
1344x1344 image's vLLM-layout item, ~58 MB in bf16, in /dev/shm at 4 GB/s or more): `ECStorage.write` of host
tensors shaped as the tower answers them (tokens and three deepstack features, or tokens alone for Qwen2.5-VL-7B),
with 1, 2, 4 and 8 writer threads, the median of --repeats writes each (new identifiers: no write is skipped), beside
a plain `os.write` of the same bytes already concatenated (the copy every file write pays) and safetensors' own
`save_file` of the concatenated tensor (what vLLM's producer does). Prints a table, writes JSON (--out).

`--http MODEL` also times /v1/encode over HTTP for the same 1344x1344 image (one client, --requests after a
warm-up, a new uuid each so that every request writes its file) against a server without and then with
`--ec-shared-storage` (dummy weights, cache off), answered as safetensors (the answer with the least serialization,
where a write held in its path would show most) and as JSON: the answer path must not be slowed.

    python3 bench/ec_write.py --out ec_write.json     (--dir /dev/shm by default)
    PYTHONPATH=$SITE$PWD python3 bench/ec_write.py --http Qwen/Qwen3-VL-8B-Instruct --out ec.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vitserve.encoder.features import Features
from vitserve.service.tiers.ec_storage import ECStorage

ITEMS = {"qwen3-vl-8b 1344x1344": (1764, 4096, 3), "qwen2.5-vl-7b 1344x1344": (2304, 3584, 0)}


def timed(fn, repeats: int) -> float:
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--http", default=None, metavar="MODEL", help="also time /v1/encode with and without the files")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--device", default="cuda:0", help="--http: the server's device")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from safetensors.torch import save_file

    rows = []
    for name, (tokens, width, levels) in ITEMS.items():
        parts = [torch.randn(tokens, width).bfloat16() for _ in range(1 + levels)]
        joined = torch.cat(parts, -1)
        size = joined.nbytes
        root = Path(tempfile.mkdtemp(dir=args.dir, prefix="vitserve-ec-bench-"))
        try:

            def plain(i):
                with open(root / f"plain{i}", "wb") as f:
                    f.write(memoryview(joined.view(torch.uint8).numpy()).cast("B"))
                (root / f"plain{i}").unlink()

            def safetensors(i):
                save_file({"ec_cache": joined}, root / f"st{i}")
                (root / f"st{i}").unlink()

            results = {
                "os.write (concatenated already)": timed(plain, args.repeats),
                "safetensors save_file (concatenated already)": timed(safetensors, args.repeats),
            }
            for writers in (1, 2, 4, 8):
                storage = ECStorage(root / f"w{writers}", 64 * size, writers=writers)
                results[f"ECStorage.write, {writers} writer{'s' * (writers > 1)}"] = timed(
                    lambda i: storage.write(f"item{i}", Features(parts[0], parts[1:])), args.repeats
                )
                shutil.rmtree(root / f"w{writers}")
        finally:
            shutil.rmtree(root, ignore_errors=True)
        for how, seconds in results.items():
            rows.append(dict(item=name, mb=size / 1e6, how=how, ms=seconds * 1e3, gb_s=size / seconds / 1e9))
    print(f"{'item':26s} {'MB':>6s}  {'how':46s} {'ms':>7s} {'GB/s':>6s}")
    for r in rows:
        print(f"{r['item']:26s} {r['mb']:6.1f}  {r['how']:46s} {r['ms']:7.2f} {r['gb_s']:6.2f}")
    result = dict(dir=args.dir, cpus=os.cpu_count(), rows=rows, date=time.strftime("%Y-%m-%d"))
    if args.http:
        result["http"] = http(args)
    if args.out:
        json.dump(result, open(args.out, "w"), indent=1)


def http(args) -> list[dict]:
    import base64
    import io
    import uuid

    import httpx
    from PIL import Image

    from vitserve.service.entry.launch import start_server

    image = Image.open(Path(__file__).resolve().parents[1] / "examples" / "sample.jpg").convert("RGB")
    buf = io.BytesIO()
    image.resize((1344, 1344)).save(buf, "JPEG", quality=90)
    uri = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="vitserve-ec-http-"))
    rows = []
    try:
        for side, extra in (("without files", []), ("with --ec-shared-storage", ["--ec-shared-storage", str(root)])):
            proc, url = start_server(
                "--model",
                args.http,
                "--load-format",
                "dummy",
                "--device",
                args.device,
                "--cache-bytes",
                "0",
                "--log-level",
                "warning",
                *extra,
                timeout=600,
            )
            try:
                with httpx.Client(timeout=120) as client:
                    for accept in ("application/octet-stream", "application/json"):
                        times, serialize = [], []
                        for i in range(args.requests + 3):
                            body = {
                                "images": [uri],
                                "layout": "vllm",
                                "dtype": "bfloat16",
                                "multi_modal_uuids": {"image": [uuid.uuid4().hex]},
                            }
                            start = time.perf_counter()
                            r = client.post(url + "/v1/encode", json=body, headers={"accept": accept})
                            r.raise_for_status()
                            if i >= 3:
                                times.append(time.perf_counter() - start)
                                serialize.append(float(r.headers["x-serialize-time"]))
                        rows.append(
                            dict(
                                side=side,
                                answer=accept,
                                p50_ms=statistics.median(times) * 1e3,
                                p90_ms=sorted(times)[int(0.9 * len(times))] * 1e3,
                                serialize_ms=statistics.median(serialize),
                                bytes=len(r.content),
                            )
                        )
                        print(
                            f"{side:28s} {accept:26s} p50 {rows[-1]['p50_ms']:7.2f} ms  p90 "
                            f"{rows[-1]['p90_ms']:7.2f} ms  serialize {rows[-1]['serialize_ms']:.2f} ms",
                            flush=True,
                        )
            finally:
                proc.terminate()
                proc.wait(60)
        files = list(root.glob("*/encoder_cache.safetensors"))
        print(f"files written: {len(files)}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


if __name__ == "__main__":
    main()
