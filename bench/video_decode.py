"""A video's decode stage, on one thread, per clip of bench/video.py's (the video processor settings of --model's
published checkpoint, sampled at --fps): PyAV decoding every frame (the floor a full decode sets), the sampled
decode (`video_decode.decode_sampled`: only what the sampled frames need, their YUV planes copied out), and
`load_video` (the decode the library and the decode workers run: that, plus swscale's RGB conversion and torch's
resize of each sampled frame on the CPU); each as a ratio of the full decode. With CUDA, the sampled frames' planes
converted and resized on the GPU (encoder.pixels: its fused kernels and its tensor ops, from pinned planes, the
same bytes as load_video's, checked here); with PyNvVideoCodec too, the sampled frames decoded by NVDEC
(encoder.video_nvdec: seconds, and whether its planes are the software decoder's). Medians of
--repeats after a warm-up; prints a table, writes JSON (--out).

    PYTHONPATH=$PWD python3 bench/video_decode.py --clip-dir build/video-clips --out video_decode.json
"""

from __future__ import annotations

import functools
import io
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import median_seconds  # noqa: E402
from video_decoders import clip_arguments, clips, published  # noqa: E402

from vitserve.encoder import video as V  # noqa: E402
from vitserve.encoder import video_nvdec  # noqa: E402
from vitserve.encoder.pixels import frames_from_planes
from vitserve.encoder.video_decode import decode_sampled
from vitserve.encoder.video_planes import Conversion


def full_decode(data: bytes) -> int:
    container = V._open(io.BytesIO(data))
    stream = container.streams.video[0]
    stream.thread_type, stream.codec_context.thread_count = "NONE", 1
    frames = sum(1 for _ in container.decode(stream))
    container.close()
    return frames


def sampled_planes(data: bytes, cfg: V.VideoConfig) -> list:
    """(y, u, v, conversion) of each sampled frame, decoding only what they need."""
    container = V._open(data)
    kept = set(np.unique(V.sample_indices(V.probe(container), cfg)).tolist())
    stream = container.streams.video[0]
    stream.thread_type, stream.codec_context.thread_count = "NONE", 1
    out = {}
    for i, frame in decode_sampled(container, stream, kept, rewindable=True):
        if i in kept:
            h, w = frame.height, frame.width
            flat = frame.to_ndarray(format="yuv420p").reshape(-1)
            y, u = flat[: h * w].reshape(h, w), flat[h * w : h * w * 5 // 4].reshape(h // 2, w // 2)
            v = flat[h * w * 5 // 4 :].reshape(h // 2, w // 2)
            out[i] = (y, u, v, Conversion.of(frame.colorspace, frame.format.name == "yuvj420p", h))
    container.close()
    return [out[i] for i in sorted(out)]


def on_device(rows: torch.Tensor, layout, size: tuple[int, int], device: str, fused: bool) -> torch.Tensor:
    """The sampled frames' planes (pinned host rows) uploaded, converted and resized: uint8 [F, h, w, 3] on `device`
    (`fused`: the Triton kernels; else the tensor ops they are checked against)."""
    frames = frames_from_planes(rows, layout, size, device, fused=fused)
    torch.cuda.synchronize()
    return frames


def nvdec_planes(data: bytes, kept: np.ndarray):
    """The sampled frames' planes decoded by NVDEC (video_nvdec.load_planes)."""
    container = V._open(data)
    try:
        return video_nvdec.load_planes(container, kept)
    finally:
        container.close()


def main() -> None:
    args = clip_arguments()
    torch.set_num_threads(1)
    cfg = published(args)
    device = "cuda" if torch.cuda.is_available() else None
    rows = []
    for clip in clips(args):
        data = clip.read_bytes()
        video = V.load_video(data, cfg, threads=1)
        row = {
            "clip": clip.name,
            "frames": full_decode(data),
            "sampled": len(video.indices),
            "full_s": median_seconds(lambda: full_decode(data), args.repeats),
            "sampled_s": median_seconds(lambda: sampled_planes(data, cfg), args.repeats),
            "load_video_s": median_seconds(lambda: V.load_video(data, cfg, threads=1), args.repeats),
        }
        if device:
            planes = V.load_video(data, cfg, threads=1, planes=True)
            rows_ = torch.from_numpy(planes.frames).pin_memory()
            for name, fused in (("device", True), ("device_ops", False)):
                run = functools.partial(on_device, rows_, planes.layout, planes.size, device, fused)
                row[f"{name}_s"] = median_seconds(run, args.repeats)
                row[f"{name}_equal"] = bool(np.array_equal(run().cpu().numpy(), video.frames))
            if video_nvdec.unavailable() is None:
                try:
                    row["nvdec_s"] = median_seconds(lambda: nvdec_planes(data, planes.indices), args.repeats)
                    got = nvdec_planes(data, planes.indices)
                    row["nvdec_equal"] = got is not None and bool(np.array_equal(got[0], planes.frames))
                except video_nvdec.NvdecError as e:
                    row["nvdec_error"] = str(e)
        rows.append(row)
        print(
            f"{row['clip']:45s} {row['sampled']:4d}/{row['frames']:5d} frames  full {row['full_s']:.3f} s  "
            f"sampled {row['sampled_s']:.3f} s ({row['sampled_s'] / row['full_s']:.2f}x)  "
            f"load_video {row['load_video_s']:.3f} s ({row['load_video_s'] / row['full_s']:.2f}x)"
            + (
                f"  on {device}: fused {row['device_s'] * 1e3:.1f} ms (equal {row['device_equal']}), tensor ops "
                f"{row['device_ops_s'] * 1e3:.1f} ms (equal {row['device_ops_equal']})"
                + (
                    f"  nvdec sampled {row['nvdec_s']:.3f} s (equal {row['nvdec_equal']})"
                    if "nvdec_s" in row
                    else f"  nvdec: {row.get('nvdec_error', 'unavailable')[:60]}"
                )
                if device
                else ""
            ),
            flush=True,
        )
    if args.out:
        json.dump({"model": args.model, "fps": args.fps, "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
