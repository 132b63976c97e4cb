"""Host-side planning: image grids -> every piece of per-batch metadata the tensor forward needs.

Grids become tensors only here. Everything runs on the CPU with numpy, so that the tensor forward (layers.py,
models/) has no host sync, no data-dependent shape and no branch on tensor values: a CUDA graph captured once can
replay any batch whose plan is copied into its static buffers.

Row order. transformers' Qwen2.5 tower permutes hidden states into window order after the patch embedding; since the
patch embedding is row-wise, we apply the same permutation to the *input rows* instead (`patch_order`) and compute
rotary positions directly in that order. The merger output is put back into raster order with `token_order`.

Padding. `make_plan(..., pad_to=budget)` appends padding patches after the real ones, and they form attention
segments of their own after the real ones (`padding_segments`): one for full attention, window-sized ones for
Qwen2.5's windows. A real row never attends to a padding row nor a padding row to a real one, and every other op
is row-wise or works on whole merge groups (`merge_unit` patches), which padding fills on its own (it starts at a
multiple of `merge_unit`). So padding can never change a real token's output, and its outputs are never returned.
Covering padding with segments keeps its rows finite through every layer (a kernel writes nothing for rows outside
all segments, which would hold whatever memory held before): a kernel that reads a tile past a segment's end and
weights it zero (fa4) must read finite numbers, since NaN times zero is NaN. It costs one short extra segment per
layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .config import VisionConfig

Grid = tuple[int, int, int]
KEPT_LAYOUTS = 128  # frame shapes whose layout is kept (frame_layout) ...
KEPT_LAYOUT_PATCHES = 4096  # ... of frames up to this many patches (<= 224 KiB each, 28 MiB in all)


@dataclass
class Segments:
    """Variable-length attention segments: `cu_seqlens` for the kernel, `lengths` for the CPU fallback."""

    cu_seqlens: torch.Tensor  # int32 [num_segments + 1], host
    max_seqlen: int
    lengths: list[int]

    @classmethod
    def from_lengths(cls, lengths: list[int]) -> Segments:
        cu = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu[1:])
        return cls(torch.from_numpy(cu), max(lengths, default=0), list(lengths))


@dataclass
class BatchPlan:
    grids: list[Grid]
    num_patches: int  # real patches
    total_patches: int  # real + padding: the length of every per-patch tensor below
    positions: torch.Tensor  # int32 [total, 2] (row, col) rotary positions, in the order the blocks see
    full: Segments  # one segment per frame (full attention)
    window: Segments | None  # Qwen2.5 window segments (None for other families)
    patch_order: torch.Tensor | None  # int64 [total]: input row feeding block row i (window order), or None
    token_order: torch.Tensor | None  # int64 [total / merge_unit]: merger output row holding raster token j
    interp_indices: torch.Tensor | None  # int64 [total, 4]: Qwen3 learned-position taps, or None
    interp_weights: torch.Tensor | None  # float32 [total, 4]
    token_offsets: list[int]  # output tokens of image i are rows token_offsets[i]:token_offsets[i + 1]

    @property
    def num_tokens(self) -> int:
        return self.token_offsets[-1]


def grid_patches(grid: Grid) -> int:
    t, h, w = grid
    return t * h * w


def check_grids(grids: list[Grid], cfg: VisionConfig) -> list[Grid]:
    m = cfg.spatial_merge_size
    out = []
    for g in grids:
        t, h, w = (int(x) for x in g)
        if t < 1 or h < m or w < m or h % m or w % m:
            raise ValueError(f"invalid grid (t, h, w) = {(t, h, w)}: t >= 1 and h, w positive multiples of {m} needed")
        out.append((t, h, w))
    return out


def block_order(h: int, w: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of each patch of an h x w frame, in merge-block order (how the processor lays rows out)."""
    rows = np.broadcast_to(np.arange(h)[:, None], (h, w)).reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3)
    cols = np.broadcast_to(np.arange(w)[None, :], (h, w)).reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3)
    return rows.reshape(-1), cols.reshape(-1)


@functools.lru_cache(maxsize=128)
def patch_starts(h: int, w: int, m: int, p: int) -> np.ndarray:
    """Each patch's first byte in a uint8 RGB [h * p, w * p, 3] image, in merge-block order (int32; read-only:
    kept per shape, as the runner cuts every image of a repeating mix the same way)."""
    rows, cols = block_order(h, w, m)
    starts = ((rows * p * (w * p) + cols * p) * 3).astype(np.int32)
    starts.setflags(write=False)
    return starts


