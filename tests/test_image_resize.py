"""Pillow's bicubic resize of batches of images on a device (encoder.image_resize: tensor ops on the CPU, a Triton
kernel on CUDA), against the installed Pillow's `Image.resize(BICUBIC)`, what transformers' PIL image processor
runs: the same bytes for downscales, upscales, mixed ones, odd sizes and extreme aspect ratios, in whichever order of
passes that Pillow takes, each image of a batch as it is alone; on CUDA, the same bytes; and a library encoder that
resizes on the device gives the features of one that resizes with PIL."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from vitserve.encoder import VisionEncoder, image_resize, pixels, vision_encoder
from vitserve.encoder.image_resize import pillow_resize_images
from vitserve.encoder.pixels import pillow_rows_first

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
    return pillow_resize_images([image], [(size[1], size[0])], device)[0].cpu().numpy()


def batch(images: list[np.ndarray], sizes: list[tuple[int, int]], device: str = "cpu") -> list[np.ndarray]:
    return [x.cpu().numpy() for x in pillow_resize_images(images, [(h, w) for w, h in sizes], device)]


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
def test_the_order_of_the_passes_is_the_installed_pillows(monkeypatch, source, target):
    """Each pass rounds to uint8, so the order changes the bytes: the other order than the one
    `pillow_rows_first` names for the installed Pillow differs from it."""
    image = photo(*source, seed=3)
    monkeypatch.setattr(image_resize, "pillow_rows_first", lambda *shape: not pillow_rows_first(*shape))
    assert not np.array_equal(ours(image, target), pil(image, target))


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


def test_lines_taken_in_steps_are_the_same(monkeypatch):
    """The tensor ops compute a few lines at a time (GATHERED output bytes): forced to one line per step, the bytes
    are still Pillow's, for both axes."""
    monkeypatch.setattr(image_resize, "GATHERED", 1)
    for source, target in [((640, 480), (448, 448)), ((97, 61), (40, 140))]:
        image = photo(*source, seed=11)
        assert np.array_equal(ours(image, target), pil(image, target)), (source, target)


def test_images_resized_together_are_each_as_alone(monkeypatch):
    """One batch of every size above (passes in both orders, one axis or none, 1-pixel sides) gives each image
    Pillow's bytes, as when split into batches of one image (UPLOAD_BYTES) or resized alone; an image at its size
    comes back as it is."""
    images = [photo(*source, seed=i) for i, (source, _) in enumerate(SIZES)] + [photo(56, 84, 1)]
    sizes = [target for _, target in SIZES] + [(56, 84)]
    together = batch(images, sizes)
    for image, size, got in zip(images, sizes, together):
        assert np.array_equal(got, pil(image, size)), size
    monkeypatch.setattr(image_resize, "UPLOAD_BYTES", 1)
    for got, again in zip(together, batch(images, sizes)):
        assert np.array_equal(got, again)


def test_the_batch_lays_out_every_pass_apart():
    """The plan's regions: the uploaded bytes (tables, lines, images), the first passes' outputs and the results
    follow one another without overlap, each line writes inside its image's output, and reads inside its source."""
    shapes, sizes = [(300, 400), (61, 97), (84, 56), (600, 4)], [(290, 410), (140, 40), (84, 56), (420, 28)]
    plan = image_resize.plan_batch(shapes, sizes)
    lines = plan.lines
    # a first pass has a line per source row (columns first) or output row (rows first), a second one per output row
    first = [h if pillow_rows_first(*shape, h, w) else shape[0] for shape, (h, w) in zip(shapes, sizes)]
    assert plan.launches == ((0, sum(first) - 84), (sum(first) - 84, sum(first) - 84 + 290 + 140 + 420))
    inputs = [(at, at + h * w * 3) for at, (h, w) in zip(plan.inputs, shapes)]
    results = [(at, at + h * w * 3) for at, h, w in plan.results]
    assert all(end <= start for (_, end), (start, _) in zip(inputs, inputs[1:])) and inputs[-1][1] <= plan.upload
    assert plan.results[2][0] == plan.inputs[2]  # at its size: the image itself
    written = sorted((int(r[image_resize.DST]), int(r[image_resize.DST] + r[image_resize.COUNT])) for r in lines)
    assert all(end <= start for (_, end), (start, _) in zip(written, written[1:]))  # no byte written twice
    assert written[0][0] >= plan.upload and written[-1][1] <= plan.size
    for lo, hi in [results[i] for i in (0, 1, 3)]:
        assert sum(min(hi, e) - max(lo, s) for s, e in written if s < hi and e > lo) == hi - lo  # every byte once


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


@pytest.mark.parametrize(
    "preprocess, on_device, device, warmed",
    [
        ("exact", True, "cuda", True),
        ("exact", False, "cuda", False),
        ("fast", True, "cuda", False),
        ("exact", True, "cpu", False),
    ],
)
def test_capture_runs_the_resize_once_where_requests_will(monkeypatch, preprocess, on_device, device, warmed):
    """An encoder whose exact preprocessing resizes on a CUDA device runs its resize once at capture, both passes,
    so that the kernel's first launch (Triton's compile or its load) is not the first request's; elsewhere (the
    host resizes, fast preprocessing's own resize, the CPU's tensor ops) nothing runs. (The encoder here is on the
    CPU, told it is on CUDA; the resize and the sync are recorded.)"""
    encoder = VisionEncoder.from_pretrained("tiny-qwen3-vl", load_format="dummy", capture=False)
    encoder.preprocess_mode, encoder.resize_on_device, encoder.device = preprocess, on_device, torch.device(device)
    calls = []
    monkeypatch.setattr(encoder.runner, "capture", lambda: calls.append("capture"))
    monkeypatch.setattr(vision_encoder, "pillow_resize_images", lambda *args: calls.append(("resize", *args)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", device)))
    encoder.capture()
    assert calls[0] == "capture" and len(calls) == (3 if warmed else 1)
    if warmed:
        (_, images, sizes, at), sync = calls[1:]
        assert at == torch.device("cuda") and sync == ("sync", at)
        passes = image_resize.plan_batch([x.shape[:2] for x in images], sizes).launches
        assert all(end > start for start, end in passes)  # the first passes' launch and the second's


@cuda
@pytest.mark.parametrize("source, target", SIZES, ids=str)
def test_the_resize_on_cuda_is_pillows(source, target):
    image = photo(*source, seed=source[1])
    assert np.array_equal(ours(image, target, "cuda"), pil(image, target))


@cuda
def test_the_kernel_gives_the_tensor_ops_bytes():
    """kernels.triton_pixels.resample_lines against the tensor ops on the same batch on CUDA (Triton off), and
    against Pillow: 60 random sizes in one batch."""
    rng = np.random.default_rng(5)
    sources = [tuple(int(v) for v in rng.integers(1, 700, 2)) for _ in range(60)]
    sizes = [tuple(int(v) for v in rng.integers(1, 900, 2)) for _ in range(60)]
    images = [photo(*source, seed=i) for i, source in enumerate(sources)]
    fused = batch(images, sizes, "cuda")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(image_resize, "triton_enabled", lambda: False)
        reference = batch(images, sizes, "cuda")
    for image, size, a, b in zip(images, sizes, fused, reference):
        assert np.array_equal(a, b) and np.array_equal(a, pil(image, size)), size
