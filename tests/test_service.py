"""The HTTP app over httpx (Starlette's TestClient runs the ASGI app with its lifespan), tiny models on the CPU."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from conftest import rel_err
from fastapi.testclient import TestClient
from PIL import Image
from safetensors.torch import load as safetensors_load

from encoder import VisionEncoder
from service import spool
from service.app import create_app
from encoder.preprocess import Base64Data
from service.engine import ClientDisconnected, Engine, WorkItem
from service.errors import ServiceError
from service.settings import Settings


def png(w: int, h: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, fmt)
    return buf.getvalue()


def data_uri(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


IMAGES = [png(120, 90, 1), png(64, 200, 2), png(300, 300, 3)]


@pytest.fixture(scope="module")
def encoders():
    return {name: VisionEncoder.from_pretrained(name, load_format="dummy")
            for name in ("tiny-qwen2.5-vl", "tiny-qwen3-vl")}


def client_for(encoder, **overrides) -> TestClient:
    settings = Settings(model=encoder.name, load_format="dummy", **overrides)
    return TestClient(create_app(settings, Engine(settings, encoder=encoder)))


@pytest.fixture(scope="module")
def client(encoders):
    with client_for(encoders["tiny-qwen3-vl"]) as c:
        yield c


def b64_floats(s: str, dtype="<f4") -> np.ndarray:
    return np.frombuffer(base64.b64decode(s), dtype=dtype)


def test_embeddings_float_and_base64_match_direct_encoding(client, encoders):
    direct = encoders["tiny-qwen3-vl"].encode(IMAGES)
    body = {"model": "tiny-qwen3-vl", "input": [data_uri(x) for x in IMAGES]}
    as_float = client.post("/v1/embeddings", json=body)
    as_b64 = client.post("/v1/embeddings", json=body | {"encoding_format": "base64"})
    assert as_float.status_code == as_b64.status_code == 200
    assert float(as_float.headers["x-queue-time"]) >= 0 and float(as_float.headers["x-inference-time"]) > 0
    f, b = as_float.json(), as_b64.json()
    assert f["object"] == "list" and f["model"] == "tiny-qwen3-vl"
    assert f["usage"] == {"prompt_tokens": sum(r.num_tokens for r in direct), "total_tokens": sum(r.num_tokens for r in direct)}
    for i, r in enumerate(direct):
        assert f["data"][i]["index"] == i and f["data"][i]["object"] == "embedding"
        vec = torch.tensor(f["data"][i]["embedding"])
        assert torch.equal(vec, torch.from_numpy(b64_floats(b["data"][i]["embedding"]).copy()))
        assert rel_err(vec, r.embeddings.mean(0)) <= 1e-6


def test_pooling_none_is_the_token_matrix(client, encoders):
    direct = encoders["tiny-qwen3-vl"].encode(IMAGES[:2])
    inputs = [base64.b64encode(x).decode() for x in IMAGES[:2]]  # bare base64 works too
    none = client.post("/v1/embeddings", json={"input": inputs, "pooling": "none", "encoding_format": "base64"}).json()
    mean = client.post("/v1/embeddings", json={"input": inputs}).json()
    for i, r in enumerate(direct):
        item = none["data"][i]
        assert item["shape"] == list(r.embeddings.shape) and item["grid_thw"] == list(r.grid_thw)
        tokens = torch.from_numpy(b64_floats(item["embedding"]).reshape(item["shape"]).copy())
        assert rel_err(tokens, r.embeddings) <= 1e-6
        assert rel_err(tokens.mean(0), torch.tensor(mean["data"][i]["embedding"])) <= 1e-6


def test_encode_json_multipart_and_safetensors(client, encoders):
    direct = encoders["tiny-qwen3-vl"].encode(IMAGES)
    js = client.post("/v1/encode", json={"images": [data_uri(x) for x in IMAGES]}).json()
    files = [("images", (f"{i}.png", x, "image/png")) for i, x in enumerate(IMAGES)]
    multi = client.post("/v1/encode", files=files).json()
    st = client.post("/v1/encode", files=files, data={"dtype": "bfloat16"}, headers={"accept": "application/octet-stream"})
    assert st.status_code == 200 and st.headers["content-type"] == "application/octet-stream"
    tensors = safetensors_load(st.content)
    for i, r in enumerate(direct):
        for reply in (js, multi):
            item = reply["data"][i]
            assert item["grid_thw"] == list(r.grid_thw) and item["dtype"] == "float32"
            emb = torch.from_numpy(b64_floats(item["embeddings"]).reshape(item["shape"]).copy())
            assert rel_err(emb, r.embeddings) <= 1e-6
            assert len(item["deepstack"]) == 2
            for j, d in enumerate(item["deepstack"]):
                assert rel_err(torch.from_numpy(b64_floats(d).reshape(item["shape"]).copy()), r.deepstack[j]) <= 1e-6
        assert tensors[f"images.{i}.embeddings"].dtype == torch.bfloat16
        assert rel_err(tensors[f"images.{i}.embeddings"].float(), r.embeddings) <= 1e-2
        assert f"images.{i}.deepstack.1" in tensors
    half = client.post("/v1/encode", json={"images": [data_uri(IMAGES[0])], "dtype": "float16", "deepstack": False})
    item = half.json()["data"][0]
    assert item["deepstack"] is None
    emb = torch.from_numpy(b64_floats(item["embeddings"], "<f2").reshape(item["shape"]).astype(np.float32))
    assert rel_err(emb, direct[0].embeddings) <= 1e-3


def test_info_endpoints(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json() == {"status": "ready"}
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny-qwen3-vl" and models["data"][0]["embedding_dim"] == 32
    client.post("/v1/embeddings", json={"input": data_uri(IMAGES[0])})
    stats = client.get("/stats").json()
    assert stats["state"] == "ready" and stats["family"] == "qwen3_vl" and stats["device"] == "cpu"
    assert sum(stats["batch_size_histogram"].values()) >= 1 and "budgets" in stats["runner"]
    metrics = client.get("/metrics").text
    for name in ("vitserve_requests_total", "vitserve_queue_seconds_bucket", "vitserve_preprocess_seconds_bucket",
                 "vitserve_inference_seconds_bucket", "vitserve_queue_depth", "vitserve_batch_tokens_bucket",
                 "vitserve_graph_replays_total", "vitserve_graph_padded_patches_total", "vitserve_eager_fallbacks_total"):
        assert name in metrics, name
    for name in ("vitserve_decode_seconds_count", 'vitserve_request_seconds_count{endpoint="/v1/embeddings"}'):
        assert float(next(line for line in metrics.splitlines() if line.startswith(name)).split()[-1]) >= 1, name


def test_unknown_paths_share_one_metrics_label(client):
    for i in range(3):
        assert client.post(f"/v1/no-such-route-{i}", json={}).status_code == 404
    metrics = client.get("/metrics").text
    assert "no-such-route" not in metrics
    assert 'vitserve_requests_total{endpoint="other",outcome="404"} 3.0' in metrics


@pytest.mark.parametrize("item, status, code", [
    ("%%%not-base64%%%", 400, "invalid_base64"),
    (base64.b64encode(b"just some text, not an image").decode(), 400, "undecodable_image"),
    (data_uri(IMAGES[0], "text/plain"), 400, "invalid_media_type"),
    ("data:image/png," + base64.b64encode(IMAGES[0]).decode(), 400, "invalid_media_type"),
    ("https://example.com/cat.png", 400, "url_fetch_disabled"),
    ("", 400, "invalid_image"),
])
def test_bad_inputs_are_4xx(client, item, status, code):
    r = client.post("/v1/embeddings", json={"input": [data_uri(IMAGES[0]), item]})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == "input[1]" and err["message"].startswith("input[1]")


@pytest.mark.parametrize("body, where", [
    ({"input": 5}, "input"), ({"input": []}, "input"), ({"input": ["x"], "encoding_format": "hex"}, "encoding_format"),
    ({"input": ["x"], "pooling": "max"}, "pooling"), ({"input": ["x"], "surprise": 1}, "surprise"),
    ({"input": ["x"], "dimensions": 8}, "dimensions"), ({}, "input"),
])
def test_validation_is_422(client, body, where):
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 422 and r.json()["error"]["param"].startswith(where)


def test_multipart_validation_and_unknown_routes(client):
    files = [("images", ("a.png", IMAGES[0], "image/png"))]
    r = client.post("/v1/encode", files=files, data={"dtype": "int4"})
    assert r.status_code == 422 and r.json()["error"]["param"].startswith("dtype")
    r = client.post("/v1/encode", files=[("x", ("a.txt", b"not an image", "text/plain"))])
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0]"
    r = client.post("/v1/encode", data={"dtype": "float32"}, files=[])
    assert r.status_code == 400
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = client.get("/v1/embeddings")
    assert r.status_code == 405 and r.json()["error"]["code"] == "http_error"


def test_unknown_model_and_bad_json(client):
    r = client.post("/v1/embeddings", json={"model": "gpt-4", "input": [data_uri(IMAGES[0])]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.post("/v1/encode", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = client.post("/v1/encode", json={"images": ["x"], "dtype": "int8"})
    assert r.status_code == 422


def test_limits_are_413(encoders):
    with client_for(encoders["tiny-qwen2.5-vl"], payload_limit=4096, max_images_per_request=2,
                    max_image_pixels=100 * 100) as c:
        r = c.post("/v1/embeddings", json={"input": [data_uri(png(200, 200))]})
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        r = c.post("/v1/embeddings", json={"input": [data_uri(png(8, 8))] * 3})
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_images"
        big = io.BytesIO()
        Image.new("L", (150, 150)).save(big, "PNG")  # 22500 decoded pixels > 10000, but a tiny file
        r = c.post("/v1/embeddings", json={"input": [data_uri(big.getvalue())]})
        assert r.status_code == 413 and r.json()["error"]["code"] == "image_too_large"
        # a chunked body with no Content-Length is cut off while streaming
        r = c.post("/v1/encode", content=iter([b"{\"images\": [\"" + b"A" * 3000, b"A" * 3000 + b"\"]}"]),
                   headers={"content-type": "application/json"})
        assert r.status_code == 413


def test_api_key(encoders):
    with client_for(encoders["tiny-qwen2.5-vl"], api_key="s3cret") as c:
        body = {"input": [data_uri(IMAGES[0])]}
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "s3cret"}):
            r = c.post("/v1/embeddings", json=body, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert "s3cret" not in r.text
        assert c.post("/v1/embeddings", json=body, headers={"authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/v1/models").status_code == 401 and c.get("/stats").status_code == 401
        for path in ("/health", "/ready", "/metrics"):
            assert c.get(path).status_code == 200


def test_queue_full_is_429(encoders):
    with client_for(encoders["tiny-qwen2.5-vl"], max_concurrent_requests=2) as c:
        engine = c.app.state.engine
        engine.in_flight = 2  # two requests admitted and not yet answered
        r = c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[0])]})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        engine.in_flight = 0
        assert c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[0])]}).status_code == 200


def test_not_ready_and_draining_are_503(encoders, monkeypatch):
    async def never_loads(self):
        await asyncio.Event().wait()

    monkeypatch.setattr(Engine, "_load", never_loads)
    settings = Settings(model="tiny-qwen2.5-vl", load_format="dummy")
    with TestClient(create_app(settings)) as c:
        assert c.get("/health").status_code == 200
        r = c.get("/ready")
        assert r.status_code == 503 and r.json() == {"status": "loading", "reason": "loading model weights"}
        r = c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[0])]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready" and "retry-after" in r.headers
    with client_for(encoders["tiny-qwen2.5-vl"]) as c:
        c.app.state.engine.drain()
        assert c.get("/ready").json()["status"] == "draining"
        r = c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[0])]})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]


def test_bad_request_does_not_fail_its_batch_neighbours(encoders):
    """Requests sent in one batching window: the bad ones fail alone, the good ones get the right numbers."""
    enc = encoders["tiny-qwen2.5-vl"]
    direct = enc.encode(IMAGES)
    with client_for(enc, max_batch_wait_ms=300) as c:
        bodies = [{"input": [data_uri(x)]} for x in IMAGES] + [{"input": ["%%%"]},
                                                               {"input": [data_uri(b"GIF89a broken")]}]
        with ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda b: c.post("/v1/embeddings", json=b), bodies))
        assert [r.status_code for r in replies] == [200, 200, 200, 400, 400]
        for r, d in zip(replies, direct):
            assert rel_err(torch.tensor(r.json()["data"][0]["embedding"]), d.embeddings.mean(0)) <= 1e-6
        hist = c.get("/stats").json()["batch_size_histogram"]
        assert any(int(k) >= 2 for k in hist), hist  # the good ones were batched together


def test_batch_failure_fails_only_that_batch(encoders, monkeypatch):
    enc = encoders["tiny-qwen2.5-vl"]
    with client_for(enc) as c:
        real_launch = enc.runner.launch_images
        calls = []

        def faulty(images, lut, pool_mean=None):
            calls.append(len(images))
            if len(calls) == 1:
                raise RuntimeError("injected fault")
            return real_launch(images, lut, pool_mean)

        monkeypatch.setattr(enc.runner, "launch_images", faulty)
        r = c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[0])]})
        assert r.status_code == 500 and r.json()["error"]["code"] == "inference_failed"
        assert "injected fault" in r.json()["error"]["message"]
        assert c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[0])]}).status_code == 200


def test_disconnected_client_is_dropped_from_the_queue(encoders):
    enc = encoders["tiny-qwen2.5-vl"]

    async def scenario():
        settings = Settings(model=enc.name, max_batch_wait_ms=200)
        engine = Engine(settings, encoder=enc)
        await engine.start()
        prepared = await engine.preprocess([IMAGES[0]])
        gone = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(engine.infer(prepared, gone))
        await asyncio.sleep(0.01)
        gone.set_result(None)  # the client went away while its image waited for the batch
        with pytest.raises(ClientDisconnected):
            await task
        kept = await engine.infer(await engine.preprocess([IMAGES[1]]))
        await engine.stop()
        return engine, kept

    engine, kept = asyncio.run(scenario())
    dropped = engine.metrics.registry.get_sample_value("vitserve_dropped_images_total")
    assert dropped == 1 and engine.metrics.registry.get_sample_value("vitserve_images_total", {"device": "cpu"}) == 1
    assert kept[0].future.result()[0].shape[0] == enc.encode([IMAGES[1]])[0].num_tokens


def test_settings_from_env(monkeypatch):
    import argparse

    from service.settings import add_arguments, from_args

    monkeypatch.setenv("VITSERVE_MODEL", "tiny-qwen2-vl")
    monkeypatch.setenv("VITSERVE_MAX_BATCH_TOKENS", "1024")
    monkeypatch.setenv("VITSERVE_ALLOW_URL_FETCH", "true")
    monkeypatch.setenv("VITSERVE_ATTENTION_BACKEND", "cudnn")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    s = from_args(parser.parse_args(["--port", "9000"]))
    assert (s.model, s.max_batch_tokens, s.allow_url_fetch, s.port) == ("tiny-qwen2-vl", 1024, True, 9000)
    # the attention backend reaches from_pretrained wherever a device loads (in-process or a device process)
    assert s.attention_backend == "cudnn" and s.encoder_kwargs()["attention_backend"] == "cudnn"
    with pytest.raises(ValueError, match="model"):
        Settings()
    with pytest.raises(ValueError, match="attention-backend must be one of auto, cudnn, fa4, flash, sdpa"):
        Settings(model="m", attention_backend="flash2")
    assert json.loads(json.dumps(s.__dict__))["model"] == "tiny-qwen2-vl"


def test_url_fetching_refuses_private_addresses(encoders):
    """With fetching enabled, URLs resolving to loopback, private or link-local addresses are refused before any
    connection is made (SSRF); a non-http scheme is not a URL at all."""
    with client_for(encoders["tiny-qwen2.5-vl"], allow_url_fetch=True) as c:
        for url in ("http://127.0.0.1:9/cat.png", "http://localhost/cat.png", "https://169.254.169.254/latest/",
                    "http://10.0.0.1/x.png", "http://[::1]/x.png"):
            r = c.post("/v1/embeddings", json={"input": [url]})
            assert r.status_code == 400 and r.json()["error"]["code"] == "forbidden_url", (url, r.text)
        r = c.post("/v1/embeddings", json={"input": ["http:///nohost.png"]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_url"


def test_several_devices_share_the_load(encoders):
    """Two replicas (here both on the CPU) take batches from the one queue: both serve, stats and metrics say which
    did what, and every answer is right."""
    enc = encoders["tiny-qwen2.5-vl"]
    twin = VisionEncoder.from_pretrained("tiny-qwen2.5-vl", load_format="dummy")
    settings = Settings(model=enc.name, load_format="dummy", max_batch_wait_ms=1, max_batch_tokens=256)
    direct = [r.embeddings.mean(0) for r in enc.encode(IMAGES)]
    with TestClient(create_app(settings, Engine(settings, encoder=[enc, twin]))) as c:
        with ThreadPoolExecutor(12) as pool:
            replies = list(pool.map(lambda i: (i, c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[i % 3])]})),
                                    range(24)))
        for i, r in replies:
            assert r.status_code == 200
            assert rel_err(torch.tensor(r.json()["data"][0]["embedding"]), direct[i % 3]) <= 1e-6
        devices = c.get("/stats").json()["devices"]
        assert set(devices) == {"cpu#0", "cpu#1"}
        assert all(d["batches"] > 0 for d in devices.values()), devices
        assert sum(d["images"] for d in devices.values()) == 24
        metrics = c.get("/metrics").text
        assert 'vitserve_images_total{device="cpu#1"}' in metrics
        assert 'vitserve_graph_replays_total{budget="256",device="cpu#0"}' in metrics


def test_device_resolution():
    from service.engine import resolve_devices

    assert resolve_devices(Settings(model="m", device="cpu")) == (["cpu"], "float32")
    assert resolve_devices(Settings(model="m", devices="cuda:0, cuda:1", dtype="float16")) == (["cuda:0", "cuda:1"],
                                                                                               "float16")
    assert resolve_devices(Settings(model="m", devices="cuda:2"))[1] == "bfloat16"
    if not torch.cuda.is_available():
        assert resolve_devices(Settings(model="m", devices="all")) == (["cpu"], "float32")


def _items(*patches):
    return [WorkItem(np.zeros((1, 1, 3), np.uint8), (1, 1, n), None) for n in patches]


def test_image_queue_batches_in_arrival_order_up_to_the_budget():
    import threading
    import time

    from service.engine import ImageQueue
    from service.metrics import Metrics

    q = ImageQueue(Metrics())
    assert q.take(100, 0.0, block=False) == []
    a, b, c, d = _items(40, 50, 30, 500)
    q.put([a, b, c, d])
    assert q.take(100, 1.0, block=False) == [a, b]  # c does not fit: it stays first, no waiting for more
    assert q.take(100, 0.0, block=False) == [c]
    assert q.take(100, 0.0, block=False) == [d]  # over the budget alone: a batch of its own
    e, f = _items(10, 90)
    threading.Timer(0.05, q.put, ([f],)).start()
    start = time.monotonic()
    q.put([e])
    assert q.take(100, 2.0, block=True) == [e, f]  # waited for f within the batch wait...
    assert time.monotonic() - start < 1.5  # ...and no longer: with f the batch is full
    g, h = _items(10, 10)
    h.cancelled = True  # its client went away
    q.put([g, h])
    assert q.take(100, 0.0, block=False) == [g] and len(q) == 0
    assert q.metrics.registry.get_sample_value("vitserve_dropped_images_total") == 1
    threading.Timer(0.05, q.close).start()
    assert q.take(100, 0.0, block=True) is None  # a taker blocked on an empty queue wakes at close


def images_in(directory) -> list[str]:
    """The spool files in `directory` but servers' lock files."""
    return [name for name in os.listdir(directory) if not name.endswith("lock")]


