"""vitserve as SGLang's encoder server (`--sglang-encoder`; docs/sglang.md): a `--language-only` SGLang server whose
`--encoder-urls` name this server sends it each request's media, and this server pushes the features to it over ZMQ,
as SGLang's own `--encoder-only` server does (sglang.srt.disaggregation.encoder, release 0.5.23).

* `POST /encode` (`EncodeCall`): one part of a request, one modality: its items encoded, then pushed to the part's
  receivers; the answer (`null`) comes once the message is handed to every receiver's socket.
* `POST /scheduler_receive_url` (`Registration`): a receiver of a part (each tensor-parallel rank of the language
  server, `receive_count` of them) says where it listens. It may come before, during or after the part's /encode.
* Where /encode carries an `embedding_port` (SGLang's zmq_to_tokenizer backend, or its legacy direct one), the
  receivers are `prefill_host` at that port (or each of those ports), and nothing registers.

A part and its registrations pair up in this process (`Pairing`): an encoded part waits up to the timeout for its
receivers, a registration whose part never comes is dropped after the timeout, and a bounded number of parts are
pending at once.

The message is SGLang's: two frames, a pickle of its `EmbeddingData` without the tensor (`meta_frame`), then the
features' raw bytes (`embedding_frame`): every item's tokens, one item after the other, in the model's dtype, with
Qwen3-VL's deepstack features after the tokens on the width (`cat([tokens, ds0, ds1, ds2], -1)`). The pickle is
written without sglang: the two classes it names are stand-ins here, written under SGLang's class paths, and
everything else in it is builtins and torch, which the receiver's allowlisting unpickler accepts.
"""

from __future__ import annotations

import asyncio
import enum
import io
import math
import pickle
import re
import time
from collections import OrderedDict
from typing import Annotated, Literal

import numpy as np
import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, model_validator

from ..encoder.vision_encoder import DTYPES
from .engine import Encoded
from .errors import ServiceError
from .outputs import OFF_LOOP_BYTES, answer_bytes, converted, raw_view

# the pickle's class paths, as SGLang's receiver looks them up (and its unpickler allows them): EmbeddingData moved
# to sglang.srt.disaggregation.encoder.receiver in 0.5.19 (sglang.srt.disaggregation.encode_receiver before);
# Modality is accepted under sglang.srt.managers.schedule_batch by every release since 0.5.10
EMBEDDING_DATA = ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData")
MODALITY = ("sglang.srt.managers.schedule_batch", "Modality")
SGLANG_VERSION = "0.5.23"  # the release whose wire format this is (the same since 0.5.19)
PROTOCOL = 4  # pickle protocol: SGLang's (Python's default)
TIMEOUT = 180.0  # seconds: SGLang's SGLANG_ENCODER_SEND_TIMEOUT and SGLANG_ENCODER_REQ_TIMEOUT
MAX_PENDING = 4096  # parts (req_ids) with registrations or an /encode in flight, at once
MAX_RECEIVERS = 256  # receive_count: the language server's tensor-parallel size
MAX_SOCKETS = 64  # persistent sockets (one per scheduler rank's address), least recently used closed beyond
LINGER_MS = 5000  # how long a closed socket still sends what it holds


class EmbeddingData:
    """Stands for SGLang's `EmbeddingData` in the pickle: only its name and its `__dict__` travel (unpickling
    makes the receiver's own class without calling its `__init__`)."""

    def __init__(self, state: dict):
        self.__dict__.update(state)


class Modality(enum.Enum):
    """Stands for SGLang's `Modality` in the pickle: an enum member travels as its class and value."""

    IMAGE = 1
    VIDEO = 2
    AUDIO = 3


class _Writer(pickle._Pickler):  # the Python pickler: the C one cannot write a class under another path
    NAMES = {EmbeddingData: EMBEDDING_DATA, Modality: MODALITY}

    def save_global(self, obj, name=None):
        if obj not in self.NAMES:
            return super().save_global(obj, name)
        module, qualname = self.NAMES[obj]
        self.save(module)
        self.save(qualname)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def dumps(obj) -> bytes:
    """`obj` pickled with the stand-ins under SGLang's class paths."""
    out = io.BytesIO()
    _Writer(out, PROTOCOL).dump(obj)
    return out.getvalue()


def _item(value):
    return {"url": value} if isinstance(value, str) else value


class MediaItem(BaseModel):
    """One of a part's `mm_items`: a data URI, base64 or an http(s) URL (a bare string in the request stands for
    `{"url": it}`). The per-medium options SGLang sends beside it (`detail`, `content_hash`, `preprocess_kwargs`,
    ...) are accepted and not applied: this server preprocesses with its own settings, and SGLang sizes the prompt
    from the grids it is sent."""

    model_config = ConfigDict(extra="allow")
    url: str


