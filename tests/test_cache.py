"""The embedding cache: a hit skips decoding and the device and is bit-identical to a computed answer; different
preprocessing never shares an entry; the bound in bytes holds; failures are never stored; identical images in
flight are computed once."""

from __future__ import annotations

import asyncio
import base64
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import b64_tensor, client_for, data_uri, png

from vitserve.encoder.features import Features
from vitserve.encoder.media import MediaBytes
from vitserve.encoder.preprocess import PreprocessConfig
from vitserve.service.ground.metrics import Metrics
from vitserve.service.pipeline.cache import WAIT, Cache, CacheKeys


def sample(client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture
def client(encoders):
    with client_for(encoders["tiny-qwen3-vl"], cache_bytes=64 * 2**20) as c:
        yield c


def test_a_hit_skips_decoding_and_the_device_and_is_bit_identical(client):
    image = data_uri(png(200, 150, 31))
    first = client.post("/v1/encode", json={"images": [image]})
    decoded, ran = sample(client, "vitserve_decode_seconds_count"), sample(client, "vitserve_images_total")
    second = client.post("/v1/encode", json={"images": [image]})
    assert first.headers["x-cache-hits"] == "0" and second.headers["x-cache-hits"] == "1"
    assert second.json()["cache_hits"] == 1 and second.json()["data"] == first.json()["data"]  # every byte
    assert sample(client, "vitserve_decode_seconds_count") == decoded and sample(client, "vitserve_images_total") == ran
    assert sample(client, "vitserve_cache_hits_total") == 1 and sample(client, "vitserve_cache_misses_total") == 1
    # the dtype and the layout are applied after the cache: a hit gives exactly what a computation gives
    for fields in ({"dtype": "bfloat16"}, {"layout": "vllm"}, {"dtype": "float16", "deepstack": False}):
        hit = client.post("/v1/encode", json={"images": [image], **fields})
        with client_for(client.app.state.engine.backend.workers[0].device.encoder, cache_bytes=0) as fresh:
            computed = fresh.post("/v1/encode", json={"images": [image], **fields})
        assert hit.headers["x-cache-hits"] == "1" and hit.json()["data"] == computed.json()["data"], fields
    stats = client.get("/stats").json()["cache"]
    assert stats["entries"] == 1 and stats["hits"] == 4 and 0 < stats["bytes"] <= stats["limit_bytes"]


def test_different_preprocessing_never_shares_an_entry(client):
    image = data_uri(png(640, 480, 32))
    tokens = client.post("/v1/encode", json={"images": [image]}).json()["data"][0]
    capped = client.post("/v1/encode", json={"images": [image], "max_pixels": 70_000})
    assert capped.headers["x-cache-hits"] == "0" and capped.json()["data"][0]["grid_thw"] != tokens["grid_thw"]
    mean = client.post("/v1/embeddings", json={"input": [image]})  # the mean, taken on the device: another entry
    assert mean.headers["x-cache-hits"] == "0"
    assert client.post("/v1/embeddings", json={"input": [image]}).headers["x-cache-hits"] == "1"
    cfg, other = PreprocessConfig(), PreprocessConfig(max_pixels=100_000)
    cache_a, cache_b = CacheKeys("model-a"), CacheKeys("model-b")
    data = MediaBytes("aGVsbG8=")
    keys = {
        cache_a.key(data, cfg, False),
        cache_a.key(data, other, False),
        cache_a.key(data, cfg, True),
        cache_b.key(data, cfg, False),
        cache_a.key(MediaBytes("aGVsbG9=="), cfg, False),
        cache_a.key(data, cfg, False, float32=True),  # the tokens widened on the device: another answer
    }
    assert cache_a.key(data, cfg, True, float32=True) == cache_a.key(data, cfg, True)  # a mean is one answer
    wide = CacheKeys("model-a", dtype="float32")  # a float32 tower answers every request alike: one entry
    assert wide.key(data, cfg, False, float32=True) == wide.key(data, cfg, False) == cache_a.key(data, cfg, False)
    assert len(keys) == 6 and cache_a.key(data, cfg, False) == cache_a.key(MediaBytes("aGVsbG8="), cfg, False)


def test_eviction_keeps_the_bound_least_recently_used_first():
    """...and tells `evicted` the keys each store evicted, with the lock let go (the core sends them to its front
    ends, whose pipes may be full: under the lock that would stall every lookup)."""
    metrics = Metrics()
    cache = Cache(3 * 400, metrics)  # room for three 100-float entries
    told = []
    cache.evicted = lambda keys: told.append((keys, cache.lock.locked()))
    entry = lambda: Features(torch.zeros(100), [], [1, 2, 2])  # noqa: E731  (400 bytes)
    for key in (b"a", b"b", b"c"):
        cache.put(key, entry())
    assert cache.get(b"a") is not None and told == []  # a is now the most recently used
    cache.put(b"d", entry())
    assert cache.get(b"b") is None and all(cache.get(k) is not None for k in (b"a", b"c", b"d"))
    assert cache.lookup([b"e"], "owner", lambda i: None) == [None]
    assert cache.settle(b"e", Features(torch.zeros(200), [], [1, 2, 2]))  # 800 bytes: two go
    assert told == [([b"b"], False), ([b"a", b"c"], False)]
    assert (
        cache.bytes == 1200 <= cache.limit and metrics.registry.get_sample_value("vitserve_cache_evictions_total") == 3
    )
    cache.put(b"e", entry())  # held already: nothing evicted, nothing told
    cache.put(b"huge", Features(torch.zeros(1000), [], [1, 2, 2]))  # larger than the whole cache: not stored
    assert cache.get(b"huge") is None and cache.bytes == 1200 and len(told) == 2


def test_a_failed_encode_is_never_cached(client, monkeypatch):
    runner = client.app.state.engine.backend.workers[0].device.encoder.runner
    real, calls = runner.launch_images, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "launch_images", fails_once)
    image = data_uri(png(90, 90, 33))
    assert client.post("/v1/encode", json={"images": [image]}).status_code == 500
    again = client.post("/v1/encode", json={"images": [image]})
    assert again.status_code == 200 and again.headers["x-cache-hits"] == "0" and len(calls) == 2


