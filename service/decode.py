"""What a decode worker process runs: decode (+ resize), the pixels into a spool file; and the header of an image
whose first bytes do not hold it. It imports numpy, PIL and the preprocessing only, never the engine or torch (which
would cost each worker ~150 MB and seconds at its first image)."""

from __future__ import annotations

import time

import numpy as np

from ..encoder.headers import ImageHeader, probe
from ..encoder.preprocess import EncodedJpeg, PreprocessConfig, decode_base64, load_for_device, load_image, resize_rgb

from . import spool


def read_header(data, is_base64: bool) -> ImageHeader:
    """Runs in a worker: the header of an image from all of its bytes (its first ones did not hold it), by the
    format's walk over the whole image (PIL's identification for a format no walk reads)."""
    return probe(decode_base64(data) if is_base64 else bytes(data), whole=True)


def decode_and_resize(data, is_base64: bool, max_image_pixels: int, cfg: PreprocessConfig,
                      spool_prefix: str | None = None, fast: bool = False,
                      jpeg_on_device: bool = False) -> tuple[np.ndarray | spool.Spooled | EncodedJpeg, float]:
    """Runs in a worker: encoded bytes (or their base64 text) -> the resized (H, W, 3) uint8 image, in a spool file
    when `spool_prefix` is given and it can, and the seconds it took. Before PIL reads it, the image's structure is
    walked whole (`probe`): what breaks its limits (a JPEG's scans, a PNG's chunks, a TIFF's arrays, its declared
    size) is refused, and the bytes after its end (a phone's motion video, junk) are left out. `fast`
    (preprocess_fast): the device resizes, so the image stays full size, and with `jpeg_on_device` a JPEG stays
    encoded (an EncodedJpeg, read from its header only) for nvJPEG to decode there."""
    start = time.perf_counter()
    data = decode_base64(data) if is_base64 else bytes(data)
    header = probe(data, whole=True)
    header.check(max_image_pixels)
    if header.end is not None and header.end < len(data):
        data = data[:header.end]
    if fast:
        image = load_for_device(data, jpeg_on_device, max_image_pixels)
        if isinstance(image, EncodedJpeg):
            return image, time.perf_counter() - start
    else:
        image = resize_rgb(load_image(data, max_image_pixels=max_image_pixels), cfg)
    seconds = time.perf_counter() - start
    return (spool_prefix and spool.put(spool_prefix, image)) or image, seconds
