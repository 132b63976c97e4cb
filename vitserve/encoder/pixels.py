"""Exact integer pixel arithmetic as plain tensor ops, on any device: a video frame's YUV planes to RGB as FFmpeg's
swscale converts them for PyAV's `to_ndarray(format="rgb24")`, and a uint8 resize as torch's CPU kernel computes
torchvision's `resize(BICUBIC, antialias=True)` (what transformers' video processors run). Both give the same bytes
as those libraries, so the conversion and the resize can run on the GPU beside the tower.

* conversion (`yuv_to_rgb`): swscale's unscaled yuv420p → rgb24 converter (x86's `yuv_2_rgb.asm`, the one FFmpeg
  runs on every x86 host): the planes shifted left by 3 less their offsets, multiplied by 13-bit coefficients
  keeping the high 16 bits (`pmulhw`: floor of the product / 2^16), summed and clamped to [0, 255]; the chroma of a
  2x2 block shared by its four pixels. The coefficients come from the frame's colour matrix and range as
  `ff_yuv2rgb_c_init_tables` computes them (`video_planes.Conversion.of`). swscale takes that converter only for
  frames of even height: a frame of odd height has no exact conversion here (`Conversion.of` gives None).
* resize (`resize_plan`, `resize`): torch's separable uint8 antialias kernel: per output pixel of each axis, the
  bicubic (a = -0.5) weights of its source span, computed in float64, normalized, and scaled to int16 by the axis'
  precision (the most bits that keep twice the largest weight under 2^15); a horizontal pass into uint8, then a
  vertical one, each `clamp((Σ w·x + 2^(p-1)) >> p, 0, 255)`; an axis whose size does not change is not resampled.
* `frames_from_planes`: both, for a video slice's planes (video_planes.SlicePlanes) on the device that runs it
  (on CUDA fused into two Triton kernels of the same arithmetic, kernels.triton_pixels).
* Pillow's resize (`axis_resize(pillow=True)`, `pillow_rows_first`; encoder.image_resize runs it on batches of
  images): `Image.resize(BICUBIC)` of a uint8 image, what transformers' PIL image processor runs (Pillow's
  `libImaging/Resample.c`): the same separable scheme with Pillow's own bicubic expression, weights scaled by 2^22
  (rounded half away from zero), each pass `clamp((Σ w·x + 2^21) >> 22, 0, 255)` in 32-bit integers; the rows' pass
  runs first where the installed Pillow runs it first (`pillow_rows_first`), since each pass rounds to uint8 and
  the order changes the bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .kernels import triton_enabled
from .video_planes import Conversion, PlanesLayout


def _mulhi(x: torch.Tensor, c: int) -> torch.Tensor:
    return (x * c) >> 16


def yuv_to_rgb(y: torch.Tensor, u: torch.Tensor, v: torch.Tensor, conversion: Conversion) -> torch.Tensor:
    """uint8 RGB [..., 3, H, W] of uint8 planes y [..., H, W], u and v [..., ceil(H / 2), ceil(W / 2)]."""
    h, w = y.shape[-2:]
    c = conversion
    u = (u.int() * 8 - 1024).repeat_interleave(2, -2).repeat_interleave(2, -1)[..., :h, :w]
    v = (v.int() * 8 - 1024).repeat_interleave(2, -2).repeat_interleave(2, -1)[..., :h, :w]
    luma = _mulhi(y.int() * 8 - c.y_offset, c.y)
    r = luma + _mulhi(v, c.v_r)
    g = luma + (_mulhi(u, c.u_g) + _mulhi(v, c.v_g))
    b = luma + _mulhi(u, c.u_b)
    return torch.stack([r, g, b], -3).clamp_(0, 255).to(torch.uint8)


@dataclass(frozen=True)
class AxisResize:
    """One axis of a uint8 antialias resize (torch's or Pillow's): per output pixel, the first source pixel of its
    span (`first`), the source pixels of its `taps` (`index`: from `first` on, held at the last source pixel) and
    their integer weights (`weights`, zero past the span), scaled by 2^precision."""

    first: torch.Tensor  # int64 [out]
    index: torch.Tensor  # int64 [out, taps]
    weights: torch.Tensor  # int32 [out, taps]
    precision: int

    def to(self, device: torch.device | str) -> AxisResize:
        first, index, weights = (_to(t, device) for t in (self.first, self.index, self.weights))
        return AxisResize(first, index, weights, self.precision)


def upload(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A host array on the device, same shape and dtype: on CUDA copied once into pinned memory and from there
    without blocking, so that the host never waits for the work already queued on the device."""
    pinned = torch.device(device).type == "cuda"
    t = torch.empty(array.shape, dtype=torch.from_numpy(np.empty(0, array.dtype)).dtype, pin_memory=pinned)
    t.numpy()[...] = array
    return t.to(device, non_blocking=True) if pinned else t


