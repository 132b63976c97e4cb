"""vitserve as SGLang's encoder server (service/sglang_tier.py and its sglang_* modules): a real server takes
/encode and /scheduler_receive_url as a --language-only SGLang server sends them, and a real ZMQ PULL socket here
stands where SGLang's scheduler rank listens. The messages are decoded without sglang, by an unpickler that allows
only what SGLang 0.5.23's receiver allows (its two classes mapped to stand-ins here); SGLang's own receiver decodes
them in tests/engine_contracts/sglang_receiver.py."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import enum
import io
import pickle
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from helpers import IMAGES, SERVED_DTYPE, client_for, data_uri, png, serving, wait_until

from vitserve.encoder.features import Features
from vitserve.service.api.http_errors import ServiceError
from vitserve.service.ground.errors import EngineError
from vitserve.service.pipeline.engine import Encoded
from vitserve.service.tiers.sglang_addresses import ReceiverNetworks, endpoint, receiver_address
from vitserve.service.tiers.sglang_frames import embedding_frame, message
from vitserve.service.tiers.sglang_pairing import Pairing
from vitserve.service.tiers.sglang_schemas import EncodeCall, Registration

zmq = pytest.importorskip("zmq")


class SGLangEmbeddingData:
    """Where SGLang's receiver has its EmbeddingData."""


class SGLangModality(enum.Enum):
    IMAGE = 1
    VIDEO = 2
    AUDIO = 3


STAND_INS = {
    ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData"): SGLangEmbeddingData,
    ("sglang.srt.managers.schedule_batch", "Modality"): SGLangModality,
    ("sglang.srt.multimodal.modality", "Modality"): SGLangModality,
}
# the entries of SGLang 0.5.23's SafeUnpickler.ALLOWED_GLOBALS (sglang.srt.utils.common) that tensors and plain
# values need; its list is exact: any other global is refused
ALLOWED = {
    ("builtins", n) for n in ("bool", "bytearray", "bytes", "dict", "float", "int", "list", "set", "str", "tuple")
} | {
    ("collections", "OrderedDict"),
    ("copyreg", "__newobj__"),
    ("torch", "Size"),
    ("torch", "dtype"),
    ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch", "UntypedStorage"),
    ("torch", "LongStorage"),
    ("torch", "FloatStorage"),
    *(("torch", n) for n in ("bfloat16", "float16", "float32", "float64", "int64", "int32", "float", "half", "long")),
}


class SGLangUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in STAND_INS:
            return STAND_INS[module, name]
        if (module, name) == ("torch.storage", "_load_from_bytes"):  # SGLang's safe stand-in for torch's
            return lambda data: torch.load(io.BytesIO(data), weights_only=True)
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name})")


def status(error: EngineError) -> int:
    """The HTTP status a client is answered for a tier's domain error (the edge's one table)."""
    return ServiceError.of(error).status


def decode(frames: list) -> SGLangEmbeddingData:
    """A message as SGLang's receiver reads it: the pickle, then (unless it is an error) the tensor from frame 1's
    bytes, which must be exactly `shape` in `dtype`."""
    meta = SGLangUnpickler(io.BytesIO(bytes(frames[0]))).load()
    assert isinstance(meta, SGLangEmbeddingData)
    if meta.error_msg is None:
        assert len(frames) == 2 and len(frames[1]) == int(np.prod(meta.shape)) * meta.dtype.itemsize
        meta.embedding = torch.frombuffer(bytearray(frames[1]), dtype=meta.dtype).reshape(meta.shape)
    return meta


def fake_result(grids, widths=(8,), videos=None, dtype=torch.float32, seed=0) -> Encoded:
    """An Encoded of items with the given grids (merge 2x2), each with `len(widths) - 1` deepstack levels."""
    g = torch.Generator().manual_seed(seed)
    outputs = []
    for i, grid in enumerate(grids):
        t, h, w = grid
        rows = t * h * w // 4
        tensors = [torch.randn(rows, width, generator=g).to(dtype) for width in widths]
        outputs.append(Features(tensors[0], tensors[1:], list(grid), videos[i] if videos else None))
    return Encoded(outputs, 0, 0, 0, 0)


def call(**fields) -> EncodeCall:
    return EncodeCall.model_validate(
        {"req_id": "r_local_part_0", "num_parts": 1, "part_idx": 0, "modality": "IMAGE", "mm_items": ["x"], **fields}
    )


