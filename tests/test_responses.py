"""The answers' models (service/api/responses.py): /openapi.json documents every route's answer, the real answers
validate against them, a mixed request's items merge in the request's order, and the edge's own domain errors keep
their statuses."""

from __future__ import annotations

import pytest
import torch
from helpers import IMAGES, client_for, data_uri

from vitserve.encoder.features import Features
from vitserve.service.api import http_errors, responses
from vitserve.service.api.encoding import merged
from vitserve.service.ground import errors
from vitserve.service.pipeline.engine import Encoded

ROUTES = {
    ("/v1/embeddings", "post"),
    ("/v1/encode", "post"),
    ("/v1/chat/completions", "post"),
    ("/encode", "post"),
    ("/scheduler_receive_url", "post"),
    ("/v1/models", "get"),
    ("/health", "get"),
    ("/ready", "get"),
    ("/stats", "get"),
    ("/metrics", "get"),
}


@pytest.fixture(scope="module")
def client(encoders):
    with client_for(encoders["tiny-qwen3-vl"]) as c:
        yield c


def test_openapi_documents_every_answer(client):
    spec = client.get("/openapi.json").json()
    assert {(path, method) for path, ops in spec["paths"].items() for method in ops} == ROUTES
    for path, method in ROUTES:
        content = spec["paths"][path][method]["responses"]["200"]["content"]
        assert all(entry["schema"] for entry in content.values()), (path, method)  # not FastAPI's empty `{}`
    assert spec["paths"]["/v1/encode"]["post"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/EncodeAnswer"
    }
    assert "application/octet-stream" in spec["paths"]["/v1/encode"]["post"]["responses"]["200"]["content"]
    assert spec["paths"]["/v1/embeddings"]["post"]["responses"]["404"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorAnswer"
    }


def test_answers_validate_against_their_models(client):
    responses.ModelList.model_validate(client.get("/v1/models").json())
    responses.Health.model_validate(client.get("/health").json())
    responses.Readiness.model_validate(client.get("/ready").json())
    responses.Stats.model_validate(client.get("/stats").json())
    inputs = [data_uri(x) for x in IMAGES[:2]]
    for body in (
        {"input": inputs},
        {"input": inputs, "pooling": "none"},
        {"input": inputs, "pooling": "none", "encoding_format": "base64"},
    ):
        answer = client.post("/v1/embeddings", json=body)
        assert answer.status_code == 200
        responses.EmbeddingAnswer.model_validate(answer.json())
    answer = client.post("/v1/encode", json={"images": inputs, "dtype": "bfloat16"})
    assert answer.status_code == 200
    assert len(responses.EncodeAnswer.model_validate(answer.json()).data[0].deepstack) > 0
    missing = client.post("/v1/encode", json={"images": inputs, "model": "another"})
    assert missing.status_code == 404
    assert responses.ErrorAnswer.model_validate(missing.json()).error.code == "model_not_found"
    off = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert off.status_code == 404 and off.json()["error"]["code"] == "encoder_tier_off"
    with pytest.raises(Exception):  # the models do check: an answer of another shape fails
        responses.EncodeAnswer.model_validate(client.get("/v1/models").json())


def part(n: int, start: int, video: bool) -> Encoded:
    return Encoded(
        [
            Features(
                torch.full((1, 1), float(start + i)),
                [],
                [1, 1, start + i],
                {"fps": float(start + i)} if video else None,
            )
            for i in range(n)
        ],
        0.1 * (1 + video),
        0.2,
        0.3 * (2 - video),
        0 if video else 1,
    )


def test_a_mixed_answer_keeps_the_requests_order():
    images, videos = part(2, 0, False), part(2, 10, True)
    result = merged(images, videos, [True, False, False, True])
    assert [o.grid[2] for o in result.outputs] == [10, 0, 1, 11]
    assert [o.tokens.item() for o in result.outputs] == [10, 0, 1, 11]
    assert [o.timing for o in result.outputs] == [{"fps": 10.0}, None, None, {"fps": 11.0}]
    assert (result.decode_s, result.inference_s, result.cache_hits) == (0.2, 0.6, 1)
    only_videos = merged(None, videos, [True, True])
    assert all(a is b for a, b in zip(only_videos.outputs, videos.outputs, strict=True))
    assert only_videos.cache_hits == 0


def test_the_edges_domain_errors_keep_their_statuses():
    assert http_errors.ServiceError.of(errors.NotServed("x", "model_not_found")).status == 404
    assert http_errors.ServiceError.of(errors.Unsupported("x", "videos_unavailable")).status == 501
    assert errors.ErrorRecord.of(errors.NotServed("x", "encoder_tier_off")).error().code == "encoder_tier_off"
