"""Our towers against transformers' own towers on checkpoints written by transformers' `save_pretrained`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import FAMILIES
from helpers import rel_err
from PIL import Image

from vitserve.encoder import EncodedImage, VisionEncoder, builtin_config, checkpoint
from vitserve.encoder.layers import MLP_ALIGN
from vitserve.encoder.models import FAMILY_MODULES
from vitserve.encoder.vision_encoder import load_configs

TOL = 1e-5
SAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sample.jpg"
# Mixed batch: a grid not divisible by Qwen2.5's 4x4-token window (20x28 -> 10x14 tokens), a tall narrow one,
# a 2-frame clip, and a single merge block.
GRIDS = [(1, 20, 28), (1, 12, 6), (2, 8, 8), (1, 2, 2)]


def pixels_for(grids, patch_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), patch_dim, generator=gen)


def reference(tower, pixel_values, grids):
    with torch.no_grad():
        out = tower(pixel_values, torch.tensor(grids))
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


@pytest.mark.parametrize("variant", ["", "-sharded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_transformers(checkpoints, family, variant):
    path, hf_tower = checkpoints[family + variant]
    enc = VisionEncoder.from_pretrained(path)
    assert enc.config.family == family
    px = pixels_for(GRIDS, enc.config.patch_dim)
    ref, ref_deepstack = reference(hf_tower, px, GRIDS)
    results = enc.encode_pixels(px, torch.tensor(GRIDS))
    assert [r.grid_thw for r in results] == GRIDS
    ours = torch.cat([r.embeddings for r in results])
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) <= TOL
    if family == "qwen3_vl":
        assert len(ref_deepstack) == 2 and all(len(r.deepstack) == 2 for r in results)
        for j, ref_j in enumerate(ref_deepstack):
            assert rel_err(torch.cat([r.deepstack[j] for r in results]), ref_j) <= TOL
    else:
        assert all(r.deepstack == [] for r in results)  # a list always: empty without deepstack


@pytest.mark.parametrize("name, layers", [("tiny-qwen2.5-vl", 0), ("tiny-qwen3-vl", 2)])
def test_one_image_in_one_result_out(name, layers):
    """encode and preprocess take one image (a path, its bytes, a PIL image) where they take a list: encode gives
    its result, not a list of one (and not one result per character of a path, or per byte); preprocess keeps
    transformers' batched layout."""
    enc = VisionEncoder.from_pretrained(name, load_format="dummy")
    (listed,) = enc.encode([str(SAMPLE)])
    for image in (str(SAMPLE), SAMPLE, SAMPLE.read_bytes(), bytearray(SAMPLE.read_bytes()), Image.open(SAMPLE)):
        one = enc.encode(image)
        assert isinstance(one, EncodedImage) and one.grid_thw == listed.grid_thw
        assert torch.equal(one.embeddings, listed.embeddings) and len(one.deepstack) == layers
        assert all(torch.equal(a, b) for a, b in zip(one.deepstack, listed.deepstack))
    pixels, grid = enc.preprocess(str(SAMPLE))
    listed_pixels, listed_grid = enc.preprocess([SAMPLE.read_bytes()])
    assert grid.shape == (1, 3) and torch.equal(grid, listed_grid) and torch.equal(pixels, listed_pixels)
    assert [r.grid_thw for r in enc.encode(iter([SAMPLE, SAMPLE]))] == [listed.grid_thw] * 2  # any iterable: a list
    assert enc.encode([]) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_batch_equals_one_by_one(checkpoints, family):
    path, _ = checkpoints[family]
    enc = VisionEncoder.from_pretrained(path)
    # (1,8,12) and (1,12,8) have the same patch count but different shapes; (1,10,6) is not window-divisible.
    grids = [(1, 8, 12), (1, 12, 8), (1, 10, 6), (1, 2, 2), (1, 16, 16)]
    px = pixels_for(grids, enc.config.patch_dim, seed=1)
    packed = enc.encode_pixels(px, grids)
    start = 0
    for grid, result in zip(grids, packed):
        n = grid[0] * grid[1] * grid[2]
        (alone,) = enc.encode_pixels(px[start : start + n], [grid])
        start += n
        assert result.embeddings.shape == (n // enc.config.merge_unit, enc.config.out_hidden_size)
        assert rel_err(result.embeddings, alone.embeddings) <= TOL
        for a, b in zip(result.deepstack or [], alone.deepstack or []):
            assert rel_err(a, b) <= TOL
    # Same count, different shapes, different outputs: a plan keyed only by count would make these equal.
    assert not torch.allclose(packed[0].embeddings, enc.encode_pixels(px[:96], [(1, 12, 8)])[0].embeddings)


@pytest.mark.parametrize("family", FAMILIES)
def test_mlp_widths_padded_and_fused(checkpoints, family):
    enc = VisionEncoder.from_pretrained(checkpoints[family][0])
    mlp = enc.tower.blocks[0].mlp
    widths = [
        p.shape[0] for n, p in mlp.named_parameters() if n.endswith("weight") and p.shape[1] == enc.config.hidden_size
    ]
    assert all(w % MLP_ALIGN == 0 for w in widths)
    if family == "qwen2_5_vl":  # gate and up are one GEMM of twice the padded width
        assert [n for n, _ in mlp.named_children()] == ["gate_up", "down"]
        assert mlp.gate_up.weight.shape[0] == 2 * 128
        # padded rows of gate/up and padded columns of down are exactly zero
        assert mlp.gate_up.weight[90:128].abs().max() == 0 and mlp.down.weight[:, 90:].abs().max() == 0


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_dummy_weights_are_seeded_and_finite(name):
    a = VisionEncoder.from_pretrained(name, load_format="dummy", seed=3)
    b = VisionEncoder.from_pretrained(name, load_format="dummy", seed=3)
    c = VisionEncoder.from_pretrained(name, load_format="dummy", seed=4)
    px = pixels_for([(1, 8, 8)], a.config.patch_dim)
    ra, rb, rc = (e.encode_pixels(px, [(1, 8, 8)])[0].embeddings for e in (a, b, c))
    assert torch.isfinite(ra).all() and torch.equal(ra, rb) and not torch.equal(ra, rc)


def test_dummy_weights_are_the_same_on_any_number_of_threads(monkeypatch):
    """Each tensor's own generator: a generator shared by the drawing threads would draw in whatever order they ran."""
    cfg = builtin_config("tiny-qwen3-vl")
    many = checkpoint.dummy_tensors(cfg, seed=5)
    monkeypatch.setattr(checkpoint.os, "cpu_count", lambda: 1)
    one = checkpoint.dummy_tensors(cfg, seed=5)
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)
    assert not torch.equal(one["blocks.0.attn.qkv.weight"], one["blocks.1.attn.qkv.weight"])  # a generator each


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_converted_on_the_device_in_its_dtype_are_the_hosts_cast(checkpoints, family):
    """build_tower casts first and converts after (on a GPU, on the device): the same weights as converting the
    published float32 tensors and casting the result, bit for bit (a conversion with arithmetic in it would not be)."""
    cfg, _, path = load_configs(checkpoints[family][0])
    assert path is not None
    tensors = checkpoint.read_vision_tensors(path)
    tower = checkpoint.build_tower(cfg, tensors, "cpu", torch.bfloat16, "sdpa")
    expected = {k: v.to(torch.bfloat16) for k, v in FAMILY_MODULES[cfg.family].convert(tensors, cfg).items()}
    state = tower.state_dict()
    assert state.keys() == expected.keys()
    assert all(state[k].dtype == torch.bfloat16 and torch.equal(state[k], expected[k]) for k in expected)


