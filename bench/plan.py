"""A batch's plan (`plan.make_plan`, host metadata the device process computes before every replay) on bench_http's
image mix, per family: 16 images a batch, padded to the smallest of the runner's budgets that holds them. `again`: the
mix's shapes planned before (a serving mix repeats its shapes); `new`: shapes the process has not planned (the kept
frame layouts cleared first, where the tree keeps them). Run it with another checkout first on PYTHONPATH for an
A/B (the script is this tree's, the code it times the one importable).

    PYTHONPATH=$PWD python3 bench/plan.py --out plan.json
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_http import image_files  # noqa: E402
from timing import median_seconds  # noqa: E402

import vitserve  # noqa: E402
from vitserve.encoder import builtin_config, plan  # noqa: E402
from vitserve.encoder.preprocess import smart_resize  # noqa: E402
from vitserve.encoder.runner import DEFAULT_BUDGETS  # noqa: E402

MODELS = ("Qwen/Qwen3-VL-8B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sizes = [Image.open(io.BytesIO(data)).size for _, data in image_files()]
    rows = []
    for model in MODELS:
        cfg = builtin_config(model)
        factor = cfg.patch_size * cfg.spatial_merge_size
        grids = []
        for i in range(args.batch):
            width, height = sizes[i % len(sizes)]
            h, w = smart_resize(height, width, factor, cfg.min_pixels, cfg.max_pixels)
            grids.append((1, h // cfg.patch_size, w // cfg.patch_size))
        patches = sum(h * w for _, h, w in grids)
        budget = next((b for b in DEFAULT_BUDGETS if b >= patches), patches)
        kept = getattr(plan, "_kept_layout", None)

        def new():
            if kept is not None:
                kept.cache_clear()
            plan.make_plan(grids, cfg, budget)

        again = median_seconds(lambda: plan.make_plan(grids, cfg, budget), args.repeat)
        cold = median_seconds(new, args.repeat)
        rows.append(
            {
                "model": model,
                "images": len(grids),
                "patches": patches,
                "budget": budget,
                "again_ms": again * 1e3,
                "new_ms": cold * 1e3,
            }  # fmt: skip
        )
    print(f"make_plan, {args.batch} images a batch (vitserve from {Path(vitserve.__file__).parent.parent})")
    print(f"{'model':<30} {'patches':>8} {'budget':>7} {'again ms':>9} {'new ms':>8} {'again us/image':>15}")
    for r in rows:
        per_image = r["again_ms"] * 1e3 / r["images"]
        print(
            f"{r['model']:<30} {r['patches']:>8} {r['budget']:>7} {r['again_ms']:>9.3f} {r['new_ms']:>8.3f} "
            f"{per_image:>15.1f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