def _to(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    return upload(t.numpy(), device) if t.device.type == "cpu" and torch.device(device).type == "cuda" else t.to(device)


def _bicubic(x: np.ndarray) -> np.ndarray:
    """torch's bicubic (a = -0.5), as its `aa_filter` writes it."""
    a, x = -0.5, np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _bicubic_pillow(x: np.ndarray) -> np.ndarray:
    """Pillow's `bicubic_filter` (a = -0.5), its expression as written: float64 rounds it apart from torch's."""
    a, x = -0.5, np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


PILLOW_PRECISION = 22  # Resample.c's PRECISION_BITS


def axis_resize(size_in: int, size_out: int, pillow: bool = False) -> AxisResize:
    """The antialias bicubic weights for one axis, each float64 operation as there (vectorized over the output
    pixels; the sums run in order): torch's int16 ones (UpSampleKernel.cpp's `_compute_weights_aa` and
    `_compute_index_ranges_int16_weights`: the precision is the most bits that keep twice the largest weight under
    2^15) or, with `pillow`, Pillow's (Resample.c's `precompute_coeffs` and `normalize_coeffs_8bpc`: 22 bits)."""
    scale = size_in / size_out
    support = 2.0 * scale if scale >= 1.0 else 2.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(size_out, dtype=np.float64) + 0.5)
    first = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)  # (C's int(): toward zero)
    size = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), size_in) - first
    taps = int(size.max())
    tap = np.arange(taps)
    within = tap[None, :] < size[:, None]
    ws = np.where(
        within,
        (_bicubic_pillow if pillow else _bicubic)(((tap + first[:, None]) - center[:, None] + 0.5) * invscale),
        0.0,
    )
    total = np.zeros(size_out)
    for k in range(taps):  # in order, as both sum
        total = total + ws[:, k]
    ws = np.where(total[:, None] != 0.0, ws / np.where(total == 0.0, 1.0, total)[:, None], ws)
    if pillow:
        precision = PILLOW_PRECISION
    else:
        largest = float(ws.max())
        precision = 0
        while precision < 22 and int(0.5 + largest * (1 << (precision + 1))) < (1 << 15):
            precision += 1
    scaled = ws * (1 << precision)
    weights = np.where(scaled < 0, np.trunc(-0.5 + scaled), np.trunc(0.5 + scaled)).astype(np.int32)
    index = np.minimum(first[:, None] + tap, size_in - 1)
    return AxisResize(torch.from_numpy(first), torch.from_numpy(index), torch.from_numpy(weights), precision)


GATHERED_BYTES = 1 << 26  # the int32 taps one step of a pass gathers at most


