"""Image headers, read by walking each format's structure with bounded steps, never with PIL's pure-Python readers
(which step through what they skip: a JPEG's fill bytes two reads at a time, a PNG's chunks one by one, every TIFF tag
as Python values, and take seconds or gigabytes on crafted files).

`probe` reads an image's header (format, size, mode, transparency: what PIL would read) and where the image ends. On
a server's event loop it looks at the first bytes only, in at most `PROBE_STEPS` steps (microseconds whatever the
bytes hold), and says `HeaderNotFound` where the header is not within them; in a decode worker it walks the whole
image and enforces the structural limits below, so that PIL and libjpeg never read a file no encoder writes.
"""

from __future__ import annotations

import dataclasses
import io
import re
import struct

import numpy as np
from PIL import TiffImagePlugin

from .image_errors import HeaderNotFound, UndecodableImage, UnsupportedFormat
from .preprocess import ALLOWED_FORMATS, check_aspect_ratio, check_size, open_header


@dataclasses.dataclass(frozen=True)
class ImageHeader:
    """What an encoded image's header declares, read without decoding its pixels, and where the image ends (`end`:
    its length in bytes, where the walk saw its end marker or a declared size; None where it did not)."""

    format: str
    width: int
    height: int
    mode: str
    transparency: bool
    end: int | None = dataclasses.field(default=None, compare=False)

    @property
    def decode_bytes(self) -> int:
        """An upper estimate of the memory that decoding and converting it to RGB takes (PIL keeps every pixel of a
        multi-band image in 4 bytes): the decoded image, then for transparency its RGBA copy, a white background and
        the composite, else one RGB copy, plus one more for the EXIF rotation."""
        decoded = 1 if self.mode in ("1", "L", "P") else 2 if self.mode == "I;16" else 4
        conversions = 3 if self.transparency or "A" in self.mode else 1
        return self.width * self.height * (decoded + 4 * (conversions + 1))

    def check(self, max_image_pixels: int) -> None:
        """What `load_image` refuses from the header alone: too many pixels (ImageTooLarge), a bad aspect ratio."""
        check_size(self.width, self.height, max_image_pixels)
        check_aspect_ratio(self.height, self.width)


# --------------------------------------------------------------------------- header readers
#
# One walk per format over an encoded image's structure: it reads the header PIL would (the same format, size,
# mode and transparency), finds where the image ends, and enforces the structural limits below. Segments and chunks
# are skipped by their lengths and junk by C-speed searches, never a Python loop per byte: on a server's event loop
# the walk reads a bounded prefix in a bounded number of steps (PROBE_STEPS), whatever the bytes;
# in a decode worker it walks the whole image before PIL sees it.

PROBE_STEPS = 256  # blocks (segments, chunks, sub-blocks, junk runs) a bounded probe walks: ~0.4 ms at most
WALK_STEPS = 1 << 17  # ... and a decode worker's walk over a whole image (~50 ms): above every cap below
MAX_JUNK_BYTES = 4096  # between two JPEG markers or GIF blocks: decoders skip them, PIL's readers a byte at a time
MAX_JPEG_MARKERS = 1000  # segments and markers of a JPEG (a photo has 10-40; an ICC profile at most 255 APP2s)
MAX_JPEG_SCANS = 100  # libjpeg's progressive script has 10 (18 for CMYK); mozjpeg picks among 64 (docs/decisions.md)
MAX_SCAN_PIXELS = 1_000_000_000  # scans x pixels: libjpeg runs every scan over every block (~2 ns a pixel)
MAX_PNG_CHUNKS_BEFORE_DATA = 1000  # PIL reads each chunk before the image data in Python
MAX_PNG_CHUNKS = 1 << 16  # ... and each one after it (65536 IDATs of libpng's 8 KB are 512 MB)
MAX_TIFF_ENTRIES = 1024  # in the first IFD (a TIFF has 10-60 tags; PIL reads each in Python)
_TIFF_ARRAY = 3 << 16  # numbers in a tag that is no strip or tile array: a 16-bit ColorMap


class _Stop(Exception):
    """The walk ran out of bytes ("truncated") or of steps."""


