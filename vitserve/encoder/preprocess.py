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
  else goes through ``Image.convert("RGB")``. Only the box around the pixels that are
  not opaque is composited: Pillow's composite of an opaque pixel is the pixel.
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

import dataclasses
import functools
import io
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np
from PIL import Image, ImageChops, ImageOps

from .config import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from .image_errors import BadAspectRatio, ImageError, ImageTooLarge, NotAnImage, UndecodableImage, UnsupportedFormat

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


# --------------------------------------------------------------------------- config


def as_triple(value: Any, name: str) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    triple = tuple(float(v) for v in value)
    if len(triple) != 3:
        raise ValueError(f"{name} must have 3 elements (RGB), got {len(triple)}")
    return triple


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
        object.__setattr__(self, "image_mean", as_triple(self.image_mean, "image_mean"))
        object.__setattr__(self, "image_std", as_triple(self.image_std, "image_std"))
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
            if (value := get(key)) is not None:
                kw[key] = int(value)
        min_pixels = first(get("min_pixels"), size.get("shortest_edge"), size.get("min_pixels"))
        max_pixels = first(get("max_pixels"), size.get("longest_edge"), size.get("max_pixels"))
        if min_pixels is not None:
            kw["min_pixels"] = int(min_pixels)
        if max_pixels is not None:
            kw["max_pixels"] = int(max_pixels)
        if get("image_mean") is not None:
            kw["image_mean"] = as_triple(get("image_mean"), "image_mean")
        if get("image_std") is not None:
            kw["image_std"] = as_triple(get("image_std"), "image_std")
        return dataclasses.replace(base, **kw)


# --------------------------------------------------------------------------- smart_resize


def check_aspect_ratio(height: int, width: int) -> None:
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
    check_aspect_ratio(height, width)
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
        return _on_white(img if img.mode == "RGBA" else img.convert("RGBA"))
    return img.convert("RGB")


def _on_white(rgba: Image.Image) -> Image.Image:
    """transformers' composite of an RGBA image on opaque white, made RGB, where it is needed only: Pillow's composite
    of an opaque pixel is the pixel (every value: tested), and PNGs and screenshots often carry an alpha band that
    is opaque everywhere or but for a few corners, while compositing costs several times a conversion (a division
    per pixel). So the pixels outside the box that holds every non-opaque one are converted, those inside composited
    (each pixel on its own: the same bytes as the whole image's composite)."""
    box = ImageChops.invert(rgba.getchannel("A")).getbbox()  # (alpha 255 inverts to 0, which getbbox leaves out)
    if box is None:
        return rgba.convert("RGB")
    if box == (0, 0, *rgba.size):
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    rgb, region = rgba.convert("RGB"), rgba.crop(box)
    white = Image.new("RGBA", region.size, (255, 255, 255, 255))
    rgb.paste(Image.alpha_composite(white, region).convert("RGB"), box[:2])
    return rgb


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


EXIF_TRANSPOSED = frozenset(range(2, 9))  # the EXIF orientations exif_transpose turns the image for


def _decode_opened(img: Image.Image, max_image_pixels: int, own: bool) -> Image.Image:
    """The image decoded, oriented and made RGB (load_image's steps); `own`: the image was opened here, so it may be
    returned as it is, where a caller's image is copied."""
    # 1. Declared size from the header, before any pixel data is decoded.
    _check_declared_size(img, max_image_pixels)
    check_aspect_ratio(img.height, img.width)
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
    # 3. EXIF orientation, where the tag asks to turn the image (exif_transpose makes a new image then; without one
    #    it would copy the image, which is kept as decoded instead).  Broken EXIF metadata does not make the pixels
    #    unusable, so a failure here keeps the image as stored rather than rejecting it.
    try:
        turned = img.getexif().get(EXIF_ORIENTATION, 1) in EXIF_TRANSPOSED
        oriented = ImageOps.exif_transpose(img) if turned else img
    except MemoryError:
        raise
    except Exception:
        oriented = img
    # 4. RGB with transparency composited on white.
    try:
        rgb = _to_rgb(oriented)
        if rgb is img and not own:
            rgb = img.copy()  # not the caller's object
    except MemoryError:
        raise
    except Exception as exc:
        raise _undecodable(f"unsupported image mode {oriented.mode!r}", exc) from exc
    check_aspect_ratio(rgb.height, rgb.width)
    return rgb


def load_image(
    source: Any, *, max_image_pixels: int = _DEFAULT_MAX_IMAGE_PIXELS, formats: tuple[str, ...] | None = ALLOWED_FORMATS
) -> Image.Image:
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
            return _decode_opened(source, max_image_pixels, own=False)
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
        f"image source must be a PIL.Image.Image, bytes/bytearray/memoryview or a path, got {type(source).__name__}"
    )


def open_header(fp: Any, what: str, formats: tuple[str, ...] | None) -> Image.Image:
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
        if other is not None and formats is not None:  # (other is only read where formats is given)
            raise UnsupportedFormat(f"{other} images are not accepted; send one of {', '.join(formats)}") from exc
        raise NotAnImage(f"not a recognized image format ({what})") from exc
    except MemoryError:
        raise
    except Exception as exc:
        raise _undecodable(f"could not read image header ({what})", exc) from exc


def _open_and_decode(
    fp: Any, max_image_pixels: int, what: str, formats: tuple[str, ...] | None = ALLOWED_FORMATS
) -> Image.Image:
    img = open_header(fp, what, formats)
    with img:
        try:
            return _decode_opened(img, max_image_pixels, own=True)
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
    with open_header(io.BytesIO(data), f"{len(data)} bytes of data", ALLOWED_FORMATS) as img:
        if img.format != "JPEG" or img.mode not in ("RGB", "L") or data[-2:] != b"\xff\xd9":
            return None
        _check_declared_size(img, max_image_pixels)
        check_aspect_ratio(img.height, img.width)
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


def load_for_device(
    source: Any, jpeg_on_device: bool, max_image_pixels: int = _DEFAULT_MAX_IMAGE_PIXELS
) -> np.ndarray | EncodedJpeg:
    """An image for a resize on the device (preprocess_fast.resize_on_device): a JPEG's bytes left encoded when
    `jpeg_on_device` (nvJPEG decodes it there), else the image decoded here, full size, as the uint8 [H, W, 3] array
    of its RGB pixels (`decode_for_device`'s image)."""
    image = decode_for_device(source, jpeg_on_device, max_image_pixels)
    return image if isinstance(image, EncodedJpeg) else np.asarray(image)


def decode_for_device(
    source: Any, jpeg_on_device: bool, max_image_pixels: int = _DEFAULT_MAX_IMAGE_PIXELS
) -> Image.Image | EncodedJpeg:
    """`load_for_device`'s image before its array: the RGB PIL image (load_image; a PIL image taken as it is, made
    RGB as `resize_rgb` makes it), or the JPEG left encoded."""
    if jpeg_on_device and isinstance(source, (bytes, bytearray, memoryview)) and len(source):
        if (jpeg := jpeg_for_device(bytes(source), max_image_pixels)) is not None:
            return jpeg
    return as_rgb(source) if isinstance(source, Image.Image) else load_image(source, max_image_pixels=max_image_pixels)


def as_rgb(image: Image.Image) -> Image.Image:
    """A PIL image as the preprocessing takes one given as an image: as it is (no EXIF orientation, its current
    frame, as transformers' processors take it), made RGB with transparency on white where it is not RGB already."""
    return _to_rgb(image) if image.mode != "RGB" or image.info.get("transparency") is not None else image


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
    image = as_rgb(image)
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