def test_spool_round_trip_and_fallback(tmp_path):
    names = iter(range(100))
    prefix = spool.spool_prefix(str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(prefix) + "lock"]  # held while we live

    image = np.random.default_rng(0).integers(0, 256, (28, 42, 3), dtype=np.uint8)

    def put(image):
        return spool.put(f"{prefix}{next(names)}", image)

    spooled = put(image)
    assert spooled is not None and len(images_in(tmp_path)) == 1
    assert np.array_equal(spooled.read(), image) and images_in(tmp_path) == []  # read back, file gone
    assert spool.put(str(tmp_path / "missing" / "x"), image) is None  # no directory: the caller pipes it
    short = put(image)
    with open(short.path, "r+b") as f:
        f.truncate(10)
    kept, lost = put(image), spool.Spooled(str(tmp_path / "gone"), (2, 2, 3))
    with pytest.raises(RuntimeError, match="lost on its way.*short"):  # every file is read and removed anyway
        spool.pixels([short, image, lost, kept])
    assert images_in(tmp_path) == []
    a, b = put(image), put(image)
    assert [x.shape for x in spool.pixels([image, a])] == [image.shape] * 2
    spool.discard(image)  # an array: nothing to do
    spool.discard(b)
    assert images_in(tmp_path) == []
    put(image), put(image)
    spool.clear(prefix)
    assert list(tmp_path.iterdir()) == []