def test_the_message_is_sglangs_embedding_data_and_its_tensors_bytes():
    """Frame 0 unpickles, through SGLang's allowlist, as its EmbeddingData with the fields its receiver reads;
    frame 1 is the items' tokens one after the other, deepstack after the tokens on the width, in the dtype said."""
    result = fake_result([(1, 4, 6), (1, 8, 8)], widths=(8, 8, 8, 8), dtype=torch.bfloat16)
    meta = decode(message(call(num_parts=3, part_idx=1), result, "qwen3_vl", torch.bfloat16))
    expected = torch.cat([torch.cat([item.tokens, *item.deepstack], -1) for item in result.outputs])
    assert meta.req_id == "r_local_part_0" and (meta.num_parts, meta.part_idx) == (3, 1)
    assert meta.modality is SGLangModality.IMAGE and meta.dtype is torch.bfloat16 and meta.shape == [22, 32]
    assert meta.grid_dim.dtype == torch.int64 and meta.grid_dim.tolist() == [[1, 4, 6], [1, 8, 8]]
    assert torch.equal(meta.embedding, expected)
    assert (meta.error_msg, meta.error_code, meta.video_timestamps, meta.second_per_grid_ts) == (None,) * 4
    assert type(meta.num_parts) is int and meta.embedding is not None and meta.send_time is None


def test_a_video_part_carries_the_metadata_its_family_needs():
    """Qwen3-VL: `video_timestamps`, a list of floats per video; Qwen2.5-VL: `second_per_grid_ts`, float32 per
    video; Qwen2-VL: neither."""
    videos = [{"timestamps": [0.25, 1.25], "second_per_grid_t": 1.0}, {"timestamps": [0.5], "second_per_grid_t": 0.5}]
    result = fake_result([(2, 4, 4), (1, 4, 4)], videos=videos)
    video = call(modality="VIDEO")
    qwen3 = decode(message(video, result, "qwen3_vl", torch.float32))
    assert qwen3.modality is SGLangModality.VIDEO and qwen3.video_timestamps == [[0.25, 1.25], [0.5]]
    assert qwen3.second_per_grid_ts is None
    qwen25 = decode(message(video, result, "qwen2_5_vl", torch.float32))
    assert qwen25.video_timestamps is None and qwen25.second_per_grid_ts.dtype == torch.float32
    assert qwen25.second_per_grid_ts.tolist() == [1.0, 0.5]
    qwen2 = decode(message(video, result, "qwen2_vl", torch.float32))
    assert qwen2.video_timestamps is None and qwen2.second_per_grid_ts is None


def test_one_item_without_deepstack_goes_out_as_its_own_memory():
    tokens = fake_result([(1, 4, 4)]).outputs[0].tokens
    frame, shape = embedding_frame([Features(tokens)], torch.float32)
    assert shape == [4, 8] and np.shares_memory(np.asarray(frame), tokens.numpy())
    frame, shape = embedding_frame([Features(tokens)], torch.float16)  # another dtype: converted
    assert torch.equal(torch.frombuffer(bytearray(frame), dtype=torch.float16).reshape(shape), tokens.half())


def test_the_pickle_names_sglangs_classes_and_no_module_of_vitserve():
    """The class paths are SGLang 0.5.23's; nothing of vitserve is named (a receiver without it reads the pickle),
    and writing it imports no sglang."""
    import pickletools
    import sys

    frames = message(
        call(modality="VIDEO"),
        fake_result([(2, 4, 4)], videos=[{"timestamps": [0.5], "second_per_grid_t": 1.0}]),
        "qwen2_5_vl",
        torch.float32,
    )
    strings = [arg for _, arg, _ in pickletools.genops(frames[0]) if isinstance(arg, str)]
    assert {
        "sglang.srt.disaggregation.encoder.receiver",
        "EmbeddingData",
        "sglang.srt.managers.schedule_batch",
        "Modality",
    } <= set(strings)
    assert not any("vitserve" in s for s in strings) and not any(m.split(".")[0] == "sglang" for m in sys.modules)


def test_a_long_string_is_bounded_by_its_schemas_max_length_once_restored():
    """read_json validates a body with each string of over 4 KB standing as a short placeholder; `bounded` then holds
    each string field to its schema's max_length (the one source of the bound): a 400 naming the field, with the
    length and not the value. A bound shorter than a placeholder (a registration's modality) and /encode's modality
    (no placeholder is IMAGE or VIDEO) are the schema's own to refuse."""
    import json

    from fastapi.exceptions import RequestValidationError

    from vitserve.service.api.json_body import parse_body
    from vitserve.service.tiers.sglang_schemas import (
        CALL_LIMITS,
        MAX_HOST,
        MAX_REQ_ID,
        REGISTRATION_LIMITS,
        bounded,
        string_limits,
    )

    assert CALL_LIMITS == string_limits(EncodeCall) == {"req_id": MAX_REQ_ID, "prefill_host": MAX_HOST}
    assert REGISTRATION_LIMITS == {"req_id": MAX_REQ_ID, "receive_url": 300, "modality": 16}
    part = {
        "req_id": "r_local_part_0",
        "num_parts": 1,
        "part_idx": 0,
        "modality": "IMAGE",
        "mm_items": ["x"],
        "prefill_host": "10.0.0.5",
        "embedding_port": 9,
    }
    rank = {"req_id": "r_local_part_0", "receive_count": 1, "receive_url": "10.0.0.5:9", "modality": "IMAGE"}
    for model, body, limits in ((EncodeCall, part, CALL_LIMITS), (Registration, rank, REGISTRATION_LIMITS)):
        bounded(parse_body(model, json.dumps(body).encode(), 16))
        for field, limit in limits.items():
            long = json.dumps(body | {field: "x" * 5000}).encode()
            if field == "modality":  # a bound shorter than a placeholder: the schema refuses the placeholder
                with pytest.raises(RequestValidationError):
                    parse_body(model, long, 16)
                continue
            parsed = parse_body(model, long, 16)
            for check in (lambda: bounded(parsed), lambda: bounded(parsed, limits)):
                with pytest.raises(EngineError) as e:
                    check()
                assert (status(e.value), e.value.code, e.value.param) == (400, "invalid_request", field)
                assert e.value.message == f"{field}: at most {limit} characters, got 5000"
    with pytest.raises(RequestValidationError):
        parse_body(EncodeCall, json.dumps(part | {"modality": "x" * 5000}).encode(), 16)


