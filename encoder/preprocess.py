"""Image decoding and Qwen-VL image preprocessing.

This module reproduces, without importing ``transformers``, what
``transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil``
does to a PIL image (``convert_to_rgb`` -> ``smart_resize`` + PIL bicubic resize ->
``rescale`` -> ``normalize`` -> ``patchify``), plus the hardened decoding a network
service needs in front of it (typed errors, decompression-bomb guard, EXIF
orientation, animated images, truncated files, 16-bit images as transformers converts them).

Two steps, kept apart because they run in different places:

* decode: ``load_image`` (bytes or path -> validated RGB image) then ``resize_rgb``
  (-> uint8 ``(H, W, 3)``, sides multiples of the patch size). The server runs this
  in its decode workers, with no torch imported.
* normalize + patchify: uint8 pixels -> float32 patch rows, through ``normalize_lut``.
  ``preprocess`` / ``preprocess_image`` do it on the host in transformers' processor
  layout (decoding first what is not yet an image); the runner does the same
  arithmetic on the device (``runner.GraphRunner.launch_images``).

Fidelity to transformers (PIL backend, transformers 5.x):

* ``convert_to_rgb``: images with an alpha band or palette/tRNS transparency are
  converted to RGBA and alpha-composited on an opaque white background, everything
  else goes through ``Image.convert("RGB")``.
* resize: ``Image.resize((w, h), resample=BICUBIC)`` on the uint8 RGB image -- the
  PIL backend converts its uint8 array back to a PIL image and calls exactly this.
  When the target size equals the input size PIL returns an unfiltered copy, so we
  skip the call.
* rescale/normalize: transformers computes ``float32(float64(x) * (1/255))`` and
  then ``(x - mean32) / std32`` in float32.  Because the input is uint8 the result
  per channel is a function of 256 possible values, so we evaluate exactly that
  arithmetic once into a (3, 256) float32 lookup table and gather from it: the
  output is bit-identical to transformers, with no per-pixel float64 temporaries.
* patchify: rows in merge-block order ``(gh/m, gw/m, m, m)``, each row laid out as
  ``(C, T, p, p)`` with the single frame repeated ``T`` times.

Everything runs per request in a server, so the pixel path is vectorized numpy
(reshape/transpose views + LUT gathers, processed in cache-sized stripes) and never
loops over pixels or patches in Python; ``preprocess`` writes every image straight
into one preallocated output buffer instead of concatenating.
"""

from __future__ import annotations

import binascii
import dataclasses
import functools
import io
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np
import pybase64
from PIL import Image, ImageOps, TiffImagePlugin

from .config import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

if TYPE_CHECKING:
    import torch

__all__ = [
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "ImageError",
    "UndecodableImage",
    "ImageTooLarge",
    "BadAspectRatio",
    "PreprocessConfig",
    "smart_resize",
    "load_image",
    "preprocess_image",
    "preprocess",
]

MAX_ASPECT_RATIO = 200
EXIF_ORIENTATION = 0x0112
# exact: transformers' PIL processor, bit for bit, on the host (this module); fast: its torchvision processor, on the
# model's device (preprocess_fast)
PREPROCESS_MODES = ("exact", "fast")
# transformers' default ``rescale_factor``; Qwen-VL configs store 0.00392156862745098 == 1/255.
_RESCALE_FACTOR = 1 / 255
_DEFAULT_MAX_IMAGE_PIXELS = 50_000_000  # above any camera's default output; bounds a decode's memory (decode_bytes)
# the formats transformers' processor is fed in practice; others (EPS runs Ghostscript, PSD, JPEG 2000, ...) are
# refused before their pixel data is read. PIL's JPEG reader also opens phones' multi-picture JPEGs (as MPO).
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")


# --------------------------------------------------------------------------- errors


class ImageError(ValueError):
    """Base class for client-side image problems. ``code`` is a short machine code; ``public`` the message without
    the decoder's own text (what a server tells a client; ``str()`` keeps the detail)."""

    code = "image_error"

    def __init__(self, message: str, detail: str | None = None):
        super().__init__(f"{message}: {detail}" if detail else message)
        self.public = message


