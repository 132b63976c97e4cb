"""Resized uint8 pixels -> the tower's patch rows on the device, in the processor's layout and values.

Each row is one patch: its p x p x 3 pixels of each of the T frames in merge-block order (as the Qwen processors
order patches), each byte mapped through a normalization table (preprocess.normalize_lut or preprocess_fast.fast_lut:
exactly that preprocessing's float32 value) and cast to the model's dtype. Where a row's pixels lie is told by four
int64 fields per row (`row_fields`): its first byte in the pixel buffer, the bytes of one pixel row of its item, the
bytes from one frame to the next (0 for an image, whose one frame stands for all T), and its table's offset (0 for
images, 768 for video slices: the second table). On CUDA with Triton one kernel cuts every row (a program per row,
kernels.triton_pixels.patch_rows); elsewhere tensor ops compute the same gathers (`patch_rows`' reference, which the
GPU tests hold the kernel to, bit for bit).
"""

from __future__ import annotations

import numpy as np
import torch

from .kernels import triton_enabled
from .plan import patch_starts

BASE, STRIDE, STEP, TABLE = range(4)  # a row's fields (`row_fields`)
TABLE_BYTES = 256  # a table's entries per channel; the second table starts at 3 * TABLE_BYTES


def row_fields(shapes: list[tuple[int, ...]], starts: list[int], patch: int, merge: int) -> np.ndarray:
    """int64 [4, rows] fields of the patch rows of items of `shapes` ([H, W, 3] images, [T, H, W, 3] video
    slices; sides multiples of `patch`) whose bytes start at `starts` in one buffer, in order."""
    counts = [(s[-3] // patch) * (s[-2] // patch) for s in shapes]
    fields = np.empty((4, sum(counts)), np.int64)
    row = 0
    for shape, start, count in zip(shapes, starts, counts):
        height, width = shape[-3], shape[-2]
        part = fields[:, row : row + count]
        part[BASE] = start + patch_starts(height // patch, width // patch, merge, patch)
        part[STRIDE] = width * 3
        part[STEP] = height * width * 3 if len(shape) == 4 else 0
        part[TABLE] = 3 * TABLE_BYTES if len(shape) == 4 else 0
        row += count
    return fields


def patch_rows(
    pixels: torch.Tensor,
    fields: torch.Tensor,
    lut: torch.Tensor,
    frames: int,
    patch: int,
    dtype: torch.dtype,
    slices: bool,
) -> torch.Tensor:
    """[rows, 3 * frames * patch * patch] rows in `dtype` cut from `pixels` (uint8, flat) as `fields` (int64
    [4, rows], on the pixels' device) place them, values through `lut` (float32 [2 * 3 * 256]: the images' tables,
    then the slices'); `slices`: some rows are a video slice's (frames that differ)."""
    rows = fields.shape[1]
    out = torch.empty(rows, 3 * frames * patch * patch, dtype=dtype, device=pixels.device)
    if rows == 0:
        return out
    if pixels.is_cuda and triton_enabled():
        from .kernels.triton_pixels import patch_rows as fused

        fused(pixels, fields, lut, out, frames, patch)
        return out
    base, stride, step, table = (f[:, None, None, None] for f in fields)  # [rows, 1, 1, 1]
    k = torch.arange(patch, device=pixels.device)
    c = torch.arange(3, device=pixels.device)[None, :, None, None]
    index = base + stride * k[:, None] + (k * 3)[None, :] + c  # [rows, 3, patch, patch]
    view = out.view(rows, 3, frames, patch, patch)
    if not slices:  # one frame, repeated
        view.copy_(lut[c * TABLE_BYTES + pixels[index].long()][:, :, None].expand_as(view))
    else:
        f = torch.arange(frames, device=pixels.device)[None, None, :, None, None]
        at = index[:, :, None] + step[..., None] * f  # [rows, 3, frames, patch, patch]
        view.copy_(lut[table[..., None] + c[:, :, None] * TABLE_BYTES + pixels[at].long()])
    return out
