"""End to end on the CPU: image files -> `vitserve encode` -> safetensors, against transformers' processor + tower;
and both commands failing fast, with one line and exit status 2, on settings that cannot work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import rel_err
from PIL import Image
from safetensors import safe_open

from vitserve.service.launch import free_port

ROOT = Path(__file__).resolve().parents[1]


def vitserve(*argv: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """`python -m vitserve ARGV...` with `env` added to the environment (stdout and stderr together)."""
    return subprocess.run([sys.executable, "-m", "vitserve", *argv], cwd=ROOT, env=os.environ | env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)


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


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["--help"], ["--model", "tiny-qwen2.5-vl"]])
def test_a_bad_variable_fails_in_one_line(argv):
    proc = vitserve("serve", *argv, timeout=60, VITSERVE_PORT="abc")
    assert (proc.returncode, proc.stdout) == (2, "vitserve serve: VITSERVE_PORT: invalid int value: 'abc'\n")


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", [
    (["--dtype", "float8"], "vitserve serve: --dtype must be auto or one of float32, float16, bfloat16, fp32, fp16, "
                            "bf16, half, got 'float8'"),
    pytest.param(["--device", "cuda"], "vitserve serve: device cuda asked for, but CUDA is not available on this "
                                       "machine", marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                                           reason="needs a machine without CUDA"))])
def test_serve_rejects_what_cannot_load_before_it_starts(flags, message):
    proc = vitserve("serve", "--model", "tiny-qwen2.5-vl", "--load-format", "dummy", "--host", "127.0.0.1",
                    "--port", str(free_port()), *flags, timeout=60)
    assert proc.returncode == 2 and "Uvicorn running" not in proc.stdout and "Traceback" not in proc.stdout
    assert proc.stdout.startswith(message) and proc.stdout.count("\n") == 1, proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("env, flags, dtype", [
    ({"VITSERVE_DTYPE": "bf16", "VITSERVE_DEVICE": "cpu"}, [], "bfloat16"),
    ({"VITSERVE_DTYPE": "bf16"}, ["--dtype", "fp16"], "float16")])  # the flag wins over its variable
def test_encode_reads_the_settings_of_serve(tmp_path, env, flags, dtype):
    """A tiny built-in without --load-format dummy: dummy weights, said so; VITSERVE_* and the dtype aliases as
    `serve` has them; --device auto is the CPU here."""
    out = tmp_path / "out.safetensors"
    proc = vitserve("encode", "--model", "tiny-qwen2.5-vl", *flags, *write_images(tmp_path), "-o", str(out), **env)
    assert proc.returncode == 0, proc.stdout
    assert "tiny-qwen2.5-vl is a built-in test tower with no checkpoint: using seeded random weights " \
           "(--load-format dummy)" in proc.stdout
    device = "cpu" if "VITSERVE_DEVICE" in env or not torch.cuda.is_available() else "cuda:0"
    assert "encoded 2 image(s), " in proc.stdout and f" tokens, on {device} in {dtype}, in " in proc.stdout
    with safe_open(out, framework="pt") as f:
        assert f.metadata()["dtype"] == dtype and f.get_tensor("images.0.embeddings").dtype == getattr(torch, dtype)


@pytest.mark.slow
def test_encode_a_builtin_hub_id_not_in_the_cache_fails_at_once_with_the_fix(tmp_path):
    start = time.perf_counter()
    proc = vitserve("encode", "--model", "Qwen/Qwen2.5-VL-3B-Instruct", *write_images(tmp_path), "-o",
                    str(tmp_path / "out"), timeout=60, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    assert time.perf_counter() - start < 20  # an interpreter and torch starting; no retries
    assert proc.returncode == 2 and proc.stdout.count("\n") == 1, proc.stdout
    assert proc.stdout.startswith("vitserve encode: 'Qwen/Qwen2.5-VL-3B-Instruct' is not a local directory and not "
                                  "in the Hugging Face cache")
    assert "add --load-format dummy for seeded random weights" in proc.stdout
    assert "hf download Qwen/Qwen2.5-VL-3B-Instruct" in proc.stdout and not (tmp_path / "out").exists()
