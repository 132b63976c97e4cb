"""Pillow's `Image.resize(BICUBIC)` of a batch of uint8 images on a device, the bytes of transformers' PIL image
processor (encoder.pixels: the weights, each pass `clamp((Σ w·x + 2^21) >> 22, 0, 255)`, the installed Pillow's
order of passes), in one upload and two kernels whatever the number of images.

Every pass of every image is cut into lines, each a row of LINE int64 fields (SRC ... TAPS): one row of an image
resampled along it (the columns' pass) or one output row made from whole source rows (the rows' pass), so that a
single kernel runs either pass of any image from the same arithmetic,
`out[dst + e] = Σ_k w[t]·x[src + index[t]·inner + e % inner]` with `t = table + (e // inner)·taps + k`. The images'
first passes run as one launch, their second passes as the next. All of it lies in one device buffer (`ResizeBatch`):
the taps' tables, the lines, the images as they came, the first passes' outputs, the results; all but the last two
go up in one copy from pinned memory.

On CUDA with Triton the lines run in kernels.triton_pixels.resample_lines; elsewhere (the CPU, Triton off) in tensor
ops over the same lines (`resample_lines`), which the GPU tests hold the kernel to.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .kernels import triton_enabled
from .pixels import PILLOW_PRECISION, axis_resize, pillow_rows_first

# a line's fields (int64 each): its source and destination offsets in the buffer, its output bytes, the bytes of one
# output pixel's run along the axis (3 for the columns' pass, the row for the rows' one), its first output pixel's
# place in the taps' tables, and its taps per output pixel
SRC, DST, COUNT, INNER, TABLE, TAPS = range(6)
LINE = 6
UPLOAD_BYTES = 1 << 28  # the images' bytes one batch uploads at most (more images: more batches)
ALIGN = 64  # each part of the buffer starts on a multiple of it (the int32 and int64 views need 4 and 8)
GATHERED = 1 << 22  # output bytes the tensor ops compute at once


@dataclass(frozen=True)
class ImagePasses:
    """One image's passes in the installed Pillow's order, relative to its own buffers: each pass's lines (offsets
    from its source's and destination's start and from the image's tables), the tables of both passes (source
    index and integer weight per output pixel and tap, `index`, `weights`) and the first pass's output bytes where
    a second pass follows (`middle`)."""

    passes: tuple[np.ndarray, ...]
    index: np.ndarray  # int32
    weights: np.ndarray  # int32
    middle: int


@functools.lru_cache(maxsize=512)
def axis_taps(size_in: int, size_out: int) -> tuple[np.ndarray, np.ndarray]:
    """One axis' Pillow taps, int32 [size_out, taps] source indices and weights (read-only: kept per size)."""
    taps = axis_resize(size_in, size_out, pillow=True)
    index, weights = taps.index.numpy().astype(np.int32), taps.weights.numpy()
    index.setflags(write=False)
    weights.setflags(write=False)
    return index, weights


