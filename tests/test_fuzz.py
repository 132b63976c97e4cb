"""Property-based fuzzing of the OpenAPI schema (schemathesis + hypothesis) against a real server: nothing a client
sends gives a 5xx, with or without the API key. Bounded (25 examples per operation) so it fits CI."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow
schemathesis = pytest.importorskip("schemathesis")
from helpers import STARTUP_S  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

from vitserve.service.entry.launch import start_server  # noqa: E402

KEY = {"authorization": "Bearer fuzz-key"}


def test_no_server_errors_from_any_generated_request():
    proc, url = start_server(
        "--model",
        "tiny-qwen2.5-vl",
        "--load-format",
        "dummy",
        "--max-batch-wait-ms",
        "1",
        "--api-key",
        "fuzz-key",
        timeout=STARTUP_S,
        capture_log=True,
    )
    try:
        schema = schemathesis.openapi.from_url(url + "/openapi.json", headers=KEY)
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.path for op in operations} >= {"/v1/embeddings", "/v1/encode", "/health", "/ready", "/stats"}
        seen = []
        for operation in operations:

            @given(case=operation.as_strategy())
            @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            def check(case):
                for headers in (KEY, {}):
                    response = case.call(headers=headers, timeout=30)
                    seen.append(response.status_code)
                    assert response.status_code < 500, (
                        case.method,
                        case.path,
                        response.status_code,
                        response.text[:300],
                    )

            check()
        assert len(seen) >= 50 and any(400 <= s < 500 for s in seen)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    proc.log_reader.join(10)
    assert "Traceback" not in "".join(proc.log)
