"""Helpers the tests share (no fixtures: those are in conftest.py): images, payload decoding, errors, waiting."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import torch
from fastapi.testclient import TestClient
from PIL import Image


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# `vitserve serve` runs on cuda:0 in bfloat16 where CUDA is present (`--device auto`, `--dtype auto`): a test that
# compares such a server with the CPU library's float32 answer holds it to the bf16 bound; where the server runs on
# the CPU, as the library does, the two are equal.
SERVER_ON_GPU = torch.cuda.is_available()
SERVED_DEVICE = "cuda:0" if SERVER_ON_GPU else "cpu"  # the `device` label of such a server's series
SERVED_DTYPE = torch.bfloat16 if SERVER_ON_GPU else torch.float32  # its dtype (what the encoder tiers hand on)
BF16_REL_ERR = 2e-2
SERVED_REL_ERR = BF16_REL_ERR if SERVER_ON_GPU else 1e-5  # such a server (or `vitserve encode`) vs a float32 reference
# How long a test's `vitserve serve` may take to answer `/ready`: its imports, the tower's build and, on a GPU, its
# graph capture, on a machine that runs several test files at once (the GPU suite runs 8; one such start took over
# 60 s on the H200). A server that exits before it is ready fails at once whatever this is.
STARTUP_S = 180


def assert_served(served: torch.Tensor, reference: torch.Tensor, exact: bool = True) -> None:
    """A server's answer against the CPU library's: bit for bit (`exact`) or within 1e-5 on the CPU; within the bf16
    bound where the server runs on a GPU."""
    served, reference = served.float(), reference.float()
    assert served.shape == reference.shape, (served.shape, reference.shape)
    if exact and not SERVER_ON_GPU:
        assert torch.equal(served, reference), rel_err(served, reference)
    else:
        assert rel_err(served, reference) <= SERVED_REL_ERR, rel_err(served, reference)


def png(w: int, h: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, fmt)
    return buf.getvalue()


def data_uri(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


IMAGES = [png(120, 90, 1), png(64, 200, 2), png(300, 300, 3)]


def b64_floats(s: str, dtype="<f4") -> np.ndarray:
    return np.frombuffer(base64.b64decode(s), dtype=dtype)


def b64_tensor(s: str, shape, dtype="<f4") -> torch.Tensor:
    return torch.from_numpy(b64_floats(s, dtype).reshape(shape).astype(np.float32))


def b64_bf16(s: str, shape) -> torch.Tensor:
    """A bfloat16 answer's base64 as the tensor (numpy has no bfloat16: its raw 16-bit words)."""
    return torch.from_numpy(b64_floats(s, "<i2").copy()).view(torch.bfloat16).reshape(shape)


def client_for(encoder, **overrides) -> TestClient:
    """The app over an already loaded encoder (`Settings` overrides as keywords)."""
    from vitserve.service.entry.app import create_app
    from vitserve.service.ground.settings import Settings
    from vitserve.service.pipeline.engine import Engine

    settings = Settings.of(model=encoder.name, load_format="dummy", **overrides)
    return TestClient(create_app(settings, Engine(settings, encoders=encoder)))


def images_in(directory) -> list[str]:
    """The spool files in `directory` but servers' lock files."""
    return [name for name in os.listdir(directory) if not name.endswith("lock")]


def children(pid: int) -> list[int]:
    """A process's children, whichever of its threads started them (a thread that ends while they are read is
    skipped: its children, if any, are its process's other threads')."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    return out


def running(pid: int) -> bool:
    """Whether a process is there and not a zombie (one that exits while it is looked at is not running)."""
    try:
        return b") Z" not in Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:  # FileNotFoundError, or ProcessLookupError once it is gone
        return False


def wait_until(condition, timeout: float = 30.0, what: str = "the condition") -> None:
    """Block until `condition()` holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        time.sleep(0.01)


async def until(condition, timeout: float = 30.0, what: str = "the condition") -> None:
    """On an event loop: wait until `condition()` holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        await asyncio.sleep(0.002)


def posts(url: str, bodies: list[dict], connections: int = 8, path: str = "/v1/embeddings") -> list[httpx.Response]:
    """Each body to `path` on a new connection, `connections` at once (connections open at once reach several
    front ends: each goes to whichever accepts it first)."""
    with ThreadPoolExecutor(connections) as pool:
        return list(pool.map(lambda b: httpx.post(url + path, json=b, timeout=120), bodies))


def serving(*flags: str, timeout: float = STARTUP_S):
    """A fixture's body: a `vitserve serve` subprocess (proc, url) while the tests use it; stopped after, and its log
    free of tracebacks."""
    from vitserve.service.entry.launch import start_server

    proc, url = start_server(*flags, timeout=timeout, capture_log=True)
    yield proc, url
    proc.terminate()
    proc.wait(timeout=30)
    proc.log_reader.join(10)
    assert "Traceback" not in "".join(proc.log)
