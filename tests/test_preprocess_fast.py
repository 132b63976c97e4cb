"""The fast preprocessing (encoder.preprocess_fast) on the CPU: EXIF orientation as PIL turns images, values within
transformers' own slow-vs-fast tolerance of its PIL processor, the runner's device gather equal to the processor
layout, and the server's fast path (full-size images from the decode workers, JPEGs left encoded) answering what the
library does. Against transformers' torchvision processor on CUDA: test_preprocess_fast_gpu.py."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from helpers import b64_tensor, data_uri, rel_err, wait_until
from PIL import Image

from vitserve.encoder import VisionEncoder, preprocess_fast
from vitserve.encoder.preprocess import (
    EncodedJpeg,
    PreprocessConfig,
    UndecodableImage,
    jpeg_for_device,
    load_for_device,
    load_image,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

CFG = PreprocessConfig(min_pixels=3136, max_pixels=12845056)


def photo(h: int, w: int, seed: int = 0) -> np.ndarray:
    """Smooth content with texture, as photos have (pure noise is where resize kernels differ most)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([127 + 100 * np.sin(x / (7 + c) + y / (11 + 2 * c) + seed) for c in range(3)], -1)
    return np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)


def encoded(array: np.ndarray, fmt: str, **save) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, fmt, **save)
    return buf.getvalue()


def broken_scan(jpeg: bytes) -> bytes:
    """A JPEG whose start-of-scan header claims 9 components: every marker before it reads (PIL's header parse
    stops there), the pixels do not."""
    sos = jpeg.find(b"\xff\xda")
    return jpeg[: sos + 2] + b"\x00\x0c\x09" + jpeg[sos + 5 :]


IMAGES = [
    encoded(photo(300, 451, 1), "PNG"),
    encoded(photo(640, 427, 2), "JPEG", quality=90),
    encoded(photo(90, 700, 3), "PNG"),
    encoded(photo(1000, 872, 4), "JPEG", quality=85),
    encoded(photo(40, 40, 5)[..., 0], "PNG"),
    encoded(np.dstack([photo(200, 300, 6), photo(200, 300, 7)[..., :1]]), "PNG"),
]


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orient_turns_an_image_as_pil_exif_transpose(orientation):
    array = photo(37, 53, orientation)
    image = Image.fromarray(array)
    exif = image.getexif()
    exif[0x0112] = orientation
    data = encoded(array, "JPEG", exif=exif, quality=95)
    jpeg = jpeg_for_device(data)
    stored = torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB"))).permute(2, 0, 1)
    turned = preprocess_fast.orient(stored, orientation).permute(1, 2, 0).numpy()
    assert np.array_equal(turned, np.asarray(load_image(data)))  # PIL's ImageOps.exif_transpose
    assert (jpeg.height, jpeg.width) == turned.shape[:2] and jpeg.orientation == orientation


