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
    data[at + 8 : at + 10] = struct.pack("<H", 50000)  # a compression scheme nobody implements
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
    "text": (uri(b"hello, this is plain text and not an image at all"), 400, "undecodable_image"),  # a file
    "words": ("a photo of a cat", 400, "text_input"),
    "words that are not base64": ("a photo of a cat!", 400, "text_input"),
    "pdf": (
        uri(b"%PDF-1.7\n1 0 obj <</Type /Catalog>> endobj\ntrailer <</Root 1 0 R>>\n%%EOF\n"),
        400,
        "undecodable_image",
    ),
    "truncated jpeg": (uri(encode(photo(200, 150, 1), "JPEG")[:600], "image/jpeg"), 400, "undecodable_image"),
    "truncated png": (uri(encode(photo(200, 150, 2), "PNG")[:900]), 400, "undecodable_image"),
    "invalid base64": ("!!!this is not base64###", 400, "invalid_base64"),
    "wrong media type": (uri(encode(photo(32, 32, 3), "PNG"), "text/plain"), 400, "invalid_media_type"),
    "missing media type": (
        "data:;base64," + base64.b64encode(encode(photo(32, 32, 3), "PNG")).decode(),
        400,
        "invalid_media_type",
    ),
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


def every_format() -> dict[str, bytes]:
    """Real files of every accepted format, in every mode and layout PIL writes them (the header readers' corpus)."""
    rgb, exif = photo(96, 64, 30), Image.Exif()
    exif[0x0112] = 6
    gray_palette = Image.new("P", (40, 30))
    gray_palette.putpalette([v for i in range(256) for v in (i, i, i)])
    files = {
        **{f"jpeg {mode}": encode(photo(80, 60, 31, mode), "JPEG") for mode in ("L", "RGB", "CMYK")},
        "jpeg progressive": encode(rgb, "JPEG", progressive=True, optimize=True),
        "jpeg 4:4:4 with exif and a comment": encode(rgb, "JPEG", subsampling=0, exif=exif.tobytes(), comment=b"hi"),
        "jpeg restart markers": encode(rgb, "JPEG", restart_marker_rows=1),
        "jpeg with a 200 KB ICC profile": encode(rgb, "JPEG", icc_profile=bytes(200_000)),
        "mpo": encode(rgb, "MPO", save_all=True, append_images=[photo(96, 64, 32)]),
        **{f"png {mode}": encode(photo(50, 40, 33, mode), "PNG") for mode in ("1", "L", "LA", "RGB", "RGBA", "P")},
        **{f"png {bits}-bit gray": encode(photo(50, 40, 34, "L"), "PNG", bits=bits) for bits in (2, 4)},
        "png 16-bit": sixteen_bit_png(),
        "png palette with transparency": palette_with_transparency(),
        "png gray with transparency": encode(photo(50, 40, 35, "L"), "PNG", transparency=7),
        "png rgb with transparency": encode(rgb, "PNG", transparency=(1, 2, 3)),
        "png optimized": encode(rgb, "PNG", optimize=True),
        "png with 100 KB of text before its data": encode(rgb, "PNG", pnginfo=_text_chunk(100_000)),
        "apng": encode(rgb, "PNG", save_all=True, append_images=[photo(96, 64, 36)]),
        "gif": encode(photo(64, 48, 37).convert("P"), "GIF"),
        "gif gray palette": encode(gray_palette, "GIF"),
        "gif L": encode(photo(64, 48, 45, "L"), "GIF"),
        "gif transparency": encode(photo(64, 48, 38).convert("P"), "GIF", transparency=0),
        "gif animated": animated("GIF"),
        "gif comment": encode(photo(64, 48, 39).convert("P"), "GIF", comment=b"x" * 600),
        **{f"bmp {mode}": encode(photo(50, 40, 40, mode), "BMP") for mode in ("1", "L", "P", "RGB", "RGBA")},
        "bmp gray palette": encode(gray_palette, "BMP"),
        **{
            f"tiff {mode}": encode(photo(48, 32, 41, mode), "TIFF")
            for mode in ("1", "L", "LA", "P", "RGB", "RGBA", "CMYK", "YCbCr", "I", "F")
        },
        "tiff I;16": encode(Image.fromarray(np.arange(48 * 32, dtype=np.uint16).reshape(32, 48)), "TIFF"),
        "tiff I;16B": encode(
            Image.fromarray(np.arange(48 * 32, dtype=np.uint16).reshape(32, 48)).convert("I;16B"), "TIFF"
        ),
        **{f"tiff {c}": encode(rgb, "TIFF", compression=c) for c in ("tiff_lzw", "tiff_deflate", "packbits", "jpeg")},
        "tiff group4": encode(photo(48, 32, 42, "1"), "TIFF", compression="group4"),
        "tiff rotated": encode(rgb, "TIFF", exif=exif),
        "tiff multi-page": encode(rgb, "TIFF", save_all=True, append_images=[photo(96, 64, 43)]),
        "bigtiff": encode(rgb, "TIFF", big_tiff=True),
        "webp lossy": encode(rgb, "WEBP", quality=80),
        "webp lossless alpha": encode(_with_alpha(photo(50, 40, 44)), "WEBP", lossless=True),
        "webp lossy alpha": encode(_with_alpha(photo(50, 40, 46)), "WEBP", quality=80),
        "webp animated": animated("WEBP"),
    }
    return files


