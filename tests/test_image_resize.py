"""Pillow's bicubic resize as integer tensor ops (encoder.pixels.pillow_resize), against the installed Pillow's
`Image.resize(BICUBIC)`, what transformers' PIL image processor runs: the same bytes for downscales, upscales, mixed
ones, odd sizes and extreme aspect ratios, in whichever order of passes that Pillow takes; on CUDA, the same bytes
as on the CPU; and a library encoder that resizes on the device gives the features of one that resizes with PIL."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch
from PIL import Image

from vitserve.encoder import VisionEncoder, pixels
from vitserve.encoder.pixels import pillow_resize, pillow_resize_plan, pillow_rows_first, resize

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def photo(width: int, height: int, seed: int) -> np.ndarray:
    """uint8 [height, width, 3]: smooth ramps (long runs of equal weights' sums), with 30% of the pixels random
    (every product and clamp, 0 and 255 beside each other)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    ramps = np.stack([xx * 255 // max(width - 1, 1), yy * 255 // max(height - 1, 1), (xx + yy) * 7 % 256], -1)
    noisy = rng.random((height, width, 1)) < 0.3
    return np.where(noisy, rng.integers(0, 256, (height, width, 3)), ramps).astype(np.uint8)


# (width, height) -> (width, height): smart_resize's small changes, 448², downscales by up to 9, upscales, one side
# only, 1-pixel sides, aspect ratios past 100:1, and each order of passes
SIZES = [
    ((1000, 700), (1008, 700)),
    ((640, 480), (448, 448)),
    ((4032, 3024), (448, 336)),
    ((37, 53), (84, 112)),
    ((97, 61), (97, 140)),
    ((97, 61), (40, 61)),
    ((1, 150), (28, 112)),
    ((150, 1), (112, 28)),
    ((4, 600), (28, 420)),
    ((2, 300), (28, 280)),
    ((500, 300), (28, 1400)),
    ((320, 240), (308, 532)),
    ((240, 320), (532, 308)),
    ((300, 400), (310, 390)),
    ((300, 400), (290, 410)),
]


def pil(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    return np.asarray(Image.fromarray(image).resize(size, Image.Resampling.BICUBIC))


def ours(image: np.ndarray, size: tuple[int, int], device: str = "cpu") -> np.ndarray:
    x = torch.from_numpy(image.copy()).to(device).permute(2, 0, 1)
    return pillow_resize(x, size[1], size[0]).permute(1, 2, 0).cpu().numpy()


@pytest.mark.parametrize("source, target", SIZES, ids=str)
def test_the_resize_is_pillows(source, target):
    image = photo(*source, seed=source[0] + target[1])
    assert np.array_equal(ours(image, target), pil(image, target))


def test_random_sizes_are_pillows():
    """Sizes no one picked: 60 random pairs of sides up to 900."""
    rng = np.random.default_rng(7)
    for _ in range(60):
        source, target = tuple(rng.integers(1, 700, 2)), tuple(rng.integers(1, 900, 2))
        image = photo(int(source[0]), int(source[1]), seed=int(source[0]))
        size = (int(target[0]), int(target[1]))
        assert np.array_equal(ours(image, size), pil(image, size)), (source, size)


@pytest.mark.parametrize(
    "source, target", [((240, 320), (532, 308)), ((4, 600), (28, 420)), ((300, 400), (290, 410))], ids=str
)
def test_the_order_of_the_passes_is_the_installed_pillows(source, target):
    """Each pass rounds to uint8, so the order changes the bytes: the other order than the one
    `pillow_rows_first` names for the installed Pillow differs from it."""
    image = photo(*source, seed=3)
    plan = pillow_resize_plan(source[1], source[0], target[1], target[0])
    x = torch.from_numpy(image.copy()).permute(2, 0, 1)
    other = resize(x, dataclasses.replace(plan, rows_first=not plan.rows_first)).permute(1, 2, 0).numpy()
    assert not np.array_equal(other, pil(image, target))


@pytest.mark.parametrize(
    "version, rows_first",
    [
        ((13, 0), [True, True, False, False]),
        ((12, 2), [False, True, False, False]),
        ((11, 3), [False, False, False, False]),
    ],
)
def test_each_pillow_version_has_its_order(monkeypatch, version, rows_first):
    """Pillow 13 resamples rows first where the height shrinks by more than twice what the width does; 12.2-12.x
    where an image over 100 times taller than wide shrinks in height; earlier ones never (each checked against that
    release's wheel: docs/decisions.md)."""
    monkeypatch.setattr(pixels, "_pillow_version", lambda: version)
    cases = [(320, 240, 308, 532), (600, 4, 420, 28), (400, 300, 410, 290), (448, 448, 448, 448)]
    assert [pillow_rows_first(*case) for case in cases] == rows_first


def test_a_pass_taken_in_steps_is_the_same(monkeypatch):
    """A large downscale gathers its taps in steps of output pixels (GATHERED_BYTES): forced to many small steps,
    the bytes are still Pillow's, for both axes."""
    monkeypatch.setattr(pixels, "GATHERED_BYTES", 3 * 64 * 4 * 7)
    for source, target in [((640, 480), (448, 448)), ((97, 61), (40, 140))]:
        image = photo(*source, seed=11)
        assert np.array_equal(ours(image, target), pil(image, target)), (source, target)


def test_the_same_size_is_not_filtered():
    x = torch.from_numpy(photo(56, 84, 1)).permute(2, 0, 1)
    assert pillow_resize(x, 84, 56) is x


def test_an_encoder_resizing_on_the_device_gives_the_hosts_features():
    """image_resize="device" (Pillow's arithmetic on the device, CPU tensors here) against "host" (PIL): the same
    pixels, so the same float32 features; a bad value is refused."""
    images = [Image.fromarray(photo(w, h, w)) for w, h in [(250, 335), (97, 61), (64, 64), (30, 500)]]
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated: a PIL image is taken as it is (no EXIF turn), as the host path and transformers do
    buffer = io.BytesIO()
    Image.fromarray(photo(90, 60, 2)[..., 0]).save(buffer, "JPEG", exif=exif.tobytes())
    images += [Image.open(buffer), Image.fromarray(photo(70, 50, 3)).convert("P")]  # grayscale, palette
    host = VisionEncoder.from_pretrained("tiny-qwen3-vl", load_format="dummy", image_resize="host")
    device = VisionEncoder.from_pretrained("tiny-qwen3-vl", load_format="dummy", image_resize="device")
    assert device.resize_on_device and not host.resize_on_device
    for a, b in zip(host.encode(images), device.encode(images)):
        assert a.grid_thw == b.grid_thw and torch.equal(a.embeddings, b.embeddings)
    with pytest.raises(ValueError, match="image_resize"):
        VisionEncoder.from_pretrained("tiny-qwen3-vl", load_format="dummy", image_resize="gpu")


@cuda
@pytest.mark.parametrize("source, target", SIZES, ids=str)
def test_the_resize_on_cuda_is_pillows(source, target):
    image = photo(*source, seed=source[1])
    assert np.array_equal(ours(image, target, "cuda"), pil(image, target))