def test_identical_images_in_flight_are_computed_once(encoders):
    with client_for(encoders["tiny-qwen3-vl"], cache_bytes=64 * 2**20, max_batch_wait_ms=200) as c:
        image = data_uri(png(120, 100, 34))
        ran = sample(c, "vitserve_images_total")
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: c.post("/v1/encode", json={"images": [image, image]}), range(4)))
        assert all(r.status_code == 200 for r in replies)
        assert sample(c, "vitserve_images_total") == ran + 1  # 8 copies of one image: one encoding
        first = b64_tensor(replies[0].json()["data"][0]["embeddings"], replies[0].json()["data"][0]["shape"])
        for r in replies:
            for item in r.json()["data"]:
                assert torch.equal(b64_tensor(item["embeddings"], item["shape"]), first)


def test_the_cache_can_be_off(encoders):
    with client_for(encoders["tiny-qwen3-vl"], cache_bytes=0) as c:
        image = data_uri(png(80, 60, 35))
        for _ in range(2):
            assert c.post("/v1/encode", json={"images": [image]}).headers["x-cache-hits"] == "0"
        assert c.get("/stats").json()["cache"]["enabled"] is False


def test_waiters_compute_themselves_when_the_first_request_fails():
    async def scenario():
        cache, loop = Cache(10**6, Metrics()), asyncio.get_running_loop()
        waiting = loop.create_future()
        claim = lambda: cache.lookup([b"k"], None, lambda i: waiting.set_result)[0]  # noqa: E731
        assert claim() is None  # the first request encodes it
        assert claim() == WAIT  # a second one waits for it
        cache.settle(b"k", None)  # the first failed
        assert await waiting is None and claim() is None  # the second now encodes it itself
        output = Features(torch.ones(4), [], [1, 2, 2])
        cache.settle(b"k", output)
        return cache.get(b"k")

    assert asyncio.run(scenario()) is not None


def test_how_an_image_was_sent_is_part_of_its_key(client):
    """Base64 text sent as a file is not an image: a 400 on a fresh server, and still a 400 once the same text was
    sent as base64 in JSON (a cache keyed on the text alone answered it 200)."""
    text = base64.b64encode(png(90, 70, 36))
    files = [("images", ("a.png", text, "image/png"))]
    assert client.post("/v1/encode", files=files).status_code == 400
    assert client.post("/v1/encode", json={"images": [text.decode()]}).status_code == 200
    again = client.post("/v1/encode", files=files)
    assert again.status_code == 400 and again.json()["error"]["code"] == "undecodable_image", again.text
    raw = client.post("/v1/encode", files=[("images", ("a.png", png(90, 70, 36), "image/png"))])
    assert raw.status_code == 200 and raw.headers["x-cache-hits"] == "0"  # the bytes themselves: another entry


@pytest.mark.parametrize("scope, hit", [("server", "1"), ("api-key", "0")])
def test_the_cache_scope_keeps_clients_apart(encoders, scope, hit):
    """With --cache-scope api-key a client never learns (from x-cache-hits, cache_hits or the phases) that another
    key sent an image; its own repeats still hit. The server scope shares every entry."""
    image = data_uri(png(80, 64, 37))
    with client_for(encoders["tiny-qwen3-vl"], api_key="alice,bob", cache_scope=scope) as c:
        alice, bob = ({"authorization": f"Bearer {key}"} for key in ("alice", "bob"))
        assert c.post("/v1/encode", json={"images": [image]}, headers=alice).headers["x-cache-hits"] == "0"
        theirs = c.post("/v1/encode", json={"images": [image]}, headers=bob)
        assert theirs.status_code == 200 and theirs.headers["x-cache-hits"] == hit
        assert theirs.json()["cache_hits"] == int(hit)
        assert c.post("/v1/encode", json={"images": [image]}, headers=alice).headers["x-cache-hits"] == "1"
        assert c.post("/v1/encode", json={"images": [image]}).status_code == 401


@pytest.mark.parametrize("scope, hit", [("server", "1"), ("api-key", "0")])
def test_the_cache_scope_keeps_clients_apart_for_videos_too(encoders, scope, hit):
    """A video's slices are keyed by the client as an image is: with --cache-scope api-key another key's video is
    decoded again; a repeat of one's own is a hit (x-cache-hits counts the videos answered from the cache)."""
    pytest.importorskip("av")
    from videos import make_video

    video = "data:video/mp4;base64," + base64.b64encode(make_video(12, 6, 64, 48)).decode()
    body = {"videos": [video], "num_frames": 4}
    with client_for(encoders["tiny-qwen3-vl"], api_key="alice,bob", cache_scope=scope) as c:
        alice, bob = ({"authorization": f"Bearer {key}"} for key in ("alice", "bob"))
        assert c.post("/v1/encode", json=body, headers=alice).headers["x-cache-hits"] == "0"
        theirs = c.post("/v1/encode", json=body, headers=bob)
        assert theirs.status_code == 200 and theirs.headers["x-cache-hits"] == hit
        assert c.post("/v1/encode", json=body, headers=alice).headers["x-cache-hits"] == "1"
