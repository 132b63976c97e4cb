"""GPU-only: graph replays equal eager forwards over the same buffers (skipped cleanly without CUDA)."""

from __future__ import annotations

import pytest
import torch

from vitserve.encoder import VisionEncoder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("backend", ["flash", "cudnn", "fa4"])
@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_graph_replay_equals_eager(name, backend):
    try:
        enc = VisionEncoder.from_pretrained(
            name, device="cuda", dtype="bfloat16", load_format="dummy", budgets=(256, 1024), attention_backend=backend
        )
    except ValueError as e:  # not installed here
        pytest.skip(str(e))
    assert enc.attention_backend == backend and enc.runner.use_graphs and set(enc.runner.graphs) == {256, 1024}
    for grids in ([(1, 8, 12), (1, 4, 4)], [(1, 12, 8), (1, 4, 4)], [(1, 20, 28)], [(1, 40, 28)]):
        px = torch.randn(sum(t * h * w for t, h, w in grids), enc.config.patch_dim)
        enc.runner.use_graphs = False
        eager = enc.encode_pixels(px, grids)
        enc.runner.use_graphs = True
        graph = enc.encode_pixels(px, grids)
        for a, b in zip(graph, eager):
            assert torch.isfinite(a.embeddings).all()
            assert torch.allclose(a.embeddings.float(), b.embeddings.float(), rtol=1e-3, atol=1e-3)


def test_uint8_path_equals_float_path_on_gpu():
    import numpy as np
    from PIL import Image

    enc = VisionEncoder.from_pretrained(
        "tiny-qwen2.5-vl", device="cuda", dtype="bfloat16", load_format="dummy", budgets=(256, 1024, 4096)
    )
    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(224, 336), (448, 448)]]
    for a, b in zip(enc.encode_pixels(*enc.preprocess(images)), enc.encode(images)):
        assert torch.equal(a.embeddings, b.embeddings)


def test_pooled_means_on_gpu_equal_the_mean_of_the_tokens():
    """Pooled images (means taken on the device, in one index_add over the replay) equal the float32 mean of the
    same replay's tokens, for a mix of pooled and token images."""
    import numpy as np

    from vitserve.encoder.preprocess import normalize_lut

    enc = VisionEncoder.from_pretrained(
        "tiny-qwen3-vl", device="cuda", dtype="bfloat16", load_format="dummy", budgets=(256, 1024, 4096)
    )
    rng = np.random.default_rng(2)
    p = enc.config.patch_size
    images = [rng.integers(0, 256, (h * p, w * p, 3), dtype=np.uint8) for h, w in [(4, 6), (16, 20), (2, 2), (8, 4)]]
    lut = normalize_lut(enc.preprocess_config.image_mean, enc.preprocess_config.image_std)
    tokens = enc.runner.collect(enc.runner.launch_images(images, lut))
    mixed = enc.runner.collect(enc.runner.launch_images(images, lut, [True, False, True, True]))
    for i in (0, 2, 3):
        want = tokens[i][0].float().mean(0)
        assert mixed[i][0].dtype == torch.float32
        assert ((mixed[i][0] - want).norm() / want.norm()).item() <= 1e-5
    assert torch.equal(mixed[1][0], tokens[1][0])


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_dummy_weights_are_the_same_on_every_device(name):
    """Seeded dummy weights are drawn on the CPU and then moved: a tower on CUDA holds the CPU tower's weights
    exactly (CUDA's generator would draw other numbers), so a GPU server answers as the CPU library does."""
    cpu = VisionEncoder.from_pretrained(name, load_format="dummy", capture=False)
    cuda = VisionEncoder.from_pretrained(name, load_format="dummy", device="cuda", capture=False)
    ours = cuda.tower.state_dict()
    for key, weight in cpu.tower.state_dict().items():
        assert torch.equal(ours[key].cpu(), weight), key


def test_pooled_means_are_the_same_run_after_run():
    """An image's pooled mean is computed without atomics: the same batch gives the same vectors bit for bit every
    time (a scatter's atomic adds, in no fixed order, changed their last bits from one request to the next)."""
    import numpy as np

    enc = VisionEncoder.from_pretrained(
        "tiny-qwen2.5-vl", device="cuda", dtype="bfloat16", load_format="dummy", budgets=(1024, 4096)
    )
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(448, 448), (224, 336), (672, 448)]]
    first = None
    for _ in range(20):
        means = [tokens for tokens, _ in enc.outputs(enc.launch(images, mean_pooling=[True] * 3))]
        if first is None:
            first = means
        assert all(torch.equal(a, b) for a, b in zip(means, first))
        tokens = [t for t, _ in enc.outputs(enc.launch(images))]
        assert all(torch.allclose(m, t.float().mean(0), rtol=1e-4, atol=1e-5) for m, t in zip(first, tokens))
