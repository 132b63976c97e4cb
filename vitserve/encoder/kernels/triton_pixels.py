"""Triton twins of encoder.pixels (CUDA only): a slice's YUV planes to resized RGB frames in two kernels, with the
same integer arithmetic as the torch ops there, so the same bytes (tests/test_pixels.py compares them on the GPU).

* `_convert_columns`: each output pixel of a source row converted from its planes (swscale's arithmetic, clamped to
  uint8) at each tap of its column span and summed with the columns' int16 weights (torch's horizontal pass), into
  uint8 [F, 3, H, width]; the RGB frames at the source size never exist.
* `_rows`: the vertical pass over those, written as [F, height, width, 3], the frames' final layout.
An axis that does not change is copied through (its flag off), as torch does not resample it.
* `_resample_lines`: encoder.image_resize's lines (either pass of any image, Pillow's arithmetic), one program per
  line and block of its output bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def _rgb(y, u, v, cy, oy, vr, ub, ug, vg):
    """swscale's yuv2rgb of int32 y, u, v (uint8 values): clamped r, g, b (encoder.pixels.yuv_to_rgb)."""
    luma = ((y * 8 - oy) * cy) >> 16
    u = u * 8 - 1024
    v = v * 8 - 1024
    r = luma + ((v * vr) >> 16)
    g = luma + (((u * ug) >> 16) + ((v * vg) >> 16))
    b = luma + ((u * ub) >> 16)
    r = tl.minimum(tl.maximum(r, 0), 255)
    g = tl.minimum(tl.maximum(g, 0), 255)
    b = tl.minimum(tl.maximum(b, 0), 255)
    return r, g, b


