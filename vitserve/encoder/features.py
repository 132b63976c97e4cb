"""One item's answer (`Features`): its tokens (or their pooled mean), its deepstack features, its grid and, for a
video, its timing; and the one place that lays an item out row by row.

The layout every consumer of the features on the width takes (vLLM's and SGLang's Qwen-VL models, their encoder
caches, `layout="vllm"`) is one `[tokens, width]` tensor whose row r is the tokens' row r, then each deepstack
feature's row r in `deepstack_visual_indexes` order: `cat([tokens, ds0, ds1, ...], -1)`. `Features.parts` is that
order; `packed()` is that tensor, and `rows(dtype)` is the same rows as views of each part's memory, for writers that
gather them (a file's rows, a frame of many items) without concatenating first. A video's slices become one item by
`Features.join`, tokens slice after slice.

It lives in the library (`encoder/`, no HTTP, no service) because every layer that handles an answer imports it: the
library joins a video's slices, the service answers, writes and sends items, and the client's consumers
(`vitserve/consumers.py`, which import neither FastAPI nor the service) pack them for an LLM.

Conversions and packing run on the calling thread alone (`converted`, `Rows.copy_into`): ATen splits a large copy
over its OpenMP team, and the team's barrier waits for its slowest member, so on a busy host a conversion of
megabytes that takes 0.2 ms alone took 4-28 ms. The service runs answers of megabytes off its event loop; numpy's
copies and ATen's conversions release the GIL.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

SERIAL_ELEMENTS = 16384  # elements per torch copy in `converted`: under ATen's grain (32768), one thread runs each


def raw_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's little-endian bytes as a flat uint8 array (float32/float16/bfloat16), without a copy where the
    tensor is contiguous already (it is, on every little-endian host)."""
    t = t.contiguous()
    array = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()  # numpy has no bfloat16
    return array.astype(array.dtype.newbyteorder("<"), copy=False).reshape(-1).view(np.uint8)


def converted(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t.to(dtype)`, bit for bit, copied by this thread alone in slices of `SERIAL_ELEMENTS`; `t` itself when it is
    in `dtype` already."""
    if t.dtype == dtype:
        return t
    out = torch.empty(t.shape, dtype=dtype)
    src, dst = t.reshape(-1), out.view(-1)
    for start in range(0, src.numel(), SERIAL_ELEMENTS):
        dst[start : start + SERIAL_ELEMENTS].copy_(src[start : start + SERIAL_ELEMENTS])
    return out


@dataclass(frozen=True)
class Rows:
    """One item's rows as raw little-endian bytes, in views of its parts' memory: `views[k]` is part k's
    `[rows, bytes]` uint8 view (tokens first, then each deepstack feature: `Features.parts`), and row r of the item
    is `views[0][r]`, `views[1][r]`, ... one after the other."""

    views: list[np.ndarray]

    @property
    def count(self) -> int:
        return self.views[0].shape[0]

    @property
    def row_bytes(self) -> int:
        return sum(view.shape[1] for view in self.views)

    @property
    def nbytes(self) -> int:
        return self.count * self.row_bytes

    def pieces(self, first: int, last: int) -> list[memoryview]:
        """Rows first..last-1, each part's piece of a row in row order: the buffers of a gathered write (no copy)."""
        return [memoryview(view[r]) for r in range(first, last) for view in self.views]

    def copy_into(self, out: np.ndarray) -> None:
        """Copy the rows into `out`, a `[count, row_bytes]` uint8 array (one copy of each part, by this thread)."""
        column = 0
        for view in self.views:
            out[:, column : column + view.shape[1]] = view
            column += view.shape[1]


@dataclass(frozen=True)
class Features:
    """One item's answer. `tokens`: `[tokens, out_hidden]` in raster order (a video's slices one after another), or
    with mean pooling their mean `[out_hidden]` (float32); `deepstack`: one `[tokens, out_hidden]` per deepstack layer
    in `deepstack_visual_indexes` order (empty without deepstack, and with mean pooling); `grid`: (t, h, w) in
    patches before the merge, as the engine reports it; `timing`: a video's frame_indices, fps, timestamps and
    second_per_grid_t (None for an image)."""

    tokens: torch.Tensor
    deepstack: list[torch.Tensor] = field(default_factory=list)
    grid: Sequence[int] | None = None
    timing: dict | None = None

    @classmethod
    def of(cls, output, grid: Sequence[int] | None = None, timing: dict | None = None) -> Features:
        """An item's Features from an encoder's output for it, `(tokens, deepstack list)` (`VisionEncoder.outputs`),
        or from a Features (the grid and timing given replace its own)."""
        if isinstance(output, Features):
            if grid is None and timing is None:
                return output
            return cls(
                output.tokens,
                output.deepstack,
                output.grid if grid is None else grid,
                output.timing if timing is None else timing,
            )
        tokens, deepstack = output
        return cls(tokens, list(deepstack), grid, timing)

    @classmethod
    def join(
        cls, slices: Iterable, grid: Sequence[int] | None = None, timing: dict | None = None, mean: bool = False
    ) -> Features:
        """A video's slices (each a Features or the engine's `(tokens, deepstack list)`), in order, as one item: the
        tokens slice after slice and each deepstack layer likewise, or with `mean` the tokens' mean (float32; the
        deepstack features are not joined)."""
        slices = [cls.of(s) for s in slices]
        tokens = torch.cat([s.tokens for s in slices])
        if mean:
            return cls(tokens.float().mean(0), [], grid, timing)
        return cls(tokens, [torch.cat(layer) for layer in zip(*(s.deepstack for s in slices))], grid, timing)

    @property
    def parts(self) -> tuple[torch.Tensor, ...]:
        """The tensors of a row, in the order of its columns: the tokens, then each deepstack feature."""
        return (self.tokens, *self.deepstack)

    @property
    def width(self) -> int:
        """The width of a packed row (out_hidden x (1 + deepstack layers))."""
        return sum(t.shape[-1] for t in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.parts)

    def discard(self) -> None:
        """What a holder calls when it lets the answer go (the embedding cache evicting it): nothing to free, the
        tensors are in this process's memory (a device process's `Output` record removes its spool file)."""

    def rows(self, dtype: torch.dtype) -> Rows:
        """The packed rows in `dtype` as views of the parts' memory (a part in another dtype is converted: one
        copy, by this thread)."""
        return Rows([raw_view(converted(t, dtype)).reshape(t.shape[0], -1) for t in self.parts])

    def packed(self) -> torch.Tensor:
        """One `[tokens, width]` tensor, each row the tokens' then each deepstack feature's: `cat(parts, -1)`. The
        tokens themselves without deepstack; copied once by this thread for CPU tensors of one dtype, else by
        `torch.cat`."""
        if not self.deepstack:
            return self.tokens
        dtype = self.tokens.dtype
        if any(t.device.type != "cpu" or t.dtype != dtype or t.requires_grad for t in self.parts):
            return torch.cat(self.parts, -1)
        out = torch.empty(self.tokens.shape[0], self.width, dtype=dtype)
        self.rows(dtype).copy_into(raw_view(out).reshape(out.shape[0], -1))
        return out