def test_the_sglang_modules_raise_domain_errors_and_import_no_web_framework():
    """The tier's modules raise domain errors (service/ground/errors.py); SGLang's error form is made at the HTTP
    edge."""
    import pathlib

    tiers = pathlib.Path(__file__).resolve().parents[1] / "vitserve" / "service" / "tiers"
    modules = sorted(m for m in tiers.glob("sglang_*.py") if m.name != "sglang_routes.py")  # (routes: the edge)
    assert {m.name for m in modules} >= {
        "sglang_tier.py",
        "sglang_schemas.py",
        "sglang_addresses.py",
        "sglang_pairing.py",
        "sglang_frames.py",
        "sglang_push.py",
    }
    for module in modules:
        source = module.read_text()
        assert not any(
            name in source for name in ("ServiceError", "HTTPException", "JSONResponse", "fastapi", "starlette")
        ), module.name


def registration(req_id="r_local_part_0", count=1, url="127.0.0.1:5000") -> Registration:
    return Registration(req_id=req_id, receive_count=count, receive_url=url)


def add(pairing: Pairing, body: Registration) -> None:
    """`pairing.register` as the tier calls it: the receiver's endpoint and host from its `receive_url`."""
    host, port = receiver_address(body.receive_url)
    pairing.register(body, endpoint(host, port), host)


def test_registrations_pair_with_their_part_in_either_order():
    async def main():
        pairing = Pairing(timeout=5)
        add(pairing, registration("early", 2, "10.0.0.1:1"))
        entry = pairing.hold("early")
        waiting = asyncio.ensure_future(pairing.receivers("early", entry))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        add(pairing, registration("early", 2, "[::1]:2"))
        assert await waiting == ["tcp://10.0.0.1:1", "tcp://[::1]:2"]
        pairing.release("early", entry)
        late = pairing.hold("late")
        add(pairing, registration("late", 1, "host-a:3"))
        assert await pairing.receivers("late", late) == ["tcp://host-a:3"]
        assert pairing.entries.keys() == {"late"}

    asyncio.run(main())


def test_pairing_refuses_what_cannot_be_one_parts_receivers():
    pairing = Pairing(timeout=5)
    add(pairing, registration("a", 1, "10.0.0.1:1"))
    for bad, code in (
        (registration("a", 2, "10.0.0.1:1"), "inconsistent_receive_count"),
        (registration("a", 1, "10.0.0.2:1"), "too_many_receivers"),
        (registration("b", 1, "10.0.0.1"), "invalid_receive_url"),
        (registration("b", 1, "::1:80"), "invalid_receive_url"),
        (registration("b", 1, "10.0.0.1:70000"), "invalid_receive_url"),
    ):
        with pytest.raises(EngineError) as e:
            add(pairing, bad)
        assert status(e.value) == 400 and e.value.code == code
    pairing.hold("c")
    with pytest.raises(EngineError) as e:
        pairing.hold("c")
    assert e.value.code == "duplicate_req_id"


