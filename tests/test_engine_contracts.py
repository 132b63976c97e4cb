"""vitserve against the LLM engines' own code (their released wheels, installed on the CPU by tests/engine_envs.sh,
which the README's test command runs first), each in a process of its own: what a vitserve server writes and answers
as vLLM's encoder tier, read by vLLM 0.34.0's classes (tests/engine_contracts/vllm_consumer.py), and what it pushes
as SGLang's encoder server, received by SGLang 0.5.23's (tests/engine_contracts/sglang_receiver.py).

- vLLM's ECExampleConnector, as a consumer (its scheduler's `has_cache_item`, its worker's `start_load_caches`),
  finds every item vitserve wrote and loads a tensor equal to vitserve's answer for it (the vLLM layout, in the
  dtype asked for);
- vLLM's own identifier of each image (its image loader and MultiModalHasher, by `ProcessorInputs.get_mm_hashes`'
  rules) equals vitserve's `ec_id`: PNG and JPEG, an image its loader converts (RGBA), with and without uuids, a uuid
  with mm_processor_kwargs (hashed), and sha256 as --mm-hasher-algorithm;
- the metadata vitserve reports per item is exactly what vLLM's Qwen parsers require with out-of-band embeddings.
- SGLang's receiver, on both ZMQ paths (zmq_to_scheduler's WaitingZmqRequest, zmq_to_tokenizer's MMReceiverHTTP),
  unpickles vitserve's messages with its own restricted unpickler as its EmbeddingData, checks and joins the parts,
  and hands its processor tensors byte-equal to vitserve's /v1/encode answer (vLLM layout), with the grids, Qwen3-VL's
  video timestamps and Qwen2.5-VL's second_per_grid_ts.
The layout is also what vLLM's Qwen models keep per item by construction (one tensor per item, deepstack after the
tokens on the width: docs/llm.md cites their code); their vision towers themselves need vLLM's compiled ops and a
GPU, so they are not run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from corpus import encode, photo
from helpers import b64_bf16, data_uri, serving, wait_until
from videos import make_video

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ROOT / ".engines"
pytestmark = pytest.mark.slow


def engine_path(*folders: str) -> str:
    if not (ENGINES / folders[0] / ".done").exists():
        pytest.skip(f"{folders[0]}'s wheel is not installed for the contract tests: bash tests/engine_envs.sh")
    return os.pathsep.join(str(ENGINES / p) for p in folders)


def answer_tensor(item: dict) -> torch.Tensor:
    return b64_bf16(item["embeddings"], item["shape"])


def file_of(directory: Path, identifier: str) -> Path:
    path = directory / identifier / "encoder_cache.safetensors"
    wait_until(path.exists, 10, f"{path} written")
    return path


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_vllm_finds_loads_and_names_what_vitserve_wrote(tmp_path, algorithm):
    path = engine_path("vllm", "vllm-deps")
    model_id = "Qwen/Qwen3-VL-8B-Instruct"  # the consumer's --model, which vLLM's content hashes include
    storage = tmp_path / "ec"
    storage.mkdir()
    pixels = photo(120, 90, 7)
    images = {
        "png": encode(pixels, "PNG"),
        "jpeg": encode(pixels, "JPEG"),
        "rgba": encode(pixels.convert("RGBA"), "PNG"),
    }
    video = make_video(20, 10, 128, 96)
    cases, expected = [], []
    for _, url in serving(
        "--model",
        "tiny-qwen3-vl",
        "--load-format",
        "dummy",
        "--ec-shared-storage",
        str(storage),
        "--ec-dtype",
        "bfloat16",
        "--ec-model-id",
        model_id,
        "--ec-hash-algorithm",
        algorithm,
    ):
        body = {
            "images": [data_uri(images[k], f"image/{'jpeg' if k == 'jpeg' else 'png'}") for k in images] * 2,
            "videos": [data_uri(video, "video/mp4")],
            "layout": "vllm",
            "dtype": "bfloat16",
            "multi_modal_uuids": {"image": [None, None, None, "u-png", "u-jpeg", None], "video": ["clip-7"]},
        }
        r = httpx.post(url + "/v1/encode", json=body, timeout=60)
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        names = list(images) * 2
        for i, item in enumerate(data):
            source = None
            if item["modality"] == "image":
                source = tmp_path / f"{i}.{names[i]}"
                source.write_bytes(images[names[i]])
            uuid = body["multi_modal_uuids"]["image"][i] if item["modality"] == "image" else "clip-7"
            cases.append(
                {
                    "identifier": item["ec_id"],
                    "file": str(source) if source else None,
                    "uuid": uuid,
                    "algorithm": algorithm,
                }
            )
            expected.append(answer_tensor(item))
            assert file_of(storage, item["ec_id"]).exists()
        # the proxy's chat request with mm_processor_kwargs: the uuid is hashed with them, as vLLM does
        part = {"type": "image_url", "image_url": {"url": data_uri(images["png"], "image/png")}, "uuid": "u-kw"}
        chat = {"messages": [{"role": "user", "content": [part]}], "mm_processor_kwargs": {"max_pixels": 100000}}
        r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200, r.text
        ((identifier, entry),) = r.json()["ec_transfer_params"].items()
        clip = {"type": "video_url", "video_url": {"url": data_uri(video, "video/mp4")}, "uuid": "clip-9"}
        r = httpx.post(
            url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": [clip]}]}, timeout=60
        )
        video_entry = r.json()["ec_transfer_params"]["clip-9"]
        assert identifier != "u-kw"
        source = tmp_path / "kw.png"
        source.write_bytes(images["png"])
        cases.append(
            {
                "identifier": identifier,
                "file": str(source),
                "uuid": "u-kw",
                "algorithm": algorithm,
                "mm_processor_kwargs": {"max_pixels": 100000},
            }
        )
        small = httpx.post(
            url + "/v1/encode",
            json={
                "images": [data_uri(images["png"], "image/png")],
                "max_pixels": 100000,
                "layout": "vllm",
                "dtype": "bfloat16",
            },
            timeout=60,
        )
        expected.append(answer_tensor(small.json()["data"][0]))
        assert entry["metadata"] == {"image_grid_thw": small.json()["data"][0]["grid_thw"]}
        assert file_of(storage, identifier).exists()
    (tmp_path / "cases.json").write_text(json.dumps({"storage": str(storage), "model_id": model_id, "items": cases}))
    env = dict(os.environ, PYTHONPATH=path, VLLM_TARGET_DEVICE="cpu")
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "engine_contracts" / "vllm_consumer.py"),
            str(tmp_path / "cases.json"),
            str(tmp_path / "out.json"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["vllm"] == "0.34.0"
    for case, tensor, seen in zip(cases, expected, out["items"]):
        assert seen["found"], case
        assert torch.equal(torch.load(seen["loaded"]), tensor), case
        if case["file"] is not None:
            assert seen["vllm_identifier"] == case["identifier"], case
    names = [c["identifier"] for c in cases]
    assert len(set(names[:3])) == 3 and names[5] == names[2]  # PNG, JPEG, RGBA: three names; the same bytes: one
    # what vitserve's ec_transfer_params carry per modality is what vLLM's Qwen parsers require: the Qwen3-VL
    # server's answers, and the Qwen2/2.5-VL form (no timestamps)
    fields = out["metadata_fields"]
    assert fields["qwen3_vl"] == {"image": sorted(entry["metadata"]), "video": sorted(video_entry["metadata"])}
    from vitserve.service.ground.media import MediaItem
    from vitserve.service.tiers.vllm_tier import VLLMTier

    qwen2 = VLLMTier.transfer_params(
        ["i", "v"],
        [MediaItem("image", None, "i", ""), MediaItem("video", None, "v", "")],
        [[1, 4, 4], [2, 4, 4]],
        [None, video_entry["metadata"] | {"fps": 10}],
        False,
    )
    assert fields["qwen2_vl"] == {m: sorted(qwen2[k]["metadata"]) for m, k in (("image", "i"), ("video", "v"))}


@pytest.mark.parametrize("model, model_type", [("tiny-qwen3-vl", "qwen3_vl"), ("tiny-qwen2.5-vl", "qwen2_5_vl")])
def test_sglangs_receiver_takes_what_vitserve_pushed(tmp_path, model, model_type):
    """An image part and a video part of one request (SGLang splits a request's items into parts per modality),
    pushed by a vitserve --sglang-encoder server to a PULL socket registered as a scheduler rank, then replayed by
    SGLang's own code."""
    import hashlib

    from test_sglang_tier import encode_body, post_encode, receive, reference, register

    path = engine_path("sglang")
    image = data_uri(encode(photo(96, 64, 7), "PNG"), "image/png")
    video = data_uri(make_video(20, 10, 128, 96), "video/mp4")
    import zmq

    context = zmq.Context()
    sock = context.socket(zmq.PULL)
    address = f"127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    messages = []
    try:
        for _, url in serving(
            "--model", model, "--load-format", "dummy", "--sglang-encoder", "--sglang-receivers", "127.0.0.1"
        ):
            expected = reference(url, images=[image], videos=[video])
            for k, (modality, item) in enumerate((("IMAGE", image), ("VIDEO", video))):
                req_id = f"rid_local_part_{k}"
                assert register(url, req_id, address, modality=modality).status_code == 200
                r = post_encode(url, encode_body(req_id, [item], modality, num_parts=2, part_idx=k))
                assert r.status_code == 200, r.text
                frames = receive(sock)
                assert frames is not None
                files = []
                for n, frame in enumerate(frames):
                    files.append(tmp_path / f"part{k}.{n}")
                    files[-1].write_bytes(frame)
                messages.append(",".join(map(str, files)))
    finally:
        sock.close(linger=0)
        context.term()
    env = dict(os.environ, PYTHONPATH=path)
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "engine_contracts" / "sglang_receiver.py"), model_type, "rid", *messages],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["sglang"] == "0.5.23"
    assert all(
        p["is_embedding_data"] and p["class"].startswith("sglang.srt.disaggregation.encoder.receiver")
        for p in out["parts"]
    )
    for path_name in ("zmq_to_scheduler", "zmq_to_tokenizer"):
        got = out[path_name]
        assert got["status"] == "SUCCESS", got
        for modality, x in zip(("IMAGE", "VIDEO"), expected):
            t = x["tensor"]
            assert got["received"]["embeddings"][modality] == {
                "shape": list(t.shape),
                "dtype": "float32",
                "sha256": hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest(),
            }
        meta = got["received"]["meta"]
        assert meta["img_grid_thw"] == [expected[0]["grid_thw"]] and meta["video_grid_thw"] == [expected[1]["grid_thw"]]
        if model_type == "qwen3_vl":
            assert meta["video_timestamps"] == [expected[1]["timestamps"]]
        else:
            # a float32 tensor, as transformers' processor (SGLang's own encoder) makes it
            assert meta["second_per_grid_ts"] == torch.tensor([expected[1]["second_per_grid_t"]]).tolist()