def test_spool_of_a_killed_server_is_removed_by_the_next(tmp_path):
    """A server killed with SIGKILL leaves its spool files; the next server on the directory removes them, never a
    live server's."""
    import subprocess
    import sys

    code = ("import sys, time; from service import spool; p = spool.spool_prefix(sys.argv[1]); "
            "open(p + '0-1', 'wb').write(b'x' * 10); print(p, flush=True); time.sleep(60)")
    other = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        theirs = other.stdout.readline().strip()
        ours = spool.spool_prefix(str(tmp_path))  # sweeps: the other server is alive, its files stay
        assert os.path.exists(theirs + "0-1") and os.path.exists(theirs + "lock") and os.path.exists(ours + "lock")
    finally:
        other.kill()
        other.wait()
    again = spool.spool_prefix(str(tmp_path))  # the next server: the killed one's files go, ours (alive) stay
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(os.path.basename(p + "lock") for p in (ours, again))
    spool.clear(ours)
    spool.clear(again)
    assert list(tmp_path.iterdir()) == []


def test_decode_workers_hand_pixels_over_through_the_spool(encoders, tmp_path):
    """With processes, decoded images stay in spool files until they are run, or dropped: the pixels equal the
    pipe's, and nothing stays behind when a request fails on a sibling image, is cancelled while decoding, or
    leaves the queue."""
    enc = encoders["tiny-qwen2.5-vl"]
    images = [Base64Data(base64.b64encode(x).decode()) for x in IMAGES]

    async def settle(spool_dir):  # decode jobs nobody waits for finish in the background
        for _ in range(100):
            await asyncio.sleep(0.05)
            if not images_in(spool_dir):
                break
        return images_in(spool_dir)

    async def scenario(spool_dir):
        engine = Engine(Settings(model=enc.name, preprocess_workers=2, spool_dir=spool_dir), encoder=enc)
        await engine.start()
        try:
            out = await engine.preprocess(images)
            pixels = spool.pixels([image for image, _ in out])
            if spool_dir == "none":
                return pixels, [grid for _, grid in out], engine.stats()["spool"]
            assert all(isinstance(image, spool.Spooled) for image, _ in out) and images_in(spool_dir) == []
            with pytest.raises(ServiceError):  # a bad sibling: the good ones' files go
                await engine.preprocess([*images, Base64Data(base64.b64encode(b"not an image").decode())])
            assert await settle(spool_dir) == []
            task = asyncio.ensure_future(engine.preprocess(images))  # cancelled while decoding
            for _ in range(3):  # the request's task, then each image's: every job submitted
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await settle(spool_dir) == []
            gone = asyncio.get_running_loop().create_future()  # left while queued (the batch waits 5 ms)
            items = [WorkItem(image, grid, gone, cancelled=True) for image, grid in await engine.preprocess(images)]
            engine.images.put(items)
            assert await settle(spool_dir) == []
            return pixels, [grid for _, grid in out], engine.stats()["spool"]
        finally:
            await engine.stop()

    spooled, grids_a, where = asyncio.run(scenario(str(tmp_path)))
    piped, grids_b, nowhere = asyncio.run(scenario("none"))
    assert where == str(tmp_path) and nowhere is None and grids_a == grids_b
    for a, b in zip(spooled, piped):
        assert np.array_equal(a, b)
    assert list(tmp_path.iterdir()) == []


