"""The engine behind the app: batching requests together without letting one's failure reach another, dropping
the images of clients that left, several devices on one queue, and which devices get a process of their own."""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from fastapi.testclient import TestClient
from helpers import IMAGES, client_for, data_uri, rel_err, until, wait_until

from vitserve.encoder import VisionEncoder
from vitserve.encoder.media import MediaBytes
from vitserve.service.entry.app import create_app
from vitserve.service.ground.errors import ClientDisconnected
from vitserve.service.ground.settings import Settings
from vitserve.service.pipeline.engine import Engine, State


def b64(data: bytes) -> MediaBytes:
    import base64

    return MediaBytes(base64.b64encode(data).decode())


def test_bad_request_does_not_fail_its_batch_neighbours(encoders, monkeypatch):
    """Requests sent while the device is busy (its first launch holds until each good image is in it or queued), so
    that those queue for one batch: the bad ones fail alone, the good ones get the right numbers."""
    enc = encoders["tiny-qwen2.5-vl"]
    direct = enc.encode(IMAGES)
    real_launch, calls = enc.runner.launch_images, []

    def slow_first(images, lut, mean_pooling=None, slice_lut=None, float32=None):
        calls.append(len(images))
        if len(calls) == 1:  # the device is busy until every good image is in this batch or waits for it
            wait_until(
                lambda: len(images) + len(c.app.state.engine.backend.queue) >= len(IMAGES), 30, "the good images queued"
            )
        return real_launch(images, lut, mean_pooling, slice_lut, float32)

    monkeypatch.setattr(enc.runner, "launch_images", slow_first)
    with client_for(enc, max_batch_wait_ms=300) as c:
        bodies = [{"input": [data_uri(x)]} for x in IMAGES] + [
            {"input": ["%%%"]},
            {"input": [data_uri(b"GIF89a broken")]},
        ]
        with ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda b: c.post("/v1/embeddings", json=b), bodies))
        assert [r.status_code for r in replies] == [200, 200, 200, 400, 400]
        for r, d in zip(replies, direct):
            assert rel_err(torch.tensor(r.json()["data"][0]["embedding"]), d.embeddings.mean(0)) <= 1e-6
        hist = c.get("/stats").json()["batch_size_histogram"]
        assert any(int(k) >= 2 for k in hist), hist  # the good ones were batched together


def test_batch_failure_fails_only_that_batch(encoders, monkeypatch, caplog):
    enc = encoders["tiny-qwen2.5-vl"]
    with client_for(enc) as c:
        real_launch = enc.runner.launch_images
        calls = []

        def faulty(images, lut, mean_pooling=None, slice_lut=None, float32=None):
            calls.append(len(images))
            if len(calls) == 1:
                raise RuntimeError("injected fault")
            return real_launch(images, lut, mean_pooling, slice_lut, float32)

        monkeypatch.setattr(enc.runner, "launch_images", faulty)
        with caplog.at_level(logging.ERROR, logger="vitserve.worker"):
            r = c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[0])]})
        assert r.status_code == 500 and r.json()["error"]["code"] == "inference_failed"
        assert "injected fault" not in r.text  # the model's own text stays in the log
        assert any("injected fault" in str(rec.exc_info[1]) for rec in caplog.records if rec.exc_info)
        assert c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[0])]}).status_code == 200


def test_out_of_memory_is_507_and_the_next_batch_is_served(encoders, monkeypatch):
    enc = encoders["tiny-qwen2.5-vl"]
    with client_for(enc) as c:
        real_collect, calls = enc.runner.collect, []

        def runs_out(launch):
            calls.append(1)
            if len(calls) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return real_collect(launch)

        monkeypatch.setattr(enc.runner, "collect", runs_out)
        r = c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[2])]})
        assert r.status_code == 507 and r.json()["error"]["code"] == "out_of_memory"
        assert c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[2])]}).status_code == 200