@functools.lru_cache(maxsize=128)
def image_passes(height_in: int, width_in: int, height: int, width: int, rows_first: bool) -> ImagePasses:
    """The passes of `Image.resize((width, height), BICUBIC)` of an RGB [height_in, width_in, 3] image, rows first
    or not; an axis that keeps its size has none."""
    order = [("rows", height_in, height), ("columns", width_in, width)]
    h, w = height_in, width_in
    passes, index, weights, table = [], [], [], 0
    for axis, size_in, size_out in order if rows_first else order[::-1]:
        if size_in == size_out:
            continue
        axis_index, axis_weights = axis_taps(size_in, size_out)
        taps = axis_weights.shape[1]
        lines = np.empty((h if axis == "columns" else size_out, LINE), np.int64)
        if axis == "columns":  # a line per row: its output pixels' channels, the taps along it
            r = np.arange(h)
            lines[:, SRC], lines[:, DST], lines[:, COUNT] = r * (w * 3), r * (size_out * 3), size_out * 3
            lines[:, INNER], lines[:, TABLE] = 3, table
            w = size_out
        else:  # a line per output row: each tap a whole source row
            j = np.arange(size_out)
            lines[:, SRC], lines[:, DST], lines[:, COUNT] = 0, j * (w * 3), w * 3
            lines[:, INNER], lines[:, TABLE] = w * 3, table + j * taps
            h = size_out
        lines[:, TAPS] = taps
        lines.setflags(write=False)
        passes.append(lines)
        index.append(axis_index.reshape(-1))
        weights.append(axis_weights.reshape(-1))
        table += size_out * taps
    middle = int(passes[0][-1, DST] + passes[0][-1, COUNT]) if len(passes) == 2 else 0
    empty = np.empty(0, np.int32)
    tables = np.concatenate(index + [empty]), np.concatenate(weights + [empty])
    for t in tables:
        t.setflags(write=False)
    return ImagePasses(tuple(passes), *tables, middle)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class ResizeBatch:
    """Images resized together, laid out in one uint8 buffer of `size` bytes: the taps' tables (int32 source
    indices from its start, weights at `weights`, `taps` of each), the lines (int64 [rows, LINE] at `lines_at`: the
    first passes' rows, then the second ones', `launches` their (start, end) rows), the images as they come
    (`inputs`: each one's offset; the uploaded bytes end at `upload`), the first passes' outputs, the results
    (`results`: each image's offset, height, width). `host` holds the uploaded bytes before the images'."""

    weights: int
    taps: int
    lines_at: int
    launches: tuple[tuple[int, int], tuple[int, int]]
    inputs: list[int]
    upload: int
    size: int
    results: list[tuple[int, int, int]]
    host: np.ndarray

    @property
    def lines(self) -> np.ndarray:
        """The lines as the host holds them (int64 [rows, LINE])."""
        return self.host[self.lines_at :].view(np.int64).reshape(-1, LINE)


def plan_batch(shapes: list[tuple[int, int]], sizes: list[tuple[int, int]]) -> ResizeBatch:
    """The batch for images of `shapes` (height, width) resized to `sizes` (height, width), in order."""
    each = [image_passes(h, w, *size, pillow_rows_first(h, w, *size)) for (h, w), size in zip(shapes, sizes)]
    taps = sum(p.index.size for p in each)
    weights_at = _aligned(taps * 4)
    lines_at = _aligned(weights_at + taps * 4)
    counts = [sum(len(p.passes[k]) for p in each if len(p.passes) > k) for k in (0, 1)]
    inputs_at = lines_at + (counts[0] + counts[1]) * LINE * 8
    inputs, at = [], _aligned(inputs_at)
    for h, w in shapes:
        inputs.append(at)
        at = _aligned(at + h * w * 3)
    upload, middles = at, []
    for p in each:
        middles.append(at)
        at = _aligned(at + p.middle)
    results = []
    for p, i, (h, w) in zip(each, inputs, sizes):
        results.append((at if p.passes else i, h, w))
        at = _aligned(at + h * w * 3) if p.passes else at
    host = np.zeros(inputs_at, np.uint8)
    empty = np.empty(0, np.int32)
    host[: taps * 4] = np.concatenate([p.index for p in each] + [empty]).view(np.uint8)
    host[weights_at : weights_at + taps * 4] = np.concatenate([p.weights for p in each] + [empty]).view(np.uint8)
    lines = host[lines_at:].view(np.int64).reshape(-1, LINE)
    rows, table = [0, counts[0]], 0
    for p, src, middle, (dst, _, _) in zip(each, inputs, middles, results):
        for k, part in enumerate(p.passes):
            block = lines[rows[k] : rows[k] + len(part)]
            block[:] = part
            block[:, SRC] += src if k == 0 else middle
            block[:, DST] += middle if k == 0 and len(p.passes) == 2 else dst
            block[:, TABLE] += table
            rows[k] += len(part)
        table += p.index.size
    launches = ((0, counts[0]), (counts[0], counts[0] + counts[1]))
    return ResizeBatch(weights_at, taps, lines_at, launches, inputs, upload, at, results, host)


