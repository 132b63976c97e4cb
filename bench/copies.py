"""The host copies an image and its answer make on their way through the server, step by step (issue 19's "fewer
copies"), on the 26-image mix of bench_http.py: what each costs per image, to weigh what removing it would win.

Input: the decode worker writes the resized pixels to a spool file; the device process reads it (np.empty + readv),
the runner concatenates the batch into pinned memory and copies it to the device. Alternative timed beside it: the
file read straight into the pinned buffer. Output: the device process writes the tokens (bf16) to a spool file, the
server reads them back, converts them to float32 and base64s them.

    PYTHONPATH=$PWD python3 bench/copies.py --out copies.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import pybase64
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_http import image_files  # noqa: E402
from timing import median_seconds  # noqa: E402

from vitserve.encoder.preprocess import PreprocessConfig, load_image, resize_rgb  # noqa: E402
from vitserve.service.decoding import spool  # noqa: E402


def best(fn, repeat: int = 20) -> float:
    """Median ms of `fn()` over `repeat` runs (after one warm-up)."""
    return median_seconds(fn, repeat) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=3584, help="the tower's output width (Qwen2.5-VL-7B: 3584)")
    ap.add_argument("--out", default="copies.json")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    cfg = PreprocessConfig(min_pixels=3136, max_pixels=12845056)
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    rows = []
    for name, data in image_files():
        image = resize_rgb(load_image(data), cfg)
        path = os.path.join(directory, f"vitserve-copies-{os.getpid()}")
        tokens = torch.randn(image.shape[0] * image.shape[1] // (28 * 28), args.width).bfloat16()

        def write():
            spool.write(path, [image])
            os.unlink(path)

        def read():
            spool.write(path, [image])
            return spool.read(path, image.size)

        def stage(array):
            raw = torch.empty(array.size, dtype=torch.uint8, pin_memory=cuda)
            np.concatenate([array.reshape(-1)], out=raw.numpy())
            return raw

        def read_into_pinned():
            spool.write(path, [image])
            raw = torch.empty(image.size, dtype=torch.uint8, pin_memory=cuda)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.readv(fd, [memoryview(raw.numpy())])
            finally:
                os.close(fd)
                os.unlink(path)
            return raw

        out = tokens.view(torch.uint8).numpy().reshape(-1)

        def answer():
            spool.write(path, [out])
            back = torch.from_numpy(spool.read(path, out.size)).view(torch.bfloat16)
            return pybase64.b64encode(back.float().numpy())

        def answer_spool():
            spool.write(path, [out])
            return spool.read(path, out.size)

        def answer_mmap():  # the file mapped (pre-faulted, private) instead of read, then unlinked
            spool.write(path, [out])
            fd = os.open(path, os.O_RDONLY)
            try:
                m = mmap.mmap(
                    fd, out.size, flags=mmap.MAP_PRIVATE | mmap.MAP_POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
                )
            finally:
                os.close(fd)
                os.unlink(path)
            back = torch.from_numpy(np.frombuffer(m, np.uint8)).view(torch.bfloat16)
            return back.float()

        def answer_read_float():
            return torch.from_numpy(answer_spool()).view(torch.bfloat16).float()

        row = dict(
            image=name,
            pixels_mb=image.size / 2**20,
            tokens_mb=out.size / 2**20,
            spool_write_ms=best(write),
            spool_write_read_ms=best(read),
            stage_pinned_ms=best(lambda: stage(image)),
            write_then_read_into_pinned_ms=best(read_into_pinned),
            answer_spool_ms=best(answer_spool),
            answer_float_ms=best(lambda: tokens.float()),
            answer_read_float_ms=best(answer_read_float),
            answer_mmap_float_ms=best(answer_mmap),
            answer_base64_ms=best(lambda: pybase64.b64encode(tokens.float().numpy())),
            answer_spool_float_base64_ms=best(answer),
        )
        if cuda:
            raw = stage(image)
            row["h2d_ms"] = best(lambda: (raw.to("cuda", non_blocking=True), torch.cuda.synchronize()))
        rows.append(row)
    keys = [k for k in rows[0] if k.endswith("_ms")]
    means = {k: statistics.mean(r[k] for r in rows) for k in keys}
    print(f"{'image':24s} " + " ".join(f"{k[:-3]:>28s}" for k in keys))
    for r in rows:
        print(f"{r['image'][:24]:24s} " + " ".join(f"{r[k]:28.3f}" for k in keys))
    print(f"{'mean':24s} " + " ".join(f"{means[k]:28.3f}" for k in keys))
    saved = means["spool_write_read_ms"] + means["stage_pinned_ms"] - means["write_then_read_into_pinned_ms"]
    print(f"reading the spool file straight into pinned memory would save {saved:.3f} ms per image (mean)")
    print(
        f"mapping the answer's spool file instead of reading it: {means['answer_mmap_float_ms']:.3f} ms against "
        f"{means['answer_read_float_ms']:.3f} (read, then float32; mean)"
    )
    json.dump(
        dict(
            device=torch.cuda.get_device_name() if cuda else "cpu",
            rows=rows,
            means=means,
            read_into_pinned_saves_ms=saved,
        ),
        open(args.out, "w"),
        indent=1,
    )


if __name__ == "__main__":
    main()