def test_what_never_pairs_is_bounded_and_expires():
    """A registration whose part never comes is dropped after the timeout; beyond `max_pending` such parts, or
    `max_per_host` for receivers on one host, a 429. Invented registrations never keep an /encode from its part (a
    held part is bounded by admission), and a part whose receivers never register waits the timeout, then is a 504."""
    now = [1000.0]
    pairing = Pairing(timeout=10, max_pending=3, max_per_host=2, clock=lambda: now[0])
    add(pairing, registration("orphan", url="10.0.0.1:1"))
    add(pairing, registration("orphan2", url="10.0.0.1:2"))
    with pytest.raises(EngineError) as e:
        add(pairing, registration("third", url="10.0.0.1:3"))  # a third for one host
    assert status(e.value) == 429 and e.value.code == "too_many_pending"
    add(pairing, registration("other", url="10.0.0.2:1"))
    with pytest.raises(EngineError) as e:
        add(pairing, registration("fourth", url="10.0.0.3:1"))  # a fourth in all
    assert status(e.value) == 429 and e.value.code == "too_many_pending"
    for k in range(5):  # the legitimate parts are served whatever waits
        pairing.hold(f"held{k}")
    add(pairing, registration("held0", url="10.0.0.3:1"))  # and their receivers register
    assert pairing.held == 5 and sum(pairing.unheld.values()) == 3
    pairing.hold("orphan")  # an /encode takes a waiting part: it no longer counts against the bounds
    add(pairing, registration("fifth", url="10.0.0.3:1"))
    now[0] += 11
    add(pairing, registration("sixth", url="10.0.0.1:3"))
    assert pairing.entries.keys() == {"orphan", "sixth", *(f"held{k}" for k in range(5))}  # the rest expired
    assert dict(pairing.unheld) == {"10.0.0.1": 1}

    async def main():
        short = Pairing(timeout=0.05)
        entry = short.hold("lonely")
        with pytest.raises(EngineError) as e:
            await short.receivers("lonely", entry)
        assert status(e.value) == 504 and e.value.code == "registration_timeout"
        assert "'lonely': no receiver registered within 0.05 s" in e.value.message  # not "none receivers"

    asyncio.run(main())


def test_a_receiver_that_cannot_be_reached_is_a_502_and_leaves_no_socket():
    """A PUSH that finds no connection within the timeout: 502, its socket closed (a kept one forgotten), and the
    tier closes cleanly; one that connects is kept for its address."""
    from vitserve.service.tiers.sglang_tier import SGLangTier

    async def main():
        tier = SGLangTier("float32", timeout=0.3)
        context = zmq.Context()
        pull = context.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        try:
            await tier.sockets.push(f"tcp://127.0.0.1:{port}", [b"meta", b"data"], keep=True)
            assert pull.poll(5000) and pull.recv_multipart() == [b"meta", b"data"]
            assert list(tier.sockets.kept) == [f"tcp://127.0.0.1:{port}"]
            pull.close(linger=0)
            dead = f"tcp://127.0.0.1:{port + 1 if port < 65535 else port - 1}"
            for keep in (True, False):
                with pytest.raises(EngineError) as e:
                    await tier.sockets.push(dead, [b"meta"], keep=keep)
                assert status(e.value) == 502 and e.value.code == "delivery_failed"
            assert list(tier.sockets.kept) == [f"tcp://127.0.0.1:{port}"] and len(tier.sockets.busy) == 1
        finally:
            await tier.close()
            context.term()
        assert not tier.sockets.busy

    asyncio.run(main())


def test_features_go_only_to_the_allowed_networks():
    """By default any address but this host's, link-local (cloud metadata) and multicast ones, a name checked by
    every address it resolves to; with --sglang-receivers, only the listed networks. What is no host at all is a
    400, a refused one a 403."""

    async def check(networks: ReceiverNetworks, host: str):
        try:
            return await networks.resolve(host, "prefill_host")
        except EngineError as e:
            assert e.param == "prefill_host"
            return status(e), e.code

    async def main():
        default, listed = ReceiverNetworks(), ReceiverNetworks("127.0.0.0/8, fd00::/8,192.0.2.7")
        refused = (403, "receiver_not_allowed")
        for host in (
            "127.0.0.1",
            "127.9.9.9",
            "localhost",
            "0.0.0.0",
            "169.254.169.254",
            "::1",
            "::ffff:127.0.0.1",
            "fe80::1",
            "fd00:ec2::254",
            "100.100.100.200",
            "224.0.0.1",
        ):
            assert await check(default, host) == refused, host
        assert await check(default, "10.0.0.5") == "10.0.0.5"
        assert await check(default, "fd00::5") == "fd00::5"
        assert await check(listed, "127.0.0.1") == "127.0.0.1" and await check(listed, "localhost") == "127.0.0.1"
        assert await check(listed, "192.0.2.7") == "192.0.2.7"
        assert await check(listed, "10.0.0.5") == refused and await check(listed, "192.0.2.8") == refused
        for bad in ("bad host", "*", "", "a" * 300, "-x", "host:1"):
            assert await check(default, bad) == (400, "invalid_receiver"), bad

    asyncio.run(main())


