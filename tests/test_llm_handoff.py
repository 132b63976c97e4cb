"""The proof of the handoff: tiny full Qwen2-VL, Qwen2.5-VL and Qwen3-VL models written by transformers'
save_pretrained, each served by a real `vitserve serve`; the client fetches the features of three images of
different sizes for one prompt, and transformers generates with them in place of its own tower: in float32 its
logits equal the model's own pixel path (relative error <= 1e-5) and its greedy tokens are identical. vLLM and
SGLang cannot be installed here: their layouts are checked against the splits and shapes their code uses."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from conftest import FAMILIES
from helpers import rel_err
from PIL import Image

from vitserve.client import AsyncClient, Client
from vitserve.consumers import (
    sglang_image_data,
    sglang_video_data,
    transformers_features,
    transformers_inputs,
    vllm_features,
    vllm_image_embeds_part,
    vllm_multi_modal_data,
)
from vitserve.service.entry.launch import start_server

pytestmark = pytest.mark.slow
SIZES = [(120, 90), (64, 200), (200, 200)]


def images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in SIZES]


def processor(family: str):
    """transformers' processor with the settings vitserve uses for a checkpoint without preprocessor_config.json."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    qwen3 = family == "qwen3_vl"
    return Qwen2VLImageProcessorPil(
        patch_size=16 if qwen3 else 14,
        **(dict(image_mean=[0.5] * 3, image_std=[0.5] * 3) if qwen3 else {}),
        size={"shortest_edge": 65536 if qwen3 else 3136, "longest_edge": 16777216 if qwen3 else 12845056},
    )


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, checkpoints):
    from transformers import AutoModelForImageTextToText

    path, _ = checkpoints[request.param]
    # on the CPU in float32 wherever the tests run: the handoff's layout is held to the model's own tower exactly
    # (a GPU server's bf16 features are the fidelity bench's business: bench/gpu_fidelity.py)
    proc, url = start_server(
        "--model", path, "--device", "cpu", "--max-batch-wait-ms", "1", timeout=120, capture_log=True
    )
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    yield request.param, url, model
    proc.terminate()
    proc.wait(timeout=30)


def test_transformers_answers_as_with_its_own_tower(served):
    family, url, model = served
    cfg = model.config
    with Client(url) as client:
        items = client.encode(images())
    batch = processor(family)(images(), return_tensors="pt")
    start, image, end = cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id
    prompt = [5, 6, start, image, end, 7, start, image, end, 8, start, image, end, 9, 10]
    inputs = transformers_inputs(prompt, items, cfg)
    assert torch.equal(inputs["image_grid_thw"], batch["image_grid_thw"])  # the prompt's token counts are right
    own = {**inputs, "pixel_values": batch["pixel_values"]}
    with torch.no_grad():
        reference = model(**own).logits
        with transformers_features(model, items):
            ours = model(**inputs).logits
        assert rel_err(ours, reference) <= 1e-5
        greedy = model.generate(**own, max_new_tokens=12, do_sample=False)
        with transformers_features(model, items):
            assert torch.equal(model.generate(**inputs, max_new_tokens=12, do_sample=False), greedy)
        with transformers_features(model, [items[1], items[0], items[2]]):  # the test can tell features apart
            swapped = model(**transformers_inputs(prompt, [items[1], items[0], items[2]], cfg)).logits
        assert swapped.shape != reference.shape or rel_err(swapped, reference) > 1e-3