class _Walk:
    """Where a walk over `data` stands: the header once read, the end once seen, the steps left."""

    __slots__ = ("data", "n", "steps", "header", "end")

    def __init__(self, data: bytes, steps: int):
        self.data, self.n, self.steps = data, len(data), steps
        self.header: ImageHeader | None = None
        self.end: int | None = None

    def step(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise _Stop("too many blocks before the image header")

    def need(self, end: int) -> None:
        if end > self.n:
            raise _Stop("truncated")

    def junk(self, skipped: int, where: str) -> None:
        if skipped > MAX_JUNK_BYTES:
            raise UndecodableImage(f"{skipped} bytes of junk {where}")


def _refuse(fmt: str, why: str) -> UndecodableImage:
    return UndecodableImage(f"not a valid {fmt} image ({why})")


_JPEG_SOF = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))  # as PIL
_JPEG_SEGMENTS = _JPEG_SOF | {0xC4, 0xCC, 0xDA, 0xDB, 0xDC, 0xDD, 0xFE, *range(0xE0, 0xF0)}  # with a length
_JPEG_LONE = frozenset((0x01, *range(0xD0, 0xD8)))  # TEM, RSTn: no length
_JPEG_MODES = {1: "L", 3: "RGB", 4: "CMYK"}
_SCAN_END = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")  # in entropy-coded data 0xFF is stuffed as FF00; RSTn sit there


def _jpeg(walk: _Walk) -> None:
    """Markers as libjpeg reads them: junk and fill bytes before a marker skipped, segments by their lengths, each
    scan's entropy-coded data by a search for the marker after it, up to the end-of-image marker."""
    data, pos, markers, scans = walk.data, 2, 0, 0
    while True:
        walk.step()
        markers += 1
        if markers > MAX_JPEG_MARKERS:
            raise _refuse("JPEG", f"more than {MAX_JPEG_MARKERS} markers")
        start, stop = pos, min(walk.n, pos + MAX_JUNK_BYTES + 2)  # no search looks further than the junk allowed
        if pos < stop and data[pos] != 0xFF:
            pos = data.find(b"\xff", pos, stop)
            pos = stop if pos < 0 else pos
        found = pos + 1 + len(data[pos + 1 : stop]) - len(data[pos + 1 : stop].lstrip(b"\xff")) if pos < stop else stop
        walk.junk(found - start - 1, "between JPEG markers")
        if found >= walk.n:
            raise _Stop("truncated")
        code, pos = data[found], found + 1
        if code == 0xD9:
            walk.end = pos
            return
        if code == 0x00 or code in _JPEG_LONE:  # FF00 before a marker is junk to libjpeg
            continue
        if code not in _JPEG_SEGMENTS:  # a second SOI, DHP, EXP, JPGn, reserved: libjpeg refuses them
            raise _refuse("JPEG", f"marker 0xFF{code:02X}")
        walk.need(pos + 2)
        length = data[pos] << 8 | data[pos + 1]
        if length < 2:
            raise _refuse("JPEG", "segment length under 2")
        if code in _JPEG_SOF:
            if walk.header is not None:
                raise _refuse("JPEG", "two frame headers")
            walk.need(pos + length)
            frame = data[pos + 2 : pos + length]
            if len(frame) < 6 or frame[0] != 8 or frame[5] not in _JPEG_MODES:  # as PIL's SOF handler
                raise _refuse("JPEG", "a frame PIL cannot read")
            walk.header = ImageHeader(
                "JPEG", frame[3] << 8 | frame[4], frame[1] << 8 | frame[2], _JPEG_MODES[frame[5]], False
            )
        elif code == 0xDA:
            if walk.header is None:
                raise _refuse("JPEG", "a scan before the frame header")
            scans += 1
            pixels = walk.header.width * walk.header.height
            if scans > MAX_JPEG_SCANS or scans * pixels > MAX_SCAN_PIXELS:
                raise _refuse("JPEG", f"more than {scans - 1} scans of {pixels} pixels")
            scan_end = _SCAN_END.search(data, pos + length)
            if scan_end is None:
                raise _Stop("truncated")
            pos = scan_end.start()
            continue
        pos += length


_PNG_MODES = {
    (1, 0): "1",
    (2, 0): "L",
    (4, 0): "L",
    (8, 0): "L",
    (16, 0): "I;16",
    (8, 2): "RGB",
    (16, 2): "RGB",
    (1, 3): "P",
    (2, 3): "P",
    (4, 3): "P",
    (8, 3): "P",
    (8, 4): "LA",
    (16, 4): "RGBA",
    (8, 6): "RGBA",
    (16, 6): "RGBA",
}  # (bit depth, colour type) -> PIL's mode


