"""What a decode worker process runs: decode (+ resize), the pixels into a spool file. It imports numpy, PIL and the
preprocessing only, never the engine or torch (which would cost each worker ~150 MB and seconds at its first image)."""

from __future__ import annotations

import time

import numpy as np

from ..encoder.preprocess import EncodedJpeg, PreprocessConfig, decode_base64, load_for_device, load_image, resize_rgb

from . import spool


def decode_and_resize(data, is_base64: bool, max_image_pixels: int, cfg: PreprocessConfig,
                      spool_prefix: str | None = None, fast: bool = False,
                      jpeg_on_device: bool = False) -> tuple[np.ndarray | spool.Spooled | EncodedJpeg, float]:
    """Runs in a worker: encoded bytes (or their base64 text) -> the resized (H, W, 3) uint8 image, in a spool file
    when `spool_prefix` is given and it can, and the seconds it took. `fast` (preprocess_fast): the device resizes,
    so the image stays full size, and with `jpeg_on_device` a JPEG stays encoded (an EncodedJpeg, read from its
    header only) for nvJPEG to decode there."""
    start = time.perf_counter()
    if is_base64:
        data = decode_base64(data)
    if fast:
        image = load_for_device(data, jpeg_on_device, max_image_pixels)
        if isinstance(image, EncodedJpeg):
            return image, time.perf_counter() - start
    else:
        image = resize_rgb(load_image(data, max_image_pixels=max_image_pixels), cfg)
    seconds = time.perf_counter() - start
    return (spool_prefix and spool.put(spool_prefix, image)) or image, seconds