def test_only_rgb_and_grayscale_jpegs_stay_encoded():
    assert isinstance(load_for_device(IMAGES[1], jpeg_on_device=True), EncodedJpeg)
    assert isinstance(load_for_device(IMAGES[1], jpeg_on_device=False), np.ndarray)  # no nvJPEG: PIL decodes
    assert isinstance(load_for_device(IMAGES[0], jpeg_on_device=True), np.ndarray)  # a PNG
    cmyk = io.BytesIO()
    Image.fromarray(photo(64, 64)).convert("CMYK").save(cmyk, "JPEG")
    assert jpeg_for_device(cmyk.getvalue()) is None  # PIL decodes CMYK
    with pytest.raises(UndecodableImage):
        jpeg_for_device(b"not an image at all")
    assert jpeg_for_device(IMAGES[1][: len(IMAGES[1]) // 2]) is None  # truncated: PIL decodes it (and refuses it)
    assert isinstance(jpeg_for_device(broken_scan(IMAGES[1])), EncodedJpeg)  # its header reads
    with pytest.raises(UndecodableImage):
        load_image(broken_scan(IMAGES[1]))
    full = load_for_device(IMAGES[0], jpeg_on_device=False)
    assert full.shape == (300, 451, 3) and full.dtype == np.uint8  # full size: the device resizes


def test_fast_values_within_transformers_slow_vs_fast_tolerance():
    """transformers holds its two Qwen2-VL processors equivalent within a mean difference of 5e-3 (its
    `_assert_slow_fast_tensors_equivalence`); the fast path's values on the CPU keep to that against the PIL
    processor, with the same grids."""
    reference = Qwen2VLImageProcessorPil(size={"shortest_edge": CFG.min_pixels, "longest_edge": CFG.max_pixels})
    for data in IMAGES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = reference(images=[load_image(data)], return_tensors="pt")
        pixels, grids = preprocess_fast.preprocess([data], CFG)
        assert torch.equal(grids, ref["image_grid_thw"])
        diff = (pixels - ref["pixel_values"].float()).abs()
        assert diff.mean() <= 5e-3, (diff.mean(), diff.max())
        assert diff.max() <= 0.25  # a few uint8 levels at most, where the two bicubic kernels round apart


def test_fast_lut_is_the_fused_float32_normalize():
    lut = preprocess_fast.fast_lut(CFG.image_mean, CFG.image_std)
    values = torch.arange(256, dtype=torch.float32)
    mean = torch.tensor(CFG.image_mean) * 255.0  # transformers: mean * (1 / rescale_factor), in float32
    std = torch.tensor(CFG.image_std) * 255.0
    assert torch.equal(torch.tensor(lut), (values[None] - mean[:, None]) / std[:, None])


def test_fast_encode_runs_the_processor_layout():
    """The runner's gather from device-side uint8 images with the fast table gives what the processor layout does."""
    enc = VisionEncoder.from_pretrained("tiny-qwen2.5-vl", load_format="dummy", preprocess="fast")
    direct = enc.encode(IMAGES)
    pixels, grids = enc.preprocess(IMAGES)
    for a, b in zip(direct, enc.encode_pixels(pixels, grids)):
        assert a.grid_thw == b.grid_thw and torch.equal(a.embeddings, b.embeddings)
    exact = VisionEncoder.from_pretrained("tiny-qwen2.5-vl", load_format="dummy").encode(IMAGES)
    assert all(rel_err(a.embeddings, b.embeddings) < 2e-2 for a, b in zip(direct, exact))  # close, not identical
    with pytest.raises(ValueError, match="preprocess"):
        VisionEncoder.from_pretrained("tiny-qwen2.5-vl", load_format="dummy", preprocess="quick")


@pytest.mark.slow
@pytest.mark.parametrize("device_processes", [False, True])
def test_server_fast_path_answers_what_the_library_does(device_processes, tmp_path):
    """`--preprocess fast`: decode workers send full-size pixels (and JPEGs still encoded, here forced: the device
    then decodes them with PIL, having no nvJPEG), the device resizes to the request's size; a bad image fails
    only its request."""
    enc = VisionEncoder.from_pretrained("tiny-qwen2.5-vl", load_format="dummy", preprocess="fast")
    direct = enc.encode(IMAGES)
    from fastapi.testclient import TestClient

    from vitserve.service.entry.app import create_app
    from vitserve.service.ground.settings import Settings
    from vitserve.service.pipeline.engine import Engine

    settings = Settings.of(
        model="tiny-qwen2.5-vl",
        load_format="dummy",
        preprocess="fast",
        cache_bytes=0,
        device_processes=device_processes,
        spool_dir=str(tmp_path),
        device="cpu",
    )
    engine = Engine(settings, encoders=None if device_processes else enc)
    engine.decoder.jpeg_on_device = True
    with TestClient(create_app(settings, engine)) as c:
        wait_until(lambda: c.get("/ready").status_code == 200, 60, "ready")
        r = c.post("/v1/encode", json={"images": [data_uri(x) for x in IMAGES], "dtype": "float32"})
        assert r.status_code == 200, r.text
        for item, d in zip(r.json()["data"], direct):
            assert item["grid_thw"] == list(d.grid_thw)
            assert rel_err(b64_tensor(item["embeddings"], item["shape"]), d.embeddings) <= 1e-6
        small = c.post("/v1/encode", json={"images": [data_uri(IMAGES[1])], "max_pixels": 100_000})
        assert small.status_code == 200 and np.prod(small.json()["data"][0]["grid_thw"]) * 196 <= 100_000 * 1.1
        for broken in (broken_scan(IMAGES[1]), IMAGES[1][: len(IMAGES[1]) // 2]):  # fails on the device; the worker
            bad = c.post("/v1/encode", json={"images": [data_uri(IMAGES[0]), data_uri(broken)]})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "images[1]", bad.text
            assert bad.json()["error"]["code"] == "undecodable_image"
        assert c.post("/v1/encode", json={"images": [data_uri(IMAGES[2])]}).status_code == 200
