"""The graph-cached runner's planning, padding and packing, exercised on the CPU exactly as on the GPU (where the
padded batch is replayed from a CUDA graph instead of run eagerly): these runners pad (`pad=True`) as a graph runner
does; a serving CPU runner runs its batches at their own size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FAMILIES
from helpers import rel_err

from vitserve.encoder import VisionEncoder
from vitserve.encoder.packing import frame_capacity, window_capacity
from vitserve.encoder.plan import make_plan, to_device
from vitserve.encoder.preprocess import normalize_lut
from vitserve.encoder.runner import GraphRunner

CPU = torch.device("cpu")


def padded(encoder: VisionEncoder) -> VisionEncoder:
    encoder.runner.pad = True
    return encoder


@pytest.fixture(scope="module")
def encoders(checkpoints):
    return {f: padded(VisionEncoder.from_pretrained(checkpoints[f][0], budgets=(256, 1024))) for f in FAMILIES}


def pixels(grids, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), dim, generator=g)


def unpadded(enc, px, grids):
    """Reference: the tower on the exact, unpadded plan of each image alone."""
    out, start = [], 0
    for grid in grids:
        n = grid[0] * grid[1] * grid[2]
        plan = make_plan([grid], enc.config)
        merged, deepstack = enc.tower(to_device(plan, px[start : start + n], CPU, torch.float32))
        out.append((merged, deepstack))
        start += n
    return out


def check(enc, grids, seed=0):
    px = pixels(grids, enc.config.patch_dim, seed)
    results = enc.encode_pixels(px, grids)
    with torch.inference_mode():
        refs = unpadded(enc, px, grids)
    for r, (merged, deepstack) in zip(results, refs):
        assert r.embeddings.shape == merged.shape
        assert rel_err(r.embeddings, merged) <= 1e-5
        for a, b in zip(r.deepstack or [], deepstack):
            assert rel_err(a, b) <= 1e-5
    return results


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_equals_unpadded_images(encoders, family):
    enc = encoders[family]
    before = enc.runner.stats.budgets[256].replays
    check(enc, [(1, 8, 12), (1, 4, 6)])  # 120 patches -> padded to 256
    stats = enc.runner.stats.budgets[256]
    assert stats.replays == before + 1 and stats.padded_patches >= 136


@pytest.mark.parametrize("family", FAMILIES)
def test_same_patch_count_different_grids(encoders, family):
    """Batches with equal totals (112 patches, same budget) but different grids and splits all match: nothing
    depends on the grids is frozen between replays."""
    enc = encoders[family]
    batches = [
        [(1, 8, 12), (1, 4, 4)],
        [(1, 12, 8), (1, 4, 4)],
        [(1, 4, 28)],
        [(1, 4, 4), (1, 8, 12)],
        [(1, 2, 56)],
        [(1, 4, 4)] * 7,
    ]
    outputs = [check(enc, grids, seed=1) for grids in batches]
    # different grids really give different outputs (a frozen plan would make them equal)
    assert not torch.allclose(outputs[0][0].embeddings, outputs[1][0].embeddings)


@pytest.mark.parametrize("family", FAMILIES)
def test_padding_cannot_reach_real_tokens(encoders, family, monkeypatch):
    """Poison the padding rows with NaN after the metadata is loaded: real outputs stay finite and unchanged."""
    enc = encoders[family]
    load = GraphRunner._load

    def poisoned(self, plan, px, budget):
        inputs = load(self, plan, px, budget)
        self.static.pixel_values[plan.num_patches : budget] = float("nan")
        return inputs

    monkeypatch.setattr(GraphRunner, "_load", poisoned)
    results = check(enc, [(1, 10, 6), (1, 6, 10)])
    assert all(torch.isfinite(r.embeddings).all() for r in results)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_budget_loaded_with_its_filler_holds_that_image_alone_whatever_came_before(encoders, family):
    """What a graph is captured on and what a lone replay reads (bench/launch.py): after a smaller budget's batch,
    `load_filler(budget)` leaves the buffers holding one image that fills the budget, so the tower on them is the
    tower on that image alone (stale metadata of the batch before, its cu_seqlens among it, would change it)."""
    enc = encoders[family]
    check(enc, [(1, 4, 4), (1, 2, 6)])  # budget 256's plan in the buffers
    grid = enc.runner.filler_grid(1024)
    with torch.inference_mode():
        inputs = enc.runner.load_filler(1024)
        assert int(inputs.cu_seqlens[-1]) == 1024 and bool((inputs.cu_seqlens.diff() >= 0).all())
        merged, deepstack = enc.tower(inputs)
        [(ref, ref_deepstack)] = unpadded(enc, torch.zeros(1024, enc.config.patch_dim), [grid])
    assert rel_err(merged, ref) <= 1e-5
    for a, b in zip(deepstack, ref_deepstack):
        assert rel_err(a, b) <= 1e-5


def test_oversize_image_runs_eagerly_and_buffers_never_move(encoders):
    enc = encoders["qwen2_5_vl"]
    s = enc.runner.static
    ptrs = [t.data_ptr() for t in vars(s).values() if torch.is_tensor(t)]
    eager = enc.runner.stats.eager_fallbacks
    check(enc, [(1, 40, 28), (1, 4, 4)])  # 1120 patches > largest budget 1024 -> eager; the small one replays
    check(enc, [(1, 2, 2)])
    assert enc.runner.stats.eager_fallbacks == eager + 1
    assert [t.data_ptr() for t in vars(s).values() if torch.is_tensor(t)] == ptrs
    assert s.pixel_values.shape[0] == 1024


def test_packing_order_and_capacities(checkpoints):
    enc = padded(VisionEncoder.from_pretrained(checkpoints["qwen2_5_vl"][0], budgets=(256, 512, 1024)))
    runner = enc.runner
    grids = [(1, 16, 16), (1, 4, 4), (1, 20, 28), (1, 8, 8), (1, 36, 36), (1, 16, 16), (1, 2, 2)]
    batches = runner.pack(grids)
    assert sorted(i for b in batches for i in b.indices) == list(range(len(grids)))  # every image exactly once
    eager = [b for b in batches if b.budget is None]
    assert [b.indices for b in eager] == [[4]]  # 1296 patches > 1024
    for b in batches:
        if b.budget is not None:
            assert b.patches == sum(grids[i][1] * grids[i][2] for i in b.indices) <= b.budget
            assert b.frames <= frame_capacity(b.budget, runner.cfg) and b.windows <= window_capacity(b.budget)
            assert b.budget == runner.packer.budget_for(b.patches, b.frames, b.windows)  # the smallest that admits it
    # first-fit decreasing: 560 + 256 + 256 + 64 + 16 + 4 = 1156 patches need 2 replays, not more
    assert len(batches) - len(eager) == 2
    # results come back in input order
    px = pixels(grids, enc.config.patch_dim)
    results = enc.encode_pixels(px, grids)
    assert [r.grid_thw for r in results] == grids
    assert [r.num_tokens for r in results] == [t * h * w // enc.config.merge_unit for t, h, w in grids]


def test_many_tiny_frames_split_by_capacity(checkpoints):
    enc = VisionEncoder.from_pretrained(checkpoints["qwen2_vl"][0], budgets=(256,))
    grids = [(1, 2, 2)] * 40  # 160 patches fit 256, but 40 frames exceed the 16-frame capacity of a 256 replay
    assert frame_capacity(256, enc.config) == 16
    batches = enc.runner.pack(grids)
    assert [len(b.indices) for b in batches] == [15, 15, 10]  # the 16th segment of each covers its padding
    check(enc, grids)


def test_overlapping_use_is_refused(encoders):
    runner = encoders["qwen2_vl"].runner
    runner._lock.acquire()
    try:
        with pytest.raises(RuntimeError, match="one worker thread"):
            runner.run(pixels([(1, 2, 2)], 1176), [(1, 2, 2)])
    finally:
        runner._lock.release()


def test_stats_dict(encoders):
    stats = encoders["qwen3_vl"].runner.stats.as_dict()
    assert set(stats) == {
        "mode",
        "budgets",
        "eager_runs",
        "eager_patches",
        "eager_fallbacks",
        "pool_bytes",
        "capture_seconds",
        "attention",
    }
    assert stats["mode"] == "padded"
    assert stats["attention"] == {"full": "sdpa"}  # auto on the CPU; no window layers in Qwen3
    assert encoders["qwen2_5_vl"].runner.stats.as_dict()["attention"] == {"full": "sdpa", "window": "sdpa"}
    assert set(stats["budgets"]) == {"256", "1024"}
    assert set(stats["budgets"]["256"]) == {"captured", "capture_ms", "replays", "real_patches", "padded_patches"}
    assert stats["budgets"]["256"]["captured"] is False  # no CUDA graphs on the CPU


def test_budgets_validated(checkpoints):
    with pytest.raises(ValueError, match="multiples of 16"):
        VisionEncoder.from_pretrained(checkpoints["qwen2_vl"][0], budgets=(100,))


def test_uint8_images_path_equals_float_rows(encoders):
    """Normalize + patchify on the device (launch_images, the server's path) gives exactly preprocess()'s rows."""
    import numpy as np
    from PIL import Image

    from vitserve.encoder.preprocess import normalize_lut

    enc = encoders["qwen3_vl"]
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(256, 320), (288, 256)]]
    via_rows = enc.encode_pixels(*enc.preprocess(images))
    via_images = enc.encode(images)
    for a, b in zip(via_rows, via_images):
        assert a.grid_thw == b.grid_thw and torch.equal(a.embeddings, b.embeddings)
        assert all(torch.equal(x, y) for x, y in zip(a.deepstack, b.deepstack))
    lut = normalize_lut(enc.preprocess_config.image_mean, enc.preprocess_config.image_std)
    with pytest.raises(ValueError, match="uint8"):
        enc.runner.launch_images([np.zeros((30, 32, 3), np.uint8)], lut)
    with pytest.raises(ValueError, match="uint8"):
        enc.runner.launch_images([np.zeros((32, 32, 3), np.float32)], lut)


def test_a_batch_of_host_arrays_and_device_tensors_is_a_batch_of_host_arrays(encoders):
    """An image still on the host beside a video slice already on the device (converted there from its planes):
    the host one is uploaded, and the answers are those of the same pixels all on the host. The host image is
    read-only, as a decode worker's spooled pixels are, and uploading it warns of nothing (torch.from_numpy warns
    about an array it cannot write, once per process, into the server's log)."""
    import warnings

    import numpy as np

    from vitserve.encoder.preprocess import normalize_lut

    enc = encoders["qwen3_vl"]
    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)
    slice_ = rng.integers(0, 256, (2, 96, 64, 3), dtype=np.uint8)
    lut = normalize_lut(enc.preprocess_config.image_mean, enc.preprocess_config.image_std)
    image.setflags(write=False)
    host = enc.runner.collect(enc.runner.launch_images([image, slice_], lut))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mixed = enc.runner.collect(enc.runner.launch_images([image, torch.from_numpy(slice_).to(enc.device)], lut))
    for (a, da), (b, db) in zip(host, mixed):
        assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(da, db))