def test_devices_in_processes_of_their_own(encoders, tmp_path):
    """--device-processes: each device loads and serves in its own process; batches and outputs cross through the
    spool. Answers equal the in-process encoder's (pooled, tokens, Qwen3 deepstack), both devices serve, their
    runner stats (of the configured budgets) reach /stats and /metrics, nothing stays in the spool, answers stay
    right through the pipe when the spool goes away, and a device process that dies fails its batch with a 503 and
    turns /health failed."""
    import time

    enc = encoders["tiny-qwen3-vl"]
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    settings = Settings(model="tiny-qwen3-vl", load_format="dummy", devices="cpu,cpu", device_processes=True,
                        spool_dir=str(spool_dir), max_batch_wait_ms=1, max_batch_tokens=256, preprocess_workers=2,
                        budgets="256,1024")
    direct = enc.encode(IMAGES)
    with TestClient(create_app(settings)) as c:
        deadline = time.time() + 120
        while c.get("/ready").status_code != 200 and time.time() < deadline:
            time.sleep(0.2)
        assert c.get("/ready").status_code == 200, c.get("/ready").json()
        with ThreadPoolExecutor(8) as pool:
            pooled = list(pool.map(lambda i: c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[i % 3])]}),
                                   range(16)))
        for i, r in enumerate(pooled):
            assert r.status_code == 200
            assert rel_err(torch.tensor(r.json()["data"][0]["embedding"]), direct[i % 3].embeddings.mean(0)) <= 1e-6
        def check_native():
            native = c.post("/v1/encode", json={"images": [data_uri(x) for x in IMAGES]}).json()
            for item, want in zip(native["data"], direct):
                tokens = torch.from_numpy(b64_floats(item["embeddings"]).reshape(item["shape"]).copy())
                assert rel_err(tokens, want.embeddings) <= 1e-6 and len(item["deepstack"]) == len(want.deepstack)
                for d, w in zip(item["deepstack"], want.deepstack):
                    assert rel_err(torch.from_numpy(b64_floats(d).reshape(item["shape"]).copy()), w) <= 1e-6

        check_native()
        stats = c.get("/stats").json()
        assert set(stats["devices"]) == {"cpu#0", "cpu#1"} and stats["family"] == "qwen3_vl"
        for d in stats["devices"].values():
            assert d["batches"] > 0 and set(d["runner"]["budgets"]) == {"256", "1024"}, stats["devices"]
        assert 'vitserve_graph_replays_total{budget="256",device="cpu#1"}' in c.get("/metrics").text
        assert images_in(spool_dir) == []
        for lock in spool_dir.iterdir():  # the server's lock file
            lock.unlink()
        spool_dir.rmdir()  # no spool any more: pixels and outputs cross through the pipes
        for _ in range(4):  # both devices, whichever takes each batch
            check_native()
        engine = c.app.state.engine
        os.kill(engine.workers[0].process.process.pid, signal.SIGKILL)
        engine.workers[0].process.process.join(10)
        errors = []
        for _ in range(40):  # the live device may take some: both take from one queue
            r = c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[0])]})
            if r.status_code != 200:
                errors.append((r.status_code, r.json()["error"]["code"]))
                break
        assert errors == [(503, "device_lost")]
        assert c.get("/health").json()["status"] == "failed" and c.get("/ready").status_code == 503


