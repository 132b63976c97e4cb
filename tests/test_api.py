"""The HTTP API over Starlette's TestClient (the ASGI app with its lifespan), tiny models on the CPU: responses,
formats, the error envelope and status codes, limits, auth."""

from __future__ import annotations

import asyncio
import base64
import io
import logging

import pytest
import torch
from fastapi.testclient import TestClient
from helpers import IMAGES, b64_floats, b64_tensor, client_for, data_uri, png, rel_err
from PIL import Image
from safetensors.torch import load as safetensors_load

import vitserve
from vitserve.service.api.outputs import OUTPUT_DTYPES
from vitserve.service.entry.app import create_app
from vitserve.service.ground.settings import Settings
from vitserve.service.pipeline.backend import LocalBackend


@pytest.fixture(scope="module")
def client(encoders):
    with client_for(encoders["tiny-qwen3-vl"]) as c:
        yield c


def test_embeddings_float_and_base64_match_direct_encoding(client, encoders):
    direct = encoders["tiny-qwen3-vl"].encode(IMAGES)
    body = {"model": "tiny-qwen3-vl", "input": [data_uri(x) for x in IMAGES]}
    as_float = client.post("/v1/embeddings", json=body)
    as_b64 = client.post("/v1/embeddings", json=body | {"encoding_format": "base64"})
    assert as_float.status_code == as_b64.status_code == 200
    assert float(as_float.headers["x-queue-time"]) >= 0 and float(as_float.headers["x-inference-time"]) > 0
    # one image, not cached: its phases follow one another within the server's time (rounded to 0.01 ms each)
    one = client.post("/v1/embeddings", json={"input": [data_uri(png(96, 80, 77))], "model": "tiny-qwen3-vl"}).headers
    phases = sum(float(one[f"x-{phase}-time"]) for phase in ("decode", "queue", "inference", "serialize"))
    assert float(one["x-inference-time"]) > 0 and phases <= float(one["x-server-time"]) + 0.05, one
    f, b = as_float.json(), as_b64.json()
    assert f["object"] == "list" and f["model"] == "tiny-qwen3-vl"
    tokens = sum(r.num_tokens for r in direct)
    assert f["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
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
        tokens = b64_tensor(item["embedding"], item["shape"])
        assert rel_err(tokens, r.embeddings) <= 1e-6
        assert rel_err(tokens.mean(0), torch.tensor(mean["data"][i]["embedding"])) <= 1e-6


def test_encode_json_multipart_and_safetensors(client, encoders):
    direct = encoders["tiny-qwen3-vl"].encode(IMAGES)
    js = client.post("/v1/encode", json={"images": [data_uri(x) for x in IMAGES]}).json()
    files = [("images", (f"{i}.png", x, "image/png")) for i, x in enumerate(IMAGES)]
    multi = client.post("/v1/encode", files=files).json()
    st = client.post(
        "/v1/encode", files=files, data={"dtype": "bfloat16"}, headers={"accept": "application/octet-stream"}
    )
    assert st.status_code == 200 and st.headers["content-type"] == "application/octet-stream"
    tensors = safetensors_load(st.content)
    for i, r in enumerate(direct):
        for reply in (js, multi):
            item = reply["data"][i]
            assert item["grid_thw"] == list(r.grid_thw) and item["dtype"] == "float32"
            assert rel_err(b64_tensor(item["embeddings"], item["shape"]), r.embeddings) <= 1e-6
            assert len(item["deepstack"]) == 2
            for j, d in enumerate(item["deepstack"]):
                assert rel_err(b64_tensor(d, item["shape"]), r.deepstack[j]) <= 1e-6
        assert tensors[f"images.{i}.embeddings"].dtype == torch.bfloat16
        assert rel_err(tensors[f"images.{i}.embeddings"].float(), r.embeddings) <= 1e-2
        assert f"images.{i}.deepstack.1" in tensors
    half = client.post("/v1/encode", json={"images": [data_uri(IMAGES[0])], "dtype": "float16", "deepstack": False})
    item = half.json()["data"][0]
    assert item["deepstack"] is None
    assert rel_err(b64_tensor(item["embeddings"], item["shape"], "<f2"), direct[0].embeddings) <= 1e-3


def test_info_endpoints(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json() == {"status": "ready"}
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny-qwen3-vl" and models["data"][0]["embedding_dim"] == 32
    client.post("/v1/embeddings", json={"input": data_uri(IMAGES[0])})
    stats = client.get("/stats").json()
    assert stats["state"] == "ready" and stats["family"] == "qwen3_vl" and stats["device"] == "cpu"
    assert sum(stats["batch_size_histogram"].values()) >= 1 and "runner" not in stats  # one copy: per device
    runner = stats["devices"]["cpu"]["runner"]  # a CPU runs its batches eagerly, unpadded: no budget is replayed
    assert runner["mode"] == "eager" and runner["budgets"] == {} and runner["eager_runs"] >= 1
    assert runner["eager_patches"] >= 1 and stats["eager_runs"] >= 1 and stats["eager_fallbacks"] == 0
    assert stats["version"] == vitserve.__version__ and stats["batching"]["max_batch_tokens"] == 4096
    assert stats["batching"]["max_batch_wait_ms"] == 5.0 and stats["batching"]["decode_workers"] >= 1
    assert all(type(stats["cache"][k]) is int for k in ("hits", "misses", "evictions", "bytes", "entries"))
    for phase in ("decode", "queue", "inference", "request"):
        latency = stats["latency"][phase]
        assert latency["count"] >= 1 and 0 <= latency["p50_ms"] <= latency["p99_ms"], (phase, latency)
    metrics = client.get("/metrics").text
    for name in (
        "vitserve_requests_total",
        "vitserve_queue_seconds_bucket",
        "vitserve_preprocess_seconds_bucket",
        "vitserve_inference_seconds_bucket",
        "vitserve_queue_depth",
        "vitserve_batch_tokens_bucket",
        "vitserve_graph_replays_total",
        "vitserve_graph_padded_patches_total",
        "vitserve_eager_fallbacks_total",
        "vitserve_eager_runs_total",
        "vitserve_eager_patches_total",
    ):
        assert name in metrics, name
    assert not any(
        line.startswith("vitserve_graph_replays_total{") and float(line.split()[-1]) > 0
        for line in metrics.splitlines()
    )  # nothing is replayed where nothing is captured
    for name in (
        "vitserve_decode_seconds_count",
        'vitserve_request_seconds_count{endpoint="/v1/embeddings",outcome="ok"}',
        "vitserve_queue_seconds_count",
    ):
        assert float(next(line for line in metrics.splitlines() if line.startswith(name)).split()[-1]) >= 1, name


def test_unknown_paths_share_one_metrics_label(client):
    for i in range(3):
        assert client.post(f"/v1/no-such-route-{i}", json={}).status_code == 404
    metrics = client.get("/metrics").text
    assert "no-such-route" not in metrics
    assert 'vitserve_requests_total{code="404",endpoint="other"} 3.0' in metrics


@pytest.mark.parametrize(
    "item, status, code",
    [
        ("%%%not-base64%%%", 400, "invalid_base64"),
        (base64.b64encode(b"just some text, not an image").decode(), 400, "undecodable_image"),
        (base64.b64encode(b"\xff\xd8\xff\xd9").decode(), 400, "undecodable_image"),  # ends before its header
        (base64.b64encode(b"GIF89a\x01\x00\x01\x00\x00\x00\x00;").decode(), 400, "undecodable_image"),
        (data_uri(IMAGES[0], "text/plain"), 400, "invalid_media_type"),
        ("data:image/png," + base64.b64encode(IMAGES[0]).decode(), 400, "invalid_media_type"),
        ("https://example.com/cat.png", 400, "url_fetch_disabled"),
        ("file:///etc/passwd", 400, "invalid_url"),  # a URL, not "not valid base64"
        ("ftp://example.com/cat.png", 400, "invalid_url"),
        ("data:video/mp4;base64,AAAAIGZ0eXBpc29t", 400, "video_input"),  # a video without modality video: the hint
        ("", 400, "invalid_image"),
    ],
)
def test_bad_inputs_are_4xx(client, item, status, code):
    r = client.post("/v1/embeddings", json={"input": [data_uri(IMAGES[0]), item]})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == "input[1]" and err["message"].startswith("input[1]")


@pytest.mark.parametrize(
    "body, where",
    [
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({"input": ["x"], "encoding_format": "hex"}, "encoding_format"),
        ({"input": ["x"], "pooling": "max"}, "pooling"),
        ({"input": ["x"], "surprise": 1}, "surprise"),
        ({"input": ["x"], "dimensions": 8}, "dimensions"),
        ({}, "input"),
    ],
)
def test_validation_is_422(client, body, where):
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 422 and r.json()["error"]["param"].startswith(where)


def test_multipart_validation_and_unknown_routes(client):
    files = [("images", ("a.png", IMAGES[0], "image/png"))]
    r = client.post("/v1/encode", files=files, data={"dtype": "int4"})
    assert r.status_code == 422 and r.json()["error"]["param"].startswith("dtype")
    r = client.post("/v1/encode", files=[("x", ("a.txt", b"not an image", "text/plain"))])
    assert r.status_code == 400 and r.json()["error"]["param"] == "images[0]"
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
    with client_for(
        encoders["tiny-qwen2.5-vl"], payload_limit=4096, max_images_per_request=2, max_image_pixels=100 * 100
    ) as c:
        r = c.post("/v1/embeddings", json={"input": [data_uri(png(200, 200))]})
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        assert r.json()["error"]["message"] == "request body over --payload-limit (4KiB, 4096 bytes)"
        r = c.post("/v1/embeddings", json={"input": [data_uri(png(8, 8))] * 3})
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_images"
        big = io.BytesIO()
        Image.new("L", (150, 150)).save(big, "PNG")  # 22500 decoded pixels > 10000, but a tiny file
        r = c.post("/v1/embeddings", json={"input": [data_uri(big.getvalue())]})
        assert r.status_code == 413 and r.json()["error"]["code"] == "image_too_large"
        # a chunked body with no Content-Length is cut off while streaming
        r = c.post(
            "/v1/encode",
            content=iter([b'{"images": ["' + b"A" * 3000, b"A" * 3000 + b'"]}']),
            headers={"content-type": "application/json"},
        )
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
        with engine.admitted(), engine.admitted():  # two requests admitted and not yet answered
            r = c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[0])]})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
        assert c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[0])]}).status_code == 200