def test_disconnected_client_is_dropped_from_the_queue(encoders):
    enc = encoders["tiny-qwen2.5-vl"]

    async def scenario():
        engine = Engine(Settings.of(model=enc.name, cache_bytes=0), encoders=enc)
        await engine.start()
        device, release, held = engine.backend.workers[0].device, threading.Event(), threading.Event()
        launch = device.launch

        def held_launch(batch):  # the device stays busy with the first batch until released
            held.set()
            release.wait(10)
            return launch(batch)

        device.launch = held_launch
        first = asyncio.ensure_future(engine.encode([b64(IMAGES[2])]))
        await until(held.is_set, what="the first batch launching")
        gone = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(engine.encode([b64(IMAGES[0])], disconnected=gone))
        decoded = "vitserve_preprocess_seconds_count"  # observed just before the image is queued, in the same step
        await until(lambda: engine.metrics.registry.get_sample_value(decoded) == 2, what="the image queued")
        gone.set_result(None)  # the client went away while its image waited behind the busy device
        with pytest.raises(ClientDisconnected):
            await task
        device.launch = launch
        release.set()
        await first
        kept = await engine.encode([b64(IMAGES[1])])
        await engine.stop()
        return engine, kept

    engine, kept = asyncio.run(scenario())
    dropped = engine.metrics.registry.get_sample_value("vitserve_dropped_images_total")
    assert dropped == 1 and engine.metrics.registry.get_sample_value("vitserve_images_total", {"device": "cpu"}) == 2
    assert kept.outputs[0].tokens.shape[0] == enc.encode([IMAGES[1]])[0].num_tokens


def test_several_devices_share_the_load(encoders):
    """Two replicas (here both on the CPU) take batches from the one queue: both serve, stats and metrics say which
    did what, and every answer is right."""
    enc = encoders["tiny-qwen2.5-vl"]
    twin = VisionEncoder.from_pretrained("tiny-qwen2.5-vl", load_format="dummy")
    settings = Settings.of(
        model=enc.name, load_format="dummy", max_batch_wait_ms=1, max_batch_tokens=256, cache_bytes=0
    )
    direct = [r.embeddings.mean(0) for r in enc.encode(IMAGES)]
    with TestClient(create_app(settings, Engine(settings, encoders=[enc, twin]))) as c:
        with ThreadPoolExecutor(12) as pool:
            replies = list(
                pool.map(lambda i: (i, c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[i % 3])]})), range(24))
            )
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
        assert 'vitserve_eager_runs_total{device="cpu#1"}' in metrics


@pytest.mark.parametrize(
    "devices, flag, expected",
    [
        ("cpu", None, False),
        ("cpu,cpu", None, False),
        ("cuda:0", None, True),
        ("cuda:0,cuda:1", None, True),
        ("cuda:0", False, False),
        ("cpu,cpu", True, True),
    ],
)
def test_device_processes_default(devices, flag, expected):
    """A process per device by default on CUDA, one GPU too (measured faster there than a thread); threads on CPU;
    the flag wins both ways. Only decided here: nothing is loaded or spawned."""
    settings = Settings.of(
        model="tiny-qwen3-vl", load_format="dummy", devices=devices, device_processes=flag, decode_processes=False
    )
    assert Engine(settings).device_processes is expected


def test_a_model_that_does_not_load_fails_the_engine():
    """A load error turns the engine FAILED with the reason (what /health reports and the CLI exits on), and nothing
    is admitted."""

    async def scenario():
        engine = Engine(Settings.of(model="/no/such/checkpoint", decode_processes=False))
        await engine.start()
        await until(lambda: engine.state is State.FAILED, what="the load to fail")
        try:
            with pytest.raises(Exception, match="server failed"):
                with engine.admitted():
                    pass
            return engine.error
        finally:
            await engine.stop()

    assert "model load failed" in asyncio.run(scenario())