def _png(walk: _Walk) -> None:
    """IHDR at byte 8, chunks by their lengths: a tRNS before the image data makes it transparent; IEND ends it."""
    data = walk.data
    walk.need(33)
    if data[12:16] != b"IHDR" or int.from_bytes(data[8:12], "big") < 13:
        raise _refuse("PNG", "no IHDR chunk first")
    mode = _PNG_MODES.get((data[24], data[25]))
    if mode is None or data[27]:  # PIL: an unknown mode, an unknown filter method
        raise _refuse("PNG", f"bit depth {data[24]} with colour type {data[25]}")
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    transparency, pos, chunks = "A" in mode, 8, 0
    while True:
        walk.step()
        chunks += 1
        if chunks > (MAX_PNG_CHUNKS if walk.header else MAX_PNG_CHUNKS_BEFORE_DATA):
            raise _refuse("PNG", f"more than {chunks - 1} chunks" + ("" if walk.header else " before the image data"))
        walk.need(pos + 8)
        kind = data[pos + 4 : pos + 8]
        if kind == b"IDAT" and walk.header is None:
            walk.header = ImageHeader("PNG", width, height, mode, transparency)
        elif kind == b"tRNS" and walk.header is None:
            transparency = True
        elif kind == b"IEND":
            walk.end = pos + 12
            return
        pos += 12 + int.from_bytes(data[pos : pos + 4], "big")


_GRAY_RAMP = bytes(range(256)) * 256  # palette entry i is gray i (BMP: modulo 256, as PIL compares them)
_GIF_GRAY = bytes(v for i in range(256) for v in (i, i, i))
_GIF_BLOCK = re.compile(rb"[!,;]")


def _gif_blocks(walk: _Walk, pos: int) -> int:
    """Past a chain of data sub-blocks (a length byte each, a zero length ends it)."""
    data = walk.data
    while True:
        walk.step()
        walk.need(pos + 1)
        size = data[pos]
        pos += 1 + size
        if not size:
            return pos


def _gif(walk: _Walk) -> None:
    """The logical screen, then blocks as PIL reads them up to the first image (a graphic control extension's
    transparency, the image's extent and colour table: "L" where the table is the gray ramp, as PIL), then on to the
    trailer."""
    data = walk.data
    walk.need(13)
    width, height, flags, pos = data[6] | data[7] << 8, data[8] | data[9] << 8, data[10], 13
    shaded = False  # a global colour table that is not the gray ramp
    if flags & 0x80:
        size = 3 << ((flags & 7) + 1)
        walk.need(pos + size)
        shaded, pos = data[pos : pos + size] != _GIF_GRAY[:size], pos + size
    transparency = False
    while True:
        walk.step()
        walk.need(pos + 1)
        if data[pos] not in b"!,;":  # PIL skips other bytes, one at a time
            found = _GIF_BLOCK.search(data, pos, pos + MAX_JUNK_BYTES + 1)
            walk.junk((found.start() if found else min(walk.n, pos + MAX_JUNK_BYTES + 1)) - pos, "between GIF blocks")
            if found is None:
                raise _Stop("truncated")
            pos = found.start()
        block = data[pos]
        if block == 0x3B:
            walk.end = pos + 1
            return
        if block == 0x21:
            walk.need(pos + 4)
            if data[pos + 1] == 0xF9 and data[pos + 2] and data[pos + 3] & 1 and walk.header is None:
                transparency = True
            pos = _gif_blocks(walk, pos + 2)
            continue
        walk.need(pos + 10)
        x0, y0, w, h = struct.unpack_from("<4H", data, pos + 1)
        local, pos = data[pos + 9], pos + 10
        if local & 0x80:
            size = 3 << ((local & 7) + 1)
            walk.need(pos + size)
            shaded, pos = data[pos : pos + size] != _GIF_GRAY[:size], pos + size
        if walk.header is None:
            walk.header = ImageHeader(
                "GIF", max(width, x0 + w), max(height, y0 + h), "P" if shaded else "L", transparency
            )
        pos = _gif_blocks(walk, pos + 1)  # after the LZW code size


