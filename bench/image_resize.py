"""The exact image resize on each side of the spool, per photo size: Pillow's `Image.resize(BICUBIC)` on the host
(what a decode worker runs with `--image-resize worker`), and `encoder.image_resize.pillow_resize_images` on --device
(what a device runs with `--image-resize device`): the host time a resize takes to be queued there, its upload
included (the device process's thread, what bounds its images/s), the device time it takes (synchronized), the
kernels it launches, and whether its bytes are Pillow's (checked on every size); then every size in one batch, as a
device process resizes a batch's images. The target is smart_resize's for --model's image processor (its published
pixel bounds). Medians of --repeats after a warm-up; prints a table, writes JSON (--out).

    PYTHONPATH=$PWD python3 bench/image_resize.py --device cuda:0 --out image_resize.json
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from PIL import Image
from timing import median_seconds

from vitserve.encoder.image_resize import pillow_resize_images
from vitserve.encoder.preprocess import target_size
from vitserve.encoder.vision_encoder import load_configs

# (width, height): a phone's 12 MP and 48 MP binned photos, a 1080p screenshot, a 720p frame, web images, a scan
SIZES = [(4032, 3024), (3024, 4032), (1920, 1080), (1280, 720), (1000, 667), (640, 480), (448, 448), (2480, 3508)]


def photo(width: int, height: int) -> np.ndarray:
    rng = np.random.default_rng(width * height)
    yy, xx = np.mgrid[0:height, 0:width]
    ramps = np.stack([xx * 255 // (width - 1), yy * 255 // (height - 1), (xx + yy) % 256], -1)
    return np.where(rng.random((height, width, 1)) < 0.3, rng.integers(0, 256, (height, width, 3)), ramps).astype(
        np.uint8
    )


def kernels_launched(run, device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen/Qwen3-VL-8B-Instruct")
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    _, cfg, _ = load_configs(args.model, "dummy")  # (its built-in config: no weights read)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    rows = []
    images = [photo(width, height) for width, height in SIZES]
    sizes = [target_size(image, cfg) for image in images]
    cases = [([image], [size], f"{image.shape[1]}x{image.shape[0]}") for image, size in zip(images, sizes)]
    cases.append((images, sizes, f"all {len(images)}"))
    for batch, targets, source in cases:
        pils = [Image.fromarray(image) for image in batch]
        expected = [np.asarray(p.resize((w, h), Image.Resampling.BICUBIC)) for p, (h, w) in zip(pils, targets)]
        got = [x.cpu().numpy() for x in pillow_resize_images(batch, targets, device)]
        queued = median_seconds(lambda: pillow_resize_images(batch, targets, device), args.repeats)
        sync(device)

        def resized():
            pillow_resize_images(batch, targets, device)
            sync(device)

        def pil_all():
            for p, (h, w) in zip(pils, targets):
                p.resize((w, h), Image.Resampling.BICUBIC)

        rows.append(
            {
                "source": source,
                "target": f"{targets[0][1]}x{targets[0][0]}" if len(batch) == 1 else "each its own",
                "pil_ms": 1e3 * median_seconds(pil_all, args.repeats),
                "queued_ms": 1e3 * queued,
                "device_ms": 1e3 * median_seconds(resized, args.repeats),
                "kernels": kernels_launched(lambda: pillow_resize_images(batch, targets, device), device),
                "equal": all(np.array_equal(a, b) for a, b in zip(got, expected)),
            }
        )
        r = rows[-1]
        print(
            f"{r['source']:>10} -> {r['target']:>12}  PIL {r['pil_ms']:7.2f} ms  queued {r['queued_ms']:6.2f} ms  "
            f"{device.type} {r['device_ms']:7.2f} ms  kernels {r['kernels']:4d}  equal {r['equal']}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "device": str(device), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
