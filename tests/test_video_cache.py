"""Videos and the embedding cache through real servers (tiny towers; on CUDA in bfloat16, held to the bf16 bound):
a bfloat16 server's slices cached by the dtype they are answered in, a video decoded again where the cache is off,
and one video from two clients at once decoded once across two front ends. The same video sent again to one
server, from its cache, is in tests/test_video_server.py beside the other requests of its module server."""

from __future__ import annotations

import httpx
import pytest
import torch
from helpers import assert_served, posts, serving
from safetensors.torch import load as load_safetensors
from test_video_server import CLIP, MODEL, series, tensor, video_uri
from videos import make_video

from vitserve.encoder import VisionEncoder

pytest.importorskip("av")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def library():
    return VisionEncoder.from_pretrained(MODEL, load_format="dummy")


def test_a_bfloat16_servers_video_slices_are_cached_by_the_dtype_they_are_answered_in():
    """A bfloat16 tower: float32 tokens (widened on the device) and a pooled mean (taken over the float32 slices)
    share one decode and one set of slices; bfloat16 tokens are slices of their own (decoded again), the same values
    narrower, and a second bfloat16 request is a hit."""
    clip = make_video(26, 10, 128, 96, photo="portrait.png")
    for _, url in serving("--model", MODEL, "--load-format", "dummy", "--dtype", "bfloat16"):
        body = {"videos": [video_uri(clip)], "num_frames": 6}
        wide = httpx.post(url + "/v1/encode", json=body, timeout=120)
        pooled = httpx.post(
            url + "/v1/embeddings", json={"input": [video_uri(clip)], "modality": "video", "num_frames": 6}, timeout=120
        )
        assert wide.status_code == pooled.status_code == 200, (wide.text, pooled.text)
        tokens = tensor(wide.json()["data"][0])
        assert torch.equal(torch.tensor(pooled.json()["data"][0]["embedding"]), tokens.mean(0))
        assert [series(url, "vitserve_videos_decoded_total"), series(url, "vitserve_cache_hits_total")] == [1, 1]
        accept = {"accept": "application/octet-stream"}
        narrow = [
            httpx.post(url + "/v1/encode", json=body | {"dtype": "bfloat16"}, headers=accept, timeout=120)
            for _ in range(2)
        ]
        assert [r.headers["x-cache-hits"] for r in narrow] == ["0", "1"]
        answers = [load_safetensors(r.content) for r in narrow]
        [name] = [name for name in answers[0] if name.endswith("embeddings")]
        assert answers[0][name].dtype == torch.bfloat16 and torch.equal(answers[1][name], answers[0][name])
        assert torch.equal(answers[0][name].float(), tokens)  # bfloat16 values either way
        assert series(url, "vitserve_videos_decoded_total") == 2


def test_without_the_cache_a_video_sent_again_is_decoded_again(library):
    for _, url in serving("--model", MODEL, "--load-format", "dummy", "--cache-bytes", "0"):
        body = {"videos": [video_uri(CLIP)], "num_frames": 6}
        replies = [httpx.post(url + "/v1/encode", json=body, timeout=120) for _ in range(2)]
        assert [r.status_code for r in replies] == [200, 200]
        assert_served(tensor(replies[1].json()["data"][0]), library.encode_videos(CLIP, num_frames=6).embeddings)
        assert series(url, "vitserve_videos_decoded_total") == 2 and series(url, "vitserve_cache_hits_total") == 0


def test_one_video_sent_by_two_clients_at_once_is_decoded_once(library):
    """Two front ends, the same video from two connections at once: the core's cache claims its slices for the
    first request, the second waits for them (or finds them): one decode, the same answer for both. A video sent
    again, on new connections that reach either front end, is answered without its header read again (the plans
    are the core's, not one front end's) and without a decode."""
    clip = make_video(30, 10, 160, 120, photo="portrait.png")
    for _, url in serving(
        "--model", MODEL, "--load-format", "dummy", "--api-servers", "2", "--device-processes", "true"
    ):
        body = {"videos": [video_uri(clip)], "num_frames": 6}
        replies = posts(url, [body] * 2, connections=2, path="/v1/encode")
        assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
        a, b = (tensor(r.json()["data"][0]) for r in replies)
        assert torch.equal(a, b)
        assert_served(a, library.encode_videos(clip, num_frames=6).embeddings)
        assert series(url, "vitserve_videos_decoded_total") == 1
        other = body | {"num_frames": 4}  # another key: its plan read once, by one front end
        first = httpx.post(url + "/v1/encode", json=other, timeout=120)
        assert first.status_code == 200, first.text
        # 8 at once, each on a connection of its own, which either front end may take (the one that read the plan
        # or the other)
        again = posts(url, [other] * 8, path="/v1/encode")
        for r in again:
            assert r.status_code == 200 and float(r.headers["x-decode-time"]) == 0.0, r.headers
            assert r.json()["data"] == first.json()["data"]
        assert series(url, "vitserve_videos_decoded_total") == 2