Port = Annotated[StrictInt, Field(ge=1, le=65535)]


class EncodeCall(BaseModel):
    """The body of `POST /encode`, as SGLang's language side (`MMReceiverHTTP.encode`) sends it and its encoder
    checks it (`validate_encode_request`); the fields only SGLang reads (`encoder_idx`, `encoder_url`,
    `time_stats_json`, ...) are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    req_id: str = Field(min_length=1, max_length=512)
    num_parts: StrictInt = Field(gt=0)
    part_idx: StrictInt = Field(ge=0)
    modality: Annotated[Literal["IMAGE", "VIDEO"], BeforeValidator(lambda v: v.upper() if isinstance(v, str) else v)]
    mm_items: list[Annotated[MediaItem, BeforeValidator(_item)]] = Field(min_length=1)
    prefill_host: str | None = None
    embedding_port: Port | list[Port] | None = None  # null: the receivers register (zmq_to_scheduler)

    @model_validator(mode="after")
    def _consistent(self):
        if self.part_idx >= self.num_parts:
            raise ValueError(f"part_idx must be in [0, {self.num_parts})")
        if self.embedding_port is not None and not self.prefill_host:
            raise ValueError("an embedding_port needs the prefill_host it is on")
        return self

    @property
    def kind(self) -> str:
        """The part's modality as this server names it: image or video."""
        return self.modality.lower()


class Registration(BaseModel):
    """The body of `POST /scheduler_receive_url`: one receiver of part `req_id` (`host:port`, an IPv6 host in
    brackets), and how many receivers the part has."""

    model_config = ConfigDict(extra="allow")
    req_id: str = Field(min_length=1, max_length=512)
    receive_count: StrictInt = Field(gt=0, le=MAX_RECEIVERS)
    receive_url: str = Field(max_length=300)
    modality: str | None = None


ADDRESS = re.compile(r"\[(?P<v6>[0-9A-Fa-f:.]+)\]:(?P<p6>\d{1,5})|(?P<host>[A-Za-z0-9.\-]+):(?P<port>\d{1,5})")


def endpoint(host: str, port: int) -> str:
    """The ZMQ endpoint of a TCP address (an IPv6 host bracketed)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def receiver_endpoint(address: str) -> str:
    """The ZMQ endpoint of a registration's `host:port`; anything else is a 400."""
    match = ADDRESS.fullmatch(address)
    port = match and int(match["p6"] or match["port"])
    if not match or not 0 < port < 65536:
        raise ServiceError(400, f"receive_url must be host:port ([ipv6]:port), got {address[:100]!r}",
                           "invalid_receive_url", "receive_url")
    return endpoint(match["v6"] or match["host"], port)


def embedding_frame(outputs: list, dtype: torch.dtype) -> tuple[memoryview, list[int]]:
    """The features of a part's items as one `[rows, width]` tensor's raw little-endian bytes, and that shape: each
    item's rows after the previous item's, each row its tokens then its deepstack features. One item without
    deepstack in `dtype` already is its own memory; otherwise each piece is copied once into place."""
    pieces = [[converted(t, dtype) for t in (tokens, *deepstack)] for tokens, deepstack in outputs]
    rows, width = sum(p[0].shape[0] for p in pieces), sum(t.shape[-1] for t in pieces[0])
    if len(pieces) == 1 and len(pieces[0]) == 1:
        return memoryview(raw_view(pieces[0][0])), [rows, width]
    size = dtype.itemsize
    out = np.empty((rows, width * size), np.uint8)
    row = 0
    for item in pieces:
        n, column = item[0].shape[0], 0
        for t in item:
            out[row:row + n, column:column + t.shape[-1] * size] = raw_view(t).reshape(n, -1)
            column += t.shape[-1] * size
        row += n
    return memoryview(out.reshape(-1)), [rows, width]


def meta_frame(call: EncodeCall, result: Encoded, family: str, dtype: torch.dtype, shape: list[int]) -> bytes:
    """SGLang's `EmbeddingData` of a part, without its tensor (`embedding` None; `dtype` and `shape` say what the
    second frame holds), pickled: the part's `req_id` as given, its grids (int64 `[items, 3]`, in patches) and
    modality, and for videos the metadata SGLang's prompt needs: Qwen3-VL's `video_timestamps` (per video, a time in
    seconds per temporal patch), Qwen2.5-VL's `second_per_grid_ts` (float32, per video); None where it does not
    apply, as SGLang's encoder sends them."""
    videos = [v for v in (result.videos or []) if v is not None]
    timestamps = [[float(t) for t in v["timestamps"]] for v in videos] if videos and family == "qwen3_vl" else None
    seconds = (torch.tensor([float(v["second_per_grid_t"]) for v in videos], dtype=torch.float32)
               if videos and family == "qwen2_5_vl" else None)
    return dumps(EmbeddingData({
        "req_id": call.req_id, "num_parts": call.num_parts, "part_idx": call.part_idx,
        "grid_dim": torch.tensor(result.grids, dtype=torch.int64).reshape(-1, 3), "modality": Modality[call.modality],
        "embedding": None, "send_time": None, "dtype": dtype, "shape": shape, "_mr_ptr": None, "error_msg": None,
        "error_code": None, "video_timestamps": timestamps, "second_per_grid_ts": seconds}))


