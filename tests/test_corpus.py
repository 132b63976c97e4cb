"""Bad and unusual input against the app (tiny Qwen2.5 checkpoint written by transformers): every invalid case is a
clear 4xx and never fails a good request in the same batching window; every valid-but-unusual image gives the same
numbers as transformers' processor + tower."""

from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from corpus import INVALID_IMAGES, VALID_IMAGES, encode, photo, uri
from fastapi.testclient import TestClient
from helpers import rel_err
from PIL import Image, ImageOps

from vitserve.encoder import VisionEncoder
from vitserve.service.entry.app import create_app
from vitserve.service.ground.settings import Settings
from vitserve.service.pipeline.engine import Engine

FAMILY = "qwen2_5_vl"


@pytest.fixture(scope="module")
def served(checkpoints):
    path, hf_tower = checkpoints[FAMILY]
    enc = VisionEncoder.from_pretrained(path)
    settings = Settings.of(
        model=path,
        served_model_name="tiny",
        max_batch_wait_ms=150,
        payload_limit=2 * 2**20,
        max_image_pixels=50_000_000,
    )
    with TestClient(create_app(settings, Engine(settings, encoders=enc))) as client:
        yield client, hf_tower


def reference(hf_tower, data: bytes) -> tuple[torch.Tensor, list[int]]:
    """transformers' path: PIL opens it (first frame), EXIF rotation applied, processor, tower."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 3136, "longest_edge": 12845056})
    batch = processor([image], return_tensors="pt")
    with torch.no_grad():
        tokens = hf_tower(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
    return tokens, batch["image_grid_thw"][0].tolist()


def tokens_of(reply: dict) -> torch.Tensor:
    item = reply["data"][0]
    return torch.from_numpy(np.frombuffer(base64.b64decode(item["embeddings"]), "<f4").reshape(item["shape"]).copy())


GOOD = encode(photo(160, 120, 99), "JPEG", quality=95)


@pytest.mark.parametrize("name", list(INVALID_IMAGES))
def test_invalid_image_is_a_clear_4xx_and_spares_its_neighbour(served, name):
    client, hf_tower = served
    item, status, code = INVALID_IMAGES[name]
    expected, grid = reference(hf_tower, GOOD)
    with ThreadPoolExecutor(2) as pool:  # both land in one 150 ms batching window
        bad = pool.submit(client.post, "/v1/encode", json={"images": [item]})
        good = pool.submit(client.post, "/v1/encode", json={"images": [uri(GOOD, "image/jpeg")]})
        bad, good = bad.result(), good.result()
    assert bad.status_code == status, bad.text
    error = bad.json()["error"]
    assert error["code"] == code and error["param"] == "images[0]" and error["message"].startswith("images[0]: ")
    assert good.status_code == 200
    assert good.json()["data"][0]["grid_thw"] == grid and rel_err(tokens_of(good.json()), expected) <= 1e-5


@pytest.mark.parametrize("name", list(VALID_IMAGES))
def test_unusual_image_matches_transformers(served, name):
    client, hf_tower = served
    data = VALID_IMAGES[name]
    expected, grid = reference(hf_tower, data)
    r = client.post("/v1/encode", json={"images": [uri(data)]})
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["grid_thw"] == grid
    assert rel_err(tokens_of(r.json()), expected) <= 1e-5


def test_exif_rotation_is_applied(served):
    client, _ = served
    from corpus import exif_rotated_jpeg

    rotated = client.post("/v1/encode", json={"images": [uri(exif_rotated_jpeg())]}).json()["data"][0]
    assert rotated["grid_thw"][1] > rotated["grid_thw"][2]  # 96x64 stored, shown 64 wide x 96 tall


@pytest.mark.parametrize(
    "body, status",
    [
        ('{"input": ' + "[" * 50_000 + "]" * 50_000 + "}", 400),  # deep nesting
        (json.dumps({"input": ["x"] * 10_000}), 413),  # 10 000 items
        (json.dumps({"input": "x" * (3 * 2**20)}), 413),  # over the 2 MiB payload limit
        (json.dumps({"input": 5}), 422),
        (json.dumps({"input": ["a"], "encoding_format": 1}), 422),
        (json.dumps({"input": ["a"], "pooling": []}), 422),
        (json.dumps({"input": ["a"], "model": 3}), 422),
        (json.dumps({"input": ["a"], "user": {}}), 422),
        (json.dumps({"input": ["a"], "modality": "audio"}), 422),
        (json.dumps({"input": ["a"], "dimensions": "x"}), 422),
        (json.dumps({"input": ["a"], "extra": True}), 422),
        (json.dumps({"input": ["a"], "model": "some-other-model"}), 404),
        ("not json at all", 400),
        ('"just a string"', 422),
        ("[]", 422),
        ("null", 422),
    ],
)
def test_malformed_bodies_are_4xx(served, body, status):
    client, _ = served
    for path in ("/v1/embeddings", "/v1/encode"):
        payload = body if path == "/v1/embeddings" else body.replace('"input"', '"images"')
        r = client.post(path, content=payload, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text[:200])
        assert "error" in r.json() and r.json()["error"]["message"]
        if path == "/v1/embeddings":
            assert r.status_code == status, r.text[:300]
