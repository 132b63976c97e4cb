"""A device served by a process of its own: answers equal the in-process encoder's, batches and outputs cross
through the spool (or the pipe without one), and a device process that dies or cannot load fails the server."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from fastapi.testclient import TestClient
from helpers import BF16_REL_ERR, IMAGES, b64_tensor, data_uri, images_in, rel_err, wait_until

from vitserve.service.devices import prestart
from vitserve.service.entry.app import create_app
from vitserve.service.ground.settings import Settings


@pytest.mark.slow
def test_devices_in_processes_of_their_own(encoders, tmp_path):
    """--device-processes: each device loads and serves in its own process; batches and outputs cross through the
    spool. Answers equal the in-process encoder's (pooled, tokens, Qwen3 deepstack), both devices serve, their
    runner stats (of the configured budgets and attention backend) reach /stats and /metrics, nothing stays in the
    spool, answers stay right through the pipe when the spool goes away, and a device process that dies fails its
    batch with a 503 and turns /health failed."""
    enc = encoders["tiny-qwen3-vl"]
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    settings = Settings.of(
        model="tiny-qwen3-vl",
        load_format="dummy",
        devices="cpu,cpu",
        device_processes=True,
        spool_dir=str(spool_dir),
        max_batch_wait_ms=1,
        max_batch_tokens=256,
        decode_workers=2,
        budgets="256,1024",
        attention_backend="sdpa",
        cache_bytes=0,
    )
    direct = enc.encode(IMAGES)
    with TestClient(create_app(settings)) as c:
        wait_until(lambda: c.get("/ready").status_code == 200, 120, "the device processes ready")
        with ThreadPoolExecutor(8) as pool:
            pooled = list(
                pool.map(lambda i: c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[i % 3])]}), range(16))
            )
        for i, r in enumerate(pooled):
            assert r.status_code == 200
            assert rel_err(torch.tensor(r.json()["data"][0]["embedding"]), direct[i % 3].embeddings.mean(0)) <= 1e-6

        def check_native():
            native = c.post("/v1/encode", json={"images": [data_uri(x) for x in IMAGES]}).json()
            for item, want in zip(native["data"], direct):
                assert rel_err(b64_tensor(item["embeddings"], item["shape"]), want.embeddings) <= 1e-6
                assert len(item["deepstack"]) == len(want.deepstack)
                for d, w in zip(item["deepstack"], want.deepstack):
                    assert rel_err(b64_tensor(d, item["shape"]), w) <= 1e-6

        check_native()
        stats = c.get("/stats").json()
        assert set(stats["devices"]) == {"cpu#0", "cpu#1"} and stats["family"] == "qwen3_vl"
        for d in stats["devices"].values():
            assert d["batches"] > 0 and d["runner"]["eager_runs"] > 0 and d["runner"]["budgets"] == {}, d
            assert d["runner"]["attention"] == {"full": "sdpa"} and d["runner"]["mode"] == "eager"
        metrics = c.get("/metrics").text  # every configured budget, used or not; and each device's eager runs
        assert 'vitserve_graph_replays_total{budget="256",device="cpu#1"}' in metrics
        assert 'vitserve_graph_replays_total{budget="1024",device="cpu#0"}' in metrics
        assert 'vitserve_eager_runs_total{device="cpu#1"}' in metrics
        wait_until(lambda: images_in(spool_dir) == [], 5, "the spool empty (answers' files go once unmapped)")
        for lock in spool_dir.iterdir():  # the server's lock file
            lock.unlink()
        spool_dir.rmdir()  # no spool any more: pixels and outputs cross through the pipes
        for _ in range(4):  # both devices, whichever takes each batch
            check_native()
        device = c.app.state.engine.backend.workers[0].device
        os.kill(device.pid, signal.SIGKILL)
        wait_until(lambda: not device.process.is_alive(), 10, "the device process to die")
        errors = []
        for _ in range(40):  # the live device may take some: both take from one queue
            r = c.post("/v1/embeddings", json={"input": [data_uri(IMAGES[0])]})
            if r.status_code != 200:
                errors.append((r.status_code, r.json()["error"]["code"]))
                break
        assert errors == [(503, "device_lost")]
        assert c.get("/health").json()["status"] == "failed" and c.get("/ready").status_code == 503


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA (the device must fail to load)")
def test_a_device_process_that_cannot_load_fails_the_server(tmp_path):
    """The device process's load error reaches /health, and the server's own process is left clean."""
    settings = Settings.of(
        model="tiny-qwen2.5-vl",
        load_format="dummy",
        devices="cuda:0",
        dtype="float32",
        device_processes=True,
        spool_dir=str(tmp_path),
    )
    with TestClient(create_app(settings)) as c:
        wait_until(lambda: c.get("/health").status_code != 200, 120, "the load to fail")
        health = c.get("/health")
        assert health.status_code == 503 and "CUDA is not available" in health.json()["error"]
        assert c.get("/ready").json()["status"] == "failed"


@pytest.mark.parametrize(
    "flags, gpu_driver, expected",
    [
        (dict(device="cuda:0"), False, 1),  # the default on a GPU: a process per device
        (dict(devices="cuda:0,cuda:1"), False, 2),
        (dict(device="auto"), True, 1),
        (dict(device="auto"), False, 0),  # auto may be the CPU
        (dict(device="cpu"), True, 0),  # CPU devices are served from threads by default
        (dict(devices="cpu,cpu", device_processes=True), False, 2),
        (dict(device="cuda:0", device_processes=False), True, 0),
        (dict(devices="all"), True, 0),  # only CUDA can count them
    ],
)
def test_device_processes_foretold_from_the_flags(flags, gpu_driver, expected):
    """`vitserve serve` starts, before it imports torch, as many device processes as the flags say it will serve:
    one too many is an interpreter importing torch for nothing, one too few a device started late."""
    settings = Settings.of(model="tiny-qwen3-vl", load_format="dummy", **flags)
    assert prestart.expected_devices(settings, gpu_driver) == expected


@pytest.mark.slow
@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda:0", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_a_device_process_started_ahead_serves_its_device(encoders, tmp_path, device):
    """Device processes started before the server knows its devices (on a GPU, each makes its CUDA context while it
    waits): the device takes one (the same process, now serving: answers equal the in-process encoder's, on a GPU
    within bfloat16's tolerance of this CPU reference) and the one it does not need exits."""
    ahead = Settings.of(model="tiny-qwen3-vl", load_format="dummy", devices=f"{device},{device}", device_processes=True)
    prestart.start(ahead)
    hosts = list(prestart._waiting)
    try:
        assert len(hosts) == 2 and all(h.process.is_alive() for h in hosts)
        settings = Settings.of(
            model="tiny-qwen3-vl",
            load_format="dummy",
            device=device,
            device_processes=True,
            spool_dir=str(tmp_path),
            decode_workers=1,
            attention_backend="sdpa",
            cache_bytes=0,
        )
        with TestClient(create_app(settings)) as c:
            wait_until(lambda: c.get("/ready").status_code == 200, 120, "the device process ready")
            assert c.app.state.engine.backend.workers[0].device.process is hosts[0].process
            assert not hosts[1].process.is_alive() and prestart._waiting == []  # the one no device took is gone
            r = c.post("/v1/encode", json={"images": [data_uri(IMAGES[0])]})
            assert r.status_code == 200
            item, want = r.json()["data"][0], encoders["tiny-qwen3-vl"].encode(IMAGES[:1])[0]
            tolerance = 1e-6 if device == "cpu" else BF16_REL_ERR
            assert rel_err(b64_tensor(item["embeddings"], item["shape"]), want.embeddings) <= tolerance
    finally:
        prestart.release()
        for h in hosts:
            if h.process.is_alive():
                h.process.kill()