_BMP_BITFIELDS = {  # (bits, masks) -> PIL's mode
    (32, (0xFF0000, 0xFF00, 0xFF, 0x0)): "RGB",
    (32, (0xFF000000, 0xFF0000, 0xFF00, 0x0)): "RGB",
    (32, (0xFF000000, 0xFF00, 0xFF, 0x0)): "RGB",
    (32, (0xFF000000, 0xFF0000, 0xFF00, 0xFF)): "RGBA",
    (32, (0xFF, 0xFF00, 0xFF0000, 0xFF000000)): "RGBA",
    (32, (0xFF0000, 0xFF00, 0xFF, 0xFF000000)): "RGBA",
    (32, (0xFF000000, 0xFF00, 0xFF, 0xFF0000)): "RGBA",
    (32, (0x0, 0x0, 0x0, 0x0)): "RGBA",
    (24, (0xFF0000, 0xFF00, 0xFF)): "RGB",
    (16, (0xF800, 0x7E0, 0x1F)): "RGB",
    (16, (0x7C00, 0x3E0, 0x1F)): "RGB",
}
_BMP_MODES = {1: "P", 4: "P", 8: "P", 16: "RGB", 24: "RGB", 32: "RGB"}


def _bmp(walk: _Walk) -> None:
    """The info header as PIL's BMP reader reads it (a palette of grays makes it "1" or "L"); the file size, where it
    holds the pixel data, is its end."""
    data = walk.data
    walk.need(18)
    size = int.from_bytes(data[14:18], "little")
    walk.need(14 + size)
    masks: tuple[int, ...]
    info, pos, masks = data[18 : 14 + size], 14 + size, ()
    if size == 12:
        width, height, _, bits = struct.unpack_from("<4H", info)
        compression, colors, padding, data_size = 0, 0, 3, 0
    elif size in (40, 52, 56, 64, 108, 124):
        width, height, _, bits, compression, data_size, _, _, colors = struct.unpack_from("<2I2H5I", info)
        if info[7] == 0xFF:  # top-down rows
            height = 2**32 - height
        padding = 4
        if compression == 3:  # BITFIELDS
            if len(info) >= 48:
                masks = struct.unpack_from("<4I" if len(info) >= 52 else "<3I", info, 36)
            else:
                walk.need(pos + 12)
                masks, pos = struct.unpack_from("<3I", data, pos), pos + 12
            masks = (*masks, 0)[:4]
    else:
        raise _refuse("BMP", f"header size {size}")
    mode = _BMP_MODES.get(bits)
    if mode is None:
        raise _refuse("BMP", f"{bits} bits a pixel")
    if compression == 3:
        mode = _BMP_BITFIELDS.get((32, masks)) if bits == 32 else _BMP_BITFIELDS.get((bits, masks[:3]))
        if mode is None:
            raise _refuse("BMP", "a bitfields layout PIL cannot read")
    elif compression not in (0, 1, 2):
        raise _refuse("BMP", f"compression {compression}")
    if mode == "P":
        colors = colors or 1 << bits
        if not 0 < colors <= 65536:
            raise _refuse("BMP", f"{colors} palette colours")
        palette = data[pos : pos + padding * colors]
        if len(palette) < padding * colors and pos + padding * colors > walk.n:
            walk.need(pos + padding * colors)
        gray = b"\x00\xff" if colors == 2 else _GRAY_RAMP[:colors]
        if len(palette) == padding * colors and all(palette[i::padding] == gray for i in range(3)):
            mode = "1" if colors <= 2 else "L"
    walk.header = ImageHeader("BMP", width, height, mode, "A" in mode)
    file_size, offset = int.from_bytes(data[2:6], "little"), int.from_bytes(data[10:14], "little")
    pixels = data_size if compression in (1, 2) else ((width * bits + 31) >> 3 & ~3) * height
    if offset and compression in (0, 3) and file_size >= offset + pixels:
        walk.end = file_size


