"""End to end on the CPU: image files -> `vitserve encode` -> safetensors, against transformers' processor + tower."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import rel_err
from PIL import Image
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]


def write_images(tmp_path: Path) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    for i, (w, h) in enumerate([(120, 90), (64, 200)]):
        path = tmp_path / f"img{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return paths


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_encode_cli_matches_transformers_pipeline(checkpoints, tmp_path, family):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path, hf_tower = checkpoints[family]
    images = write_images(tmp_path)
    out = tmp_path / "out.safetensors"
    proc = subprocess.run([sys.executable, "-m", "vitserve", "encode", "--model", path, *images, "-o", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "encoded 2 image(s)" in proc.stderr

    qwen3 = family == "qwen3_vl"
    processor = Qwen2VLImageProcessorPil(
        patch_size=16 if qwen3 else 14, **(dict(image_mean=[0.5] * 3, image_std=[0.5] * 3) if qwen3 else {}),
        size={"shortest_edge": 65536 if qwen3 else 3136, "longest_edge": 16777216 if qwen3 else 12845056})
    batch = processor([Image.open(p) for p in images], return_tensors="pt")
    with torch.no_grad():
        ref = hf_tower(batch["pixel_values"], batch["image_grid_thw"])
    with safe_open(out, framework="pt") as f:
        meta = f.metadata()
        assert json.loads(meta["grid_thw"]) == batch["image_grid_thw"].tolist()
        assert json.loads(meta["sources"]) == images and meta["family"] == family
        ours = torch.cat([f.get_tensor(f"images.{i}.embeddings") for i in range(2)])
        assert rel_err(ours, ref.pooler_output) <= 1e-5
        if qwen3:
            for j, ref_j in enumerate(ref.deepstack_features):
                assert rel_err(torch.cat([f.get_tensor(f"images.{i}.deepstack.{j}") for i in range(2)]), ref_j) <= 1e-5
        else:
            assert not any(".deepstack." in k for k in f.keys())


@pytest.mark.slow
def test_encode_cli_reports_bad_input(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    cmd = [sys.executable, "-m", "vitserve", "encode", "--model", "tiny-qwen2-vl", "--load-format", "dummy"]
    proc = subprocess.run(cmd + [str(bad), "-o", str(tmp_path / "o.safetensors")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "vitserve encode:" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "vitserve", "encode", "--model", str(tmp_path / "missing"),
                           str(bad), "-o", "x"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
