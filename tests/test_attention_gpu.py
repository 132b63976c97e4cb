"""GPU-only: every attention backend installed here against exact float32 attention, eagerly and from a CUDA graph
replayed with another layout written into its cu_seqlens (skipped cleanly without CUDA or without the package)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vitserve.encoder import attention
from vitserve.encoder.runner import capture_graph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
HEADS = 4
# (segment lengths, capacity, max_seqlen as a budget graph passes it, padding rows after the last segment)
LAYOUTS = [
    ([300, 0, 17, 1000], 8, 1536, 219),
    ([1536], 8, 1536, 0),
    ([64] * 24, 32, 1536, 0),
    ([5, 1, 2], 8, 1536, 1528),
]


def backend_or_skip(name: str, head_dim: int):
    try:
        return attention.select(name, torch.device("cuda"), torch.bfloat16, HEADS, head_dim)
    except ValueError as e:
        pytest.skip(str(e))


def cu_of(lengths, capacity):
    cu = torch.zeros(capacity + 1, dtype=torch.int32)
    cu[1 : len(lengths) + 1] = torch.tensor(lengths).cumsum(0)
    cu[len(lengths) + 1 :] = cu[len(lengths)]
    return cu.cuda()


# what padding rows hold: NaN where a backend promises never to read them, so a real row that read one comes out NaN;
# large finite values for fa4, which weights the rows it reads past a segment's end zero (attention.py)
PADDING = {"fa4": 3e4}


def inputs(lengths, pad, head_dim, seed, padding=float("nan")):
    """q, k contiguous and v a view of a fused [rows, 3, H, D] buffer (as the tower has them); `padding` in the
    padding rows."""
    real = sum(lengths)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(real + pad, 3, HEADS, head_dim, device="cuda", generator=gen).bfloat16()
    qkv[real:] = padding
    return qkv[:, 0].contiguous(), qkv[:, 1].contiguous(), qkv[:, 2]


def exact(q, k, v, lengths):
    out, start = [], 0
    for n in lengths:
        seg = [t[start : start + n].float().transpose(0, 1)[None] for t in (q, k, v)]
        out.append(
            F.scaled_dot_product_attention(*seg)[0].transpose(0, 1) if n else q.new_zeros(0, *q.shape[1:]).float()
        )
        start += n
    return torch.cat(out)


def close(out, want):
    assert torch.isfinite(out).all()
    assert ((out.float() - want).norm() / want.norm()).item() < 1e-2  # bf16 inputs: ~3e-3


@pytest.mark.parametrize("head_dim", [72, 80])
@pytest.mark.parametrize("name", ["flash", "cudnn", "fa4"])
def test_backend_matches_exact_attention_eager_and_in_graph(name, head_dim):
    backend = backend_or_skip(name, head_dim)
    for seed, (lengths, capacity, max_seqlen, pad) in enumerate(LAYOUTS):
        q, k, v = inputs(lengths, pad, head_dim, seed, PADDING.get(name, float("nan")))
        real = sum(lengths)
        want = exact(q, k, v, lengths)
        close(backend.bind(cu_of(lengths, capacity), max(lengths), None)(q, k, v)[:real], want)
        # a graph captured on one segment over all real rows, replayed after this layout is written in place
        cu = cu_of([real], capacity)

        graph, out = capture_graph(lambda: backend.bind(cu, max_seqlen, None)(q, k, v))
        cu.copy_(cu_of(lengths, capacity))
        out.fill_(float("nan"))
        graph.replay()
        close(out[:real], want)


def test_cudnn_graphs_are_shared_by_eager_calls_of_nearby_shapes():
    """Eager calls (the runner's fallback for an image over every budget) pass exact shapes: their cuDNN graphs are
    keyed by powers of two, so images of 1000 to 1024 rows in 3 or 4 segments share one graph, and stay correct."""
    backend = backend_or_skip("cudnn", 80)
    before = len(backend.graphs)
    for lengths in ([1000], [1010, 3], [1024, 0, 7], [600, 400, 24, 0]):
        q, k, v = inputs(lengths, 0, 80, 7)
        out = backend.bind(cu_of(lengths, len(lengths)), max(lengths), None)(q, k, v)
        close(out, exact(q, k, v, lengths))
    assert len(backend.graphs) - before <= 3  # 1, 2 and 4 segments at max_seqlen 1024 (per stride of v)