def test_pooled_images_come_back_as_device_means(encoders):
    """`mean_pooling` images return the mean of exactly the tokens they would return, in float32, whether the whole
    replay is pooled (only means are copied back) or mixed with token requests; the others are unchanged."""
    enc = encoders["qwen3_vl"]
    rng = np.random.default_rng(0)
    p = enc.config.patch_size
    images = [rng.integers(0, 256, (h * p, w * p, 3), dtype=np.uint8) for h, w in [(4, 6), (8, 8), (2, 2), (6, 4)]]
    lut = normalize_lut(enc.preprocess_config.image_mean, enc.preprocess_config.image_std)
    runner = enc.runner
    tokens = runner.collect(runner.launch_images(images, lut))
    mixed = runner.collect(runner.launch_images(images, lut, [True, False, True, False]))
    pooled = runner.collect(runner.launch_images(images, lut, [True] * 4))
    for i, (t, deepstack) in enumerate(tokens):
        assert (
            t.shape[0] == images[i].shape[0] * images[i].shape[1] // (p * p * enc.config.merge_unit)
            and len(deepstack) == 2
        )
        for vec, ds in [pooled[i]] + ([mixed[i]] if i % 2 == 0 else []):
            assert vec.dtype == torch.float32 and vec.shape == (t.shape[1],) and ds == []
            assert rel_err(vec, t.mean(0, dtype=torch.float32)) <= 1e-6
        if i % 2:
            assert torch.equal(mixed[i][0], t) and all(torch.equal(a, b) for a, b in zip(mixed[i][1], deepstack))
    with pytest.raises(ValueError, match="mean_pooling"):
        runner.launch_images(images, lut, [True])


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_images_wanted_in_float32_come_back_widened_from_a_bfloat16_runner(checkpoints, device):
    """A replay holding an image flagged `float32` copies its tokens and deepstack back in float32, every value the
    runner's bfloat16 one exactly (so no host converts them, and the cache keeps values a bfloat16 answer narrows
    back to the same bits); a replay without one stays in the runner's dtype, the graphs' outputs too (CUDA: graph
    replays, widened on the GPU into pinned memory); pooled means are float32 either way."""
    enc = VisionEncoder.from_pretrained(
        checkpoints["qwen3_vl"][0], device=device, dtype="bfloat16", budgets=(256, 1024)
    )
    enc = padded(enc) if device == "cpu" else enc
    rng = np.random.default_rng(1)
    p = enc.config.patch_size
    images = [rng.integers(0, 256, (h * p, w * p, 3), dtype=np.uint8) for h, w in [(4, 6), (8, 8), (2, 2)]]
    lut = normalize_lut(enc.preprocess_config.image_mean, enc.preprocess_config.image_std)
    runner = enc.runner
    narrow = runner.collect(runner.launch_images(images, lut))
    wide = runner.collect(runner.launch_images(images, lut, None, None, [False, True, False]))
    pooled = runner.collect(runner.launch_images(images, lut, [True, False, True], None, [False, True, False]))
    again = runner.collect(runner.launch_images(images, lut))
    for (t, ds), (w, wds), (m, _), (r, _) in zip(narrow, wide, pooled, again):
        assert t.dtype == torch.bfloat16 and w.dtype == torch.float32 and all(d.dtype == torch.float32 for d in wds)
        assert torch.equal(w, t.float()) and all(torch.equal(a, b.float()) for a, b in zip(wds, ds))
        assert m.dtype == torch.float32 and torch.equal(r, t) and w.is_pinned() == (device == "cuda")
    assert torch.equal(pooled[1][0], wide[1][0])
    with pytest.raises(ValueError, match="float32"):
        runner.launch_images(images, lut, None, None, [True])


