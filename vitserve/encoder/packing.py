"""Packing: which images share a replay, and the patch budget that replay runs at.

A replay of budget B runs exactly B patches (the real ones, then padding) with a fixed number of attention segments
per layer kind: the kernels take these as Python ints, frozen when the budget's graph is captured. `Packer` puts
images into as few replays as it can (first-fit decreasing, no image split), each at the smallest budget that holds
its patches and whose segment capacities hold its frames and windows plus the segments that cover its padding
(plan.padding_segments). An image larger than every budget runs eagerly.

Frame capacity. Flash and fa4 launch segments x ceil(max_seqlen / 128) x heads blocks, and an empty one costs
~1.3 ns (bench/results/varlen-probe-h200.json), so the full-attention segment capacity is bounded (`frame_capacity`):
it shrinks as the budget grows (at most ~40 us per full-attention layer), and towers with full attention in every
layer (Qwen2-VL, Qwen3-VL) admit fewer frames per replay than Qwen2.5-VL with full attention in 4 of its 32 layers,
keeping the waste near 2% of a replay's compute; more small images take another replay. A backend whose unused
segments cost a flat amount (cudnn) states its own bound (`max_segments`, attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import VisionConfig
from .plan import check_grids, grid_patches, padding_segments

MAX_ROW_BLOCKS = 2048  # frames x ceil(budget / 128) bound on full-attention row blocks per replay
FULL_ATTENTION_FRAMES = 16  # frames per replay when every layer is full attention (scaled up by depth / full layers)
MIN_FRAME_PATCHES = 16  # the smallest frame the default preprocessing makes (56x56 pixels = 4x4 patches)


def frame_capacity(budget: int, cfg: VisionConfig, max_segments: int | None = None) -> int:
    """Full-attention segments (image frames) one replay of this budget admits for this tower. `max_segments`: the
    attention backend's own bound, where an unused segment costs it a flat amount (attention.py); None: flash's
    launch grid, bounded as the module docstring says."""
    if max_segments is not None:
        return max(1, min(budget // MIN_FRAME_PATCHES, max_segments))
    full_layers = len(cfg.fullatt_block_indexes) if cfg.window_size else cfg.depth
    by_layers = FULL_ATTENTION_FRAMES * cfg.depth // max(1, full_layers)
    return max(1, min(budget // MIN_FRAME_PATCHES, MAX_ROW_BLOCKS * 128 // budget, by_layers))


def window_capacity(budget: int, max_segments: int | None = None) -> int:
    """Window-attention segments one replay admits: windows average >= 16 patches for any preprocessed image (and
    at most the backend's `max_segments`)."""
    return max(1, min(budget // MIN_FRAME_PATCHES, max_segments or budget))


def count_windows(grid, cfg: VisionConfig) -> int:
    """Window-attention segments of one (t, h, w) grid (0 for towers without windows)."""
    if not cfg.window_size:
        return 0
    t, h, w = grid
    side = cfg.window_tokens * cfg.spatial_merge_size
    return t * -(-h // side) * -(-w // side)


@dataclass
class Batch:
    """Images (by input index) that run together: in one replay of `budget`, or eagerly when budget is None."""

    indices: list[int]
    budget: int | None
    patches: int = 0
    frames: int = 0
    windows: int = 0


class Packer:
    """Packs image grids into the replays of a set of patch budgets for one tower. `full_max_segments` and
    `window_max_segments` are its attention backends' `max_segments` (None: bounded by the launch grid)."""

    def __init__(
        self, cfg: VisionConfig, budgets, full_max_segments: int | None = None, window_max_segments: int | None = None
    ):
        self.cfg = cfg
        self.budgets = sorted({int(b) for b in budgets})
        bad = [b for b in self.budgets if b < MIN_FRAME_PATCHES or b % MIN_FRAME_PATCHES]
        if not self.budgets or bad:
            raise ValueError(f"budgets must be positive multiples of {MIN_FRAME_PATCHES} patches, got {bad or budgets}")
        self.full_max_segments, self.window_max_segments = full_max_segments, window_max_segments

    def frame_capacity(self, budget: int) -> int:
        return frame_capacity(budget, self.cfg, self.full_max_segments)

    def window_capacity(self, budget: int) -> int:
        return window_capacity(budget, self.window_max_segments)

    def budget_for(self, patches: int, frames: int, windows: int) -> int | None:
        """The smallest budget whose replay admits this many patches, frames and windows, with the segments that
        cover its padding (plan.padding_segments) (None: run eagerly)."""
        for b in self.budgets:
            if patches <= b:
                full_pad, window_pad = padding_segments(b - patches, self.cfg)
                if frames + len(full_pad) <= self.frame_capacity(b) and windows + len(
                    window_pad
                ) <= self.window_capacity(b):
                    return b
        return None

    def pack(self, grids) -> list[Batch]:
        """First-fit decreasing into as few replays as possible; no image is split; oversize images run eagerly."""
        grids = check_grids(grids, self.cfg)
        batches: list[Batch] = []
        for i in sorted(range(len(grids)), key=lambda i: -grid_patches(grids[i])):
            p, f, w = grid_patches(grids[i]), grids[i][0], count_windows(grids[i], self.cfg)
            if self.budget_for(p, f, w) is None:
                batches.append(Batch([i], None, p, f, w))
                continue
            for batch in batches:
                if batch.budget is not None:
                    budget = self.budget_for(batch.patches + p, batch.frames + f, batch.windows + w)
                    if budget is not None:
                        batch.indices.append(i)
                        batch.budget, batch.patches, batch.frames, batch.windows = (
                            budget,
                            batch.patches + p,
                            batch.frames + f,
                            batch.windows + w,
                        )
                        break
            else:
                batches.append(Batch([i], self.budget_for(p, f, w), p, f, w))
        return batches