def test_a_dead_decode_worker_fails_no_request(encoders, tmp_path):
    """A worker that dies (a decoder crash, the OOM killer) fails only the image it was decoding, which is tried
    again on another; the worker is replaced, every request in flight is answered correctly, and nothing is left in
    the spool."""
    enc = encoders["tiny-qwen2.5-vl"]
    images = [Base64Data(base64.b64encode(x).decode()) for x in IMAGES]
    big = Base64Data(base64.b64encode(png(3000, 3000)).decode())  # decodes long enough to be caught at it

    async def scenario():
        engine = Engine(Settings(model=enc.name, preprocess_workers=2, spool_dir=str(tmp_path)), encoder=enc)
        await engine.start()
        pool = engine.preprocess_pool
        try:
            want = await engine.preprocess([*images, big])
            tasks = [asyncio.ensure_future(engine.preprocess([[*images, big][i % 4]])) for i in range(12)]
            for _ in range(500):  # a worker busy with the big image
                busy = [link for link in pool._links if link.job is not None and len(link.job[1]) > 100_000]
                if busy:
                    break
                await asyncio.sleep(0.002)
            os.kill(busy[0].process.pid, signal.SIGKILL)
            got = await asyncio.gather(*tasks)
            read = [(spool.pixels([image])[0], grid) for image, grid in [*want, *(g[0] for g in got)]]
            left = images_in(tmp_path)
            return read[:len(want)], read[len(want):], pool.replaced, engine.stats()["decode_workers_replaced"], left
        finally:
            await engine.stop()

    want, got, replaced, reported, left = asyncio.run(scenario())
    assert replaced == reported == 1 and left == []
    for i, (image, grid) in enumerate(got):
        assert grid == want[i % 4][1] and np.array_equal(image, want[i % 4][0])


