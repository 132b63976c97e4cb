"""A decode worker's time per image, as a server's worker spends it (`decode.decode_and_resize` into a spool file,
in a process whose heap keeps what it frees, as `decode.serve_jobs` runs): full size as GPU servers decode (the
device resizes) and resized as CPU servers do, on bench_http's image mix (`--alpha`: PNGs with an alpha band
instead, as screenshots are saved: opaque, and with transparent corners). Medians of --repeat per image, the sum
over the mix. Run it with another checkout first on PYTHONPATH for an A/B (the script is this tree's, the code it
times the one importable).

    PYTHONPATH=$PWD python3 bench/decode_worker.py --out decode_worker.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
from bench_http import image_files  # noqa: E402
from PIL import Image, ImageDraw  # noqa: E402
from timing import median_seconds  # noqa: E402

import vitserve  # noqa: E402
from vitserve.encoder.preprocess import PreprocessConfig  # noqa: E402
from vitserve.service.decoding import spool  # noqa: E402
from vitserve.service.decoding.decode import decode_and_resize  # noqa: E402
from vitserve.service.ground.heap import keep_freed_memory  # noqa: E402


def alpha_files() -> list[tuple[str, bytes]]:
    """RGBA PNGs: a drawn screenshot (2560x1440: panels, lines of text) and a photo (the shipped sample at
    1920x1080), each opaque and with transparent rounded corners (a window's capture)."""
    shot = Image.new("RGBA", (2560, 1440), (246, 246, 248, 255))
    draw = ImageDraw.Draw(shot)
    for i in range(6):
        draw.rectangle((40 + i * 420, 80, 420 + i * 420, 1400), fill=(255, 255, 255, 255), outline=(200, 200, 210, 255))
        for line in range(40):
            draw.text(
                (60 + i * 420, 100 + line * 32),
                f"item {i}.{line}: the quick brown fox {line * i}",
                fill=(30, 30, 40, 255),
            )
    photo = (
        Image.open(Path(__file__).resolve().parents[1] / "examples" / "sample.jpg").resize((1920, 1080)).convert("RGBA")
    )
    files = []
    for name, image in (("screenshot-2560x1440", shot), ("photo-1920x1080", photo)):
        cornered = np.asarray(image).copy()
        r = 24
        yy, xx = np.mgrid[:r, :r]
        outside = (yy - r) ** 2 + (xx - r) ** 2 > r * r
        for rows, cols in ((slice(0, r), slice(0, r)), (slice(0, r), slice(-r, None))):
            corner = cornered[rows, cols]
            flipped = outside if cols.start == 0 else outside[:, ::-1]
            corner[flipped, 3] = 0
        for label, rgba in (("opaque", np.asarray(image)), ("corners", cornered)):
            buf = io.BytesIO()
            Image.fromarray(rgba, "RGBA").save(buf, "PNG")
            files.append((f"{name} RGBA {label}", buf.getvalue()))
    return files


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=40)
    ap.add_argument("--alpha", action="store_true", help="RGBA PNGs (screenshots, a photo) instead of the mix")
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

    for name, data in alpha_files() if args.alpha else image_files():
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