def test_not_ready_and_draining_are_503(encoders, monkeypatch):
    async def never_loads(self):
        await asyncio.Event().wait()

    monkeypatch.setattr(LocalBackend, "_load", never_loads)
    settings = Settings.of(model="tiny-qwen2.5-vl", load_format="dummy")
    with TestClient(create_app(settings)) as c:
        assert c.get("/health").status_code == 200
        r = c.get("/ready")
        assert r.status_code == 503 and r.json() == {"status": "loading", "reason": "loading model weights"}
        r = c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[0])]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready" and r.headers["retry-after"] == "5"
    with client_for(encoders["tiny-qwen2.5-vl"]) as c:
        c.app.state.engine.drain()
        assert c.get("/ready").json()["status"] == "draining"
        r = c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[0])]})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]


def test_url_fetching_refuses_private_addresses(encoders):
    """With fetching enabled, URLs resolving to loopback, private or link-local addresses are refused before any
    connection is made (SSRF); a non-http scheme is not a URL at all."""
    with client_for(encoders["tiny-qwen2.5-vl"], allow_url_fetch=True) as c:
        for url in (
            "http://127.0.0.1:9/cat.png",
            "http://localhost/cat.png",
            "https://169.254.169.254/latest/",
            "http://10.0.0.1/x.png",
            "http://[::1]/x.png",
        ):
            r = c.post("/v1/embeddings", json={"input": [url]})
            assert r.status_code == 400 and r.json()["error"]["code"] == "forbidden_url", (url, r.text)
        r = c.post("/v1/embeddings", json={"input": ["http:///nohost.png"]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_url"


def test_every_domain_error_has_one_status():
    """The one table: every domain error the engine raises maps to an HTTP status (and Retry-After where retrying
    helps), a subclass included."""
    from vitserve.service.api import http_errors
    from vitserve.service.ground import errors

    domain = [
        c
        for c in vars(errors).values()
        if isinstance(c, type) and issubclass(c, errors.EngineError) and c is not errors.EngineError
    ]
    assert set(domain) == set(http_errors.HTTP_STATUS)
    assert http_errors.ServiceError.of(errors.QueueFull("x")).headers == {"Retry-After": "1"}
    assert http_errors.ServiceError.of(errors.Unavailable("x", "device_lost")).status == 503

    class Narrower(errors.InputRejected):
        pass

    assert http_errors.ServiceError.of(Narrower("x", "odd")).status == 400


def test_metrics_are_conventional(client):
    """Status codes as numbers, no *_created series, process metrics and build info, latency by outcome."""
    client.post("/v1/embeddings", json={"input": [data_uri(IMAGES[0])]})
    client.post("/v1/embeddings", json={"input": ["%%%"]})
    metrics = client.get("/metrics").text
    assert 'vitserve_requests_total{code="200",endpoint="/v1/embeddings"}' in metrics
    assert 'vitserve_requests_total{code="400",endpoint="/v1/embeddings"}' in metrics
    assert 'outcome="ok"' not in metrics.split("vitserve_requests_total")[1].split("\n# ")[0]
    assert "_created" not in metrics
    assert "process_resident_memory_bytes" in metrics and "process_cpu_seconds_total" in metrics
    build = next(line for line in metrics.splitlines() if line.startswith("vitserve_build_info{"))
    assert 'family="qwen3_vl"' in build and 'version="' in build and build.endswith(" 1.0")
    for outcome in ("ok", "client_error"):
        assert f'vitserve_request_seconds_count{{endpoint="/v1/embeddings",outcome="{outcome}"}}' in metrics


def test_request_ids_and_access_lines(client, caplog):
    """Every response carries x-request-id (the client's, or a new one); every request, a 4xx too, logs one access
    line with it."""
    with caplog.at_level(logging.INFO, logger="vitserve.access"):
        fresh = {"input": [data_uri(png(70, 50, 77))]}  # not in the cache: it is encoded
        ok = client.post("/v1/embeddings", json=fresh, headers={"x-request-id": "abc-123"})
        bad = client.post("/v1/embeddings", json={"input": ["%%%"]})
        odd = client.get("/v1/models", headers={"x-request-id": "not ok\x01"})
    assert ok.headers["x-request-id"] == "abc-123"
    assert len(bad.headers["x-request-id"]) == 32 and odd.headers["x-request-id"] != "not ok\x01"
    lines = [r for r in caplog.records if r.name == "vitserve.access"]
    assert len(lines) == 3
    first = lines[0].fields
    assert first["status"] == 200 and first["images"] == 1 and first["tokens"] > 0 and first["request_id"] == "abc-123"
    assert first["queue_ms"] >= 0 and first["inference_ms"] > 0 and "request_id=abc-123" in lines[0].getMessage()
    assert lines[1].fields["status"] == 400 and lines[1].fields["request_id"] == bad.headers["x-request-id"]


def test_normalize_and_per_request_max_pixels(client, encoders):
    big = png(600, 400, 7)
    plain = client.post("/v1/embeddings", json={"input": [data_uri(big)]}).json()["data"][0]["embedding"]
    unit = client.post("/v1/embeddings", json={"input": [data_uri(big)], "normalize": True}).json()
    vector = torch.tensor(unit["data"][0]["embedding"])
    assert (
        abs(vector.norm().item() - 1) < 1e-5
        and rel_err(vector, torch.nn.functional.normalize(torch.tensor(plain), dim=0)) < 1e-6
    )
    tokens = client.post("/v1/embeddings", json={"input": [data_uri(big)], "pooling": "none", "normalize": True})
    item = tokens.json()["data"][0]
    rows = torch.tensor(item["embedding"]).reshape(item["shape"])
    assert torch.allclose(rows.norm(dim=-1), torch.ones(item["shape"][0]), atol=1e-5)
    capped = client.post("/v1/encode", json={"images": [data_uri(big)], "max_pixels": 100_000}).json()["data"][0]
    full = client.post("/v1/encode", json={"images": [data_uri(big)]}).json()["data"][0]
    patch = encoders["tiny-qwen3-vl"].preprocess_config.patch_size
    assert (
        capped["grid_thw"][1] * capped["grid_thw"][2] * patch**2
        <= 100_000
        < full["grid_thw"][1] * full["grid_thw"][2] * patch**2
    )
    huge = client.post("/v1/encode", json={"images": [data_uri(big)], "max_pixels": 10**12}).json()["data"][0]
    assert huge["grid_thw"] == full["grid_thw"]  # the server's own cap still applies
    low = client.post("/v1/encode", json={"images": [data_uri(big)], "max_pixels": 64})
    assert low.status_code == 400 and low.json()["error"]["param"] == "max_pixels"
    files = [("images", ("a.png", big, "image/png"))]
    form = client.post("/v1/encode", files=files, data={"max_pixels": "100000"}).json()["data"][0]
    assert form["grid_thw"] == capped["grid_thw"]


def test_multipart_fields_are_strict_and_params_name_the_real_field(client):
    files = [("images", ("a.png", IMAGES[0], "image/png"))]
    for data, where in (({"dtyp": "float16"}, "dtyp"), ({"deepstack": "maybe"}, "deepstack")):
        r = client.post("/v1/encode", files=files, data=data)
        assert r.status_code == 422 and r.json()["error"]["param"] == where, r.text
    r = client.post("/v1/encode", files=files, data={"model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert client.post("/v1/encode", files=files, data={"deepstack": "false"}).json()["data"][0]["deepstack"] is None
    r = client.post("/v1/encode", json={"images": [data_uri(IMAGES[0]), "%%%"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "images[1]"
    r = client.post("/v1/encode", json={"images": [data_uri(IMAGES[0]), 5]})
    assert r.status_code == 422 and r.json()["error"]["param"] == "images[1]"
    assert client.post("/v1/embeddings", json={"input": 5}).json()["error"]["param"] == "input"


def test_openapi_documents_the_multipart_form(client):
    """/openapi.json documents the multipart form, and the package's own version."""
    assert client.get("/openapi.json").json()["info"]["version"] == vitserve.__version__
    body = client.get("/openapi.json").json()["paths"]["/v1/encode"]["post"]["requestBody"]["content"]
    form = body["multipart/form-data"]["schema"]
    assert form["properties"]["images"]["items"]["format"] == "binary" and {"dtype", "deepstack"} <= set(
        form["properties"]
    )
    assert "application/json" in body


def test_the_vllm_layout_puts_deepstack_on_the_width(client, encoders):
    """layout=vllm: one tensor per image, cat([tokens, ds0, ds1], -1) in deepstack order (Qwen3), in JSON and in
    safetensors, as a field, form field or query parameter; for a tower without deepstack it is the tokens."""
    images = [png(120, 90, 41), png(64, 200, 42)]
    direct = encoders["tiny-qwen3-vl"].encode(images)
    body = {"images": [data_uri(x) for x in images], "layout": "vllm"}
    js = client.post("/v1/encode", json=body).json()
    files = [("images", (f"{i}.png", x, "image/png")) for i, x in enumerate(images)]
    form = client.post("/v1/encode", files=files, data={"layout": "vllm"}).json()
    query = client.post("/v1/encode?layout=vllm", files=files, headers={"accept": "application/octet-stream"})
    tensors = safetensors_load(query.content)
    assert js["layout"] == "vllm" and not any(".deepstack." in k for k in tensors)
    for i, r in enumerate(direct):
        want = torch.cat([r.embeddings, *r.deepstack], -1)
        assert want.shape[1] == 3 * 32
        for reply in (js, form):
            item = reply["data"][i]
            assert item["deepstack"] is None and item["shape"] == list(want.shape)
            assert rel_err(b64_tensor(item["embeddings"], item["shape"]), want) <= 1e-6
        assert rel_err(tensors[f"images.{i}.embeddings"], want) <= 1e-6
    with client_for(encoders["tiny-qwen2.5-vl"]) as other:
        plain = other.post("/v1/encode", json={"images": [data_uri(images[0])]}).json()["data"][0]
        vllm = other.post("/v1/encode", json={"images": [data_uri(images[0])], "layout": "vllm"}).json()["data"][0]
        assert vllm["embeddings"] == plain["embeddings"] and vllm["shape"] == plain["shape"]
    assert client.post("/v1/encode", json={"images": ["x"], "layout": "sglang"}).status_code == 422


SHARED = [png(96, 64, 51), png(64, 96, 52)]  # sent as A, A, B, A: the repeats share one output (the cache's)


def _items(reply, accept: str) -> list:
    """A /v1/encode or /v1/embeddings answer as one comparable value per image (raw bytes, base64 text, floats)."""
    assert reply.status_code == 200, reply.text
    if accept:
        tensors = safetensors_load(reply.content)
        return [
            {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"images.{i}.")}
            for i in range(len({k.split(".")[1] for k in tensors}))
        ]
    return [{k: v for k, v in item.items() if k != "index"} for item in reply.json()["data"]]


@pytest.mark.parametrize("family", ["tiny-qwen3-vl", "tiny-qwen2.5-vl"])
def test_the_same_image_twice_in_a_request_is_answered_whole_every_way(encoders, family):
    """Items that share one output (repeats in a request, and repeats of a cached image) come out whole and equal to
    the image sent alone, in every output path: safetensors and JSON base64 in every dtype, layout and deepstack
    choice, and /v1/embeddings floats and base64, pooled or not, normalized or not."""
    a, b = (data_uri(x) for x in SHARED)
    with client_for(encoders[family]) as client:
        cases = [
            ("/v1/encode", {"dtype": d, "layout": lay, "deepstack": ds}, accept)
            for d in ("float32", "float16", "bfloat16")
            for lay in ("tokens", "vllm")
            for ds in (True, False)
            for accept in ("", "application/octet-stream")
        ]
        cases += [
            ("/v1/embeddings", {"pooling": p, "encoding_format": e, "normalize": n}, "")
            for p in ("mean", "none")
            for e in ("float", "base64")
            for n in (False, True)
        ]
        for path, fields, accept in cases:
            key = "images" if path == "/v1/encode" else "input"
            headers = {"accept": accept} if accept else {}
            alone = [_items(client.post(path, json={key: [x], **fields}, headers=headers), accept)[0] for x in (a, b)]
            for _ in range(2):  # the second time every item is a cache hit
                both = _items(client.post(path, json={key: [a, a, b, a], **fields}, headers=headers), accept)
                for got, want in zip(both, [alone[0], alone[0], alone[1], alone[0]]):
                    assert got.keys() == want.keys()
                    for k in got:
                        equal = torch.equal(got[k], want[k]) if accept else got[k] == want[k]
                        assert equal, (path, fields, accept, k)
        files = [("images", ("a.png", SHARED[0], "image/png"))] * 2
        reply = client.post("/v1/encode", files=files, headers={"accept": "application/octet-stream"})
        tensors = _items(reply, "application/octet-stream")
        assert len(tensors) == 2 and all(torch.equal(tensors[0][k], tensors[1][k]) for k in tensors[0])


def test_float_token_matrices_are_flat_with_their_shape_and_dtype_aliases_are_taken(client, encoders):
    """OpenAI's `embedding` is a flat list[float]: a token matrix (pooling none) goes row by row in floats as in
    base64, its `shape` beside it; a request's dtype takes the CLI's aliases (bf16, fp16, fp32, half)."""
    image = data_uri(IMAGES[1])
    direct = encoders["tiny-qwen3-vl"].encode([IMAGES[1]])[0].embeddings
    floats = client.post("/v1/embeddings", json={"input": [image], "pooling": "none"}).json()["data"][0]
    b64 = client.post("/v1/embeddings", json={"input": [image], "pooling": "none", "encoding_format": "base64"}).json()[
        "data"
    ][0]
    assert all(isinstance(v, float) for v in floats["embedding"]) and floats["shape"] == list(direct.shape)
    assert torch.equal(torch.tensor(floats["embedding"]), torch.from_numpy(b64_floats(b64["embedding"]).copy()))
    assert rel_err(torch.tensor(floats["embedding"]).reshape(floats["shape"]), direct) <= 1e-6
    for alias, name in (("bf16", "bfloat16"), ("fp16", "float16"), ("half", "float16"), ("fp32", "float32")):
        reply = client.post("/v1/encode", json={"images": [image], "dtype": alias})
        assert reply.status_code == 200 and reply.json()["data"][0]["dtype"] == name, reply.text
        files = [("images", ("a.png", IMAGES[1], "image/png"))]
        form = client.post(
            "/v1/encode", files=files, data={"dtype": alias}, headers={"accept": "application/octet-stream"}
        )
        assert safetensors_load(form.content)["images.0.embeddings"].dtype == OUTPUT_DTYPES[name]
    assert client.post("/v1/encode", json={"images": [image], "dtype": "int8"}).status_code == 422


def test_a_body_that_finds_no_room_in_time_is_429():
    """With --body-memory full, a request's body is not read past its free first MiB; if no room comes within the
    body deadline the answer is a 429 (the server's load, not the client's slowness), and the small requests are
    served meanwhile. A chunked body, whose length is unknown, is a 429 at once where its next MiB does not fit."""
    from vitserve.service.api.gate import Gate
    from vitserve.service.ground.metrics import Metrics

    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    settings = Settings.of(model="tiny-qwen3-vl", body_memory=4 * 2**20, body_timeout=0.3)
    gate = Gate(app, settings, Metrics())
    client = TestClient(gate)  # no lifespan: the gate and a bare app
    gate.bodies.used = 3 * 2**20  # other requests' shares
    big = client.post("/v1/encode", content=b"x" * (2 * 2**20))  # counted beyond its first MiB: 2 MiB
    assert big.status_code == 429 and big.json()["error"]["code"] == "queue_full"
    assert big.headers["retry-after"] == "1"
    assert client.post("/v1/encode", content=b"x" * (3 * 2**19)).status_code == 200  # 1 MiB of 1.5: fits
    assert client.post("/v1/encode", content=b"x" * 2**19).status_code == 200  # within its free MiB
    gate.bodies.used = 4 * 2**20  # full: a body within its first MiB is still read
    assert client.post("/v1/encode", content=b"x" * 2**20).status_code == 200
    chunked = client.post("/v1/encode", content=(b"x" * 2**18 for _ in range(8)))  # no length: a share per MiB
    assert chunked.status_code == 429  # at once: a chunked body never waits holding a share
    gate.bodies.used = 2 * 2**20
    assert client.post("/v1/encode", content=(b"x" * 2**18 for _ in range(8))).status_code == 200
    assert gate.bodies.used == 2 * 2**20  # each share given back


def test_a_server_without_pyav_says_so(encoders, monkeypatch, caplog):
    """Without PyAV (an import that fails, as on an install without the `video` extra) a video request is the
    server's condition, a 501 videos_unavailable that names the extra, not the client's 400 "cannot decode the
    image"; the startup log, /v1/models' capabilities and /stats say so too, and images are still served."""
    monkeypatch.setitem(__import__("sys").modules, "av", None)  # `import av` raises ImportError
    video = "data:video/mp4;base64," + base64.b64encode(b"\x00\x00\x00\x20ftypisom" + bytes(600)).decode()
    with caplog.at_level(logging.WARNING, logger="vitserve.engine"):
        c = client_for(encoders["tiny-qwen3-vl"])
    with c:
        assert "videos cannot be decoded here" in caplog.text
        for path, body in (
            ("/v1/encode", {"videos": [video]}),
            ("/v1/embeddings", {"input": [video], "modality": "video"}),
        ):
            r = c.post(path, json=body)
            error = r.json()["error"]
            assert (r.status_code, error["code"], error["type"]) == (501, "videos_unavailable", "server_error"), r.text
            assert "pip install 'vitserve[video]'" in error["message"]
        assert c.get("/v1/models").json()["data"][0]["capabilities"] == {"images": True, "videos": False}
        assert c.get("/stats").json()["videos"]["available"] is False
        assert c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[0])]}).status_code == 200


def test_videos_are_counted_as_videos(encoders):
    """A video of 4 slices is not 4 images: it counts its slices, frames and seconds, and its decode is observed in
    vitserve_decode_seconds as an image's is; an image beside it counts one image."""
    pytest.importorskip("av")
    from videos import make_video

    clip = make_video(24, 12, 96, 64)  # 2 s
    with client_for(encoders["tiny-qwen3-vl"]) as c:

        def sample(name, **labels):
            return c.app.state.engine.metrics.registry.get_sample_value(name, labels) or 0.0

        before = [sample("vitserve_images_total", device="cpu"), sample("vitserve_decode_seconds_count")]
        r = c.post(
            "/v1/encode",
            json={
                "videos": ["data:video/mp4;base64," + base64.b64encode(clip).decode()],
                "images": [data_uri(IMAGES[0])],
                "num_frames": 8,
            },
        )
        assert r.status_code == 200, r.text
        assert [item["grid_thw"][0] for item in r.json()["data"]][1] == 4
        assert sample("vitserve_images_total", device="cpu") == before[0] + 1
        assert sample("vitserve_video_slices_total", device="cpu") == 4
        assert sample("vitserve_video_frames_total") == 8 and sample("vitserve_video_seconds_total") == 2.0
        assert sample("vitserve_videos_decoded_total", decoder="cpu") == 1
        assert sample("vitserve_decode_seconds_count") == before[1] + 2  # the image and the video
