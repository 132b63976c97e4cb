"""The answer builders (service/outputs.py) and the protocol's send (service/http.py) on their own: bit-identical to
torch's own conversions and h11's own framing, without the copies those make."""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from types import SimpleNamespace

import h11
import numpy as np
import pytest
import torch
from safetensors.torch import load as safetensors_load
from starlette.requests import Request

from vitserve.encoder.features import SERIAL_ELEMENTS, Features, converted
from vitserve.service.api.encoding import answer
from vitserve.service.api.http import CountedConnection
from vitserve.service.api.outputs import (
    OFF_LOOP_BYTES,
    OUTPUT_DTYPES,
    PartsResponse,
    answer_bytes,
    b64,
    laid_out,
    raw_bytes,
    render_json,
    safetensors_parts,
    work_bytes,
)
from vitserve.service.ground.metrics import Metrics
from vitserve.service.pipeline.encoded import Encoded

DTYPES = list(OUTPUT_DTYPES.values())
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def awkward(dtype: torch.dtype, rows: int = 7, width: int = 5000) -> torch.Tensor:
    """Values a tower could give, and the edges of each dtype: NaN, infinities, signed zeros, subnormals of float32
    and float16, values that round on narrowing; over several `SERIAL_ELEMENTS` slices and a remainder."""
    t = torch.randn(rows, width, generator=torch.Generator().manual_seed(7)) * 300
    flat = t.view(-1)
    flat[:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 3e-6, 65520.0, 1 + 2**-9])
    flat[-3:] = torch.tensor([float("nan"), 1e-42, -1e-5])
    return t.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def one_thread_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t.to(dtype)` by ATen on one thread. (Over several, a NaN's payload depends on where the threads' ranges
    split: ATen's scalar and vector paths quiet a float16 NaN differently. Every other value converts the same.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return t.to(dtype)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("source", DTYPES)
@pytest.mark.parametrize("target", DTYPES)
def test_converted_is_tensor_to_bit_for_bit(source, target):
    """One thread's slices convert as ATen's whole-tensor `to` does (a dropped or doubled slice, a rounding of its
    own, would show), and a tensor already in the dtype is answered as it is: no copy."""
    t = awkward(source)
    assert t.numel() > 2 * SERIAL_ELEMENTS and t.numel() % SERIAL_ELEMENTS
    out = converted(t, target)
    assert same_bits(out, one_thread_to(t, target))
    numbers = ~t.isnan()
    assert torch.equal(out.isnan(), ~numbers) and same_bits(out[numbers], t.to(target)[numbers])
    assert (out is t) == (source == target)


def test_raw_bytes_are_a_view_of_the_tensor():
    t = awkward(torch.bfloat16)
    view = raw_bytes(t)
    assert len(view) == t.nbytes and np.frombuffer(view, np.uint8).ctypes.data == t.data_ptr()
    assert bytes(view) == t.view(torch.int16).numpy().astype("<i2").tobytes()


@pytest.mark.parametrize("target", DTYPES)
def test_safetensors_parts_are_views_where_no_conversion_is_needed(target):
    """The body is a safetensors file whose tensors are `to(dtype)` bit for bit; a tensor already in the answer's
    dtype goes out as its own memory (a `.tobytes()` copy would show as another address), and a tensor shared by
    two items is a whole piece of each."""
    shared = awkward(torch.bfloat16, 3, 40)
    deep = [awkward(torch.bfloat16, 3, 40) * 2, awkward(torch.bfloat16, 3, 40) * 3]
    other = awkward(torch.bfloat16, 5, 40)
    outputs = [(shared, deep), (other, []), (shared, deep)]
    name = str(target).removeprefix("torch.")
    parts = safetensors_parts([Features(*output) for output in outputs], name, {"dtype": name})
    tensors = safetensors_load(b"".join(parts))
    for i, (embeddings, deepstack) in enumerate(outputs):
        assert same_bits(tensors[f"images.{i}.embeddings"], one_thread_to(embeddings, target))
        for j, d in enumerate(deepstack):
            assert same_bits(tensors[f"images.{i}.deepstack.{j}"], one_thread_to(d, target))
    addresses = [np.frombuffer(p, np.uint8).ctypes.data for p in parts[1:]]
    if target == torch.bfloat16:
        assert addresses[:3] == [t.data_ptr() for t in (shared, *deep)] == addresses[4:]
    else:
        assert shared.data_ptr() not in addresses


@pytest.mark.parametrize("target", DTYPES)
def test_base64_is_of_the_converted_tensors_raw_bytes(target):
    t = awkward(torch.bfloat16, 3, 100)
    want = converted(t, target)
    (piece,) = [p for p in render_json({"a": [b64(want)]}) if len(p) > 100]
    assert piece == base64.b64encode(want.view(BITS[target]).numpy().tobytes())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("layout", ["tokens", "vllm"])
@pytest.mark.parametrize("raw", [True, False])
@pytest.mark.parametrize("deep", [True, False])
def test_work_bytes_are_none_exactly_where_the_answer_is_views_of_the_tensors(dtype, layout, raw, deep):
    """`work_bytes` says 0 only for an answer whose body pieces are the tensors' own memory (safetensors in their
    dtype, not packed); every conversion, packing (vLLM's layout of a deepstack tower) or base64 counts all the
    tensor bytes: those builds run in a thread, the others on the loop."""
    tokens = awkward(torch.bfloat16, 3, 40)
    items = [Features(tokens, [awkward(torch.bfloat16, 3, 40) * 2] if deep else [], (1, 2, 6))]
    work = work_bytes(items, dtype, layout, raw)
    views = raw and dtype == "bfloat16" and not (layout == "vllm" and deep)
    assert work == (0 if views else answer_bytes(items))
    if raw:
        parts = safetensors_parts([laid_out(item, layout) for item in items], dtype, {})
        own = {t.data_ptr() for item in items for t in (item.tokens, *item.deepstack)}
        assert all(np.frombuffer(p, np.uint8).ctypes.data in own for p in parts[1:]) == views


@pytest.mark.parametrize("work", [0, OFF_LOOP_BYTES - 1, OFF_LOOP_BYTES, None])
def test_an_answer_is_built_in_a_thread_only_where_its_build_works_over_off_loop_bytes(work):
    """A 16 MB answer whose build touches none of its bytes (work 0) is built on the event loop's thread, without two
    hand-offs to and from a thread; one that converts or encodes OFF_LOOP_BYTES or more (by default all of its
    bytes) in another thread, so that the loop never waits on megabytes of conversion."""
    served = SimpleNamespace(engine=SimpleNamespace(metrics=Metrics()))
    request = Request({"type": "http", "method": "POST", "path": "/v1/encode", "headers": []})
    request.state.arrived = time.perf_counter()
    features = Features(torch.zeros(1024, 4096), [], (1, 32, 128))
    result = Encoded([features], 0.0, 0.0, 0.0, 1)
    threads = []

    def build():
        threads.append(threading.current_thread())
        return PartsResponse([b"{}"])

    async def run():
        response = await answer(served, request, result, build, work)
        return response, threading.current_thread()

    response, loop_thread = asyncio.run(run())
    assert answer_bytes(result.outputs) >= 16 * 2**20 and response.headers["x-cache-hits"] == "1"
    in_thread = work is None or work >= OFF_LOOP_BYTES
    assert (threads[0] is not loop_thread) == in_thread


def _sending(conn: h11.Connection | CountedConnection, events: list) -> list:
    return [conn.send(e) for e in events]


class _Protocol:
    def __init__(self):
        self.responses = []

    def sending(self, response):
        self.responses.append(response)


def _server(request: bytes) -> h11.Connection:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(request)
    conn.next_event(), conn.next_event()
    return conn


@pytest.mark.parametrize("length", [True, False])
def test_the_protocols_send_frames_as_h11_and_passes_body_pieces_through(length):
    """`CountedConnection.send` writes what h11's `send` writes (a Content-Length body, and a chunked one), and a
    Content-Length body's piece is the very object sent (h11 itself joins it into new bytes: a copy of a memoryview)."""
    piece = memoryview(np.arange(3000, dtype=np.uint8))
    headers = [(b"content-length", b"6000")] if length else []
    events = [
        h11.Response(status_code=200, headers=headers),
        h11.Data(data=piece),
        h11.Data(data=b"x" * 3000),
        h11.EndOfMessage(),
    ]
    request = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    protocol = _Protocol()
    ours = _sending(CountedConnection(_server(request), protocol), events)
    theirs = _sending(_server(request), events)
    assert [bytes(x) for x in ours] == [bytes(x) for x in theirs]
    assert (ours[1] is piece) == length and len(protocol.responses) == 1