def _webp(walk: _Walk) -> None:
    """The canvas size and alpha from the first chunk (PIL reads WebP only whole); the RIFF size is its end, as
    libwebp reads it."""
    walk.need(30)
    data = walk.data
    chunk = data[12:16]
    if chunk == b"VP8X":
        alpha = bool(data[20] & 0x10)
        width, height = 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
    elif chunk == b"VP8L" and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        width, height, alpha = 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF), bool(bits >> 28 & 1)
    elif chunk == b"VP8 ":
        width, height, alpha = (
            int.from_bytes(data[26:28], "little") & 0x3FFF,
            int.from_bytes(data[28:30], "little") & 0x3FFF,
            False,
        )
    else:
        raise _refuse("WebP", f"first chunk {bytes(chunk)!r}")
    walk.header = ImageHeader("WEBP", width, height, "RGBA" if alpha else "RGB", alpha)
    walk.end = 8 + int.from_bytes(data[4:8], "little")


_TIFF_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4, 16: 8, 17: 8, 18: 8}
_TIFF_INTS = {3: "H", 4: "L", 8: "h", 9: "l", 13: "L", 16: "Q", 17: "q", 18: "Q"}
_TIFF_TEXT = (1, 2, 7)  # BYTE, ASCII, UNDEFINED: PIL keeps them as bytes; every other type becomes Python numbers
_TIFF_READ = (256, 257, 258, 259, 262, 266, 274, 277, 284, 338, 339, 0xBC01)  # the tags PIL's mode comes from