def test_deliveries_are_bounded_and_a_bad_address_leaves_no_socket(monkeypatch):
    """At most MAX_OPEN_SOCKETS sockets at once (a 429 beyond, the idle kept ones closed first); an address ZMQ
    cannot connect to is a 400 and leaves no socket open."""
    from vitserve.service.tiers import sglang_push, sglang_tier

    monkeypatch.setattr(sglang_push, "MAX_OPEN_SOCKETS", 2)

    async def main():
        tier = sglang_tier.SGLangTier("float32", timeout=30)
        try:
            with pytest.raises(EngineError) as e:
                await tier.sockets.push("tcp://bad host:1", [b"meta"], keep=False)
            assert status(e.value) == 400 and e.value.code == "invalid_receiver" and not tier.sockets.busy
            waiting = [
                asyncio.ensure_future(tier.sockets.push(f"tcp://192.0.2.1:{port}", [b"meta"], keep=False))
                for port in (1, 2)
            ]
            await asyncio.sleep(0.05)
            assert len(tier.sockets.busy) == 2
            with pytest.raises(EngineError) as e:
                await tier.sockets.push("tcp://192.0.2.1:3", [b"meta"], keep=False)
            assert status(e.value) == 429 and e.value.code == "too_many_deliveries" and len(tier.sockets.busy) == 2
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
            assert not tier.sockets.busy
        finally:
            await tier.close()

    asyncio.run(main())


def test_the_endpoints_need_the_flag(encoders):
    with client_for(encoders["tiny-qwen3-vl"]) as c:
        for path in ("/encode", "/scheduler_receive_url"):
            r = c.post(path, json={})
            assert r.status_code == 404 and r.json()["error"]["code"] == "encoder_tier_off"


def test_by_default_nothing_goes_to_this_host_or_metadata_addresses(encoders):
    """Without --sglang-receivers, a receiver on loopback or a metadata address is refused (403) before anything
    is encoded or connected, also as an IPv6 address that carries it (6to4, NAT64)."""
    with client_for(encoders["tiny-qwen3-vl"], sglang_encoder=True) as c:
        for address in (
            "127.0.0.1:5000",
            "localhost:5000",
            "169.254.169.254:80",
            "[::1]:5000",
            "[2002:7f00:1::1]:5000",
            "[64:ff9b::a9fe:a9fe]:80",
        ):
            r = c.post("/scheduler_receive_url", json={"req_id": "r", "receive_count": 1, "receive_url": address})
            assert r.status_code == 403 and "--sglang-receivers" in r.json()["message"], r.text
        for host in ("127.0.0.1", "169.254.169.254", "::1"):
            r = c.post(
                "/encode",
                json=encode_body("p_local_part_0", [data_uri(IMAGES[0])], embedding_port=5000) | {"prefill_host": host},
            )
            assert r.status_code == 403 and r.json()["status"] == "error", r.text


# --- a real server and a real socket -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3():
    for _, url in serving(
        "--model",
        "tiny-qwen3-vl",
        "--load-format",
        "dummy",
        "--sglang-encoder",
        "--sglang-timeout",
        "3",
        "--sglang-receivers",
        "127.0.0.0/8",
    ):
        yield url


@pytest.fixture(scope="module")
def qwen25():
    for _, url in serving(
        "--model", "tiny-qwen2.5-vl", "--load-format", "dummy", "--sglang-encoder", "--sglang-receivers", "127.0.0.1"
    ):
        yield url


@pytest.fixture
def receivers():
    """Bind PULL sockets as SGLang's scheduler ranks do (one each, a random port on 127.0.0.1): `make()` gives
    (socket, "127.0.0.1:port")."""
    context = zmq.Context()
    sockets = []

    def make():
        sock = context.socket(zmq.PULL)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        sockets.append(sock)
        return sock, f"127.0.0.1:{port}"

    yield make
    for sock in sockets:
        sock.close(linger=0)
    context.term()


def receive(sock, timeout: float = 10.0) -> list | None:
    """The next message's frames, or None if none comes within `timeout` seconds."""
    if not sock.poll(int(timeout * 1000)):
        return None
    return sock.recv_multipart()


def encode_body(
    req_id: str, items: list, modality: str = "IMAGE", num_parts: int = 1, part_idx: int = 0, embedding_port=None
) -> dict:
    """What SGLang 0.5.23's MMReceiverHTTP.encode posts (zmq_to_scheduler: no embedding_port)."""
    return {
        "encoder_idx": 0,
        "encoder_url": "http://vitserve",
        "mm_items": items,
        "num_parts": num_parts,
        "part_idx": part_idx,
        "req_id": req_id,
        "modality": modality,
        "prefill_host": "127.0.0.1",
        "embedding_port": embedding_port,
        "time_stats_json": None,
    }


def register(url: str, req_id: str, address: str, count: int = 1, modality: str = "IMAGE") -> httpx.Response:
    return httpx.post(
        url + "/scheduler_receive_url",
        json={"req_id": req_id, "receive_count": count, "receive_url": address, "modality": modality},
        timeout=30,
    )