def test_decode_pool_worker_death_and_errors():
    """The pool on its own: results in order of submission per job, exceptions back to their job, a job that kills
    its worker fails alone (WorkerDied) while the other jobs finish, and closing fails what still waits."""
    from service.decode_pool import DecodePool, PoolUnavailable, WorkerDied

    async def scenario():
        pool = DecodePool(2)
        await pool.start()
        try:
            ok = pool.submit(bytes.upper, b"abc")
            bad = pool.submit(int, b"x")
            dies = pool.submit(eval, b"__import__('os')._exit(3)")
            after = [pool.submit(bytes.center, b"a", i) for i in range(6)]
            assert await ok == b"ABC"
            with pytest.raises(ValueError):
                await bad
            with pytest.raises(WorkerDied, match="exit code 3"):
                await dies
            assert [await f for f in after] == [b"a".center(i) for i in range(6)]
            for _ in range(200):
                if len(pool._links) == 2:
                    break
                await asyncio.sleep(0.01)
            assert pool.replaced == 1 and len(pool._links) == 2 and len(pool._idle) == 2
            cancelled = pool.submit(bytes.upper, b"x" * 10**6)
            cancelled.cancel()
            assert await pool.submit(bytes.upper, b"y" * 10**6) == b"Y" * 10**6  # a megabyte each way
            processes = [link.process for link in pool._links]
        finally:
            await pool.close()
        late = pool.submit(bytes.upper, b"x")
        with pytest.raises(PoolUnavailable, match="closed"):
            await late
        return processes

    assert all(not p.is_alive() for p in asyncio.run(scenario()))


