"""GPU-only: graph replays equal eager forwards over the same buffers (skipped cleanly without CUDA)."""

from __future__ import annotations

import pytest
import torch

from encoder import VisionEncoder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_graph_replay_equals_eager(name):
    enc = VisionEncoder.from_pretrained(name, device="cuda", dtype="bfloat16", load_format="dummy", budgets=(256, 1024))
    assert enc.runner.use_graphs and set(enc.runner.graphs) == {256, 1024}
    for grids in ([(1, 8, 12), (1, 4, 4)], [(1, 12, 8), (1, 4, 4)], [(1, 20, 28)], [(1, 40, 28)]):
        px = torch.randn(sum(t * h * w for t, h, w in grids), enc.config.patch_dim)
        enc.runner.use_graphs = False
        eager = enc.encode_pixels(px, grids)
        enc.runner.use_graphs = True
        graph = enc.encode_pixels(px, grids)
        for a, b in zip(graph, eager):
            assert torch.isfinite(a.embeddings).all()
            assert torch.allclose(a.embeddings.float(), b.embeddings.float(), rtol=1e-3, atol=1e-3)
