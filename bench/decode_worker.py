"""A decode worker's time per image, as a server's worker spends it (`decode.decode_and_resize` into a spool file,
in a process whose heap keeps what it frees, as `decode.serve_jobs` runs): full size as GPU servers decode (the
device resizes) and resized as CPU servers do, on bench_http's image mix. Medians of --repeat per image, the sum
over the mix. Run it with another checkout first on PYTHONPATH for an A/B (the script is this tree's, the code it
times the one importable).

    PYTHONPATH=$PWD python3 bench/decode_worker.py --out decode_worker.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_http import image_files  # noqa: E402
from timing import median_seconds  # noqa: E402

import vitserve  # noqa: E402
from vitserve.encoder.preprocess import PreprocessConfig  # noqa: E402
from vitserve.service.decoding import spool  # noqa: E402
from vitserve.service.decoding.decode import decode_and_resize  # noqa: E402
from vitserve.service.ground.heap import keep_freed_memory  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=40)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    keep_freed_memory()
    cfg, rows = PreprocessConfig(), []
    spool_dir = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    prefix = spool.spool_prefix(spool_dir)
    names = iter(range(1 << 30))

    def spooled(data: bytes, full_size: bool) -> None:
        decoded = decode_and_resize(data, False, 1 << 28, cfg, f"{prefix}{next(names)}", full_size=full_size)
        spool.discard(decoded.image)

    for name, data in image_files():
        row = {"image": name, "bytes": len(data)}
        for label, full_size in (("full_size_ms", True), ("resized_ms", False)):
            row[label] = 1e3 * median_seconds(lambda: spooled(data, full_size), args.repeat)
        rows.append(row)
    spool.clear(prefix)
    total = {k: sum(r[k] for r in rows) for k in ("full_size_ms", "resized_ms")}
    code = Path(vitserve.__file__).parent
    print(f"decode worker, {len(rows)} images, medians of {args.repeat} (vitserve from {code})")
    print(f"{'image':28s} {'full size ms':>12s} {'resized ms':>12s}")
    for r in rows:
        print(f"{r['image']:28s} {r['full_size_ms']:12.3f} {r['resized_ms']:12.3f}")
    print(f"{'sum':28s} {total['full_size_ms']:12.3f} {total['resized_ms']:12.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"code": str(code), "rows": rows, "sum": total}))


if __name__ == "__main__":
    main()