async def cannot_spawn():
    """In place of DecodePool._spawn: the system out of processes."""
    raise OSError("fork: Resource temporarily unavailable")


def test_decode_pool_that_cannot_replace_its_last_worker_fails_what_waits():
    """When no worker is left and none can be started (the system out of processes or memory), what waits and what
    comes after fails with PoolUnavailable at once, instead of waiting forever, and the owner is told."""
    from service.decode_pool import DecodePool, PoolUnavailable, WorkerDied

    async def scenario():
        pool = DecodePool(2)
        await pool.start()
        told = []
        pool.on_broken = told.append

        pool._spawn, pool.respawn_delays = cannot_spawn, (0.01, 0.01)
        try:
            busy = [pool.submit(eval, b"__import__('time').sleep(30)") for _ in range(2)]
            for _ in range(200):  # both workers hold a job
                if not pool._idle:
                    break
                await asyncio.sleep(0.01)
            waiting = pool.submit(bytes.upper, b"abc")
            for link in list(pool._links):
                os.kill(link.process.pid, signal.SIGKILL)
            for job in busy:
                with pytest.raises(WorkerDied):
                    await asyncio.wait_for(job, 20)
            with pytest.raises(PoolUnavailable, match="none could be started"):
                await asyncio.wait_for(waiting, 20)
            with pytest.raises(PoolUnavailable, match="none could be started"):
                await pool.submit(bytes.upper, b"abc")
            return told, pool.replaced
        finally:
            await pool.close()

    told, replaced = asyncio.run(scenario())
    assert replaced == 2 and len(told) == 1 and "Resource temporarily unavailable" in told[0]


