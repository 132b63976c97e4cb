"""GPU-only: the fast preprocessing against transformers' own fast (torchvision) Qwen2-VL image processor run on the
same CUDA device, nvJPEG's decode against PIL's, and a JPEG nvJPEG cannot read failing alone (skipped cleanly
without CUDA or torchvision)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from test_preprocess_fast import CFG, IMAGES, broken_scan, encoded, photo

from vitserve.encoder import VisionEncoder, preprocess_fast
from vitserve.encoder.preprocess import (
    EncodedJpeg,
    ImageError,
    UndecodableImage,
    load_for_device,
    load_image,
    target_size,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not preprocess_fast.nvjpeg_available(), reason="needs CUDA and torchvision"),
]


def processor():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor(size={"shortest_edge": CFG.min_pixels, "longest_edge": CFG.max_pixels})


def close(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """transformers' slow-vs-fast tolerance (atol 0.1, rtol 1e-3, mean 5e-3); the largest difference."""
    torch.testing.assert_close(ours, theirs, atol=1e-1, rtol=1e-3)
    assert (ours - theirs).abs().mean() <= 5e-3
    return float((ours - theirs).abs().max())


def test_fast_equals_transformers_fast_processor_on_cuda():
    """PNGs (decoded by PIL on both sides) and JPEGs (nvJPEG on both sides: the processor fed torchvision's own
    CUDA decode): the same grids, and the same values to transformers' tolerance."""
    from torchvision.io import ImageReadMode, decode_jpeg

    hf = processor()
    for data in IMAGES:
        if data[:2] == b"\xff\xd8":
            source = decode_jpeg(
                torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB, device="cuda"
            )
        else:
            source = load_image(data)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = hf(images=[source], return_tensors="pt", device="cuda")
        pixels, grids = preprocess_fast.preprocess([data], CFG, "cuda")
        assert torch.equal(grids, ref["image_grid_thw"].cpu())
        largest = close(pixels, ref["pixel_values"].float().cpu())
        print(f"{len(data)} bytes {tuple(grids[0].tolist())}: largest difference {largest:.2e}")


def test_nvjpeg_decodes_as_pil_does_within_a_level_or_two():
    from torchvision.io import ImageReadMode, decode_jpeg

    for data in (IMAGES[1], IMAGES[3], encoded(photo(480, 640, 9)[..., 0], "JPEG")):
        ours = (
            decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB, device="cuda")
            .permute(1, 2, 0)
            .cpu()
            .numpy()
            .astype(int)
        )
        pil = np.asarray(load_image(data)).astype(int)
        diff = np.abs(ours - pil)
        print(f"nvJPEG against PIL: mean {diff.mean():.3f} levels, largest {diff.max()}")
        assert ours.shape == pil.shape and diff.mean() < 6.0  # an IDCT and chroma upsampling apart, not an image


def test_a_jpeg_nvjpeg_refuses_fails_alone_or_falls_back_to_pil():
    good = load_for_device(IMAGES[1], jpeg_on_device=True)
    broken = load_for_device(broken_scan(IMAGES[3]), jpeg_on_device=True)  # its header reads, its scan does not
    exif = Image.fromarray(photo(120, 200, 3)).getexif()
    exif[0x0112] = 6
    rotated_data = encoded(photo(120, 200, 3), "JPEG", exif=exif)
    rotated = load_for_device(rotated_data, jpeg_on_device=True)
    assert all(isinstance(x, EncodedJpeg) for x in (good, broken, rotated))
    with pytest.raises(UndecodableImage):  # no end marker: PIL's to decode, and it refuses a truncated file
        load_for_device(IMAGES[3][: len(IMAGES[3]) // 3], jpeg_on_device=True)
    sizes = [target_size(x, CFG) for x in (good, broken, rotated)]
    out = preprocess_fast.resize_on_device([good, broken, rotated], sizes, torch.device("cuda"))
    assert out[0].is_cuda and tuple(out[0].shape) == (*sizes[0], 3)
    assert isinstance(out[1], ImageError)  # neither nvJPEG nor PIL reads it: only it fails
    assert tuple(out[2].shape) == (*sizes[2], 3) and sizes[2][0] > sizes[2][1]  # turned upright (orientation 6)


def test_fast_encoder_on_cuda_matches_its_processor_layout():
    enc = VisionEncoder.from_pretrained(
        "tiny-qwen2.5-vl",
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        budgets=(256, 1024, 4096),
        preprocess="fast",
    )
    direct = enc.encode(IMAGES)
    pixels, grids = enc.preprocess(IMAGES)
    for a, b in zip(direct, enc.encode_pixels(pixels, grids)):
        assert a.grid_thw == b.grid_thw
        assert torch.allclose(a.embeddings.float(), b.embeddings.float(), rtol=1e-2, atol=1e-2)