def resample_lines(
    buffer: torch.Tensor, lines: torch.Tensor, host: np.ndarray, index: torch.Tensor, weights: torch.Tensor
) -> None:
    """The lines' (`lines` on the buffer's device, `host` the same rows on the host) output bytes written into
    `buffer` (uint8) from its source bytes, as tensor ops in 32-bit integers, as Pillow sums: lines of one shape
    (output bytes, inner run, taps) together, as [lines, output pixels, inner run], in steps of at most GATHERED
    output bytes; each tap's weights and indices gathered per output pixel, its source bytes per output byte."""
    shape = host[:, [COUNT, INNER, TAPS]]
    starts = np.flatnonzero(np.r_[True, (shape[1:] != shape[:-1]).any(1)])
    device = buffer.device
    for a, b in zip(starts, np.r_[starts[1:], len(host)]):
        count, inner, taps = (int(v) for v in shape[a])
        pixels = torch.arange(count // inner, device=device) * taps
        run, e = torch.arange(inner, device=device), torch.arange(count, device=device)
        step = max(1, GATHERED // count)
        for s in range(a, b, step):
            part = lines[s : min(b, s + step)]
            src, dst, table = (part[:, f, None] for f in (SRC, DST, TABLE))
            half = 1 << (PILLOW_PRECISION - 1)
            total = torch.full((len(part), count // inner, inner), half, dtype=torch.int32, device=device)
            for k in range(taps):
                t = table + pixels + k  # [lines, output pixels]
                at = src + index[t].long() * inner
                total += weights[t][..., None] * buffer[at[..., None] + run].int()
            out = (total >> PILLOW_PRECISION).clamp_(0, 255).to(torch.uint8)
            buffer[dst + e] = out.view(len(part), count)


def pillow_resize_images(
    images: list[np.ndarray], sizes: list[tuple[int, int]], device: torch.device | str
) -> list[torch.Tensor]:
    """uint8 [H, W, 3] host images -> each as the installed Pillow's `Image.resize((width, height), BICUBIC)` makes
    it at its (height, width) in `sizes`, uint8 [height, width, 3] on `device` (an image at its size comes as it
    is): in batches of at most UPLOAD_BYTES of images, each one upload and two launches."""
    out: list = []
    start = 0
    while start < len(images):
        end, total = start, 0
        while end < len(images) and (end == start or total + images[end].nbytes <= UPLOAD_BYTES):
            total, end = total + images[end].nbytes, end + 1
        out += _resize_batch(images[start:end], sizes[start:end], torch.device(device))
        start = end
    return out


def _resize_batch(images: list[np.ndarray], sizes: list[tuple[int, int]], device: torch.device) -> list[torch.Tensor]:
    """One batch: its plan's bytes and the images staged in (pinned) host memory, one copy to the device, each
    launch's lines run there; the results are views of the device buffer."""
    batch = plan_batch([tuple(x.shape[:2]) for x in images], sizes)
    pinned = device.type == "cuda"
    staged = torch.empty(batch.upload, dtype=torch.uint8, pin_memory=pinned)
    view = staged.numpy()
    view[: len(batch.host)] = batch.host
    for x, at in zip(images, batch.inputs):
        view[at : at + x.nbytes].reshape(x.shape)[...] = x
    buffer = torch.empty(batch.size, dtype=torch.uint8, device=device)
    buffer[: batch.upload].copy_(staged, non_blocking=pinned)
    index, weights = (buffer[at : at + batch.taps * 4].view(torch.int32) for at in (0, batch.weights))
    host = batch.lines
    lines = buffer[batch.lines_at : batch.lines_at + host.nbytes].view(torch.int64).view(-1, LINE)
    fused = pinned and triton_enabled()
    if fused:
        from .kernels.triton_pixels import resample_lines as fused_lines
    for start, end in batch.launches:
        if end == start:
            continue
        if fused:
            fused_lines(buffer, lines[start:end], index, weights, PILLOW_PRECISION, int(host[start:end, COUNT].max()))
        else:
            resample_lines(buffer, lines[start:end], host[start:end], index, weights)
    return [buffer[at : at + h * w * 3].view(h, w, 3) for at, h, w in batch.results]
