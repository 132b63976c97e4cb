"""How fast an item's vLLM encoder-cache file lands (service/ec_storage.py), for issue 28's target (a Qwen3-VL-8B
1344x1344 image's vLLM-layout item, ~58 MB in bf16, in /dev/shm at 4 GB/s or more): `ECStorage.write` of host
tensors shaped as the tower answers them (tokens and three deepstack features, or tokens alone for Qwen2.5-VL-7B),
with 1, 2, 4 and 8 writer threads, the median of --repeats writes each (new identifiers: no write is skipped), beside
a plain `os.write` of the same bytes already concatenated (the copy every file write pays) and safetensors' own
`save_file` of the concatenated tensor (what vLLM's producer does). Prints a table, writes JSON (--out).

    python3 bench/ec_write.py --out ec_write.json     (--dir /dev/shm by default)
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

from vitserve.service.ec_storage import ECStorage

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

            results = {"os.write (concatenated already)": timed(plain, args.repeats),
                       "safetensors save_file (concatenated already)": timed(safetensors, args.repeats)}
            for writers in (1, 2, 4, 8):
                storage = ECStorage(root / f"w{writers}", 64 * size, writers=writers)
                results[f"ECStorage.write, {writers} writer{'s' * (writers > 1)}"] = timed(
                    lambda i: storage.write(f"item{i}", parts[0], parts[1:]), args.repeats)
                shutil.rmtree(root / f"w{writers}")
        finally:
            shutil.rmtree(root, ignore_errors=True)
        for how, seconds in results.items():
            rows.append(dict(item=name, mb=size / 1e6, how=how, ms=seconds * 1e3, gb_s=size / seconds / 1e9))
    print(f"{'item':26s} {'MB':>6s}  {'how':46s} {'ms':>7s} {'GB/s':>6s}")
    for r in rows:
        print(f"{r['item']:26s} {r['mb']:6.1f}  {r['how']:46s} {r['ms']:7.2f} {r['gb_s']:6.2f}")
    if args.out:
        json.dump(dict(dir=args.dir, cpus=os.cpu_count(), rows=rows, date=time.strftime("%Y-%m-%d")),
                  open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