def post_encode(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/encode", json=body, timeout=60)


def reference(url: str, images=(), videos=()) -> list[dict]:
    """/v1/encode's answer for the same media, in the layout SGLang takes (`vllm`) and the server's dtype."""
    r = httpx.post(
        url + "/v1/encode",
        json={"images": list(images), "videos": list(videos), "layout": "vllm", "dtype": "float32"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    for x in data:
        x["tensor"] = torch.from_numpy(np.frombuffer(base64.b64decode(x["embeddings"]), "<f4").copy()).reshape(
            x["shape"]
        )
    return data


@pytest.mark.slow
def test_a_part_reaches_its_receiver_whichever_comes_first(qwen3, receivers):
    """Registration before /encode, and /encode before registration (it answers once the receiver has registered
    and the message is pushed): the receiver gets the part's two images as one tensor equal to /v1/encode's, their
    grids, IMAGE, and /encode answers `null`."""
    items = [data_uri(IMAGES[0]), data_uri(IMAGES[1], "image/png")]
    expected = reference(qwen3, images=items)
    sock, address = receivers()
    assert register(qwen3, "first_local_part_0", address).status_code == 200
    r = post_encode(qwen3, encode_body("first_local_part_0", items))
    assert r.status_code == 200 and r.json() is None
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            post_encode, qwen3, encode_body("second_local_part_0", [{"url": items[0], "detail": "high"}, items[1]])
        )
        time.sleep(0.5)
        assert not pending.done()  # it waits for its receiver
        assert register(qwen3, "second_local_part_0", address).status_code == 200
        assert pending.result().status_code == 200 and pending.result().json() is None
    for req_id in ("first_local_part_0", "second_local_part_0"):
        meta = decode(receive(sock))
        assert meta.req_id == req_id and (meta.num_parts, meta.part_idx) == (1, 0)
        assert meta.modality is SGLangModality.IMAGE and meta.dtype is SERVED_DTYPE
        assert meta.grid_dim.tolist() == [x["grid_thw"] for x in expected]
        assert torch.equal(meta.embedding.float(), torch.cat([x["tensor"] for x in expected]))
        assert meta.video_timestamps is None and meta.second_per_grid_ts is None


@pytest.mark.slow
def test_every_rank_gets_its_own_copy(qwen3, receivers):
    """receive_count 2 (tensor parallel 2): /encode waits for both, and each rank's socket gets the whole part."""
    (a, address_a), (b, address_b) = receivers(), receivers()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post_encode, qwen3, encode_body("tp_local_part_0", [data_uri(IMAGES[2])]))
        assert register(qwen3, "tp_local_part_0", address_a, count=2).status_code == 200
        time.sleep(0.3)
        assert not pending.done()
        assert register(qwen3, "tp_local_part_0", address_b, count=2).status_code == 200
        assert pending.result().status_code == 200
    first, second = receive(a), receive(b)
    (expected,) = reference(qwen3, [data_uri(IMAGES[2])])
    assert first == second and torch.equal(decode(first).embedding, expected["tensor"])


@pytest.mark.slow
def test_a_request_of_an_image_part_and_a_video_part(qwen3, receivers):
    """num_parts 2, as SGLang splits a request with an image and a video: each part its own req_id and receivers'
    registration; the video's part carries its grid and Qwen3-VL's timestamps, as /v1/encode reports them."""
    from videos import make_video

    image, video = data_uri(png(96, 64, 7)), data_uri(make_video(20, 10, 128, 96), "video/mp4")
    expected = reference(qwen3, images=[image], videos=[video])
    sock, address = receivers()
    for k, (modality, item) in enumerate((("VIDEO", video), ("IMAGE", image))[::-1]):
        req_id = f"mix_local_part_{k}"
        assert register(qwen3, req_id, address, modality=modality).status_code == 200
        assert post_encode(qwen3, encode_body(req_id, [item], modality, num_parts=2, part_idx=k)).status_code == 200
    parts = {m.part_idx: m for m in (decode(receive(sock)), decode(receive(sock)))}
    assert parts[0].modality is SGLangModality.IMAGE and parts[1].modality is SGLangModality.VIDEO
    for k, x in enumerate(expected):
        assert parts[k].num_parts == 2 and parts[k].grid_dim.tolist() == [x["grid_thw"]]
        assert torch.equal(parts[k].embedding, x["tensor"])
    assert parts[0].video_timestamps is None
    assert parts[1].video_timestamps == [expected[1]["timestamps"]]
    assert len(expected[1]["timestamps"]) == expected[1]["grid_thw"][0]


@pytest.mark.slow
def test_a_qwen25_video_carries_its_seconds_per_temporal_patch(qwen25, receivers):
    from videos import make_video

    video = data_uri(make_video(16, 8, 112, 84), "video/mp4")
    (expected,) = reference(qwen25, videos=[video])
    sock, address = receivers()
    assert register(qwen25, "v_local_part_0", address, modality="VIDEO").status_code == 200
    assert post_encode(qwen25, encode_body("v_local_part_0", [video], "VIDEO")).status_code == 200
    meta = decode(receive(sock))
    assert meta.video_timestamps is None and meta.second_per_grid_ts.dtype == torch.float32
    assert meta.second_per_grid_ts.tolist() == [pytest.approx(expected["second_per_grid_t"])]
    assert meta.grid_dim.tolist() == [expected["grid_thw"]]
    assert torch.equal(meta.embedding.float(), expected["tensor"])


@pytest.mark.slow
def test_an_embedding_port_is_pushed_to_without_registration(qwen3, receivers):
    """zmq_to_tokenizer: /encode names the port (`prefill_host`:`embedding_port`); nothing registers."""
    sock, address = receivers()
    port = int(address.rsplit(":", 1)[1])
    r = post_encode(qwen3, encode_body("tok_local_part_0", [data_uri(IMAGES[0])], embedding_port=port))
    assert r.status_code == 200
    meta = decode(receive(sock))
    assert meta.req_id == "tok_local_part_0"
    assert torch.equal(meta.embedding.float(), reference(qwen3, [data_uri(IMAGES[0])])[0]["tensor"])


@pytest.mark.slow
def test_errors_are_sglangs_json_and_push_nothing(qwen3, receivers):
    """A bad image, a bad body, an unsupported modality: 400 `{"status": "error", "message", "req_id"}` and no
    message for the registered receiver; a part whose receiver never registers: 504 after --sglang-timeout."""
    sock, address = receivers()
    assert register(qwen3, "bad_local_part_0", address).status_code == 200
    r = post_encode(qwen3, encode_body("bad_local_part_0", ["data:image/png;base64,bm90IGFuIGltYWdl"]))
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["status"] == "error" and body["req_id"] == "bad_local_part_0" and body["message"]
    for bad in (
        encode_body("x_local_part_0", [data_uri(IMAGES[0])], num_parts=1, part_idx=1),
        encode_body("x_local_part_0", [data_uri(IMAGES[0])], "AUDIO"),
        encode_body("x_local_part_0", []),
    ):
        r = post_encode(qwen3, bad)
        assert r.status_code == 400 and r.json()["status"] == "error" and r.json()["message"], r.text
    assert register(qwen3, "tp_local_part_9", address, count=1).status_code == 200
    r = register(qwen3, "tp_local_part_9", address, count=2)
    assert r.status_code == 400 and "receive_count" in r.json()["message"] and r.json()["status"] == "error"
    start = time.monotonic()
    r = post_encode(qwen3, encode_body("lonely_local_part_0", [data_uri(IMAGES[0])]))
    assert r.status_code == 504 and r.json()["status"] == "error" and 3 <= time.monotonic() - start < 20
    assert receive(sock, timeout=0.5) is None


@pytest.mark.slow
def test_the_tier_pushes_only_where_its_fences_allow(qwen3, receivers):
    """A registration names its own address (a receiver registering another is a 403, and the part's features
    never reach it); a host outside --sglang-receivers is a 403; what is no host is a 400, not a 500; a req_id or
    prefill_host over its length is a 400 that does not echo it, even past the JSON reader's 4 KB."""
    sock, address = receivers()
    port = int(address.rsplit(":", 1)[1])
    r = register(qwen3, "fence_local_part_0", f"127.0.0.2:{port}")  # it comes from 127.0.0.1
    assert r.status_code == 403 and r.json()["status"] == "error" and "registers itself" in r.json()["message"]
    r = register(qwen3, "fence_local_part_0", "169.254.169.254:80")
    assert r.status_code == 403 and "--sglang-receivers" in r.json()["message"]
    item = data_uri(IMAGES[0])
    for host, status in (("bad host", 400), ("*", 400), ("10.1.2.3", 403), ("169.254.169.254", 403)):
        r = post_encode(qwen3, encode_body("fence_local_part_1", [item], embedding_port=port) | {"prefill_host": host})
        assert r.status_code == status and r.json()["status"] == "error", (host, r.text)
    for field in ("req_id", "prefill_host"):
        body = encode_body("fence_local_part_2", [item], embedding_port=port) | {field: "x" * 5000}
        r = post_encode(qwen3, body)
        assert r.status_code == 400 and field in r.json()["message"] and len(r.text) < 1000, r.text
    r = register(qwen3, "y" * 5000, address)
    assert r.status_code == 400 and "req_id" in r.json()["message"] and len(r.text) < 1000, r.text
    assert receive(sock, timeout=0.3) is None


HTTP_400 = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n"


@contextlib.contextmanager
def tcp_peer(read_first: bool, answer: bytes | None, close: bool):
    """A plain TCP port that speaks no ZMQ (its port): on each connection it reads what comes first (ZMQ's greeting)
    or not, answers `answer` (None: nothing) and closes the connection or holds it open until it stops."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held = []

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            with contextlib.suppress(OSError):
                if read_first:
                    conn.recv(64)
                if answer:
                    conn.sendall(answer)
                if close:
                    conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        listener.close()
        thread.join(5)
        for conn in held:
            conn.close()


@contextlib.contextmanager
def http_port():
    """An HTTP server's port as SGLang's is (uvicorn with uvicorn[standard]'s parser, in a thread): it answers ZMQ's
    greeting with a 400 and closes the connection."""
    import uvicorn

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http="httptools", lifespan="off", log_config=None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 30, "uvicorn to start")
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


NOT_ZMQ = {  # a port where no ZMQ receiver listens, as each can behave
    "answers_and_holds": lambda: tcp_peer(read_first=False, answer=HTTP_400, close=False),
    "reads_answers_and_holds": lambda: tcp_peer(read_first=True, answer=HTTP_400, close=False),
    "answers_and_closes": lambda: tcp_peer(read_first=False, answer=HTTP_400, close=True),
    "reads_answers_and_closes": lambda: tcp_peer(read_first=True, answer=HTTP_400, close=True),
    "silent": lambda: tcp_peer(read_first=True, answer=None, close=False),
    "http_server": http_port,
}


@pytest.mark.parametrize(
    "peer", [pytest.param(p, marks=pytest.mark.slow) if p == "http_server" else p for p in NOT_ZMQ]
)
def test_a_port_that_speaks_no_zmq_takes_nothing_and_is_a_502_at_once(peer, monkeypatch):
    """A port where no ZMQ receiver listens never takes a message. libzmq takes a peer whose first bytes are not
    ZMTP 3's greeting (an HTTP server's answer) for a ZMTP 1.0 one and would send to it; the tier refuses it: every
    push is a 502 at once (not retried until the timeout), counted as a failure and never as a delivery, and leaves
    no socket. A silent port fails ZMQ's handshake once HANDSHAKE_MS passes."""
    from vitserve.service.tiers import sglang_push, sglang_tier

    monkeypatch.setattr(sglang_push, "HANDSHAKE_MS", 300)

    async def main(port):
        tier = sglang_tier.SGLangTier("float32", timeout=20)
        try:
            for keep in (True, False) * 3:
                start = time.monotonic()
                with pytest.raises(EngineError) as e:
                    await tier.sockets.push(f"tcp://127.0.0.1:{port}", [b"meta", b"x" * 100], keep=keep)
                assert status(e.value) == 502 and e.value.code == "delivery_failed", e.value.message
                assert "handshake" in e.value.message and time.monotonic() - start < 10
                assert not tier.sockets.busy and not tier.sockets.kept and not tier.sockets.watches
            assert tier.stats()["delivery_failures"] == 6 and tier.stats()["deliveries"] == 0
        finally:
            await tier.close()

    with NOT_ZMQ[peer]() as port:
        asyncio.run(main(port))


def test_a_kept_socket_outlives_its_receivers_restart_and_expires_when_unused(monkeypatch):
    """A receiver that goes away after ZMQ's handshake is not a port without ZMQ: its kept socket reconnects and
    delivers to it once it is back. A kept socket unused for KEPT_IDLE seconds is closed."""
    from vitserve.service.tiers import sglang_push, sglang_tier

    async def main():
        tier = sglang_tier.SGLangTier("float32", timeout=60)
        context = zmq.Context()
        pull = context.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        target = f"tcp://127.0.0.1:{port}"
        try:
            await tier.sockets.push(target, [b"meta"], keep=True)
            assert pull.poll(5000) and pull.recv_multipart() == [b"meta"] and list(tier.sockets.kept) == [target]
            kept = tier.sockets.kept[target]
            pull.close(linger=0)
            await asyncio.sleep(0.3)  # the kept socket sees the disconnection
            pull = context.socket(zmq.PULL)
            pull.bind(target)
            await tier.sockets.push(target, [b"again"], keep=True)
            assert pull.poll(5000) and pull.recv_multipart() == [b"again"] and tier.sockets.kept[target] is kept
            monkeypatch.setattr(sglang_push, "KEPT_IDLE", 0.0)
            with pytest.raises(EngineError):  # any socket opened sweeps the idle kept ones
                await tier.sockets.push("tcp://bad host:1", [b"meta"], keep=False)
            assert not tier.sockets.kept and not tier.sockets.busy and tier.stats()["deliveries"] == 2
        finally:
            pull.close(linger=0)
            await tier.close()
            context.term()

    asyncio.run(main())


def test_sglang_receivers_takes_networks_and_addresses():
    from vitserve.service.ground.settings import Settings

    assert Settings.of(model="tiny-qwen3-vl", sglang_receivers="10.0.0.0/8, fd00::/8,192.0.2.7").tiers.sglang_receivers
    for bad in ("10.0.0.0/33", "localhost", "10.0.0.0/8,,", "*"):
        with pytest.raises(ValueError, match="--sglang-receivers"):
            Settings.of(model="tiny-qwen3-vl", sglang_receivers=bad)