def _tiff(walk: _Walk) -> None:
    """The first IFD's entries (one numpy view, whatever their number), the few tags PIL's mode comes from read as
    PIL reads them, and every number array bounded by what an image of its size could need (PIL would load them all
    as Python ints: 3 M StripOffsets are a gigabyte)."""
    data = walk.data
    order, big = "<" if data[:2] == b"II" else ">", data[2] == 43
    walk.need(16 if big else 8)
    ifd = struct.unpack_from(order + ("Q" if big else "L"), data, 8 if big else 4)[0]
    walk.need(ifd + (8 if big else 2))
    count = struct.unpack_from(order + ("Q" if big else "H"), data, ifd)[0]
    if count > MAX_TIFF_ENTRIES:
        raise _refuse("TIFF", f"{count} tags")
    start, size = ifd + (8 if big else 2), 20 if big else 12
    walk.need(start + count * size)
    entries = np.frombuffer(
        data,
        np.dtype(
            [
                ("tag", order + "u2"),
                ("type", order + "u2"),
                ("count", order + ("u8" if big else "u4")),
                ("value", f"V{8 if big else 4}"),
            ]
        ),
        count,
        start,
    )
    read = entries[np.isin(entries["tag"], _TIFF_READ)]
    fields = {int(e["tag"]): (int(e["type"]), int(e["count"]), e["value"].tobytes()) for e in read}

    def get(tag, default=None, scalar=True):
        if tag not in fields:
            return default
        kind, n, value = fields[tag]
        if kind not in _TIFF_INTS or scalar and n != 1:
            raise _refuse("TIFF", f"tag {tag} of type {kind} and count {n}")
        length = _TIFF_SIZES[kind] * n
        if length > len(value):
            at = struct.unpack(order + ("Q" if big else "L"), value)[0]
            walk.need(at + length)
            value = data[at : at + length]
        numbers = struct.unpack_from(f"{order}{n}{_TIFF_INTS[kind]}", value)
        return numbers[0] if scalar else numbers

    if 0xBC01 in fields:
        raise _refuse("TIFF", "Windows Media Photo")
    compression = TiffImagePlugin.COMPRESSION_INFO.get(get(259, 1))
    if compression is None:
        raise _refuse("TIFF", f"compression {get(259)}")
    width, height = get(256), get(257)
    if width is None or height is None:
        raise _refuse("TIFF", "no size")
    planar, photo, fill = get(284, 1), 6 if compression == "tiff_jpeg" else get(262, 0), get(266, 1)
    planes = get(277, 3 if compression == "tiff_jpeg" and photo in (2, 6) else 1)
    if planes > TiffImagePlugin.MAX_SAMPLESPERPIXEL:
        raise _refuse("TIFF", f"{planes} samples a pixel")
    need = max(_TIFF_ARRAY, planes * max(height, -(-width // 16) * -(-height // 16)))
    numbers = (entries["count"] > need) & ~np.isin(entries["type"], _TIFF_TEXT)
    if numbers.any():
        tag = entries[numbers][0]
        raise _refuse("TIFF", f"{int(tag['count'])} numbers in tag {int(tag['tag'])}, for {width}x{height} pixels")
    # PIL's _setup: the key of its OPEN_INFO table
    sample_format = get(339, (1,), scalar=False)
    if len(sample_format) > 1 and max(sample_format) == min(sample_format):
        sample_format = sample_format[:1]
    bits, extra = get(258, (1,), scalar=False), get(338, (), scalar=False)
    if planar == 2 and extra and max(extra) == 0:
        bits, planes, extra = bits[: -len(extra)], planes - len(extra), ()
    if planes < len(bits):
        bits = bits[:planes]
    elif planes > len(bits) == 1:
        bits *= planes
    key = (data[:2], photo, sample_format, fill, bits, extra)
    if len(bits) != planes or key not in TiffImagePlugin.OPEN_INFO:
        raise _refuse("TIFF", "a pixel layout PIL cannot read")
    mode = TiffImagePlugin.OPEN_INFO[key][0]
    if compression != "raw":  # read by libtiff
        mode = "RGB" if photo == 6 else TiffImagePlugin.OPEN_INFO[key[:3] + (1,) + key[4:]][0] if fill == 2 else mode
    if get(274) in (5, 6, 7, 8):  # PIL gives a rotated TIFF's size upright
        width, height = height, width
    walk.header = ImageHeader("TIFF", width, height, mode, "A" in mode)


_READERS = (
    (b"\xff\xd8\xff", "JPEG", _jpeg),
    (b"\x89PNG\r\n\x1a\n", "PNG", _png),
    (b"GIF87a", "GIF", _gif),
    (b"GIF89a", "GIF", _gif),
    (b"BM", "BMP", _bmp),
    *((prefix, "TIFF", _tiff) for prefix in TiffImagePlugin.PREFIXES),
)


def _reader(data: bytes):
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP" and data[12:16] in (b"VP8 ", b"VP8L", b"VP8X"):
        return "WEBP", _webp
    return next(((fmt, read) for prefix, fmt, read in _READERS if data.startswith(prefix)), (None, None))


def probe(data: bytes, formats: tuple[str, ...] | None = ALLOWED_FORMATS, whole: bool = False) -> ImageHeader:
    """The header of an encoded image in one of `formats` (UnsupportedFormat otherwise), and where it ends, by the
    format's walk (never PIL's pure-Python readers, which take seconds on crafted files).

    `whole=False`: `data` is the first bytes of the image, read on an event loop: the walk stops after PROBE_STEPS
    steps, and raises HeaderNotFound where the header is not within them or `data`, or the format is not one read
    here (the whole image is then probed off the loop). `whole=True`: `data` is all of the image, in a decode worker:
    the walk goes on to its end and enforces the structural limits (JPEG scans and markers, PNG chunks, TIFF arrays,
    junk between blocks) so that PIL never reads such a file; a format read here by no walk is identified by PIL
    (UnsupportedFormat names it)."""
    if not data:
        raise UndecodableImage("image data is empty (0 bytes)")
    fmt, read = _reader(data)
    if fmt is None:
        if not whole:
            raise HeaderNotFound("not a format the probe reads")
        with open_header(io.BytesIO(data), f"{len(data)} bytes of data", formats) as img:
            transparency = "transparency" in img.info or "A" in img.getbands()
            return ImageHeader(img.format, img.width, img.height, img.mode, transparency)
    if formats is not None and fmt not in formats:
        raise UnsupportedFormat(f"{fmt} images are not accepted; send one of {', '.join(formats)}")
    walk = _Walk(data, WALK_STEPS if whole else PROBE_STEPS)
    try:
        read(walk)
    except _Stop as stop:
        if walk.header is None:
            if not whole:
                raise HeaderNotFound(f"no {fmt} header within {len(data)} bytes") from None
            raise _refuse(fmt, str(stop)) from None
    except (struct.error, IndexError):  # a field that is not there
        raise _refuse(fmt, "a malformed header") from None
    header = walk.header
    if header is None:  # the walk ended before any header: a JPEG's end of image, a GIF's trailer
        if not whole:
            raise HeaderNotFound(f"no {fmt} header within {len(data)} bytes")
        raise _refuse(fmt, "no image header")
    if header.width <= 0 or header.height <= 0:
        raise UndecodableImage(f"image has an empty size ({header.width}x{header.height})")
    return dataclasses.replace(header, end=walk.end)
