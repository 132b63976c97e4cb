"""One item's answer (encoder/features.py): the packed layout (tokens, then each deepstack feature, per row) against
a hand-laid `torch.cat` of the parts in that order, its row views for gathered writes, and a video's slices joined."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vitserve.encoder.features import Features, Rows, raw_view

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def tensor(rows: int, width: int, seed: int, dtype: torch.dtype = torch.float32, edges: bool = True) -> torch.Tensor:
    t = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 100
    if edges:  # bits a value compare would miss
        t.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])
    return t.to(dtype)


def item(
    rows: int = 7, widths=(48, 16, 16, 16), dtype: torch.dtype = torch.float32, seed: int = 0, edges: bool = True
) -> Features:
    tokens, *deepstack = [tensor(rows, w, seed + k, dtype, edges) for k, w in enumerate(widths)]
    return Features(tokens, deepstack, [1, 2 * rows, 2])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def hand_laid(tokens: torch.Tensor, deepstack: list[torch.Tensor]) -> torch.Tensor:
    """The documented layout: `cat([tokens, ds0, ds1, ...], -1)`."""
    return torch.cat([tokens, *deepstack], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_is_the_tokens_then_each_deepstack_feature_per_row(dtype):
    """Distinct widths per part: a part out of order, or a row of one part beside another's next row, shows."""
    features = item(widths=(40, 8, 16, 24), dtype=dtype)
    packed = features.packed()
    assert same_bits(packed, hand_laid(features.tokens, features.deepstack))
    assert packed.shape == (7, features.width) == (7, 88)
    first_row = torch.cat([features.tokens[0], *(d[0] for d in features.deepstack)])
    assert same_bits(packed[0], first_row)


def test_packed_without_deepstack_is_the_tokens_themselves():
    tokens = tensor(5, 32, 1)
    assert Features(tokens).packed() is tokens


def test_packed_of_tensors_torch_must_join_is_torch_cat():
    """Tensors of several dtypes (or on a device, or in autograd) take torch.cat's own path: the same layout."""
    tokens, deep = tensor(4, 8, 1), tensor(4, 8, 2, torch.float16)
    assert same_bits(Features(tokens, [deep]).packed(), torch.cat([tokens, deep.float()], -1))
    grad = tensor(4, 8, 3).requires_grad_()
    packed = Features(grad, [tokens]).packed()
    assert packed.requires_grad and same_bits(packed.detach(), torch.cat([grad.detach(), tokens], -1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_views_of_the_parts_in_the_packed_order(dtype):
    """Row views in the item's own dtype are its tensors' memory (no copy), and a gathered write of their pieces is
    the packed tensor's bytes, from any first row to any last."""
    features = item(dtype=dtype)
    rows = features.rows(dtype)
    assert [v.ctypes.data for v in rows.views] == [t.data_ptr() for t in features.parts]
    assert (rows.count, rows.row_bytes) == (7, features.width * dtype.itemsize)
    assert rows.nbytes == features.nbytes
    want = raw_view(hand_laid(features.tokens, features.deepstack)).tobytes()
    row = rows.row_bytes
    assert b"".join(bytes(p) for p in rows.pieces(0, rows.count)) == want
    assert b"".join(bytes(p) for p in rows.pieces(2, 5)) == want[2 * row : 5 * row]
    assert len(rows.pieces(2, 5)) == 3 * len(features.parts)


@pytest.mark.parametrize("source", DTYPES)
@pytest.mark.parametrize("target", DTYPES)
def test_rows_in_another_dtype_are_the_converted_parts(source, target):
    features = item(dtype=source)
    rows = features.rows(target)
    out = np.empty((rows.count, rows.row_bytes), np.uint8)
    rows.copy_into(out)
    want = hand_laid(features.tokens.to(target), [d.to(target) for d in features.deepstack])
    numbers = ~want.isnan()
    got = torch.from_numpy(out.view(np.uint8).reshape(-1).copy()).view(target).reshape(want.shape)
    assert torch.equal(got.isnan(), ~numbers) and same_bits(got[numbers], want[numbers])


def test_copy_into_fills_a_slice_of_a_larger_frame():
    """Items one after another in one buffer (SGLang's frame): each item's rows land in its own rows only."""
    a, b = item(rows=3, seed=1), item(rows=5, seed=2)
    ra, rb = a.rows(torch.float32), b.rows(torch.float32)
    out = np.zeros((8, ra.row_bytes), np.uint8)
    ra.copy_into(out[:3])
    rb.copy_into(out[3:])
    frame = torch.from_numpy(out.reshape(-1).copy()).view(torch.float32).reshape(8, -1)
    assert same_bits(frame, torch.cat([hand_laid(a.tokens, a.deepstack), hand_laid(b.tokens, b.deepstack)]))


def test_join_puts_a_videos_slices_one_after_another():
    """Tokens slice after slice, each deepstack layer likewise (not interleaved, not reordered); the grid and timing
    given are the item's."""
    slices = [item(rows=n, seed=10 * n) for n in (4, 4, 2)]
    timing = {"frame_indices": [0, 1], "fps": 2.0, "timestamps": [0.25, 1.25, 2.0], "second_per_grid_t": 1.0}
    video = Features.join(slices, [3, 4, 4], timing)
    assert same_bits(video.tokens, torch.cat([s.tokens for s in slices]))
    assert len(video.deepstack) == 3
    for j, layer in enumerate(video.deepstack):
        assert same_bits(layer, torch.cat([s.deepstack[j] for s in slices]))
    assert (video.grid, video.timing) == ([3, 4, 4], timing)
    assert same_bits(video.packed(), torch.cat([hand_laid(s.tokens, s.deepstack) for s in slices]))


def test_join_takes_the_engines_pairs_and_pools_the_mean():
    """The engine's (tokens, deepstack list) per slice join as Features do; `mean` is the float32 mean of every
    slice's tokens, without deepstack."""
    slices = [
        item(rows=3, seed=1, dtype=torch.bfloat16, edges=False),
        item(rows=2, seed=2, dtype=torch.bfloat16, edges=False),
    ]
    pairs = [(s.tokens, s.deepstack) for s in slices]
    assert same_bits(Features.join(pairs).packed(), Features.join(slices).packed())
    pooled = Features.join(pairs, mean=True)
    assert pooled.deepstack == [] and pooled.tokens.dtype == torch.float32 and pooled.tokens.shape == (48,)
    assert torch.equal(pooled.tokens, torch.cat([s.tokens for s in slices]).float().mean(0))
    assert not torch.equal(pooled.tokens, slices[0].tokens.float().mean(0))


def test_of_builds_an_item_from_the_engines_output():
    tokens, deep = tensor(3, 8, 1), [tensor(3, 8, 2)]
    features = Features.of((tokens, deep), [1, 6, 2], None)
    assert features.tokens is tokens and features.deepstack == deep and features.grid == [1, 6, 2]
    assert Features.of(features) is features
    timed = Features.of(features, None, {"fps": 2.0})
    assert Features.of(timed, [1, 2, 2]).grid == [1, 2, 2] and Features.of(timed, [1, 2, 2]).timing == {"fps": 2.0}
    assert isinstance(features.rows(torch.float32), Rows)