def test_builtin_configs_cover_published_checkpoints():
    expected = {  # family, depth, width, MLP, out_hidden (published config.json values)
        "Qwen/Qwen2-VL-7B-Instruct": ("qwen2_vl", 32, 1280, 5120, 3584),
        "Qwen/Qwen2.5-VL-7B-Instruct": ("qwen2_5_vl", 32, 1280, 3420, 3584),
        "Qwen/Qwen2.5-VL-3B-Instruct": ("qwen2_5_vl", 32, 1280, 3420, 2048),
        "Qwen/Qwen3-VL-8B-Instruct": ("qwen3_vl", 27, 1152, 4304, 4096),
        "Qwen/Qwen3-VL-2B-Instruct": ("qwen3_vl", 24, 1024, 4096, 2048),
    }
    for name, want in expected.items():
        c = builtin_config(name)
        assert (c.family, c.depth, c.hidden_size, c.intermediate_size, c.out_hidden_size) == want
    assert builtin_config("qwen2.5-vl-7b-instruct") is builtin_config("Qwen/Qwen2.5-VL-7B-Instruct")
    assert builtin_config("Qwen/Qwen3-VL-8B-Instruct").deepstack_visual_indexes == (8, 16, 24)
    with pytest.raises(KeyError, match="no built-in config"):
        builtin_config("Qwen/Qwen9-VL")


def test_parameter_counts_match_published_towers():
    """Meta-device builds of the real-size towers have the published parameter counts (before MLP padding)."""

    for name, millions in [
        ("Qwen/Qwen2-VL-7B-Instruct", 676),
        ("Qwen/Qwen2.5-VL-7B-Instruct", 677),
        ("Qwen/Qwen3-VL-8B-Instruct", 576),
        ("Qwen/Qwen3-VL-2B-Instruct", 407),
    ]:
        cfg = builtin_config(name)
        shapes = FAMILY_MODULES[cfg.family].hf_layout(cfg).values()
        total = sum(torch.Size(s).numel() for s in shapes)
        assert round(total / 1e6) == millions, (name, total)