@triton.jit
def _convert_columns(
    rows_ptr,
    out_ptr,
    first_ptr,
    weights_ptr,
    H,
    W,
    CW,
    OW,
    row_bytes,
    precision,
    cy,
    oy,
    vr,
    ub,
    ug,
    vg,
    TAPS: tl.constexpr,
    RESIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    f = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < OW
    base = rows_ptr + f * row_bytes
    y_row = base + r * W
    u_row = base + H * W + (r // 2) * CW
    v_row = u_row + ((H + 1) // 2) * CW
    if RESIZE:
        first = tl.load(first_ptr + cols, mask=mask, other=0)
        acc_r = tl.zeros([BLOCK], dtype=tl.int32) + (1 << (precision - 1))
        acc_g = acc_r
        acc_b = acc_r
        for k in tl.static_range(TAPS):
            src = tl.minimum(first + k, W - 1)
            w = tl.load(weights_ptr + cols * TAPS + k, mask=mask, other=0)
            y = tl.load(y_row + src, mask=mask, other=0).to(tl.int32)
            u = tl.load(u_row + src // 2, mask=mask, other=0).to(tl.int32)
            v = tl.load(v_row + src // 2, mask=mask, other=0).to(tl.int32)
            pr, pg, pb = _rgb(y, u, v, cy, oy, vr, ub, ug, vg)
            acc_r += pr * w
            acc_g += pg * w
            acc_b += pb * w
        pr = tl.minimum(tl.maximum(acc_r >> precision, 0), 255)
        pg = tl.minimum(tl.maximum(acc_g >> precision, 0), 255)
        pb = tl.minimum(tl.maximum(acc_b >> precision, 0), 255)
    else:
        y = tl.load(y_row + cols, mask=mask, other=0).to(tl.int32)
        u = tl.load(u_row + cols // 2, mask=mask, other=0).to(tl.int32)
        v = tl.load(v_row + cols // 2, mask=mask, other=0).to(tl.int32)
        pr, pg, pb = _rgb(y, u, v, cy, oy, vr, ub, ug, vg)
    plane = H * OW
    out = out_ptr + f * 3 * H * OW + r * OW + cols
    tl.store(out, pr.to(tl.uint8), mask=mask)
    tl.store(out + plane, pg.to(tl.uint8), mask=mask)
    tl.store(out + 2 * plane, pb.to(tl.uint8), mask=mask)


@triton.jit
def _rows(
    x_ptr,
    out_ptr,
    first_ptr,
    weights_ptr,
    H,
    OW,
    OH,
    precision,
    TAPS: tl.constexpr,
    RESIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    f = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < OW
    plane = H * OW
    x = x_ptr + f * 3 * H * OW + cols
    if RESIZE:
        first = tl.load(first_ptr + i)
        acc_r = tl.zeros([BLOCK], dtype=tl.int32) + (1 << (precision - 1))
        acc_g = acc_r
        acc_b = acc_r
        for k in tl.static_range(TAPS):
            src = tl.minimum(first + k, H - 1)
            w = tl.load(weights_ptr + i * TAPS + k)
            acc_r += tl.load(x + src * OW, mask=mask, other=0).to(tl.int32) * w
            acc_g += tl.load(x + plane + src * OW, mask=mask, other=0).to(tl.int32) * w
            acc_b += tl.load(x + 2 * plane + src * OW, mask=mask, other=0).to(tl.int32) * w
        pr = tl.minimum(tl.maximum(acc_r >> precision, 0), 255)
        pg = tl.minimum(tl.maximum(acc_g >> precision, 0), 255)
        pb = tl.minimum(tl.maximum(acc_b >> precision, 0), 255)
    else:
        pr = tl.load(x + i * OW, mask=mask, other=0).to(tl.int32)
        pg = tl.load(x + plane + i * OW, mask=mask, other=0).to(tl.int32)
        pb = tl.load(x + 2 * plane + i * OW, mask=mask, other=0).to(tl.int32)
    out = out_ptr + (f * OH + i) * OW * 3 + cols * 3
    tl.store(out, pr.to(tl.uint8), mask=mask)
    tl.store(out + 1, pg.to(tl.uint8), mask=mask)
    tl.store(out + 2, pb.to(tl.uint8), mask=mask)


def frames_from_rows(rows: torch.Tensor, layout, plan, size: tuple[int, int]) -> torch.Tensor:
    """uint8 [F, height, width, 3] from device rows [F, row_bytes] of `layout` (video_planes.PlanesLayout), resized
    by `plan` (pixels.ResizePlan on this device) to `size`."""
    frames, (h, w), (height, width) = rows.shape[0], (layout.height, layout.width), size
    c = layout.conversion
    coefficients = (c.y, c.y_offset, c.v_r, c.u_b, c.u_g, c.v_g)
    columns, lines = plan.columns, plan.rows
    mid = torch.empty(frames, 3, h, width, dtype=torch.uint8, device=rows.device)
    dummy = torch.zeros(1, dtype=torch.int32, device=rows.device)
    _convert_columns[(frames, h, triton.cdiv(width, BLOCK))](
        rows,
        mid,
        columns.first if columns is not None else dummy,
        columns.weights if columns is not None else dummy,
        h,
        w,
        layout.chroma[1],
        width,
        layout.row_bytes,
        columns.precision if columns is not None else 0,
        *coefficients,
        TAPS=columns.weights.shape[1] if columns is not None else 0,
        RESIZE=columns is not None,
        BLOCK=BLOCK,
    )
    out = torch.empty(frames, height, width, 3, dtype=torch.uint8, device=rows.device)
    _rows[(frames, height, triton.cdiv(width, BLOCK))](
        mid,
        out,
        lines.first if lines is not None else dummy,
        lines.weights if lines is not None else dummy,
        h,
        width,
        height,
        lines.precision if lines is not None else 0,
        TAPS=lines.weights.shape[1] if lines is not None else 0,
        RESIZE=lines is not None,
        BLOCK=BLOCK,
    )
    return out


@triton.jit
def _resample_lines(buffer_ptr, lines_ptr, index_ptr, weights_ptr, precision, BLOCK: tl.constexpr):
    line = lines_ptr + tl.program_id(0).to(tl.int64) * 6  # (image_resize.LINE fields: SRC, DST, COUNT, INNER, ...)
    src, dst, count = tl.load(line), tl.load(line + 1), tl.load(line + 2)
    inner, table, taps = tl.load(line + 3), tl.load(line + 4), tl.load(line + 5)
    e = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = e < count
    j = e // inner
    t = table + j * taps
    x = buffer_ptr + src + (e - j * inner)
    total = tl.zeros([BLOCK], dtype=tl.int32) + (1 << (precision - 1))
    for k in range(taps):
        w = tl.load(weights_ptr + t + k, mask=mask, other=0)
        i = tl.load(index_ptr + t + k, mask=mask, other=0).to(tl.int64)
        total += tl.load(x + i * inner, mask=mask, other=0).to(tl.int32) * w
    out = tl.minimum(tl.maximum(total >> precision, 0), 255)
    tl.store(buffer_ptr + dst + e, out.to(tl.uint8), mask=mask)


LINE_BLOCK = 512


def resample_lines(
    buffer: torch.Tensor, lines: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, precision: int, longest: int
) -> None:
    """encoder.image_resize's `lines` (int64 [n, 6] on the device, the longest `longest` output bytes) run in one
    launch over `buffer` (uint8) with the int32 taps' tables `index` and `weights`."""
    _resample_lines[(lines.shape[0], triton.cdiv(longest, LINE_BLOCK))](
        buffer, lines, index, weights, precision, BLOCK=LINE_BLOCK
    )
