"""Test videos made with PyAV from the repository's real photos (examples/): a camera panning and zooming across a
photo, encoded in the codec, container and frame rate asked for. Nothing downloads; each call builds its bytes."""

from __future__ import annotations

import fractions
import io
from pathlib import Path

import numpy as np
from PIL import Image

PHOTOS = Path(__file__).resolve().parent.parent / "examples"


def frames_of(photo: str, count: int, width: int, height: int) -> list[np.ndarray]:
    """`count` RGB frames of width x height: a window sliding and shrinking across the photo."""
    image = Image.open(PHOTOS / photo).convert("RGB")
    w, h = image.size
    out = []
    for i in range(count):
        s = i / max(count - 1, 1)
        cw, ch = int(w * (0.9 - 0.3 * s)), int(h * (0.9 - 0.3 * s))
        x, y = int((w - cw) * s), int((h - ch) * (1 - s) * 0.5)
        out.append(np.asarray(image.crop((x, y, x + cw, y + ch)).resize((width, height), Image.BILINEAR)))
    return out


def make_video(count: int = 24, fps: float = 12, width: int = 160, height: int = 120, codec: str = "h264",
               container: str = "mp4", photo: str = "sample.jpg", rates: list[int] | None = None) -> bytes:
    """An encoded video of `count` frames. `rates`: per-frame durations in 1/1000 s (a variable frame rate)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        rate = fractions.Fraction(fps).limit_denominator(1001)
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        if rates is not None:
            stream.time_base = fractions.Fraction(1, 1000)
        pts = 0
        for i, array in enumerate(frames_of(photo, count, width, height)):
            frame = av.VideoFrame.from_ndarray(array, format="rgb24")
            if rates is not None:
                frame.pts, frame.time_base = pts, fractions.Fraction(1, 1000)
                pts += rates[i % len(rates)]
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()