def test_transformers_answers_videos_as_with_its_own_tower(served, checkpoints):
    """An image and a video (3 slices) in one prompt: the model fed vitserve's features (fetched by the client)
    gives the logits and greedy tokens of its own tower on the same pixels. Qwen3-VL's prompt holds the video slice
    by slice, each after its timestamp; Qwen2.5-VL's second_per_grid_ts reaches the model (another value changes
    its logits: the rope's time axis uses it)."""
    from videos import make_video

    from vitserve.encoder import VisionEncoder

    family, url, model = served
    cfg = model.config
    clip = make_video(30, 10, 160, 120)
    with Client(url) as client:
        video = client.encode_videos(clip, num_frames=6)
        image = client.encode(images()[0])
    pixels, grids = VisionEncoder.from_pretrained(checkpoints[family][0]).preprocess_videos(clip, num_frames=6)
    start, end = cfg.vision_start_token_id, cfg.vision_end_token_id
    if family == "qwen3_vl":  # what its processor writes: "<0.3 seconds>" (here one token each) before each slice
        assert len(video.timestamps) == video.grid_thw[0] == 3
        clip_ids = [i for k in range(3) for i in (11 + k, start, cfg.video_token_id, end)]
    else:
        clip_ids = [start, cfg.video_token_id, end]
    prompt = [5, start, cfg.image_token_id, end, 6, *clip_ids, 7, 8]
    inputs = transformers_inputs(prompt, [image, video], cfg)
    assert torch.equal(inputs["video_grid_thw"], grids)
    own = {
        **inputs,
        "pixel_values": processor(family)(images()[:1], return_tensors="pt")["pixel_values"],
        "pixel_values_videos": pixels,
    }
    with torch.no_grad():
        reference = model(**own).logits
        greedy = model.generate(**own, max_new_tokens=8, do_sample=False)
        with transformers_features(model, [image, video]):
            ours = model(**inputs).logits
            assert torch.equal(model.generate(**inputs, max_new_tokens=8, do_sample=False), greedy)
        assert rel_err(ours, reference) <= 1e-5
        data = vllm_multi_modal_data([image, video])  # vLLM splits video_embeds per video by prod(grid) // merge²
        merge = cfg.vision_config.spatial_merge_size**2
        assert data["video"]["video_embeds"].shape[0] == int(data["video"]["video_grid_thw"].prod()) // merge
        assert torch.equal(data["video"]["video_embeds"], vllm_features(video))
        assert data["image"]["image_embeds"].shape[0] == image.num_tokens
        (sglang,) = sglang_video_data(video)
        assert sglang["modality"] == "VIDEO" and torch.equal(sglang["feature"], data["video"]["video_embeds"])
        if family == "qwen2_5_vl":
            assert inputs["second_per_grid_ts"].tolist() == [video.second_per_grid_t] == [1.0]  # 2 / (6 / 3 s)
            slower = model(**{**own, "second_per_grid_ts": torch.tensor([50.0])}).logits
            assert rel_err(slower, reference) > 10 * max(rel_err(ours, reference), 1e-6)  # far beyond the noise


def test_consumer_layouts_split_as_vllm_and_sglang_split_them(served):
    family, url, model = served
    layers = len(getattr(model.config.vision_config, "deepstack_visual_indexes", []) or [])
    with Client(url) as client:
        items = client.encode(images())
        laid = client.encode(images(), layout="vllm")
    width = items[0].embeddings.shape[1]
    assert width == model.config.text_config.hidden_size and len(items[0].deepstack) == layers
    merge = model.config.vision_config.spatial_merge_size**2
    data = vllm_multi_modal_data(items)["image"]
    assert data["image_grid_thw"].dtype == torch.int64 and data["image_grid_thw"].shape == (3, 3)
    assert data["image_embeds"].shape[1] == width * (1 + layers)
    # vLLM's split (qwen2_vl.py): per image prod(grid) // merge**2 rows
    parts = data["image_embeds"].split((data["image_grid_thw"].prod(-1) // merge).tolist())
    for part, item, server_side in zip(parts, items, laid):
        assert torch.equal(part[:, :width], item.embeddings)
        for j, d in enumerate(item.deepstack):  # deepstack after the tokens, in deepstack_visual_indexes order
            assert torch.equal(part[:, width * (1 + j) : width * (2 + j)], d)
        assert torch.equal(server_side.embeddings, part) and server_side.deepstack == []  # layout=vllm agrees
    part = vllm_image_embeds_part(items[1])
    assert part["type"] == "image_embeds"
    loaded = {k: torch.load(io.BytesIO(base64.b64decode(v))) for k, v in part["image_embeds"].items()}
    assert torch.equal(loaded["image_embeds"], parts[1]) and loaded["image_grid_thw"].tolist() == list(
        items[1].grid_thw
    )
    (sglang,) = sglang_image_data(items)
    assert sglang["format"] == "precomputed_embedding" and sglang["modality"] == "IMAGE"
    assert torch.equal(sglang["feature"], data["image_embeds"]) and torch.equal(
        sglang["image_grid_thw"], data["image_grid_thw"]
    )


def test_the_async_client_and_pooled_vectors(served):
    import asyncio

    _, url, _ = served

    async def fetch():
        async with AsyncClient(url, max_images_per_request=2) as client:  # three images: two requests
            return await client.encode(images()), await client.embed(images(), normalize=True)

    items, vectors = asyncio.run(fetch())
    with Client(url) as client:
        direct = client.encode(images())
    assert [i.grid_thw for i in items] == [i.grid_thw for i in direct]
    assert all(torch.equal(a.embeddings, b.embeddings) for a, b in zip(items, direct))
    for vector, item in zip(vectors, direct):
        assert abs(vector.norm().item() - 1) < 1e-5 and vector.shape == (item.embeddings.shape[1],)
