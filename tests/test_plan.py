"""The host-side plan against transformers' own metadata helpers (vision_utils), on many grids."""

from __future__ import annotations

import random

import pytest
import torch

from vitserve.encoder import builtin_config, plan
from vitserve.encoder.plan import make_plan

vu = pytest.importorskip("transformers.vision_utils")

QWEN2, QWEN25, QWEN3 = (
    builtin_config(n) for n in ("Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen3-VL-8B-Instruct")
)


def random_grids(rng: random.Random, n: int):
    return [(rng.choice([1, 1, 1, 2]), 2 * rng.randint(1, 24), 2 * rng.randint(1, 24)) for _ in range(n)]


def test_window_examples_from_transformers():
    assert make_plan([(1, 16, 16)], QWEN25).window.cu_seqlens.tolist() == [0, 64, 128, 192, 256]
    assert make_plan([(1, 12, 20)], QWEN25).window.cu_seqlens.tolist() == [0, 64, 128, 160, 192, 224, 240]


@pytest.mark.parametrize("seed", range(20))
def test_plan_equals_transformers_metadata(seed):
    rng = random.Random(seed)
    assert_plans_equal_transformers(random_grids(rng, rng.randint(1, 6)))


def test_shapes_planned_again_plan_the_same_and_plans_share_no_memory():
    """A frame shape's layout is kept after its first plan (plan.frame_layout): a batch that repeats shapes, clips
    of several frames of a kept shape, and a frame too large to keep plan as transformers does, the second time as
    the first; writing into one plan's tensors changes no later plan."""
    large = (1, 2 * 33, 2 * 32)  # 4224 patches: not kept
    assert large[1] * large[2] > plan.KEPT_LAYOUT_PATCHES
    grids = [(1, 16, 24), (3, 16, 24), large, (1, 16, 24), (2, 8, 40), large]
    for _ in range(2):
        assert_plans_equal_transformers(grids)
    for cfg in (QWEN25, QWEN3):
        first = make_plan(grids, cfg)
        tensors = [first.positions, first.patch_order, first.token_order, first.interp_indices, first.interp_weights]
        for t in tensors:
            if t is not None:
                t.fill_(7)
        again = make_plan(grids, cfg)
        assert not torch.equal(again.positions, first.positions)
    assert_plans_equal_transformers(grids)


def assert_plans_equal_transformers(grids):
    grid_thw = torch.tensor(grids)

    p2 = make_plan(grids, QWEN2)
    ref_pos = vu.get_vision_position_ids(grid_thw, 2)
    assert torch.equal(p2.positions.long(), ref_pos)
    assert torch.equal(p2.full.cu_seqlens, vu.get_vision_cu_seqlens(grid_thw))
    assert p2.full.max_seqlen == max(h * w for _, h, w in grids)
    assert p2.window is None and p2.patch_order is None and p2.interp_indices is None

    p25 = make_plan(grids, QWEN25)
    window_index, cu_window = vu.get_vision_window_index(grid_thw, 2, 112, 14)
    assert torch.equal(p25.window.cu_seqlens, cu_window)
    assert p25.window.max_seqlen == int((cu_window[1:] - cu_window[:-1]).max())
    # our rows are the window-permuted rows, and our positions are transformers' positions permuted the same way
    rows = (window_index[:, None] * QWEN25.merge_unit + torch.arange(QWEN25.merge_unit)).reshape(-1)
    assert torch.equal(p25.patch_order, rows)
    assert torch.equal(p25.positions.long(), ref_pos[rows])
    assert torch.equal(p25.token_order, torch.argsort(window_index))

    p3 = make_plan(grids, QWEN3)
    idx, wts = vu.get_vision_interpolation_indices_and_weights(
        grid_thw, 48, mode="bilinear", align_corners=True, spatial_merge_size=2
    )
    assert torch.equal(p3.interp_indices, idx)
    assert torch.equal(p3.interp_weights, wts)
    offsets = [0]
    for t, h, w in grids:
        offsets.append(offsets[-1] + t * h * w // QWEN3.merge_unit)
    assert p3.token_offsets == offsets


@pytest.mark.parametrize("cfg", [QWEN2, QWEN25, QWEN3], ids=lambda c: c.family)
def test_padding_forms_segments_of_its_own(cfg):
    """The real segments are the unpadded plan's; padding patches follow as one full-attention segment and as
    window-sized window segments, so no real row attends to padding and every padding row is in some segment."""
    grids = [(1, 10, 14), (1, 4, 4)]
    real = 156
    plan = make_plan(grids, cfg, pad_to=1024)
    unpadded = make_plan(grids, cfg)
    assert plan.num_patches == real and plan.total_patches == 1024
    assert plan.full.cu_seqlens.tolist() == unpadded.full.cu_seqlens.tolist() + [1024]
    if plan.window is not None:  # 868 padding rows: 13 windows of 64, then 36
        pad = plan.window.cu_seqlens.tolist()[len(unpadded.window.cu_seqlens) :]
        assert plan.window.cu_seqlens.tolist()[: len(unpadded.window.cu_seqlens)] == unpadded.window.cu_seqlens.tolist()
        assert pad == [real + 64 * i for i in range(1, 14)] + [1024]
        assert plan.window.max_seqlen == 64
    assert make_plan(grids, cfg, pad_to=real).full.cu_seqlens.tolist() == unpadded.full.cu_seqlens.tolist()
    assert torch.equal(plan.positions[:real], unpadded.positions) and plan.positions[real:].abs().sum() == 0
    if plan.interp_weights is not None:
        assert plan.interp_weights[real:].abs().sum() == 0 and plan.interp_indices[real:].abs().sum() == 0
    if plan.patch_order is not None:  # padding rows stay at the end, untouched by the window permutation
        assert torch.equal(plan.patch_order[:real], unpadded.patch_order)
        assert torch.equal(plan.patch_order[real:], torch.arange(real, 1024))
        u = cfg.merge_unit
        assert torch.equal(plan.token_order[real // u :], torch.arange(real // u, 1024 // u))


def test_rejects_bad_grids_and_padding():
    with pytest.raises(ValueError, match="invalid grid"):
        make_plan([(1, 3, 4)], QWEN2)
    with pytest.raises(ValueError, match="cannot pad"):
        make_plan([(1, 16, 16)], QWEN2, pad_to=128)