def test_decode_pool_tries_again_to_replace_a_worker():
    """A replacement that fails to start once (the system briefly out of processes) is tried again: the pool gets
    back to its size and serves, instead of shrinking for good."""
    from service.decode_pool import DecodePool

    async def scenario():
        pool = DecodePool(1)
        await pool.start()
        spawn, failures = pool._spawn, []

        async def fails_once():
            if not failures:
                failures.append(True)
                raise OSError("fork: Resource temporarily unavailable")
            await spawn()

        pool._spawn, pool.respawn_delays = fails_once, (0.01,)
        try:
            [link] = pool._links
            os.kill(link.process.pid, signal.SIGKILL)
            for _ in range(500):
                if pool._links and link not in pool._links:
                    break
                await asyncio.sleep(0.01)
            return await pool.submit(bytes.upper, b"abc"), len(pool._links), pool.broken, failures
        finally:
            await pool.close()

    assert asyncio.run(scenario()) == (b"ABC", 1, None, [True])


def test_engine_without_decode_workers_fails_and_answers_503(encoders):
    """The engine's side of a broken decode pool: the server reports failed (the CLI then exits for a restart) and a
    request is answered 503 decode_unavailable, not a 400 that blames the image."""
    enc = encoders["tiny-qwen2.5-vl"]

    async def scenario():
        engine = Engine(Settings(model=enc.name, preprocess_workers=1), encoder=enc)
        exited = []
        engine.on_failure = lambda: exited.append(True)
        await engine.start()
        try:
            pool = engine.preprocess_pool
            pool._spawn, pool.respawn_delays = cannot_spawn, (0.01,)
            [link] = pool._links
            os.kill(link.process.pid, signal.SIGKILL)
            for _ in range(500):
                if engine.state == "failed":
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(ServiceError) as error:
                await engine.preprocess([IMAGES[0]])
            return engine.state, engine.error, exited, error.value
        finally:
            await engine.stop()

    state, reason, exited, error = asyncio.run(scenario())
    assert state == "failed" and "no decode worker is left" in reason and exited == [True]
    assert error.status == 503 and error.code == "decode_unavailable"


def test_decode_workers_import_no_torch(encoders):
    """What a decode worker runs lives away from the engine and torch (150 MB and a second or two per worker)."""
    enc = encoders["tiny-qwen2.5-vl"]

    async def scenario():
        engine = Engine(Settings(model=enc.name, preprocess_workers=1), encoder=enc)
        await engine.start()
        try:
            [(image, _)] = await engine.preprocess([IMAGES[0]])  # the one worker has decoded an image
            imported = await engine.preprocess_pool.submit(
                eval, b"'torch' in __import__('sys').modules or 'service.engine' in __import__('sys').modules")
            return spool.pixels([image])[0], imported
        finally:
            await engine.stop()

    image, imported = asyncio.run(scenario())
    assert image.ndim == 3 and not imported


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA (the device must fail to load)")
def test_a_device_process_that_cannot_load_fails_the_server(tmp_path):
    """The device process's load error reaches /health, and the server's own process is left clean."""
    import time

    settings = Settings(model="tiny-qwen2.5-vl", load_format="dummy", devices="cuda:0", dtype="float32",
                        device_processes=True, spool_dir=str(tmp_path))
    with TestClient(create_app(settings)) as c:
        deadline = time.time() + 120
        while c.get("/health").status_code == 200 and time.time() < deadline:
            time.sleep(0.2)
        health = c.get("/health")
        assert health.status_code == 503 and "CUDA is not available" in health.json()["error"]
        assert c.get("/ready").json()["status"] == "failed"


@pytest.mark.parametrize("devices, flag, expected", [
    ("cpu", None, False), ("cpu,cpu", None, False), ("cuda:0", None, True), ("cuda:0,cuda:1", None, True),
    ("cuda:0", False, False), ("cpu,cpu", True, True)])
def test_device_processes_default(devices, flag, expected):
    """A process per device by default on CUDA, one GPU too (measured faster there than a thread); threads on CPU;
    the flag wins both ways. Only decided here: nothing is loaded or spawned."""
    settings = Settings(model="tiny-qwen3-vl", load_format="dummy", devices=devices, device_processes=flag,
                        preprocess_processes=False)
    assert Engine(settings).device_processes is expected
