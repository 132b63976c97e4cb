"""The bad-input corpus: every case made here, deterministically, from a few lines each (no binary blobs)."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def photo(w: int, h: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(1, h // 8), max(1, w // 8), 3), dtype=np.uint8)
    return Image.fromarray(small).resize((w, h), Image.BILINEAR).convert(mode)


def uri(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def bomb_png(side: int = 100_000) -> bytes:
    """A tiny file declaring side x side pixels (a decompression bomb if anyone decoded it)."""
    header = png_chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + header + png_chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + png_chunk(b"IEND", b"")


def tiff_with_unknown_compression() -> bytes:
    data = bytearray(encode(photo(32, 32, 5), "TIFF", compression="tiff_deflate"))
    entry = struct.pack("<HHI", 259, 3, 1)  # tag Compression, type SHORT, count 1
    at = data.index(entry)
    data[at + 8:at + 10] = struct.pack("<H", 50000)  # a compression scheme nobody implements
    return bytes(data)


def exif_rotated_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    return encode(photo(96, 64, 6), "JPEG", quality=95, exif=exif.tobytes())


def animated(fmt: str) -> bytes:
    frames = [photo(64, 48, 10 + i) for i in range(3)]
    return encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=50, loop=0)


def palette_with_transparency() -> bytes:
    img = photo(80, 60, 7).convert("P", palette=Image.ADAPTIVE, colors=16)
    return encode(img, "PNG", transparency=3)


def sixteen_bit_png() -> bytes:
    g = (np.arange(64 * 48).reshape(48, 64) * 7 % 1024).astype(np.uint16)
    return encode(Image.fromarray(g), "PNG")


# name -> (bytes or data-URI text, expected status, expected error code)
INVALID_IMAGES = {
    "zero bytes": ("data:image/png;base64,", 400, "invalid_image"),
    "text": (uri(b"hello, this is plain text and not an image at all"), 400, "undecodable_image"),
    "pdf": (uri(b"%PDF-1.7\n1 0 obj <</Type /Catalog>> endobj\ntrailer <</Root 1 0 R>>\n%%EOF\n"), 400,
            "undecodable_image"),
    "truncated jpeg": (uri(encode(photo(200, 150, 1), "JPEG")[:600], "image/jpeg"), 400, "undecodable_image"),
    "truncated png": (uri(encode(photo(200, 150, 2), "PNG")[:900]), 400, "undecodable_image"),
    "invalid base64": ("!!!this is not base64###", 400, "invalid_base64"),
    "wrong media type": (uri(encode(photo(32, 32, 3), "PNG"), "text/plain"), 400, "invalid_media_type"),
    "missing media type": ("data:;base64," + base64.b64encode(encode(photo(32, 32, 3), "PNG")).decode(), 400,
                           "invalid_media_type"),
    "decompression bomb": (uri(bomb_png()), 413, "image_too_large"),
    "aspect ratio 300:1": (uri(encode(photo(600, 2, 4), "PNG")), 400, "bad_aspect_ratio"),
    "undecodable tiff compression": (uri(tiff_with_unknown_compression(), "image/tiff"), 400, "undecodable_image"),
}

VALID_IMAGES = {
    "1x1": encode(photo(1, 1, 20), "PNG"),
    "2x2": encode(photo(2, 2, 21), "PNG"),
    "cmyk jpeg": encode(photo(120, 90, 22, "CMYK"), "JPEG", quality=95),
    "16-bit png": sixteen_bit_png(),
    "palette with transparency": palette_with_transparency(),
    "grayscale with alpha": encode(photo(70, 50, 23, "LA"), "PNG"),
    "animated gif": animated("GIF"),
    "animated webp": animated("WEBP"),
    "multi-page tiff": encode(photo(64, 64, 24), "TIFF", save_all=True, append_images=[photo(64, 64, 25)]),
    "exif-rotated jpeg": exif_rotated_jpeg(),
}