def test_frame_capacity_follows_full_attention_layers():
    """Empty flash blocks cost per full-attention layer: all-full towers admit 16 frames a replay, Qwen2.5 (4 full
    layers of 32) up to the row-block bound."""
    from vitserve.encoder.config import builtin_config

    qwen2, qwen25, qwen3 = (
        builtin_config(m)
        for m in ("Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen3-VL-8B-Instruct")
    )
    assert [frame_capacity(b, qwen2) for b in (256, 2048, 8192, 16384)] == [16, 16, 16, 16]
    assert [frame_capacity(b, qwen3) for b in (256, 2048, 8192, 16384)] == [16, 16, 16, 16]
    assert [frame_capacity(b, qwen25) for b in (256, 1024, 2048, 8192, 16384)] == [16, 64, 128, 32, 16]


def test_a_cpu_runner_runs_batches_at_their_own_size(checkpoints):
    """Without graphs, a runner does not pad unless asked: a batch runs eagerly at its real size, counted as an eager
    run (not as a replay of a budget), with the same results as a padded runner; no padded buffers are allocated."""
    enc = VisionEncoder.from_pretrained(checkpoints["qwen2_5_vl"][0], budgets=(256, 1024))
    runner = enc.runner
    assert not runner.pad and runner.stats.mode == "eager"
    grids = [(1, 8, 12), (1, 4, 6), (1, 40, 28)]  # two share a 256 budget; the third is over the largest
    results = check(enc, grids)
    stats = runner.stats.as_dict()
    assert stats["eager_runs"] == 2 and stats["eager_patches"] == 8 * 12 + 4 * 6 + 40 * 28
    assert stats["eager_fallbacks"] == 1  # the one larger than any budget
    assert all(b["replays"] == 0 and b["padded_patches"] == 0 for b in stats["budgets"].values())
    assert runner._static is None
    again = padded(VisionEncoder.from_pretrained(checkpoints["qwen2_5_vl"][0], budgets=(256, 1024)))
    for a, b in zip(results, again.encode_pixels(pixels(grids, enc.config.patch_dim), grids)):
        assert rel_err(a.embeddings, b.embeddings) <= 1e-5
