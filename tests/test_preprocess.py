"""Tests for encoder.preprocess against transformers' Qwen2VLImageProcessorPil (the reference)."""

from __future__ import annotations

import io
import struct
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitserve.encoder.preprocess import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    BadAspectRatio,
    ImageError,
    ImageTooLarge,
    PreprocessConfig,
    UndecodableImage,
    load_image,
    preprocess,
    preprocess_image,
    smart_resize,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from transformers.image_transforms import convert_to_rgb as hf_convert_to_rgb
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize


# --------------------------------------------------------------------------- settings

QWEN2 = PreprocessConfig(min_pixels=3136, max_pixels=12845056)  # Qwen2/2.5-VL preprocessor_config.json
QWEN3 = PreprocessConfig(
    patch_size=16, min_pixels=65536, max_pixels=16777216, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5)
)
DEFAULTS = PreprocessConfig()  # transformers class defaults: max 28*28*1280
SETTINGS = {"qwen2": QWEN2, "qwen3": QWEN3, "defaults": DEFAULTS}

_REF_CACHE: dict[PreprocessConfig, Qwen2VLImageProcessorPil] = {}


def reference(cfg: PreprocessConfig) -> Qwen2VLImageProcessorPil:
    if cfg not in _REF_CACHE:
        _REF_CACHE[cfg] = Qwen2VLImageProcessorPil(
            size={"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels},
            patch_size=cfg.patch_size,
            temporal_patch_size=cfg.temporal_patch_size,
            merge_size=cfg.merge_size,
            image_mean=list(cfg.image_mean),
            image_std=list(cfg.image_std),
        )
    return _REF_CACHE[cfg]


def run_reference(images, cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = reference(cfg)(images=images, return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def rand_image(h: int, w: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed + 7919 * h + w)
    channels = len(mode)
    arr = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
    return Image.fromarray(arr if channels > 1 else arr[..., 0], mode=mode)


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def png_bytes(arr: np.ndarray | None, *, width=None, height=None, color_type=0, bit_depth=8, idat=True) -> bytes:
    """Hand-made PNG (so headers can lie / be huge without allocating pixels)."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    if arr is not None:
        height, width = arr.shape[:2]
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    out = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
    if idat and arr is not None:
        dtype = ">u2" if bit_depth == 16 else "u1"
        raw = b"".join(b"\x00" + np.ascontiguousarray(row).astype(dtype).tobytes() for row in arr)
        out += chunk(b"IDAT", zlib.compress(raw))
    elif idat:
        out += chunk(b"IDAT", zlib.compress(b"\x00" * 64))  # far too little data for the header
    return out + chunk(b"IEND", b"")


# --------------------------------------------------------------------------- sizes

# (h, w) pairs, tiny to huge, all aspect ratios <= 200.
SIZES = [
    (1, 1),
    (2, 2),
    (1, 2),
    (3, 5),
    (1, 200),
    (200, 1),
    (10, 300),
    (300, 10),
    (27, 27),
    (28, 28),
    (29, 29),
    (31, 33),
    (55, 57),
    (56, 56),
    (64, 64),
    (100, 100),
    (111, 222),
    (224, 224),
    (240, 320),
    (256, 256),
    (333, 444),
    (480, 640),
    (500, 375),
    (13, 1777),
    (3000, 20),
    (20, 3000),
    (17, 3399),
    (799, 601),
    # math only (too big to push real pixels through the slow reference in a unit test)
    (1080, 1920),
    (1920, 1080),
    (3000, 4000),
    (4000, 3000),
    (3584, 3584),
    (3585, 3583),
    (4096, 4096),
    (8192, 8192),
    (12000, 60),
    (7000, 35),
    (20000, 15000),
    (100000, 500),
]
REAL_PIXEL_LIMIT = 320_000


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "defaults"])
def test_grid_thw_matches_transformers(name):
    cfg = SETTINGS[name]
    ref = reference(cfg)
    checked_real = 0
    for h, w in SIZES:
        # math: our smart_resize -> grid vs transformers' own patch count and smart_resize
        rh, rw = smart_resize(h, w, cfg.factor, cfg.min_pixels, cfg.max_pixels)
        assert (rh, rw) == hf_smart_resize(h, w, cfg.factor, cfg.min_pixels, cfg.max_pixels), (h, w)
        assert rh % cfg.factor == 0 and rw % cfg.factor == 0
        assert (rh // cfg.patch_size) * (rw // cfg.patch_size) == ref.get_number_of_image_patches(h, w), (h, w)
        if h * w > REAL_PIXEL_LIMIT:
            continue
        # real pixels through both pipelines
        img = rand_image(h, w)
        pv, grid = preprocess([img], cfg)
        ref_pv, ref_grid = run_reference([img], cfg)
        assert grid.dtype == torch.int64 and grid.tolist() == ref_grid.tolist(), (h, w)
        assert pv.dtype == torch.float32 and tuple(pv.shape) == ref_pv.shape, (h, w)
        single, single_grid = preprocess_image(img, cfg)
        assert single_grid == tuple(ref_grid[0].tolist())
        checked_real += 1
    assert checked_real >= 25


NO_RESIZE_CASES = [
    ("qwen2", (28 * 4, 28 * 6)),
    ("qwen2", (448, 224)),
    ("qwen2", (896, 140)),
    ("qwen2", (28, 3136)),
    ("defaults", (448, 448)),
    ("defaults", (56, 56)),
    ("qwen3", (256, 256)),
    ("qwen3", (256, 320)),
    ("qwen3", (640, 480)),
    ("qwen3", (32, 2048)),
]


@pytest.mark.parametrize("name,hw", NO_RESIZE_CASES)
def test_pixel_values_bit_identical_without_resize(name, hw):
    cfg = SETTINGS[name]
    h, w = hw
    assert smart_resize(h, w, cfg.factor, cfg.min_pixels, cfg.max_pixels) == (h, w)
    img = rand_image(h, w, seed=1)
    arr = np.asarray(img).copy()
    arr[0, :256, 0] = np.arange(256)[: min(256, w)]  # every uint8 value hits the LUT at least once
    img = Image.fromarray(arr)
    ours, grid = preprocess_image(img, cfg)
    ref_pv, ref_grid = run_reference([img], cfg)
    assert ours.dtype == np.float32 and ours.shape == (h * w // cfg.patch_size**2, cfg.patch_dim)
    assert grid == (1, h // cfg.patch_size, w // cfg.patch_size) == tuple(ref_grid[0].tolist())
    np.testing.assert_array_equal(ours, ref_pv)  # bit-identical, max abs diff 0


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "defaults"])
def test_pixel_values_when_resized(name):
    # Tolerance: both sides run the very same PIL bicubic (integer fixed-point) on the same uint8
    # RGB image and the same float32 rescale/normalize arithmetic, and the measured max abs diff
    # is exactly 0.0 for every case here (transformers 5.24 / Pillow 12 / numpy 2), so the bound
    # asserted is 0 -- any difference would mean a real divergence, not float noise.
    cfg = SETTINGS[name]
    resized = 0
    for h, w in [(1, 1), (3, 5), (10, 300), (57, 83), (199, 301), (500, 375), (1000, 30), (641, 479)]:
        img = rand_image(h, w, seed=2)
        assert smart_resize(h, w, cfg.factor, cfg.min_pixels, cfg.max_pixels) != (h, w)
        ours, _ = preprocess_image(img, cfg)
        ref_pv, _ = run_reference([img], cfg)
        assert ours.shape == ref_pv.shape
        assert float(np.abs(ours - ref_pv).max()) == 0.0, (name, h, w)
        resized += 1
    assert resized == 8


def test_downscale_path_bit_identical():
    # Force a real downscale through max_pixels with a small config (fast): 600x900 -> <= 200k px.
    cfg = QWEN2.with_overrides(max_pixels=200_704)
    img = rand_image(600, 900, seed=3)
    ours, grid = preprocess_image(img, cfg)
    ref_pv, ref_grid = run_reference([img], cfg)
    assert grid == tuple(ref_grid[0].tolist())
    assert grid[1] * grid[2] * 14 * 14 <= 200_704
    np.testing.assert_array_equal(ours, ref_pv)


def test_preprocess_batch_concatenates_like_transformers():
    imgs = [rand_image(56, 84, 4), rand_image(300, 200, 5), rand_image(3, 5, 6), rand_image(224, 224, 7)]
    for cfg in (QWEN2, QWEN3):
        pv, grid = preprocess(imgs, cfg)
        ref_pv, ref_grid = run_reference(imgs, cfg)
        assert isinstance(pv, torch.Tensor) and isinstance(grid, torch.Tensor)
        assert grid.shape == (4, 3) and grid.dtype == torch.int64
        np.testing.assert_array_equal(grid.numpy(), ref_grid)
        np.testing.assert_array_equal(pv.numpy(), ref_pv)
        assert pv.shape[0] == int(grid.prod(dim=1).sum())
        # and equal to per-image preprocess_image
        singles = np.concatenate([preprocess_image(im, cfg)[0] for im in imgs])
        np.testing.assert_array_equal(pv.numpy(), singles)


def test_preprocess_accepts_encoded_sources_and_empty_list():
    img = rand_image(56, 112, 8)
    png = encode(img, "PNG")
    pv, grid = preprocess([png, img], QWEN2)
    half = pv.shape[0] // 2
    np.testing.assert_array_equal(pv[:half].numpy(), pv[half:].numpy())
    assert grid.tolist() == [[1, 4, 8], [1, 4, 8]]
    with pytest.raises(ImageTooLarge):
        preprocess([png], QWEN2.with_overrides(max_image_pixels=56 * 112 - 1))
    pv, grid = preprocess([], QWEN2)
    assert tuple(pv.shape) == (0, QWEN2.patch_dim) and tuple(grid.shape) == (0, 3)


def test_preprocess_image_converts_non_rgb_like_transformers():
    rgba = np.random.default_rng(9).integers(0, 256, (60, 90, 4), dtype=np.uint8)
    img = Image.fromarray(rgba, mode="RGBA")
    ours, _ = preprocess_image(img, QWEN2)
    ref_pv, _ = run_reference([img], QWEN2)
    np.testing.assert_array_equal(ours, ref_pv)


def test_patch_layout_independent_of_reference():
    # Hand-check the merge-block row order and (C, T, p, p) row layout on a tiny image whose pixel
    # values encode their position; the checks below are written from the layout spec, not the code.
    cfg = PreprocessConfig(patch_size=2, temporal_patch_size=2, merge_size=2, min_pixels=16, max_pixels=10_000)
    h, w = 4, 8  # grid 2x4, merge blocks 1x2
    arr = np.zeros((h, w, 3), dtype=np.uint8)
    yy, xx = np.mgrid[0:h, 0:w]
    arr[..., 0] = yy * 10 + xx
    arr[..., 1] = 100 + yy * 10 + xx
    arr[..., 2] = 200 + yy * 10 + xx - 20 * (yy >= 3)  # stay < 256
    out, grid = preprocess_image(Image.fromarray(arr), cfg)
    assert grid == (1, 2, 4) and out.shape == (8, 3 * 2 * 2 * 2)
    mean = np.float32(cfg.image_mean)
    std = np.float32(cfg.image_std)
    # invert the normalization to recover the uint8 values
    vals = out.reshape(8, 3, 2, 2, 2) * std[None, :, None, None, None] + mean[None, :, None, None, None]
    vals = np.rint(vals * 255).astype(int)
    # the two temporal frames are identical
    np.testing.assert_array_equal(vals[:, :, 0], vals[:, :, 1])
    # row order: block (0,0): patches (0,0),(0,1),(1,0),(1,1); block (0,1): (0,2),(0,3),(1,2),(1,3)
    expected_patches = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    for row, (py, px) in enumerate(expected_patches):
        patch = arr[py * 2 : py * 2 + 2, px * 2 : px * 2 + 2].transpose(2, 0, 1)
        np.testing.assert_array_equal(vals[row, :, 0], patch, err_msg=f"row {row}")


# --------------------------------------------------------------------------- smart_resize


def test_smart_resize_sweep_matches_transformers():
    rng = np.random.default_rng(10)
    settings = [
        (28, 3136, 12845056),
        (28, 56 * 56, 28 * 28 * 1280),
        (32, 65536, 16777216),
        (28, 200_000, 400_000),
        (14, 1, 10_000),
        (32, 1024, 1024 * 64),
    ]
    hs = list(range(1, 120)) + rng.integers(1, 20000, 200).tolist()
    count = 0
    for factor, lo, hi in settings:
        for h in hs:
            for w in (1 + (h * 37) % 9999, h, max(1, h // 3), h * 5, 28, 999):
                if max(h, w) / min(h, w) > 200:
                    continue
                assert smart_resize(h, w, factor, lo, hi) == hf_smart_resize(h, w, factor, lo, hi), (h, w, factor)
                count += 1
    assert count > 5000


def test_smart_resize_defaults_and_aspect_ratio():
    assert smart_resize(1000, 700) == hf_smart_resize(1000, 700, 28, 56 * 56, 28 * 28 * 1280)
    assert smart_resize(1, 200, 28, 3136, 12845056) == hf_smart_resize(1, 200, 28, 3136, 12845056)
    for h, w in [(1, 201), (201, 1), (10, 2001), (3, 1000), (100000, 1)]:
        with pytest.raises(BadAspectRatio) as ei:
            smart_resize(h, w)
        assert isinstance(ei.value, ValueError) and ei.value.code == "bad_aspect_ratio"
        with pytest.raises(ValueError):  # transformers agrees these are invalid
            hf_smart_resize(h, w)
    with pytest.raises(ValueError):
        smart_resize(0, 10)


# --------------------------------------------------------------------------- config


def test_config_properties_and_overrides():
    cfg = PreprocessConfig()
    assert cfg.factor == 28 and cfg.patch_dim == 3 * 2 * 14 * 14 == 1176
    assert cfg.image_mean == OPENAI_CLIP_MEAN and cfg.image_std == OPENAI_CLIP_STD
    assert cfg.max_image_pixels == 50_000_000 and cfg.max_pixels == 28 * 28 * 1280 and cfg.min_pixels == 3136
    assert QWEN3.factor == 32 and QWEN3.patch_dim == 1536
    c2 = cfg.with_overrides(max_pixels=1_000_000, image_mean=[0.5, 0.5, 0.5])
    assert c2.max_pixels == 1_000_000 and c2.image_mean == (0.5, 0.5, 0.5) and cfg.max_pixels == 28 * 28 * 1280
    hash(c2)
    with pytest.raises(ValueError):
        cfg.with_overrides(min_pixels=10, max_pixels=5)
    with pytest.raises(ValueError):
        cfg.with_overrides(patch_size=0)


def test_config_from_hf():
    base = PreprocessConfig(max_image_pixels=1234)
    qwen25 = {
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": list(OPENAI_CLIP_MEAN),
        "image_std": list(OPENAI_CLIP_STD),
        "rescale_factor": 0.00392156862745098,
        "resample": 3,
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_convert_rgb": True,
    }
    c = PreprocessConfig.from_hf(qwen25, base)
    assert (c.min_pixels, c.max_pixels, c.patch_size, c.factor) == (3136, 12845056, 14, 28)
    assert c.max_image_pixels == 1234  # not an HF key: from base
    qwen3 = {
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    c = PreprocessConfig.from_hf(qwen3, base)
    assert c == QWEN3.with_overrides(max_image_pixels=1234)
    # missing keys fall back to base; top-level min/max_pixels beat size (as in transformers' __init__)
    c = PreprocessConfig.from_hf(
        {"size": {"shortest_edge": 100, "longest_edge": 5000}, "max_pixels": 7000}, base.with_overrides(patch_size=16)
    )
    assert (c.min_pixels, c.max_pixels, c.patch_size, c.image_mean) == (100, 7000, 16, OPENAI_CLIP_MEAN)
    assert PreprocessConfig.from_hf({}, base) == base
    # the HF reference built from the same dict agrees on the pixel bounds
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = Qwen2VLImageProcessorPil(**{k: v for k, v in qwen25.items() if k != "image_processor_type"})
    c = PreprocessConfig.from_hf(qwen25, base)
    assert (hf.size["shortest_edge"], hf.size["longest_edge"]) == (c.min_pixels, c.max_pixels)
    with pytest.raises(ValueError):
        PreprocessConfig.from_hf({"do_normalize": False}, base)
    with pytest.raises(ValueError):
        PreprocessConfig.from_hf({"rescale_factor": 1 / 127.5}, base)


# --------------------------------------------------------------------------- load_image


def gradient(h=40, w=64) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w]
    return np.stack([(xx * 255 // (w - 1)), (yy * 255 // (h - 1)), ((xx + yy) * 3) % 256], -1).astype(np.uint8)


@pytest.mark.parametrize("orientation,rot", [(3, 2), (6, -1), (8, 1), (1, 0)])
def test_load_image_applies_exif_orientation(orientation, rot):
    stored = Image.fromarray(gradient())  # 64 wide x 40 high
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(stored, "JPEG", exif=exif, quality=95)
    decoded_stored = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    out = load_image(data)
    assert out.mode == "RGB"
    expected = np.rot90(decoded_stored, k=rot)
    assert np.asarray(out).shape == expected.shape
    np.testing.assert_array_equal(np.asarray(out), expected)


def test_load_image_copies_no_image_it_keeps_as_decoded(monkeypatch):
    """An RGB image decoded here, without an EXIF turn, is returned as decoded: no full copy of its pixels
    (exif_transpose copies an image it does not turn); one whose EXIF asks for a turn is turned once; a caller's
    image is never returned itself (the caller's pixels stay theirs)."""
    copies = []
    real_copy = Image.Image.copy
    monkeypatch.setattr(Image.Image, "copy", lambda self: copies.append(self.size) or real_copy(self))
    stored = Image.fromarray(gradient())
    for orientation, turns in ((None, 0), (1, 0), (6, 1)):
        exif = Image.Exif()
        if orientation is not None:
            exif[0x0112] = orientation
        data = encode(stored, "JPEG", exif=exif, quality=95)
        copies.clear()
        out = load_image(data)
        assert copies == [] and out.size == ((40, 64) if turns else (64, 40))
    caller = Image.fromarray(gradient())
    out = load_image(caller)
    assert out is not caller and copies == [caller.size]
    out.putpixel((0, 0), (1, 2, 3))
    assert caller.getpixel((0, 0)) == tuple(gradient()[0, 0])


def _alpha_images():
    rng = np.random.default_rng(11)
    rgba = rng.integers(0, 256, (20, 30, 4), dtype=np.uint8)
    rgba[0, 0, 3] = 0
    rgba[0, 1, 3] = 255
    la = rng.integers(0, 256, (20, 30, 2), dtype=np.uint8)
    la[0, 0, 1] = 0
    pal = Image.fromarray(rng.integers(0, 8, (20, 30), dtype=np.uint8), mode="P")
    pal.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255, 90, 90, 90, 10, 20, 30, 200, 100, 50, 1, 2, 3])
    return {
        "RGBA": encode(Image.fromarray(rgba, mode="RGBA"), "PNG"),
        "LA": encode(Image.fromarray(la, mode="LA"), "PNG"),
        "P-png": encode(pal, "PNG", transparency=1),
        "P-gif": encode(pal, "GIF", transparency=1),
    }


@pytest.mark.parametrize("kind", ["RGBA", "LA", "P-png", "P-gif"])
def test_load_image_transparency_composited_on_white_like_transformers(kind):
    data = _alpha_images()[kind]
    out = np.asarray(load_image(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = hf_convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    np.testing.assert_array_equal(out, ref)
    src = Image.open(io.BytesIO(data))
    transparent = np.asarray(src.convert("RGBA"))[..., 3] == 0
    assert transparent.any()
    assert (out[transparent] == 255).all()  # white, not black / not the hidden colour
    # plain convert("RGB") would differ, so this test can tell compositing apart from it
    assert not np.array_equal(out, np.asarray(src.convert("RGB")))


def _opaque_rgba() -> np.ndarray:
    """An RGBA image with alpha 255 everywhere whose colour bands hold every value 0..255 (each band a different
    arrangement), on a random background."""
    rgba = np.random.default_rng(5).integers(0, 256, (24, 256, 4), dtype=np.uint8)
    rgba[..., 3] = 255
    v = np.arange(256, dtype=np.uint8)
    rgba[0, :, 0], rgba[1, :, 1], rgba[2, :, 2] = v, v[::-1], np.roll(v, 77)
    return rgba


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_load_image_opaque_alpha_matches_transformers_composite(mode):
    """An alpha band every pixel of which is opaque (PNGs and screenshots saved with one they do not use) is dropped
    rather than composited: transformers' composite on white gives the same bytes for every value."""
    rgba = _opaque_rgba()
    img = Image.fromarray(rgba, mode="RGBA")
    if mode == "LA":
        img = img.convert("LA")
    elif mode == "P":  # a palette with a tRNS index no pixel uses: every pixel opaque
        img = Image.fromarray((rgba[..., 0] % 7).astype(np.uint8), mode="P")
        img.putpalette([i * 9 % 256 for i in range(3 * 8)])
    data = encode(img, "PNG", **({"transparency": 7} if mode == "P" else {}))
    assert Image.open(io.BytesIO(data)).mode == mode
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = hf_convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    np.testing.assert_array_equal(np.asarray(load_image(data)), ref)


def _translucent(where: str) -> np.ndarray:
    rgba = _opaque_rgba()
    if where == "last pixel, alpha 254":
        rgba[-1, -1] = (0, 0, 0, 254)
    elif where == "last pixel, alpha 0":
        rgba[-1, -1] = (0, 0, 0, 0)
    elif where == "a block inside":
        rgba[5:9, 100:151, 3] = np.random.default_rng(1).integers(0, 255, (4, 51))
    else:  # the first pixel and the last: the box is the whole image
        rgba[0, 0, 3] = rgba[-1, -1, 3] = 17
    return rgba


@pytest.mark.parametrize(
    "where,box",
    [
        ("last pixel, alpha 254", (1, 1)),
        ("last pixel, alpha 0", (1, 1)),
        ("a block inside", (51, 4)),
        ("first and last pixels", (256, 24)),
    ],
)
def test_load_image_composites_only_the_box_of_translucent_pixels(where, box, monkeypatch):
    """Only the box around the pixels that are not opaque is composited on white, the rest converted: transformers'
    bytes either way (the translucent pixels differ from their colour without the alpha band, so a pixel left out of
    the composite, or an opaque image composited wrongly, fails); an opaque image is not composited at all."""
    composited = []
    real = Image.alpha_composite
    monkeypatch.setattr(Image, "alpha_composite", lambda a, b: composited.append(b.size) or real(a, b))
    data = encode(Image.fromarray(_translucent(where), mode="RGBA"), "PNG")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = hf_convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    composited.clear()
    out = np.asarray(load_image(data))
    np.testing.assert_array_equal(out, ref)
    assert composited == [box]
    assert not np.array_equal(out, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
    composited.clear()
    load_image(encode(Image.fromarray(_opaque_rgba(), mode="RGBA"), "PNG"))
    assert composited == []


def test_load_image_cmyk_jpeg():
    cmyk = np.zeros((16, 32, 4), dtype=np.uint8)
    cmyk[:, :16, 0] = 255  # cyan
    cmyk[:, 16:, 1] = 255  # magenta
    data = encode(Image.fromarray(cmyk, mode="CMYK"), "JPEG", quality=95)
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    out = load_image(data)
    assert out.mode == "RGB"
    arr = np.asarray(out).astype(int)
    np.testing.assert_array_equal(arr, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
    assert np.abs(arr[4:12, 2:12] - [0, 255, 255]).max() <= 8  # cyan
    assert np.abs(arr[4:12, 20:30] - [255, 0, 255]).max() <= 8  # magenta


def test_load_image_16bit_matches_transformers():
    """16-bit images give transformers' numbers (PIL's clipping convert), like every HF-processor-based stack."""
    g = np.array([[0, 255, 256, 0x12FF], [0x8000, 0xFFFF, 0x00FF, 0x7F80]], dtype=np.uint16)
    data = png_bytes(g, color_type=0, bit_depth=16)
    opened = Image.open(io.BytesIO(data))
    assert opened.mode == "I;16"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = hf_convert_to_rgb(opened, return_numpy=True)
    np.testing.assert_array_equal(np.asarray(load_image(data)), ref)
    vals = np.array([[-5, 0, 300, 65535, 70000, 0x4321]], dtype=np.int32)
    img = Image.fromarray(vals, mode="I")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = hf_convert_to_rgb(img, return_numpy=True)
    np.testing.assert_array_equal(np.asarray(load_image(img)), ref)
    # 16-bit grayscale with a tRNS value: transparency composited on white, as transformers does
    g = np.array([[300, 0x8000, 300]], dtype=np.uint16)
    data = encode(Image.fromarray(g), "PNG", transparency=300)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = hf_convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    np.testing.assert_array_equal(np.asarray(load_image(data)), ref)


@pytest.mark.parametrize("mode", ["L", "1", "F", "P", "YCbCr"])
def test_load_image_other_modes_match_convert_rgb(mode):
    base = Image.fromarray(gradient(12, 20))
    img = base.convert(mode) if mode != "F" else base.convert("L").convert("F")
    out = load_image(img)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = hf_convert_to_rgb(img, return_numpy=True)
    assert out.mode == "RGB" and out.size == (20, 12)
    np.testing.assert_array_equal(np.asarray(out), ref)


def test_load_image_animated_first_frame():
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    frames = [Image.new("RGB", (24, 16), c) for c in colors]
    gif = io.BytesIO()
    frames[0].save(gif, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    tiff = io.BytesIO()
    frames[0].save(tiff, "TIFF", save_all=True, append_images=frames[1:])
    webp = io.BytesIO()
    frames[0].save(webp, "WEBP", save_all=True, append_images=frames[1:], lossless=True)
    for data in (gif.getvalue(), tiff.getvalue(), webp.getvalue()):
        opened = Image.open(io.BytesIO(data))
        assert getattr(opened, "n_frames", 1) == 3
        out = np.asarray(load_image(data))
        assert out.shape == (16, 24, 3)
        assert (out == colors[0]).all(), Image.open(io.BytesIO(data)).format
        # a caller's PIL image left on a later frame is rewound to the first one
        opened.seek(2)
        assert (np.asarray(load_image(opened)) == colors[0]).all()


@pytest.mark.parametrize(
    "data,fragment",
    [
        (b"", "empty"),
        (bytearray(), "empty"),
        (memoryview(b""), "empty"),
        (b"hello, this is definitely not an image\n" * 10, "not a recognized image"),
        (np.random.default_rng(12).integers(0, 256, 5000, dtype=np.uint8).tobytes(), "not a recognized image"),
        (b"\x89PNG\r\n\x1a\n", ""),  # signature only
    ],
)
def test_load_image_rejects_garbage(data, fragment):
    with pytest.raises(UndecodableImage) as ei:
        load_image(data)
    assert ei.value.code == "undecodable_image" and isinstance(ei.value, ImageError)
    assert fragment in str(ei.value)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF"])
def test_load_image_truncated(fmt):
    img = rand_image(64, 64, seed=13)
    data = encode(img.convert("P") if fmt == "GIF" else img, fmt)
    load_image(data)  # the full file is fine
    with pytest.raises(UndecodableImage) as ei:
        load_image(data[: len(data) // 2])
    assert ei.value.code == "undecodable_image"


def test_load_image_decompression_bomb_rejected_from_header():
    huge = png_bytes(None, width=100_000, height=100_000, color_type=2)
    t0 = time.perf_counter()
    with pytest.raises(ImageTooLarge) as ei:
        load_image(huge)
    assert ei.value.code == "image_too_large"
    # below PIL's own bomb limit: our declared-size check must trigger, before any decoding
    # (the IDAT here holds 64 bytes for a 2000x2000 image, so decoding would fail as truncated)
    medium = png_bytes(None, width=2000, height=2000, color_type=2)
    with pytest.raises(ImageTooLarge):
        load_image(medium, max_image_pixels=1_000_000)
    with pytest.raises(UndecodableImage):  # under the limit it is decoded and found truncated
        load_image(medium, max_image_pixels=4_000_000)
    assert time.perf_counter() - t0 < 2.0  # nothing was allocated/decoded at 10^10 pixels
    # the limit is inclusive
    ok = encode(rand_image(20, 50), "PNG")
    assert load_image(ok, max_image_pixels=1000).size == (50, 20)
    with pytest.raises(ImageTooLarge):
        load_image(ok, max_image_pixels=999)
    with pytest.raises(ImageTooLarge):
        load_image(rand_image(20, 50), max_image_pixels=999)


def test_load_image_bad_aspect_ratio():
    with pytest.raises(BadAspectRatio) as ei:
        load_image(encode(Image.new("RGB", (402, 2)), "PNG"))
    assert ei.value.code == "bad_aspect_ratio"
    assert load_image(encode(Image.new("RGB", (400, 2)), "PNG")).size == (400, 2)


def test_load_image_accepts_all_source_kinds(tmp_path: Path):
    img = rand_image(30, 45, seed=14)
    data = encode(img, "PNG")
    path = tmp_path / "x.png"
    path.write_bytes(data)
    expected = np.asarray(img)
    for src in (data, bytearray(data), memoryview(data), str(path), path, Image.open(io.BytesIO(data)), img):
        out = load_image(src)
        assert isinstance(out, Image.Image) and out.mode == "RGB", type(src)
        np.testing.assert_array_equal(np.asarray(out), expected)
    assert load_image(img) is not img  # caller's object is not handed back / mutated
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    with pytest.raises(UndecodableImage):
        load_image(empty)
    with pytest.raises(FileNotFoundError):
        load_image(tmp_path / "missing.png")
    with pytest.raises(TypeError):
        load_image(12345)


def test_error_codes():
    assert UndecodableImage.code == "undecodable_image"
    assert ImageTooLarge.code == "image_too_large"
    assert BadAspectRatio.code == "bad_aspect_ratio"
    for cls in (UndecodableImage, ImageTooLarge, BadAspectRatio):
        assert issubclass(cls, ImageError) and issubclass(cls, ValueError)


# --------------------------------------------------------------------------- header readers (issue 25)


def _pil_header(data: bytes):
    from vitserve.encoder.headers import ImageHeader

    with Image.open(io.BytesIO(data)) as img:  # an MPO is the JPEG it starts with
        return ImageHeader(
            "JPEG" if img.format == "MPO" else img.format,
            img.width,
            img.height,
            img.mode,
            "transparency" in img.info or "A" in img.getbands(),
        )


def test_header_readers_agree_with_pil_on_every_format_and_find_the_end():
    """The walks read what PIL reads (format, size, mode, transparency: so the decode memory estimate is PIL's) for
    real files of every accepted format and mode, from the first 64 KB where the header is there (else they say
    so), and where they see the image's end, the bytes up to it decode to the same pixels, with junk after it."""
    from corpus import every_format

    from vitserve.encoder.headers import probe
    from vitserve.encoder.image_errors import HeaderNotFound

    ends = 0
    for name, data in every_format().items():
        want = _pil_header(data)
        whole = probe(data, whole=True)
        assert whole == want, name
        try:
            assert probe(data[:65536]) == want, name
        except HeaderNotFound:
            assert len(data) > 65536, name
        padded = probe(data + b"\x00junk" * 1000, whole=True)
        assert padded == want and padded.end == whole.end, name
        if whole.end is not None:
            ends += 1
            assert whole.end <= len(data)
            np.testing.assert_array_equal(np.asarray(load_image(data[: whole.end])), np.asarray(load_image(data)))
    assert ends >= 30  # JPEG, PNG, GIF, BMP and WebP files end where their walk says


def test_png_modes_are_pils():
    from PIL import PngImagePlugin

    from vitserve.encoder.headers import _PNG_MODES

    assert _PNG_MODES == {key: mode for key, (mode, _) in PngImagePlugin._MODES.items()}


def test_probe_on_the_loop_is_bounded_whatever_the_bytes():
    """Issue 25: PIL's header readers took 5-30 s on these (a byte or a chunk at a time, 3 M Python ints). The bounded
    probe refuses them or hands them on within a millisecond or so (a generous bound here), and the whole-image walk
    a decode worker runs refuses each by its structural limit before PIL sees it."""
    from corpus import fill_before_jpeg, png_chunk_flood, tiff_strip_flood

    from vitserve.encoder.headers import probe
    from vitserve.encoder.image_errors import HeaderNotFound

    cases = {
        "fill": (fill_before_jpeg(22 << 20), "junk between JPEG markers"),
        "chunks": (png_chunk_flood(4 << 20), "chunks before the image data"),
        "strips": (tiff_strip_flood(3_000_000), "3000000 numbers in tag 273, for 16x16 pixels"),
    }
    for name, (data, why) in cases.items():
        start = time.perf_counter()
        with pytest.raises(UndecodableImage):  # refused, or HeaderNotFound: a worker reads it
            probe(data[:65536])
        assert time.perf_counter() - start < 0.05, name
        with pytest.raises(UndecodableImage, match=why) as error:
            probe(data, whole=True)
        assert not isinstance(error.value, HeaderNotFound)
    # 64 KB of tiny segments, sub-blocks or chunks: at most PROBE_STEPS of them on the loop
    com = b"\xff\xd8" + b"\xff\xfe\x00\x02" * 16384
    gif = b"GIF89a\x08\x00\x08\x00\x00\x00\x00" + b"!\xfe" + b"\x01x" * 32768  # a comment of 1-byte sub-blocks
    for data in (com, gif):
        start = time.perf_counter()
        with pytest.raises(HeaderNotFound):
            probe(data)
        assert time.perf_counter() - start < 0.05


def test_a_file_that_ends_before_its_header_is_an_image_error():
    """A JPEG's end of image or a GIF's trailer before any header: on the loop the worker is left to read it
    (HeaderNotFound), in the worker the image is refused (UndecodableImage), never an AttributeError."""
    from vitserve.encoder.headers import probe
    from vitserve.encoder.image_errors import HeaderNotFound

    for data in (b"\xff\xd8\xff\xd9", b"GIF89a\x01\x00\x01\x00\x00\x00\x00;"):
        with pytest.raises(HeaderNotFound):
            probe(data)
        with pytest.raises(UndecodableImage, match="no image header") as error:
            probe(data, whole=True)
        assert not isinstance(error.value, HeaderNotFound)


def test_scan_bombs_are_refused_before_pil_decodes_them():
    """A progressive JPEG with its last scan repeated: libjpeg makes a pass over every block per scan (~2 ns a
    pixel), only warning. At most MAX_JPEG_SCANS scans, and MAX_SCAN_PIXELS scans x pixels."""
    from corpus import progressive_jpeg

    from vitserve.encoder.headers import MAX_JPEG_SCANS, MAX_SCAN_PIXELS, probe

    assert probe(progressive_jpeg(64, MAX_JPEG_SCANS), whole=True).height == 64
    with pytest.raises(UndecodableImage, match="more than 100 scans"):
        probe(progressive_jpeg(64, MAX_JPEG_SCANS + 1), whole=True)
    side = 4000
    allowed = MAX_SCAN_PIXELS // side**2
    assert probe(progressive_jpeg(side, allowed), whole=True).width == side
    with pytest.raises(UndecodableImage, match=f"more than {allowed} scans of {side * side} pixels"):
        probe(progressive_jpeg(side, allowed + 1), whole=True)
    with pytest.raises(UndecodableImage, match="scans"):  # the bomb: 340 KB, 2000 scans of 7000² pixels
        probe(progressive_jpeg(7000, 2000), whole=True)


def test_base64_is_sent_up_to_the_image_end():
    import base64

    from vitserve.encoder.media import MediaBytes

    data = encode(rand_image(8, 8), "PNG")
    text = base64.b64encode(data + bytes(30_000)).decode()
    sent = MediaBytes("data:image/png;base64," + text, 22).ascii(len(data))
    assert len(sent) == -(-len(data) // 3) * 4 and base64.b64decode(bytes(sent))[: len(data)] == data
    wrapped = MediaBytes("\n".join(text[i : i + 76] for i in range(0, len(text), 76)))
    assert len(wrapped.ascii(len(data))) == len(wrapped)  # whitespace before the end: all of it
