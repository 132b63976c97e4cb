"""A video's sampled frames as their decoder left them (YUV 4:2:0 planes at the source size) until the device that
runs them converts and resizes them (encoder.pixels: the same bytes as swscale's conversion and torch's resize on
the host). Planes are half the bytes of RGB at the source size, and the per-frame conversion and resize, most of a
video's host work, move to the GPU.

A frame's planes lie back to back in one uint8 row: Y (height x width), then U and V (ceil(height / 2) x
ceil(width / 2) each); a video slice is T such rows. `PlanesLayout` says how to read them, `SlicePlanes` is a slice
on its way (its rows, maybe still in a spool file); `pixels.frames_from_planes` makes its RGB frames on a device.
This module needs no torch: the decode workers hold these records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# ff_yuv2rgb_coeffs (libswscale/yuv2rgb.c) by the frame's colour matrix (AVColorSpace): Cr→R, Cb→B, Cb→G, Cr→G,
# times 2^16; the matrices FFmpeg converts with BT.601's are listed as BT.601
BT601 = (104597, 132201, 25675, 53279)
COEFFICIENTS = {
    0: BT601,  # (AVCOL_SPC_RGB: swscale's table gives BT.601 for a YUV frame tagged so)
    1: (117489, 138438, 13975, 34925),  # BT.709
    2: BT601,  # unspecified
    3: BT601,  # reserved
    4: (104448, 132798, 24759, 53109),  # FCC
    5: BT601,  # BT.470 BG
    6: BT601,  # SMPTE 170M
    7: (117579, 136230, 16907, 35559),  # SMPTE 240M
    9: (110013, 140363, 12277, 42626),  # BT.2020 non-constant
    10: (110013, 140363, 12277, 42626),  # BT.2020 constant
}


def _round16(value: int) -> int:
    """swscale's roundToInt16: value / 2^16 rounded, clipped to int16."""
    return max(-32768, min(32767, (value + (1 << 15)) >> 16))


@dataclass(frozen=True)
class Conversion:
    """The integer coefficients of swscale's yuv420p → rgb24 converter for one colour matrix and range."""

    y: int
    y_offset: int
    v_r: int
    u_b: int
    u_g: int
    v_g: int

    @classmethod
    def of(cls, colorspace: int, full_range: bool, height: int) -> Conversion | None:
        """The conversion of a yuv420p frame with this colour matrix (AVColorSpace), range (full: JPEG's, or a
        yuvj420p frame) and height; None where swscale would not take this converter (odd height, a matrix it does
        not know)."""
        if height % 2 or colorspace not in COEFFICIENTS:
            return None
        crv, cbu, cgu, cgv = COEFFICIENTS[colorspace]
        cgu, cgv = -cgu, -cgv
        cy, oy = 1 << 16, 0
        if full_range:  # (C's division, toward zero)
            crv, cbu, cgu, cgv = (c * 224 // 255 if c >= 0 else -(-c * 224 // 255) for c in (crv, cbu, cgu, cgv))
        else:
            cy, oy = cy * 255 // 219, 16 << 16
        return cls(*(_round16(c << s) for c, s in ((cy, 13), (oy, 3), (crv, 13), (cbu, 13), (cgu, 13), (cgv, 13))))


FORMATS = {"yuv420p": False, "yuvj420p": True}  # the pixel formats converted exactly, and whether full range


@dataclass(frozen=True)
class PlanesLayout:
    """How a frame's planes lie in its row (source `height` x `width`, 4:2:0) and the conversion that makes them
    RGB."""

    height: int
    width: int
    conversion: Conversion

    @property
    def chroma(self) -> tuple[int, int]:
        return -(-self.height // 2), -(-self.width // 2)

    @property
    def row_bytes(self) -> int:
        return self.bytes_for(self.height, self.width)

    @staticmethod
    def bytes_for(height: int, width: int) -> int:
        """A frame's planes, in bytes."""
        return height * width + 2 * (-(-height // 2)) * (-(-width // 2))

    @classmethod
    def of(cls, frame: Any) -> PlanesLayout | None:
        """The layout of a decoded PyAV frame, None where its pixels have no exact conversion here (another pixel
        format, odd height, an unknown colour matrix)."""
        full = FORMATS.get(frame.format.name)
        if full is None:
            return None
        conversion = Conversion.of(int(frame.colorspace), full or int(frame.color_range) == 2, frame.height)
        return None if conversion is None else cls(frame.height, frame.width, conversion)


def planes_row(frame: Any, layout: PlanesLayout, out: np.ndarray) -> None:
    """A decoded frame's planes copied into `out` (uint8 [layout.row_bytes])."""
    start = 0
    for plane in frame.planes:
        rows = np.frombuffer(plane, np.uint8).reshape(plane.height, plane.line_size)[:, : plane.width]
        out[start : start + rows.size].reshape(rows.shape)[:] = rows
        start += rows.size


@dataclass
class SlicePlanes:
    """A video slice on its way to a device: its T frames' planes (uint8 [T, row_bytes], or where a decode worker
    spooled them), their layout, and the (height, width) the device resizes them to."""

    rows: Any  # np.ndarray, or decoding.spool.Spooled until it is read
    layout: PlanesLayout
    size: tuple[int, int]

    @property
    def ndim(self) -> int:  # a slice: VisionEncoder.launch tells slices by their four dimensions
        return 4