def _windows(lh: int, lw: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Merged-token order and non-empty window sizes for one frame: windows of side x side merged tokens in raster
    order, raster order inside each window (transformers' get_vision_window_index, without its -100 padding; its
    windows never span two frames)."""
    nh, nw = -(-lh // side), -(-lw // side)
    ids = np.full((nh * side, nw * side), -1, dtype=np.int64)
    ids[:lh, :lw] = np.arange(lh * lw).reshape(lh, lw)
    ids = ids.reshape(nh, side, nw, side).transpose(0, 2, 1, 3).reshape(nh * nw, side * side)
    counts = (ids >= 0).sum(1)
    return ids[ids >= 0], counts[counts > 0]


def _interpolation(rows: np.ndarray, cols: np.ndarray, h: int, w: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear (align_corners=True) taps of a side x side learned table resampled to h x w, as transformers'
    get_vision_interpolation_indices_and_weights computes them (same float32 arithmetic)."""

    def axis(index: np.ndarray, size: int):
        src = torch.from_numpy(index).to(torch.float32) * (side - 1) / max(size - 1, 1)
        floor = torch.floor(src)
        taps = floor.long()[:, None] + torch.arange(2)
        weights = (1 - (src[:, None] - floor[:, None] - torch.arange(2)).abs()).clamp(min=0)
        return taps.clamp(0, side - 1), weights

    h_taps, h_weights = axis(rows, h)
    w_taps, w_weights = axis(cols, w)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return indices.numpy(), weights.numpy()


@dataclass(frozen=True)
class FrameLayout:
    """One h x w frame's share of a plan, the same in every batch and every frame of a clip: its patches' rotary
    positions in the order the blocks see them, its merged tokens' window order and the windows' patch counts
    (windowed families), the position table's taps and weights (Qwen3). Arrays are read-only: they are shared."""

    positions: np.ndarray  # int32 [h * w, 2]
    window_order: np.ndarray | None  # int64 [h * w / merge_unit]
    window_lengths: list[int] | None
    interp_indices: np.ndarray | None  # int64 [h * w, 4]
    interp_weights: np.ndarray | None  # float32 [h * w, 4]


def frame_layout(h: int, w: int, m: int, unit: int, window_tokens: int, side: int) -> FrameLayout:
    """The layout of an h x w frame (merge size m, `unit` patches a token; `window_tokens` 0: no windows; `side` 0:
    no position table). A small frame's is computed once per shape and kept: a serving mix repeats a few shapes,
    and a batch's plan is paid on the device process's one thread (a large frame's plan is small beside its
    compute)."""
    make = _kept_layout if h * w <= KEPT_LAYOUT_PATCHES else _layout
    return make(h, w, m, unit, window_tokens, side)


def _layout(h: int, w: int, m: int, unit: int, window_tokens: int, side: int) -> FrameLayout:
    rows, cols = block_order(h, w, m)
    positions = np.stack([rows, cols], axis=1).astype(np.int32)
    order = lengths = indices = weights = None
    if window_tokens:
        order, counts = _windows(h // m, w // m, window_tokens)
        positions = positions[(order[:, None] * unit + np.arange(unit)).reshape(-1)]
        lengths = (counts * unit).tolist()
    if side:
        indices, weights = _interpolation(rows, cols, h, w, side)
    for a in (positions, order, indices, weights):
        if a is not None:
            a.setflags(write=False)
    return FrameLayout(positions, order, lengths, indices, weights)


_kept_layout = functools.lru_cache(maxsize=KEPT_LAYOUTS)(_layout)


def padding_segments(padding: int, cfg: VisionConfig) -> tuple[list[int], list[int]]:
    """The lengths of the full-attention and window segments that cover `padding` padding patches (module
    docstring): one segment, and window-sized ones (none without windows)."""
    if not padding:
        return [], []
    if not cfg.window_size:
        return [padding], []
    rows = cfg.window_tokens**2 * cfg.merge_unit
    return [padding], [rows] * (padding // rows) + ([padding % rows] if padding % rows else [])


def make_plan(grids: list[Grid], cfg: VisionConfig, pad_to: int | None = None) -> BatchPlan:
    """Plan one packed batch of images (or video clips) given as (t, h, w) patch grids."""
    grids = check_grids(grids, cfg)
    m, unit = cfg.spatial_merge_size, cfg.merge_unit
    num_patches = sum(grid_patches(g) for g in grids)
    total = num_patches if pad_to is None else pad_to
    if total < num_patches or total % unit:
        raise ValueError(f"cannot pad {num_patches} patches to {total}: needs a multiple of {unit} that holds them")

    positions = np.zeros((total, 2), dtype=np.int32)
    full_lengths: list[int] = []
    windowed = cfg.window_size > 0
    window_lengths: list[int] = []
    token_window_order = np.arange(total // unit, dtype=np.int64)
    interp = cfg.num_position_embeddings > 0
    side = int(round(cfg.num_position_embeddings**0.5))
    interp_indices = np.zeros((total if interp else 0, 4), dtype=np.int64)
    interp_weights = np.zeros((total if interp else 0, 4), dtype=np.float32)
    token_offsets = [0]

    start = 0  # first patch of the current image
    for t, h, w in grids:
        n, frame_tokens = t * h * w, h * w // unit
        frame = frame_layout(h, w, m, unit, cfg.window_tokens if windowed else 0, side if interp else 0)
        full_lengths += [h * w] * t
        positions[start : start + n] = np.tile(frame.positions, (t, 1))
        if frame.window_order is not None and frame.window_lengths is not None:  # (windowed) a window holds
            # one frame's tokens: frame k's order is the first frame's shifted by k frames
            shifts = start // unit + frame_tokens * np.arange(t)[:, None]
            token_window_order[start // unit : (start + n) // unit] = (frame.window_order + shifts).reshape(-1)
            window_lengths += frame.window_lengths * t
        if frame.interp_indices is not None and frame.interp_weights is not None:  # (interp)
            interp_indices[start : start + n] = np.tile(frame.interp_indices, (t, 1))
            interp_weights[start : start + n] = np.tile(frame.interp_weights, (t, 1))
        start += n
        token_offsets.append(start // unit)

    full_pad, window_pad = padding_segments(total - num_patches, cfg)
    full_lengths += full_pad
    window_lengths += window_pad
    patch_order = token_order = window = None
    if windowed:
        patch_order = torch.from_numpy((token_window_order[:, None] * unit + np.arange(unit)).reshape(-1))
        token_order = torch.from_numpy(np.argsort(token_window_order, kind="stable"))
        window = Segments.from_lengths(window_lengths)
    return BatchPlan(
        grids=grids,
        num_patches=num_patches,
        total_patches=total,
        positions=torch.from_numpy(positions),
        full=Segments.from_lengths(full_lengths),
        window=window,
        patch_order=patch_order,
        token_order=token_order,
        interp_indices=torch.from_numpy(interp_indices) if interp else None,
        interp_weights=torch.from_numpy(interp_weights) if interp else None,
        token_offsets=token_offsets,
    )


@dataclass
class TowerInputs:
    """A plan's tensors on the device, plus the Python ints the kernels take. The graph runner builds one of these
    over its static buffers; the eager path builds one per batch with `to_device`."""

    pixel_values: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    seqlens: list[int] | None  # host lengths, only for the CPU attention fallback
    cu_window_seqlens: torch.Tensor | None = None
    max_window_seqlen: int = 0
    window_seqlens: list[int] | None = None
    patch_order: torch.Tensor | None = None
    token_order: torch.Tensor | None = None
    interp_indices: torch.Tensor | None = None
    interp_weights: torch.Tensor | None = None


def to_device(plan: BatchPlan, pixel_values: torch.Tensor, device: torch.device, dtype: torch.dtype) -> TowerInputs:
    """Move one plan and its (already padded) pixel rows to `device` for an eager forward."""
    if pixel_values.shape[0] != plan.total_patches:
        raise ValueError(f"pixel_values has {pixel_values.shape[0]} rows, the plan {plan.total_patches}")

    def dev(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    window = plan.window
    return TowerInputs(
        pixel_values=pixel_values.to(device=device, dtype=dtype, non_blocking=True),
        positions=plan.positions.to(device, non_blocking=True),
        cu_seqlens=plan.full.cu_seqlens.to(device, non_blocking=True),
        max_seqlen=plan.full.max_seqlen,
        seqlens=plan.full.lengths,
        cu_window_seqlens=None if window is None else dev(window.cu_seqlens),
        max_window_seqlen=0 if window is None else window.max_seqlen,
        window_seqlens=None if window is None else window.lengths,
        patch_order=dev(plan.patch_order),
        token_order=dev(plan.token_order),
        interp_indices=dev(plan.interp_indices),
        interp_weights=dev(plan.interp_weights),
    )