def _pass(x: torch.Tensor, axis: AxisResize, dim: int) -> torch.Tensor:
    """One axis resampled, uint8 in and out: every output pixel's taps gathered at once, weighted and summed (integer
    sums, the same in any order), `(sum + 2^(p-1)) >> p` clamped; in steps of output pixels whose gathered taps stay
    under GATHERED_BYTES (a large downscale has tens of taps), so a few kernels per pass whatever the taps."""
    size_out, taps = axis.weights.shape
    step = max(1, GATHERED_BYTES // max(1, x.numel() // x.shape[dim] * taps * 4))
    parts = []
    for start in range(0, size_out, step):
        index, weights = axis.index[start : start + step], axis.weights[start : start + step]
        count = index.shape[0]
        shape = [*x.shape[:dim], count, taps, *x.shape[dim + 1 :]]
        taken = x.index_select(dim, index.reshape(-1)).view(shape).int()
        weights = weights.view([count, taps] + [1] * (x.dim() - dim - 1))
        total = (taken * weights).sum(dim + 1)  # (int64: no int32 sum of these taps overflows, as in the C code)
        parts.append(((total + (1 << (axis.precision - 1))) >> axis.precision).clamp_(0, 255).to(torch.uint8))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


@dataclass(frozen=True)
class ResizePlan:
    """A resize of [..., H, W] images to (height, width): each axis that changes (None: it does not), and whether
    the rows' (vertical) pass runs before the columns' one."""

    rows: AxisResize | None
    columns: AxisResize | None
    rows_first: bool = False

    def to(self, device: torch.device | str) -> ResizePlan:
        rows, columns = (a.to(device) if a is not None else None for a in (self.rows, self.columns))
        return ResizePlan(rows, columns, self.rows_first)


def resize_plan(height_in: int, width_in: int, height: int, width: int) -> ResizePlan:
    """torch's CPU uint8 bicubic antialias resize (torchvision's `resize(BICUBIC, antialias=True)`): columns, then
    rows."""
    return ResizePlan(
        axis_resize(height_in, height) if height != height_in else None,
        axis_resize(width_in, width) if width != width_in else None,
    )


@functools.cache
def _pillow_version() -> tuple[int, int]:
    import PIL

    major, minor = PIL.__version__.split(".")[:2]
    return int(major), int(minor)


def pillow_rows_first(height_in: int, width_in: int, height: int, width: int) -> bool:
    """Whether the installed Pillow resamples the rows first (the order changes the bytes): from 13.0 where the
    height shrinks by more than twice what the width does (Resample.c, `horizontal_first`); in 12.2-12.x where the
    image is over 100 times taller than wide and its height shrinks (`Image.resize`, two calls); before, never."""
    version = _pillow_version()
    if version >= (13, 0):
        return height_in - height > 0 and height_in - height > (width_in - width) * 2
    if version >= (12, 2):
        return height_in > width_in * 100 and height < height_in
    return False


def resize(x: torch.Tensor, plan: ResizePlan) -> torch.Tensor:
    """uint8 [..., H, W] resized as the plan's kernel does it: a pass per axis that changes, each into uint8, in the
    plan's order."""
    passes = [(plan.columns, x.dim() - 1), (plan.rows, x.dim() - 2)]
    for axis, dim in reversed(passes) if plan.rows_first else passes:
        if axis is not None:
            x = _pass(x, axis, dim)
    return x


@functools.lru_cache(maxsize=64)
def _resize_plan(height_in: int, width_in: int, height: int, width: int, device: str) -> ResizePlan:
    return resize_plan(height_in, width_in, height, width).to(device)


def frames_from_planes(
    rows: torch.Tensor | np.ndarray, layout: PlanesLayout, size: tuple[int, int], device, fused: bool | None = None
) -> torch.Tensor:
    """uint8 RGB frames [F, height, width, 3] on `device` from F frames' planes (host or device rows): converted as
    swscale does and resized as torch's CPU kernel does (encoder.pixels), so equal to the frames `load_video` makes
    on the host. On CUDA the same arithmetic runs fused in two Triton kernels (kernels.triton_pixels) unless
    `fused` is False (the tensor ops here, their reference) or Triton is off (VITSERVE_DISABLE_TRITON=1)."""
    device = torch.device(device)
    x = rows.to(device, non_blocking=True) if torch.is_tensor(rows) else upload(np.asarray(rows), device)
    if device.type == "cuda" and (triton_enabled() if fused is None else fused):
        from .kernels.triton_pixels import frames_from_rows

        return frames_from_rows(x, layout, _resize_plan(layout.height, layout.width, *size, str(device)), size)
    h, w = layout.height, layout.width
    ch, cw = layout.chroma
    y = x[:, : h * w].view(-1, h, w)
    u = x[:, h * w : h * w + ch * cw].view(-1, ch, cw)
    v = x[:, h * w + ch * cw :].view(-1, ch, cw)
    rgb = yuv_to_rgb(y, u, v, layout.conversion)
    plan = _resize_plan(h, w, *size, str(device))
    return resize(rgb, plan).permute(0, 2, 3, 1).contiguous()


def slices_from_planes(slices: list, device) -> list[torch.Tensor]:
    """Video slices (video_planes.SlicePlanes, rows on the host) -> their uint8 RGB frames [T, h, w, 3] on `device`:
    the slices of one layout and size converted and resized together (one upload, one pass of each op), whichever
    videos they come from."""
    out: list = [None] * len(slices)
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(slices):
        groups.setdefault((s.layout, s.size), []).append(i)
    pinned = torch.device(device).type == "cuda"
    for (layout, size), members in groups.items():
        parts = [np.asarray(slices[i].rows) for i in members]
        rows = torch.empty(sum(len(p) for p in parts), layout.row_bytes, dtype=torch.uint8, pin_memory=pinned)
        np.concatenate(parts, out=rows.numpy())  # (the one copy from the spool files' pages)
        frames = frames_from_planes(rows, layout, size, device)
        start = 0
        for i in members:
            count = len(slices[i].rows)
            out[i], start = frames[start : start + count], start + count
    return out
