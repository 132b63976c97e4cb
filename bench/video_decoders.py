"""NVDEC against FFmpeg's software decoders (encoder/video.py's `decoder`), on the clips bench/video.py makes: for
each clip, `load_video` through each decoder (the video processor settings of --model's published checkpoint,
sampled at --fps), seconds per clip (median of --repeats, after one warm-up), which decoder ran, and how far the
NVDEC frames are from the software ones (pixels that differ, largest and mean absolute difference in uint8 levels).
Prints a table, writes JSON (--out).

    PYTHONPATH=$SITE$PWD python3 bench/video_decoders.py --clip-dir build/video-clips --out decoders.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vitserve.encoder import video as V  # noqa: E402
from vitserve.encoder.config import builtin_config  # noqa: E402


def clip_arguments() -> argparse.Namespace:
    """The arguments of the per-clip video benches (this one, video_decode.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen3-VL-8B-Instruct")
    ap.add_argument("--clip-dir", default="build/video-clips")
    ap.add_argument("--fps", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--largest-mb", type=float, default=5.0, help="skip larger clips (the 10-minute one)")
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def published(args: argparse.Namespace) -> V.VideoConfig:
    """--model's published video processor settings, sampled at --fps."""
    cfg = builtin_config(args.model)
    return V.VideoConfig.for_model(cfg).from_hf(V.PUBLISHED[cfg.family]).with_request(fps=args.fps)


def clips(args: argparse.Namespace) -> list[Path]:
    """bench/video.py's MP4 clips in --clip-dir up to --largest-mb, smallest first."""
    found = [p for p in Path(args.clip_dir).glob("*.mp4") if p.stat().st_size <= args.largest_mb * 1e6]
    return sorted(found, key=lambda p: p.stat().st_size)


def main():
    args = clip_arguments()
    base = published(args)
    rows = []
    for clip in clips(args):
        data = clip.read_bytes()
        row = {"clip": clip.name}
        frames = {}
        for decoder in V.DECODERS:
            config = dataclasses.replace(base, decoder=decoder)
            video = V.load_video(data, config)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                video = V.load_video(data, config)
                times.append(time.perf_counter() - start)
            frames[decoder] = video.frames
            row[f"{decoder}_s"] = statistics.median(times)
            row[f"{decoder}_ran"] = video.decoder
        diff = np.abs(frames["nvdec"].astype(np.int16) - frames["cpu"].astype(np.int16))
        row |= {
            "frames": len(frames["cpu"]),
            "size": list(frames["cpu"].shape[1:3]),
            "differing_pixels": float((diff.max(axis=-1) > 0).mean()),
            "max_abs": int(diff.max()),
            "mean_abs": float(diff.mean()),
            "nvdec_refused": V.nvdec_refused(),
        }
        rows.append(row)
        print(
            f"{row['clip']:42s} {row['frames']:4d} frames  cpu {row['cpu_s']:.3f} s  nvdec {row['nvdec_s']:.3f} s "
            f"({row['nvdec_ran']})  differing {row['differing_pixels']:.2%}  max {row['max_abs']}  "
            f"mean {row['mean_abs']:.4f}",
            flush=True,
        )
    if args.out:
        json.dump(dict(model=args.model, fps=args.fps, rows=rows), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