def _text_chunk(size: int):
    from PIL import PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("comment", "x" * size)
    return info


def _with_alpha(image: Image.Image) -> Image.Image:
    rgba = image.convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize(image.size))
    return rgba


# --------------------------------------------------------------------------- hostile structures (issue 25)


def progressive_jpeg(side: int, scans: int, mode: str = "L") -> bytes:
    """A flat progressive JPEG whose last scan is repeated until it has `scans` (a scan bomb: every scan is a pass
    over every block, while a repeated refinement scan of a flat image is a few bytes)."""
    data = encode(Image.new(mode, (side, side), 128), "JPEG", progressive=True, quality=90)
    starts = [i for i in range(len(data) - 1) if data[i] == 0xFF and data[i + 1] == 0xDA]
    return data[:-2] + data[starts[-1] : -2] * (scans - len(starts)) + b"\xff\xd9"


def fill_before_jpeg(fill: int) -> bytes:
    """SOI, `fill` bytes of 0xFF (fill bytes: what PIL's header reader steps through one at a time), then a 16x16
    JPEG's segments."""
    return b"\xff\xd8" + b"\xff" * fill + encode(photo(16, 16, 50), "JPEG")[2:]


def png_chunk_flood(size: int) -> bytes:
    """A 16x16 PNG with `size` bytes of empty private chunks (valid CRCs) before its image data."""
    data = encode(photo(16, 16, 51), "PNG")
    at = data.index(b"IDAT") - 4
    return data[:at] + png_chunk(b"quIt", b"") * (size // 12) + data[at:]


def tiff_strip_flood(strips: int) -> bytes:
    """An uncompressed 16x16 gray TIFF whose StripOffsets array has `strips` entries (PIL makes a Python int and a
    tile of each)."""
    entries = [
        (256, 3, 1, 16),
        (257, 3, 1, 16),
        (258, 3, 1, 8),
        (259, 3, 1, 1),
        (262, 3, 1, 1),
        (273, 4, strips, None),
        (277, 3, 1, 1),
        (278, 3, 1, 1),
        (279, 4, 1, 256),
    ]
    array = 8 + 2 + 12 * len(entries) + 4  # where the StripOffsets array starts, after the IFD
    ifd = struct.pack("<H", len(entries))
    for tag, kind, count, value in entries:
        ifd += struct.pack("<HHI", tag, kind, count) + (
            struct.pack("<I", array)
            if value is None
            else struct.pack("<HH", value, 0)
            if kind == 3
            else struct.pack("<I", value)
        )
    offsets = np.full(strips, array + 4 * strips, "<u4").tobytes()  # every strip: the 256 pixels after the array
    return b"II*\x00" + struct.pack("<I", 8) + ifd + bytes(4) + offsets + bytes(256)