def message(call: EncodeCall, result: Encoded, family: str, dtype: torch.dtype) -> list:
    """A part's two frames: its `EmbeddingData` pickled, and its features' bytes."""
    features, shape = embedding_frame(result.outputs, dtype)
    return [meta_frame(call, result, family, dtype, shape), features]


class Receivers:
    """The receivers registered for one part: their endpoints (in order), how many there are to be, whether an
    /encode holds the part, and when an unheld entry is dropped."""

    __slots__ = ("count", "endpoints", "held", "expires", "changed")

    def __init__(self, expires: float):
        self.count: int | None = None
        self.endpoints: dict[str, None] = {}
        self.held, self.expires, self.changed = False, expires, asyncio.Event()

    def complete(self) -> bool:
        return self.count is not None and len(self.endpoints) >= self.count


class Pairing:
    """Parts and their registrations, by `req_id`: at most `max_pending` at once (a 503 beyond); an entry no /encode
    holds is dropped `timeout` seconds after it was made (by `clock`), one an /encode holds when the /encode ends."""

    def __init__(self, timeout: float = TIMEOUT, max_pending: int = MAX_PENDING, clock=time.monotonic):
        self.timeout, self.max_pending, self.clock = timeout, max_pending, clock
        self.entries: dict[str, Receivers] = {}
        self._swept = -math.inf

    def _entry(self, req_id: str) -> Receivers:
        now = self.clock()
        if now - self._swept >= 1.0:
            self._swept = now
            for key in [k for k, e in self.entries.items() if not e.held and e.expires <= now]:
                del self.entries[key]
        entry = self.entries.get(req_id)
        if entry is None:
            if len(self.entries) >= self.max_pending:
                raise ServiceError(503, f"{self.max_pending} parts are pending already", "too_many_pending",
                                   headers={"Retry-After": "1"})
            entry = self.entries[req_id] = Receivers(now + self.timeout)
        return entry

    def register(self, body: Registration) -> None:
        """Record a receiver of `body.req_id`; a `receive_count` unlike the part's earlier one, or a receiver more
        than it, is a 400."""
        target = receiver_endpoint(body.receive_url)
        entry = self._entry(body.req_id)
        if entry.count is None:
            entry.count = body.receive_count
        if body.receive_count != entry.count:
            raise ServiceError(400, f"inconsistent receive_count for req_id {body.req_id[:100]!r}: registered "
                                    f"{entry.count}, got {body.receive_count}", "inconsistent_receive_count",
                               "receive_count")
        if target not in entry.endpoints and len(entry.endpoints) >= entry.count:
            raise ServiceError(400, f"more receivers than receive_count ({entry.count}) for req_id "
                                    f"{body.req_id[:100]!r}", "too_many_receivers", "receive_url")
        entry.endpoints[target] = None
        entry.changed.set()

    def hold(self, req_id: str) -> Receivers:
        """The entry of a part an /encode serves (made now, or found with what registered first); a part another
        /encode holds is a 400."""
        entry = self._entry(req_id)
        if entry.held:
            raise ServiceError(400, f"req_id {req_id[:100]!r} is being encoded already", "duplicate_req_id", "req_id")
        entry.held = True
        return entry

    def release(self, req_id: str, entry: Receivers) -> None:
        if self.entries.get(req_id) is entry:
            del self.entries[req_id]

    async def receivers(self, req_id: str, entry: Receivers) -> list[str]:
        """The part's receivers once all have registered; a 504 when they have not within the timeout."""
        deadline = time.monotonic() + self.timeout
        while not entry.complete():
            entry.changed.clear()
            try:
                await asyncio.wait_for(entry.changed.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                have = f"{len(entry.endpoints)} of {entry.count} receivers" if entry.count else "no receiver"
                raise ServiceError(504, f"req_id {req_id[:100]!r}: {have} registered within "
                                        f"{self.timeout:g} s", "registration_timeout") from None
        return list(entry.endpoints)


class SGLangTier:
    """One front end's SGLang encoder side: the pairing of parts with receivers, and the PUSH sockets the messages
    leave by (pyzmq, imported here: the `sglang` extra). A scheduler rank's socket is kept (one per address, at most
    `MAX_SOCKETS`); an `embedding_port`'s is opened for its message."""

    def __init__(self, dtype: str, timeout: float = TIMEOUT, max_pending: int = MAX_PENDING):
        try:
            import zmq
            import zmq.asyncio
        except ImportError:
            raise ImportError("--sglang-encoder pushes over ZMQ: pip install 'vitserve[sglang]' (pyzmq)") from None
        self.zmq, self.dtype, self.timeout = zmq, DTYPES[dtype], timeout  # the model's dtype: SGLang's choice
        self.pairing = Pairing(timeout, max_pending)
        self.context = zmq.asyncio.Context()
        self.sockets: OrderedDict[str, object] = OrderedDict()  # kept, by address
        self.busy: dict[object, int] = {}  # every open socket: the messages it is handing over now

    def register(self, body: Registration) -> None:
        self.pairing.register(body)

    async def serve(self, call: EncodeCall, encode, family) -> None:
        """Serve one /encode part: `encode()` (the part's items, an `Encoded`; its receivers may register
        meanwhile), then the message, built off the event loop when large, pushed to every receiver once all have
        registered. `family()`: the model's family, once the items are encoded. A failure is raised (a
        ServiceError where it is this tier's); nothing is pushed then."""
        entry = self.pairing.hold(call.req_id) if call.embedding_port is None else None
        try:
            result = await encode()
            frames = await self._message(call, result, family())
            if entry is not None:
                targets, keep = await self.pairing.receivers(call.req_id, entry), True
            else:
                ports = call.embedding_port if isinstance(call.embedding_port, list) else [call.embedding_port]
                targets, keep = [endpoint(call.prefill_host, port) for port in ports], False
            sent = await asyncio.gather(*(self._push(target, frames, keep) for target in targets),
                                        return_exceptions=True)
            failed = next((e for e in sent if isinstance(e, BaseException)), None)
            if failed is not None:
                raise failed
        finally:
            if entry is not None:
                self.pairing.release(call.req_id, entry)

    async def _message(self, call: EncodeCall, result: Encoded, family: str) -> list:
        """`message`, built in a thread where its features are `OFF_LOOP_BYTES` or more."""
        if answer_bytes(result.outputs) >= OFF_LOOP_BYTES:
            return await asyncio.to_thread(message, call, result, family, self.dtype)
        return message(call, result, family, self.dtype)

    def _socket(self, target: str, keep: bool):
        """A PUSH socket connected to `target`: the kept one (`keep`), or a new one. Beyond `MAX_SOCKETS` kept,
        the least recently used that sends nothing now are closed."""
        zmq = self.zmq
        sock = self.sockets.get(target) if keep else None
        if sock is not None:
            self.sockets.move_to_end(target)
            return sock
        sock = self.context.socket(zmq.PUSH)
        self.busy[sock] = 0
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # a message waits for a connection, not in a pipe to nowhere
        if target.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(target)
        if keep:
            self.sockets[target] = sock
            idle = [t for t, s in self.sockets.items() if not self.busy[s] and s is not sock]
            for old in idle[:max(0, len(self.sockets) - MAX_SOCKETS)]:
                self._close(self.sockets.pop(old), LINGER_MS)
        return sock

    def _close(self, sock, linger: int) -> None:
        self.busy.pop(sock, None)
        sock.close(linger=linger)

    async def _push(self, target: str, frames: list, keep: bool) -> None:
        """Hand the message to `target`'s socket (its frames by reference, not copied); a socket that cannot take it
        within the timeout (no connection) is closed, a 502. A socket opened for this message alone is closed after
        it, sending what it holds for up to `LINGER_MS`."""
        sock = self._socket(target, keep)
        self.busy[sock] += 1
        try:
            await asyncio.wait_for(sock.send_multipart(frames, copy=False), self.timeout)
        except (asyncio.TimeoutError, self.zmq.ZMQError) as e:
            if self.sockets.get(target) is sock:
                del self.sockets[target]
            self._close(sock, 0)
            why = f"no connection within {self.timeout:g} s" if isinstance(e, asyncio.TimeoutError) else str(e)
            raise ServiceError(502, f"embedding delivery to {target} failed: {why}", "delivery_failed") from None
        finally:
            if sock in self.busy:
                self.busy[sock] -= 1
                if not keep:
                    self._close(sock, LINGER_MS)

    async def close(self) -> None:
        """Close every socket (what they still hold is sent for up to `LINGER_MS`), then the context."""
        for sock in list(self.busy):
            self._close(sock, LINGER_MS)
        self.sockets.clear()
        await asyncio.to_thread(self.context.term)