class InvalidBase64(ImageError):
    """Image data sent as base64 text that does not decode."""

    code = "invalid_base64"


class Base64Data:
    """Base64 text of an encoded image, decoded where the image is (a server's decode worker, not its event loop).

    It holds the text as the request gave it, a string or a view of the request body's bytes, and where the base64
    starts in it (after a data URI's header), so the payload is never copied to be told apart: a 30 MB image stays
    where it arrived until its bytes are sent."""

    __slots__ = ("text", "start")

    def __init__(self, text: str | memoryview, start: int = 0):
        self.text, self.start = text, start

    def __len__(self) -> int:
        return len(self.text) - self.start

    def __repr__(self) -> str:
        return f"Base64Data({len(self)} characters)"

    def prefix(self, n: int) -> str:
        """The first `n` characters of the base64."""
        part = self.text[self.start:self.start + n]
        return part if isinstance(part, str) else bytes(part).decode("latin-1")

    def ascii(self, nbytes: int | None = None) -> memoryview:
        """The base64 as ASCII bytes (a non-ASCII character becomes something no base64 decoder accepts); with
        `nbytes`, only the whole quads of characters that hold the first `nbytes` bytes (the image's end: what
        follows is not copied), where no whitespace comes before them."""
        text, end = self.text, len(self.text)
        if nbytes is not None and (n := -(-nbytes // 3) * 4) < len(self):
            quads = text[self.start:self.start + n]
            if not (_WHITESPACE if isinstance(quads, str) else _WHITESPACE_BYTES).search(quads):
                end = self.start + n
        if isinstance(text, str):  # the whole text encoded once, or only the prefix that holds the image
            return memoryview(text[self.start:end].encode("ascii", "replace")) if end < len(text) else \
                memoryview(text.encode("ascii", "replace"))[self.start:]
        return text[self.start:end]

    def decode(self) -> bytes:
        return decode_base64(self.ascii())


_WHITESPACE = re.compile(r"\s")
_WHITESPACE_BYTES = re.compile(rb"\s")


def decode_base64(text: str | bytes | memoryview) -> bytes:
    """Strict base64 (whitespace allowed, e.g. line breaks), or InvalidBase64."""
    if isinstance(text, memoryview):
        text = bytes(text)
    try:
        return pybase64.b64decode(type(text)().join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidBase64("not valid base64") from None


class UndecodableImage(ImageError):
    """Empty data, not an image, truncated/corrupt file, or unsupported format/mode."""

    code = "undecodable_image"


class NotAnImage(UndecodableImage):
    """Data in no image format PIL knows."""


class HeaderNotFound(UndecodableImage):
    """A bounded probe did not find the header within the bytes and steps it looks at, or the format is not one it
    reads: the whole image must be looked at (a server does that off its event loop)."""


class ImageTooLarge(ImageError):
    """The image declares more pixels than allowed (decompression-bomb guard)."""

    code = "image_too_large"


class UnsupportedFormat(ImageError):
    """An image format outside ``ALLOWED_FORMATS``."""

    code = "unsupported_format"


class BadAspectRatio(ImageError):
    """max(h, w) / min(h, w) > 200 (the limit enforced by Qwen-VL's smart_resize)."""

    code = "bad_aspect_ratio"


# --------------------------------------------------------------------------- config


def _as_triple(value: Any, name: str) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    triple = tuple(float(v) for v in value)
    if len(triple) != 3:
        raise ValueError(f"{name} must have 3 elements (RGB), got {len(triple)}")
    return triple  # type: ignore[return-value]


@dataclass(frozen=True)
class PreprocessConfig:
    """Qwen-VL image preprocessing parameters.

    ``min_pixels``/``max_pixels`` bound the *resized* image (transformers'
    ``size["shortest_edge"]``/``size["longest_edge"]``); ``max_image_pixels`` bounds the
    *decoded* image and is only a safety limit for ``load_image``.
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    max_image_pixels: int = _DEFAULT_MAX_IMAGE_PIXELS

    def __post_init__(self) -> None:
        # Coerce lists (e.g. straight from JSON) to tuples so the config stays hashable.
        object.__setattr__(self, "image_mean", _as_triple(self.image_mean, "image_mean"))
        object.__setattr__(self, "image_std", _as_triple(self.image_std, "image_std"))
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "max_image_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) must be <= max_pixels ({self.max_pixels})")
        if any(s == 0.0 for s in self.image_std):
            raise ValueError("image_std must not contain zeros")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size**2

    def with_overrides(self, **kw: Any) -> PreprocessConfig:
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], base: PreprocessConfig | None = None) -> PreprocessConfig:
        """Build from a HF ``preprocessor_config.json`` dict; missing keys fall back to ``base``.

        Pixel bounds follow ``Qwen2VLImageProcessor.__init__``: top-level ``min_pixels`` /
        ``max_pixels`` (Qwen2/2.5-VL configs) override ``size["shortest_edge"]`` /
        ``size["longest_edge"]`` (Qwen3-VL configs); legacy ``size["min_pixels"]`` /
        ``size["max_pixels"]`` are accepted last.  Settings this module cannot reproduce
        (resize/rescale/normalize disabled, a rescale factor other than 1/255, a resample
        filter other than bicubic) raise ``ValueError`` instead of being silently ignored.
        """
        base = cls() if base is None else base
        d = dict(d or {})
        get = d.get

        for flag in ("do_resize", "do_rescale", "do_normalize"):
            if get(flag) is False:
                raise ValueError(f"unsupported preprocessor config: {flag}=false")
        rf = get("rescale_factor")
        if rf is not None and not math.isclose(float(rf), _RESCALE_FACTOR, rel_tol=1e-9):
            raise ValueError(f"unsupported preprocessor config: rescale_factor={rf} (only 1/255)")
        resample = get("resample")
        if resample is not None and int(resample) != int(Image.Resampling.BICUBIC):
            raise ValueError(f"unsupported preprocessor config: resample={resample} (only bicubic=3)")

        size = get("size") or {}
        if not isinstance(size, Mapping):
            size = {}

        def first(*candidates: Any) -> Any:
            for c in candidates:
                if c is not None:
                    return c
            return None

        kw: dict[str, Any] = {}
        for key in ("patch_size", "temporal_patch_size", "merge_size"):
            if get(key) is not None:
                kw[key] = int(get(key))
        min_pixels = first(get("min_pixels"), size.get("shortest_edge"), size.get("min_pixels"))
        max_pixels = first(get("max_pixels"), size.get("longest_edge"), size.get("max_pixels"))
        if min_pixels is not None:
            kw["min_pixels"] = int(min_pixels)
        if max_pixels is not None:
            kw["max_pixels"] = int(max_pixels)
        if get("image_mean") is not None:
            kw["image_mean"] = _as_triple(get("image_mean"), "image_mean")
        if get("image_std") is not None:
            kw["image_std"] = _as_triple(get("image_std"), "image_std")
        return dataclasses.replace(base, **kw)


# --------------------------------------------------------------------------- smart_resize


def _check_aspect_ratio(height: int, width: int) -> None:
    if height <= 0 or width <= 0:
        raise ValueError(f"image height and width must be positive, got {height}x{width}")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise BadAspectRatio(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got {ratio} ({width}x{height})"
        )


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280
) -> tuple[int, int]:
    """Target (height, width) for an image, exactly as transformers' Qwen2-VL ``smart_resize``.

    Both sides become multiples of ``factor``, the area lands in ``[min_pixels, max_pixels]``
    (up to rounding to ``factor``) and the aspect ratio is kept as closely as possible.
    Raises ``BadAspectRatio`` (a ``ValueError``, like transformers) when
    ``max/min > 200``, and ``ValueError`` for non-positive sides.
    """
    _check_aspect_ratio(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# --------------------------------------------------------------------------- decoding


def _to_rgb(img: Image.Image) -> Image.Image:
    """transformers' ``convert_to_rgb`` for PIL images: transparency composited on white, else ``convert("RGB")``.

    16-bit images ("I;16", "I") follow it too: PIL's ``convert`` clips values above 255. Scaling them (``>> 8``) would
    look better, but every stack built on the HF processor (transformers, vLLM, SGLang) feeds the LLM the clipped
    numbers, and an encoder service must give the numbers its LLM was served with.
    """
    if img.mode == "RGB" and img.info.get("transparency") is None:
        return img
    has_alpha = "A" in img.getbands() or img.info.get("transparency") is not None
    if has_alpha:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def _undecodable(msg: str, exc: BaseException | None = None) -> UndecodableImage:
    return UndecodableImage(msg, None if exc is None else str(exc).strip() or type(exc).__name__)


def _check_declared_size(img: Image.Image, max_image_pixels: int) -> None:
    check_size(*img.size, max_image_pixels)


def check_size(width: int, height: int, max_image_pixels: int) -> None:
    """An image's declared size against the pixel limit (ImageTooLarge), before any pixel is decoded."""
    if width <= 0 or height <= 0:
        raise UndecodableImage(f"image has an empty size ({width}x{height})")
    if width * height > max_image_pixels:
        raise ImageTooLarge(
            f"image is {width}x{height} = {width * height} pixels, more than the limit of {max_image_pixels}"
        )


def _decode_opened(img: Image.Image, max_image_pixels: int) -> Image.Image:
    # 1. Declared size from the header, before any pixel data is decoded.
    _check_declared_size(img, max_image_pixels)
    _check_aspect_ratio(img.height, img.width)
    # 2. First frame of animated / multi-page images, then a full decode.  Truncated or
    #    corrupt data surfaces here (LOAD_TRUNCATED_IMAGES is deliberately left alone).
    try:
        img.seek(0)
        img.load()
    except MemoryError:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageTooLarge(str(exc)) from exc
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, EOFError, struct.error, ...
        raise _undecodable("could not decode image data (truncated or corrupt file?)", exc) from exc
    # Some plugins (ICO/ICNS/...) only settle the real size on load.
    _check_declared_size(img, max_image_pixels)
    # 3. EXIF orientation.  Broken EXIF metadata does not make the pixels unusable, so a
    #    failure here keeps the image as stored rather than rejecting it.
    try:
        oriented = ImageOps.exif_transpose(img)
    except MemoryError:
        raise
    except Exception:
        oriented = img
    if oriented is None:  # pragma: no cover - only with in_place=True
        oriented = img
    # 4. RGB with transparency composited on white.
    try:
        rgb = _to_rgb(oriented)
        if rgb is img:
            rgb = img.copy()  # detach from the file / the caller's object
    except MemoryError:
        raise
    except Exception as exc:
        raise _undecodable(f"unsupported image mode {oriented.mode!r}", exc) from exc
    _check_aspect_ratio(rgb.height, rgb.width)
    return rgb


def load_image(source: Any, *, max_image_pixels: int = _DEFAULT_MAX_IMAGE_PIXELS,
               formats: tuple[str, ...] | None = ALLOWED_FORMATS) -> Image.Image:
    """Decode ``source`` into an RGB ``PIL.Image.Image``, validating it on the way.

    ``source`` may be a ``PIL.Image.Image``, ``bytes``/``bytearray``/``memoryview`` of an
    encoded file, or a ``str``/``os.PathLike`` path (a missing/unreadable path raises the
    usual ``OSError``; it is the caller's problem, not the image's).

    Steps: reject empty data and non-images (``UndecodableImage``); compare the size
    declared in the header against ``max_image_pixels`` *before* decoding pixel data
    (``ImageTooLarge``; PIL's own ``DecompressionBombError``, and
    ``DecompressionBombWarning`` when warnings are configured as errors, map to it too --
    no ``warnings.catch_warnings`` here because it mutates process-global state and is
    not thread-safe); reject ``max/min side > 200`` (``BadAspectRatio``); take the first
    frame of animated/multi-page images (``seek(0)``, which also rewinds a caller's
    multi-frame PIL image); fully decode inside try/except so truncated files raise
    ``UndecodableImage``; apply the EXIF orientation; convert to RGB like transformers'
    ``convert_to_rgb`` (alpha/palette transparency composited on white, everything else
    ``convert("RGB")`` -- CMYK, YCbCr, "1", "L", "P", "F" included).

    16-bit ("I;16*", "I") and float ("F") images get transformers' ``convert("RGB")`` too, values clipped to the
    0..255 range (see ``_to_rgb`` for why).
    """
    if isinstance(source, Image.Image):
        try:
            return _decode_opened(source, max_image_pixels)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ImageTooLarge(str(exc)) from exc

    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if len(data) == 0:
            raise UndecodableImage("image data is empty (0 bytes)")
        return _open_and_decode(io.BytesIO(data), max_image_pixels, f"{len(data)} bytes of data", formats)

    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        with open(path, "rb") as fh:  # OSError (missing file, permissions) propagates
            if os.fstat(fh.fileno()).st_size == 0:
                raise UndecodableImage(f"image file is empty (0 bytes): {path!r}")
            return _open_and_decode(fh, max_image_pixels, f"file {path!r}", formats)

    raise TypeError(
        "image source must be a PIL.Image.Image, bytes/bytearray/memoryview or a path, "
        f"got {type(source).__name__}"
    )


def _open(fp: Any, what: str, formats: tuple[str, ...] | None) -> Image.Image:
    """The image's header read (no pixel data yet), in one of `formats` (None: any PIL reads)."""
    Image.init()  # every plugin registered (formats names some that PIL loads only on demand: MPO, WEBP, TIFF)
    try:
        return Image.open(fp, formats=formats)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLarge(str(exc)) from exc
    except Image.UnidentifiedImageError as exc:
        other = None
        if formats is not None:  # one PIL knows but we do not take, or not an image at all (its header only)
            fp.seek(0)
            try:
                with Image.open(fp) as img:
                    other = img.format
            except Exception:
                pass
        if other is not None:
            raise UnsupportedFormat(f"{other} images are not accepted; send one of "
                                    f"{', '.join(formats)}") from exc
        raise NotAnImage(f"not a recognized image format ({what})") from exc
    except MemoryError:
        raise
    except Exception as exc:
        raise _undecodable(f"could not read image header ({what})", exc) from exc


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
        _check_aspect_ratio(self.height, self.width)


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
        self.data, self.n, self.steps, self.header, self.end = data, len(data), steps, None, None

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
        found = pos + 1 + len(data[pos + 1:stop]) - len(data[pos + 1:stop].lstrip(b"\xff")) if pos < stop else stop
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
            frame = data[pos + 2:pos + length]
            if len(frame) < 6 or frame[0] != 8 or frame[5] not in _JPEG_MODES:  # as PIL's SOF handler
                raise _refuse("JPEG", "a frame PIL cannot read")
            walk.header = ImageHeader("JPEG", frame[3] << 8 | frame[4], frame[1] << 8 | frame[2],
                                      _JPEG_MODES[frame[5]], False)
        elif code == 0xDA:
            if walk.header is None:
                raise _refuse("JPEG", "a scan before the frame header")
            scans += 1
            pixels = walk.header.width * walk.header.height
            if scans > MAX_JPEG_SCANS or scans * pixels > MAX_SCAN_PIXELS:
                raise _refuse("JPEG", f"more than {scans - 1} scans of {pixels} pixels")
            found = _SCAN_END.search(data, pos + length)
            if found is None:
                raise _Stop("truncated")
            pos = found.start()
            continue
        pos += length


_PNG_MODES = {(1, 0): "1", (2, 0): "L", (4, 0): "L", (8, 0): "L", (16, 0): "I;16", (8, 2): "RGB", (16, 2): "RGB",
              (1, 3): "P", (2, 3): "P", (4, 3): "P", (8, 3): "P", (8, 4): "LA", (16, 4): "RGBA", (8, 6): "RGBA",
              (16, 6): "RGBA"}  # (bit depth, colour type) -> PIL's mode


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
        kind = data[pos + 4:pos + 8]
        if kind == b"IDAT" and walk.header is None:
            walk.header = ImageHeader("PNG", width, height, mode, transparency)
        elif kind == b"tRNS" and walk.header is None:
            transparency = True
        elif kind == b"IEND":
            walk.end = pos + 12
            return
        pos += 12 + int.from_bytes(data[pos:pos + 4], "big")


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
        shaded, pos = data[pos:pos + size] != _GIF_GRAY[:size], pos + size
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
            shaded, pos = data[pos:pos + size] != _GIF_GRAY[:size], pos + size
        if walk.header is None:
            walk.header = ImageHeader("GIF", max(width, x0 + w), max(height, y0 + h), "P" if shaded else "L",
                                      transparency)
        pos = _gif_blocks(walk, pos + 1)  # after the LZW code size


_BMP_BITFIELDS = {  # (bits, masks) -> PIL's mode
    (32, (0xFF0000, 0xFF00, 0xFF, 0x0)): "RGB", (32, (0xFF000000, 0xFF0000, 0xFF00, 0x0)): "RGB",
    (32, (0xFF000000, 0xFF00, 0xFF, 0x0)): "RGB", (32, (0xFF000000, 0xFF0000, 0xFF00, 0xFF)): "RGBA",
    (32, (0xFF, 0xFF00, 0xFF0000, 0xFF000000)): "RGBA", (32, (0xFF0000, 0xFF00, 0xFF, 0xFF000000)): "RGBA",
    (32, (0xFF000000, 0xFF00, 0xFF, 0xFF0000)): "RGBA", (32, (0x0, 0x0, 0x0, 0x0)): "RGBA",
    (24, (0xFF0000, 0xFF00, 0xFF)): "RGB", (16, (0xF800, 0x7E0, 0x1F)): "RGB", (16, (0x7C00, 0x3E0, 0x1F)): "RGB"}
_BMP_MODES = {1: "P", 4: "P", 8: "P", 16: "RGB", 24: "RGB", 32: "RGB"}


def _bmp(walk: _Walk) -> None:
    """The info header as PIL's BMP reader reads it (a palette of grays makes it "1" or "L"); the file size, where it
    holds the pixel data, is its end."""
    data = walk.data
    walk.need(18)
    size = int.from_bytes(data[14:18], "little")
    walk.need(14 + size)
    info, pos, masks = data[18:14 + size], 14 + size, ()
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
        palette = data[pos:pos + padding * colors]
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
        width, height, alpha = (int.from_bytes(data[26:28], "little") & 0x3FFF,
                                int.from_bytes(data[28:30], "little") & 0x3FFF, False)
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
    entries = np.frombuffer(data, np.dtype([("tag", order + "u2"), ("type", order + "u2"),
                                            ("count", order + ("u8" if big else "u4")),
                                            ("value", f"V{8 if big else 4}")]), count, start)
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
            value = data[at:at + length]
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
        bits, planes, extra = bits[:-len(extra)], planes - len(extra), ()
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


_READERS = ((b"\xff\xd8\xff", "JPEG", _jpeg), (b"\x89PNG\r\n\x1a\n", "PNG", _png), (b"GIF87a", "GIF", _gif),
            (b"GIF89a", "GIF", _gif), (b"BM", "BMP", _bmp),
            *((prefix, "TIFF", _tiff) for prefix in TiffImagePlugin.PREFIXES))


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
        with _open(io.BytesIO(data), f"{len(data)} bytes of data", formats) as img:
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
    if walk.header.width <= 0 or walk.header.height <= 0:
        raise UndecodableImage(f"image has an empty size ({walk.header.width}x{walk.header.height})")
    return dataclasses.replace(walk.header, end=walk.end)


def _open_and_decode(fp: Any, max_image_pixels: int, what: str,
                     formats: tuple[str, ...] | None = ALLOWED_FORMATS) -> Image.Image:
    img = _open(fp, what, formats)
    with img:
        try:
            return _decode_opened(img, max_image_pixels)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ImageTooLarge(str(exc)) from exc


# --------------------------------------------------------------------------- preprocessing


@dataclass
class EncodedJpeg:
    """A JPEG left for the device to decode: its bytes, its EXIF orientation, and its size once oriented."""

    data: bytes
    height: int
    width: int
    orientation: int = 1

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.height, self.width, 3


def jpeg_for_device(data: bytes, max_image_pixels: int = _DEFAULT_MAX_IMAGE_PIXELS) -> EncodedJpeg | None:
    """From its header alone: an RGB or grayscale JPEG as an EncodedJpeg (its size checked as `load_image` checks
    it), None for anything else (PIL decodes that). A file that does not end at its end-of-image marker is left to
    PIL too: nvJPEG decodes a truncated file (its missing rows black), where PIL refuses it. Raises the ImageError
    `load_image` would for a bad header."""
    with _open(io.BytesIO(data), f"{len(data)} bytes of data", ALLOWED_FORMATS) as img:
        if img.format != "JPEG" or img.mode not in ("RGB", "L") or data[-2:] != b"\xff\xd9":
            return None
        _check_declared_size(img, max_image_pixels)
        _check_aspect_ratio(img.height, img.width)
        try:
            orientation = int(img.getexif().get(EXIF_ORIENTATION, 1))
        except Exception:  # broken EXIF: the image as stored, as load_image keeps it
            orientation = 1
        orientation = orientation if 1 <= orientation <= 8 else 1
        width, height = (img.height, img.width) if orientation >= 5 else img.size
    return EncodedJpeg(bytes(data), height, width, orientation)


def target_size(image, cfg: PreprocessConfig) -> tuple[int, int]:
    """smart_resize's (height, width) for a full-size image (a [H, W, 3] array or an EncodedJpeg)."""
    return smart_resize(image.shape[0], image.shape[1], cfg.factor, cfg.min_pixels, cfg.max_pixels)


def load_for_device(source: Any, jpeg_on_device: bool,
                    max_image_pixels: int = _DEFAULT_MAX_IMAGE_PIXELS) -> np.ndarray | EncodedJpeg:
    """An image for the fast preprocessing (preprocess_fast.resize_on_device), which resizes on the device: a JPEG's bytes
    left encoded when `jpeg_on_device` (nvJPEG decodes it there), else the image decoded here, full size, as the
    uint8 [H, W, 3] array of its RGB pixels (load_image)."""
    if jpeg_on_device and isinstance(source, (bytes, bytearray, memoryview)) and len(source):
        if (jpeg := jpeg_for_device(bytes(source), max_image_pixels)) is not None:
            return jpeg
    image = source if isinstance(source, Image.Image) and source.mode == "RGB" and \
        source.info.get("transparency") is None else load_image(source, max_image_pixels=max_image_pixels)
    return np.asarray(image)


@functools.lru_cache(maxsize=32)
def normalize_lut(mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """(3, 256) float32: transformers' rescale+normalize of every uint8 value, per channel.

    rescale: ``(x.astype(float64) * (1/255)).astype(float32)``; normalize: float32
    ``(x - mean32) / std32`` -- the same IEEE operations, so gathers are bit-identical.
    """
    v = (np.arange(256, dtype=np.uint8).astype(np.float64) * _RESCALE_FACTOR).astype(np.float32)
    mean32 = np.asarray(mean, dtype=np.float32)[:, None]
    std32 = np.asarray(std, dtype=np.float32)[:, None]
    lut = (v[None, :] - mean32) / std32
    assert lut.dtype == np.float32
    lut.setflags(write=False)
    return lut


# Elements per channel per stripe in ``_patchify_into``: keeps the gather temporaries
# cache-resident (~1 MiB), faster than one whole-image pass.
_STRIPE_ELEMS = 1 << 18


def _patchify_into(rgb: np.ndarray, cfg: PreprocessConfig, out: np.ndarray) -> None:
    """Normalize + patchify a (H, W, 3) uint8 array into ``out`` ((H/p)*(W/p), patch_dim) float32.

    Row order is merge-block order ``(gh/m, gw/m, m, m)`` and each row is ``(C, T, p, p)``
    with the frame repeated ``T`` times -- identical to transformers' ``patchify``.  The
    uint8 image is only reshaped/transposed as a view; each channel is gathered from the
    normalization LUT into a small temporary and broadcast over ``T`` into ``out``.
    """
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    height, width, channels = rgb.shape
    bh, bw = height // (p * m), width // (p * m)
    lut = normalize_lut(cfg.image_mean, cfg.image_std)
    # (bh, m, p, bw, m, p, C) -> (bh, bw, m_h, m_w, C, p_h, p_w)
    view = rgb.reshape(bh, m, p, bw, m, p, channels).transpose(0, 3, 1, 4, 6, 2, 5)
    dst = out.view()
    dst.shape = (bh, bw, m, m, channels, t, p, p)  # raises instead of silently copying
    per_block_row = bw * m * m * p * p
    stripe = max(1, _STRIPE_ELEMS // per_block_row)
    for start in range(0, bh, stripe):
        src = view[start : start + stripe]
        tgt = dst[start : start + stripe]
        for c in range(channels):
            tgt[:, :, :, :, c] = lut[c][src[:, :, :, :, c]][:, :, :, :, None]


def resize_rgb(image: Image.Image, cfg: PreprocessConfig) -> np.ndarray:
    """An image as the (H, W, 3) uint8 array the patches are cut from (smart_resize + PIL bicubic). The server ships
    these, 8x smaller than float patch rows, and normalizes + patchifies on the device (runner.launch_images)."""
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL.Image.Image, got {type(image).__name__}")
    if image.mode != "RGB" or image.info.get("transparency") is not None:
        image = _to_rgb(image)
    h, w = smart_resize(image.height, image.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    if (w, h) != image.size:  # same size: PIL would return an unfiltered copy anyway
        image = image.resize((w, h), resample=Image.Resampling.BICUBIC)
    arr = np.asarray(image)
    if arr.dtype != np.uint8 or arr.shape != (h, w, 3):  # pragma: no cover - defensive
        raise ValueError(f"unexpected RGB array {arr.dtype} {arr.shape}")
    return arr


def preprocess_image(image: Image.Image, cfg: PreprocessConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One RGB PIL image -> (pixel rows float32 [gh*gw, patch_dim], grid (1, gh, gw)).

    ``smart_resize`` (may raise ``BadAspectRatio``), PIL bicubic resize of the uint8 RGB
    image, then rescale/normalize/patchify bit-identical to ``Qwen2VLImageProcessorPil``.
    A non-RGB image is first converted like ``load_image`` does (no EXIF/frame handling).
    """
    arr = resize_rgb(image, cfg)
    gh, gw = arr.shape[0] // cfg.patch_size, arr.shape[1] // cfg.patch_size
    out = np.empty((gh * gw, cfg.patch_dim), dtype=np.float32)
    _patchify_into(arr, cfg, out)
    return out, (1, gh, gw)


def preprocess(images: Sequence[Any] | Iterable[Any], cfg: PreprocessConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch version of ``preprocess_image``, laid out like the transformers processor output.

    Returns ``pixel_values`` float32 ``[sum(gh*gw), patch_dim]`` (images concatenated in
    order) and ``image_grid_thw`` int64 ``[n, 3]``.  Items may be PIL images (used as is,
    converted to RGB if needed) or anything ``load_image`` accepts (bytes, paths), which is
    then decoded with ``cfg.max_image_pixels``.  All images are resized first, then
    written directly into one preallocated buffer (no concatenate copy).  An empty list
    gives tensors of shape (0, patch_dim) and (0, 3).
    """
    arrays: list[np.ndarray] = []
    for item in images:
        if not isinstance(item, Image.Image):
            item = load_image(item, max_image_pixels=cfg.max_image_pixels)
        arrays.append(resize_rgb(item, cfg))
    p = cfg.patch_size
    grids = np.array([(1, a.shape[0] // p, a.shape[1] // p) for a in arrays], dtype=np.int64).reshape(-1, 3)
    rows = [int(g[1] * g[2]) for g in grids]
    out = np.empty((sum(rows), cfg.patch_dim), dtype=np.float32)
    offset = 0
    for arr, n in zip(arrays, rows):
        _patchify_into(arr, cfg, out[offset : offset + n])
        offset += n
    import torch  # here only: decode/resize worker processes import this module without torch

    return torch.from_numpy(out), torch.from_numpy(grids)
