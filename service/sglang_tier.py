"""vitserve as SGLang's encoder server (`--sglang-encoder`; docs/sglang.md): a `--language-only` SGLang server whose
`--encoder-urls` name this server sends it each request's media, and this server pushes the features to it over ZMQ,
as SGLang's own `--encoder-only` server does (sglang.srt.disaggregation.encoder, release 0.5.23).

* `POST /encode` (`EncodeCall`): one part of a request, one modality: its items encoded, then pushed to the part's
  receivers; the answer (`null`) comes once the message is handed to every receiver's socket.
* `POST /scheduler_receive_url` (`Registration`): a receiver of a part (each tensor-parallel rank of the language
  server, `receive_count` of them) says where it listens, from that address itself. It may come before, during or
  after the part's /encode.
* Where /encode carries an `embedding_port` (SGLang's zmq_to_tokenizer backend, or its legacy direct one), the
  receivers are `prefill_host` at that port (or each of those ports), and nothing registers.

SGLang sends no API key, so the tier fences itself (`ReceiverNetworks`): features go only to the allowed networks
(`--sglang-receivers`; by default no loopback, link-local, metadata or multicast address), to the address checked.
A part and its registrations pair up in this process (`Pairing`): an encoded part waits up to the timeout for its
receivers; a registration whose part has not come is dropped after the timeout, and a bounded number of them wait
at once (in all, and per host). The parts being encoded are bounded by admission (the gate admits /encode), the
sockets open by `MAX_OPEN_SOCKETS`.

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
import ipaddress
import math
import pickle
import re
import socket
import time
from collections import Counter, OrderedDict
from typing import Annotated, Literal

import numpy as np
import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, model_validator

from ..encoder.features import Features
from ..encoder.vision_encoder import DTYPES
from .engine import Encoded
from .errors import DeliveryFailed, InputRejected, NotAllowed, QueueFull, TimedOut
from .fetch import embedded_ipv4
from .outputs import OFF_LOOP_BYTES, answer_bytes, answered

# the pickle's class paths, as SGLang's receiver looks them up (and its unpickler allows them): EmbeddingData moved
# to sglang.srt.disaggregation.encoder.receiver in 0.5.19 (sglang.srt.disaggregation.encode_receiver before);
# Modality is accepted under sglang.srt.managers.schedule_batch by every release since 0.5.10
EMBEDDING_DATA = ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData")
MODALITY = ("sglang.srt.managers.schedule_batch", "Modality")
SGLANG_VERSION = "0.5.23"  # the release whose wire format this is (the same since 0.5.19)
PROTOCOL = 4  # pickle protocol: SGLang's (Python's default)
TIMEOUT = 180.0  # seconds: SGLang's SGLANG_ENCODER_SEND_TIMEOUT and SGLANG_ENCODER_REQ_TIMEOUT
MAX_PENDING = 4096  # parts (req_ids) with registrations and no /encode yet, at once
MAX_PENDING_PER_HOST = 256  # of those, the parts whose receivers are on one host
MAX_RECEIVERS = 256  # receive_count, and an embedding_port list: the language server's tensor-parallel size
MAX_SOCKETS = 64  # persistent sockets (one per scheduler rank's address), least recently used closed beyond
MAX_OPEN_SOCKETS = 128  # sockets open at once, kept or handing over a message (a 429 beyond)
LINGER_MS = 5000  # how long a closed socket still sends what it holds
HANDSHAKE_MS = 5000  # how long a receiver may take to answer ZMQ's handshake (one that does not speaks no ZMQ)
ZAP_DOMAIN = b"vitserve"  # set on every socket: libzmq then refuses peers that speak no ZMTP 3 (see _socket)
KEPT_IDLE = 600.0  # seconds a kept socket may go unused before it is closed
RESOLVE_TIMEOUT = 5.0  # seconds to resolve a receiver's host name
MAX_REQ_ID = 512  # characters of a req_id
MAX_HOST = 253  # characters of a host name (DNS's limit)
HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")
# where features are never pushed unless --sglang-receivers lists the network: this host (loopback, unspecified),
# link-local (cloud metadata services at 169.254.169.254 and fd00:ec2::254 among them), multicast and broadcast,
# and the metadata addresses outside those ranges (Alibaba's, Azure's wire server)
REFUSED = tuple(ipaddress.ip_network(n) for n in (
    "127.0.0.0/8", "0.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "255.255.255.255/32", "100.100.100.200/32",
    "168.63.129.16/32", "::1/128", "::/128", "fe80::/10", "ff00::/8", "fd00:ec2::254/128"))


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
    req_id: str = Field(min_length=1, max_length=MAX_REQ_ID)
    num_parts: StrictInt = Field(gt=0)
    part_idx: StrictInt = Field(ge=0)
    modality: Annotated[Literal["IMAGE", "VIDEO"], BeforeValidator(lambda v: v.upper() if isinstance(v, str) else v)]
    mm_items: list[Annotated[MediaItem, BeforeValidator(_item)]] = Field(min_length=1)
    prefill_host: str | None = Field(default=None, max_length=MAX_HOST)
    embedding_port: Port | Annotated[list[Port], Field(min_length=1, max_length=MAX_RECEIVERS)] | None = None
    # (null: the receivers register, zmq_to_scheduler)

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
    req_id: str = Field(min_length=1, max_length=MAX_REQ_ID)
    receive_count: StrictInt = Field(gt=0, le=MAX_RECEIVERS)
    receive_url: str = Field(max_length=300)
    modality: str | None = Field(default=None, max_length=16)


def bounded(body: BaseModel, limits: dict[str, int]) -> None:
    """A body's string fields within their lengths once its long strings are restored (read_json validates the body
    with each string of over 4 KB standing as a short placeholder): a 400 naming the field, not echoing it."""
    for name, limit in limits.items():
        value = getattr(body, name)
        if isinstance(value, str) and len(value) > limit:
            raise InputRejected(f"{name}: at most {limit} characters, got {len(value)}", "invalid_request", name)


CALL_LIMITS = {"req_id": MAX_REQ_ID, "prefill_host": MAX_HOST, "modality": 16}
REGISTRATION_LIMITS = {"req_id": MAX_REQ_ID, "receive_url": 300, "modality": 16}


ADDRESS = re.compile(r"\[(?P<v6>[0-9A-Fa-f:.]+)\]:(?P<p6>\d{1,5})|(?P<host>[A-Za-z0-9.\-]+):(?P<port>\d{1,5})")


def endpoint(host: str, port: int) -> str:
    """The ZMQ endpoint of a TCP address (an IPv6 host bracketed)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def receiver_address(address: str) -> tuple[str, int]:
    """The host and port of a registration's `host:port`; anything else is a 400."""
    match = ADDRESS.fullmatch(address)
    port = match and int(match["p6"] or match["port"])
    if not match or not 0 < port < 65536:
        raise InputRejected(f"receive_url must be host:port ([ipv6]:port), got {address[:100]!r}",
                            "invalid_receive_url", "receive_url")
    return match["v6"] or match["host"], port


def address_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An IP literal as an address (an IPv4-mapped IPv6 one as its IPv4 address); None for a host name."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return ip.ipv4_mapped or ip if ip.version == 6 else ip


class ReceiverNetworks:
    """Where this server pushes features to (`--sglang-receivers`): an address in a listed network; with none
    listed, any address but this host's, link-local (cloud metadata) and multicast ones (`REFUSED`). A host name is
    resolved here (off the event loop, within `RESOLVE_TIMEOUT`), every address it has is checked, and the socket
    connects to the address checked (never to the name, which could resolve elsewhere the next time)."""

    def __init__(self, networks: str | None = None):
        self.networks = [ipaddress.ip_network(n.strip(), strict=False) for n in (networks or "").split(",")
                         if n.strip()]

    def allowed(self, ip) -> bool:
        """`ip` may be pushed to; an IPv6 address that carries an IPv4 one (6to4, Teredo, NAT64) only where both may."""
        inner = embedded_ipv4(ip) if ip.version == 6 else None
        for address in (ip, *filter(None, [inner])):
            if self.networks:
                if not any(address.version == n.version and address in n for n in self.networks):
                    return False
            elif any(address.version == n.version and address in n for n in REFUSED):
                return False
        return True

    async def resolve(self, host: str, param: str) -> str:
        """The address to push to for `host` (a 400 for a host that is no host name or cannot be resolved, a 403
        for one outside the allowed networks); `param` names the field in errors."""
        ip = address_of(host)
        if ip is None:
            if not HOST_NAME.fullmatch(host):
                raise InputRejected(f"{param}: not a host name or IP address: {host[:100]!r}",
                                    "invalid_receiver", param)
            try:
                found = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(
                    host, None, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT)
            except (OSError, asyncio.TimeoutError):
                raise InputRejected(f"{param}: cannot resolve {host!r}", "invalid_receiver", param) from None
            addresses = [address_of(entry[4][0].split("%")[0]) for entry in found]
            if not addresses:
                raise InputRejected(f"{param}: {host!r} has no address", "invalid_receiver", param)
        else:
            addresses = [ip]
        refused = next((a for a in addresses if not self.allowed(a)), None)
        if refused is not None:
            named = f"{refused} is" if ip is not None else f"{host!r} resolves to {refused},"
            raise NotAllowed(f"{param}: {named} outside the networks features are pushed to "
                             "(--sglang-receivers)", "receiver_not_allowed", param)
        return str(addresses[0])


def embedding_frame(items: list[Features], dtype: torch.dtype) -> tuple[memoryview, list[int]]:
    """The features of a part's items as one `[rows, width]` tensor's raw little-endian bytes, and that shape: each
    item's packed rows (`Features.rows`) after the previous item's. One item without deepstack in `dtype` already
    is its own memory; otherwise each piece is copied once into place."""
    rows = [item.rows(dtype) for item in items]
    count, width = sum(r.count for r in rows), items[0].width
    if len(rows) == 1 and len(rows[0].views) == 1:
        return memoryview(rows[0].views[0].reshape(-1)), [count, width]
    out = np.empty((count, rows[0].row_bytes), np.uint8)
    start = 0
    for r in rows:
        r.copy_into(out[start:start + r.count])
        start += r.count
    return memoryview(out.reshape(-1)), [count, width]


def meta_frame(call: EncodeCall, items: list[Features], family: str, dtype: torch.dtype, shape: list[int]) -> bytes:
    """SGLang's `EmbeddingData` of a part, without its tensor (`embedding` None; `dtype` and `shape` say what the
    second frame holds), pickled: the part's `req_id` as given, its grids (int64 `[items, 3]`, in patches) and
    modality, and for videos the metadata SGLang's prompt needs: Qwen3-VL's `video_timestamps` (per video, a time in
    seconds per temporal patch), Qwen2.5-VL's `second_per_grid_ts` (float32, per video); None where it does not
    apply, as SGLang's encoder sends them."""
    videos = [item.timing for item in items if item.timing is not None]
    timestamps = [[float(t) for t in v["timestamps"]] for v in videos] if videos and family == "qwen3_vl" else None
    seconds = (torch.tensor([float(v["second_per_grid_t"]) for v in videos], dtype=torch.float32)
               if videos and family == "qwen2_5_vl" else None)
    return dumps(EmbeddingData({
        "req_id": call.req_id, "num_parts": call.num_parts, "part_idx": call.part_idx,
        "grid_dim": torch.tensor([list(item.grid) for item in items], dtype=torch.int64).reshape(-1, 3),
        "modality": Modality[call.modality],
        "embedding": None, "send_time": None, "dtype": dtype, "shape": shape, "_mr_ptr": None, "error_msg": None,
        "error_code": None, "video_timestamps": timestamps, "second_per_grid_ts": seconds}))


def message(call: EncodeCall, result: Encoded, family: str, dtype: torch.dtype) -> list:
    """A part's two frames: its `EmbeddingData` pickled, and its features' bytes."""
    items = answered(result)
    features, shape = embedding_frame(items, dtype)
    return [meta_frame(call, items, family, dtype, shape), features]


class Receivers:
    """The receivers registered for one part: their endpoints (in order), how many there are to be, whether an
    /encode holds the part, the host of the first receiver (what an unheld entry counts against), and when an
    unheld entry is dropped."""

    __slots__ = ("count", "endpoints", "held", "expires", "changed", "host")

    def __init__(self, expires: float, host: str | None = None):
        self.count: int | None = None
        self.endpoints: dict[str, None] = {}
        self.held, self.expires, self.changed, self.host = False, expires, asyncio.Event(), host

    def complete(self) -> bool:
        return self.count is not None and len(self.endpoints) >= self.count


class Pairing:
    """Parts and their registrations, by `req_id`. A part an /encode holds is bounded by admission (every /encode
    is admitted) and dropped when the /encode ends. A part with registrations and no /encode yet is unheld: at most
    `max_pending` of them at once, `max_per_host` of them for receivers on one host (a 429 beyond either), each
    dropped `timeout` seconds after it was made (by `clock`)."""

    def __init__(self, timeout: float = TIMEOUT, max_pending: int = MAX_PENDING,
                 max_per_host: int = MAX_PENDING_PER_HOST, clock=time.monotonic):
        self.timeout, self.max_pending, self.max_per_host, self.clock = timeout, max_pending, max_per_host, clock
        self.entries: dict[str, Receivers] = {}
        self.unheld: Counter[str] = Counter()  # unheld entries by their receivers' host
        self._swept = -math.inf

    def _sweep(self) -> float:
        now = self.clock()
        if now - self._swept >= 1.0:
            self._swept = now
            for key in [k for k, e in self.entries.items() if not e.held and e.expires <= now]:
                self._drop(key)
        return now

    def _drop(self, req_id: str) -> None:
        entry = self.entries.pop(req_id)
        if not entry.held:
            self.unheld[entry.host] -= 1
            if not self.unheld[entry.host]:
                del self.unheld[entry.host]

    def register(self, body: Registration, target: str, host: str) -> None:
        """Record receiver `target` (an endpoint on `host`) of `body.req_id`; a `receive_count` unlike the part's
        earlier one, or a receiver more than it, is a 400; a new unheld part over the bounds a 429."""
        now = self._sweep()
        entry = self.entries.get(body.req_id)
        if entry is None:
            if sum(self.unheld.values()) >= self.max_pending or self.unheld[host] >= self.max_per_host:
                raise QueueFull(f"{self.max_pending} parts (or {self.max_per_host} for receivers on one "
                                "host) wait for their /encode already", "too_many_pending", "req_id")
            entry = self.entries[body.req_id] = Receivers(now + self.timeout, host)
            self.unheld[host] += 1
        if entry.count is None:
            entry.count = body.receive_count
        if body.receive_count != entry.count:
            raise InputRejected(f"inconsistent receive_count for req_id {body.req_id[:100]!r}: registered "
                                f"{entry.count}, got {body.receive_count}", "inconsistent_receive_count",
                                "receive_count")
        if target not in entry.endpoints and len(entry.endpoints) >= entry.count:
            raise InputRejected(f"more receivers than receive_count ({entry.count}) for req_id "
                                f"{body.req_id[:100]!r}", "too_many_receivers", "receive_url")
        entry.endpoints[target] = None
        entry.changed.set()

    def hold(self, req_id: str) -> Receivers:
        """The entry of a part an /encode serves (made now, or found with what registered first); a part another
        /encode holds is a 400."""
        now = self._sweep()
        entry = self.entries.get(req_id)
        if entry is None:
            entry = self.entries[req_id] = Receivers(now + self.timeout)
        elif entry.held:
            raise InputRejected(f"req_id {req_id[:100]!r} is being encoded already", "duplicate_req_id", "req_id")
        else:
            self._drop(req_id)
            self.entries[req_id] = entry
        entry.held = True
        return entry

    def release(self, req_id: str, entry: Receivers) -> None:
        if self.entries.get(req_id) is entry:
            del self.entries[req_id]

    @property
    def held(self) -> int:
        return len(self.entries) - sum(self.unheld.values())

    async def receivers(self, req_id: str, entry: Receivers) -> list[str]:
        """The part's receivers once all have registered; a 504 when they have not within the timeout."""
        deadline = time.monotonic() + self.timeout
        while not entry.complete():
            entry.changed.clear()
            try:
                await asyncio.wait_for(entry.changed.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                have = f"{len(entry.endpoints)} of {entry.count} receivers" if entry.count else "no receiver"
                raise TimedOut(f"req_id {req_id[:100]!r}: {have} registered within {self.timeout:g} s",
                               "registration_timeout") from None
        return list(entry.endpoints)


class SGLangTier:
    """One front end's SGLang encoder side: the pairing of parts with receivers, and the PUSH sockets the messages
    leave by (pyzmq, imported here: the `sglang` extra). A scheduler rank's socket is kept (one per address, at most
    `MAX_SOCKETS`); an `embedding_port`'s is opened for its message; at most `MAX_OPEN_SOCKETS` are open at once.
    Features go only to the allowed networks (`receivers`: `--sglang-receivers`, see `ReceiverNetworks`), and a
    receiver registers itself: a registration comes from the address it names."""

    def __init__(self, dtype: str, timeout: float = TIMEOUT, max_pending: int = MAX_PENDING,
                 receivers: str | None = None):
        try:
            import zmq
            import zmq.asyncio
        except ImportError:
            raise ImportError("--sglang-encoder pushes over ZMQ: pip install 'vitserve[sglang]' (pyzmq)") from None
        self.zmq, self.dtype, self.timeout = zmq, DTYPES[dtype], timeout  # the model's dtype: SGLang's choice
        self.pairing = Pairing(timeout, max_pending)
        self.networks = ReceiverNetworks(receivers)
        self.context = zmq.asyncio.Context()
        self.sockets: OrderedDict[str, object] = OrderedDict()  # kept, by address
        self.busy: dict[object, int] = {}  # every open socket: the messages it is handing over now
        self.watches: dict[object, tuple] = {}  # every open socket's monitor and the task that reads it
        self.used: dict[object, float] = {}  # when each kept socket last took a message
        self.counts: Counter[str] = Counter()  # deliveries, delivery_failures, delivery_timeouts, ...

    def stats(self) -> dict:
        """The tier's figures for /stats and /metrics."""
        return {"parts_encoding": self.pairing.held, "parts_waiting_for_encode": sum(self.pairing.unheld.values()),
                "sockets": len(self.busy), **{k: self.counts[k] for k in (
                    "deliveries", "delivery_failures", "delivery_timeouts", "registration_timeouts")}}

    async def register(self, body: Registration, sender: str | None) -> None:
        """Record a receiver of a part. It registers itself: `sender` (the registration's peer address) must be the
        address its `receive_url` names (a 403 else), in the allowed networks."""
        host, port = receiver_address(body.receive_url)
        ip = await self.networks.resolve(host, "receive_url")
        peer = address_of(sender or "")
        if str(peer) != ip:
            raise NotAllowed(f"receive_url: a receiver registers itself, from its own address; {ip} is not "
                             f"the address this registration came from ({peer or 'unknown'})",
                             "receiver_not_sender", "receive_url")
        self.pairing.register(body, endpoint(ip, port), ip)

    async def serve(self, call: EncodeCall, encode, family) -> None:
        """Serve one /encode part: `encode()` (the part's items, an `Encoded`; its receivers may register
        meanwhile), then the message, built off the event loop when large, pushed to every receiver once all have
        registered. `family()`: the model's family, once the items are encoded. An `embedding_port`'s host is
        checked before anything is encoded. A failure is raised (a domain error where it is this tier's); nothing is
        pushed then."""
        targets = None
        if call.embedding_port is not None:
            ip = await self.networks.resolve(call.prefill_host, "prefill_host")
            ports = call.embedding_port if isinstance(call.embedding_port, list) else [call.embedding_port]
            targets = [endpoint(ip, port) for port in dict.fromkeys(ports)]
        entry = self.pairing.hold(call.req_id) if targets is None else None
        try:
            result = await encode()
            frames = await self._message(call, result, family())
            keep = entry is not None
            if keep:
                try:
                    targets = await self.pairing.receivers(call.req_id, entry)
                except TimedOut:
                    self.counts["registration_timeouts"] += 1
                    raise
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
        if answer_bytes(answered(result)) >= OFF_LOOP_BYTES:
            return await asyncio.to_thread(message, call, result, family, self.dtype)
        return message(call, result, family, self.dtype)

    def _socket(self, target: str, keep: bool):
        """A PUSH socket connected to `target`: the kept one (`keep`), or a new one. Beyond `MAX_SOCKETS` kept,
        the least recently used that sends nothing now are closed, and so is one unused for `KEPT_IDLE` seconds.
        Each socket's monitor (`_watch`) tells a peer that speaks no ZMQ from a connection to come."""
        zmq = self.zmq
        now = time.monotonic()
        for old in [t for t, s in self.sockets.items() if not self.busy[s] and now - self.used[s] > KEPT_IDLE]:
            self._close(self.sockets.pop(old), LINGER_MS)
        sock = self.sockets.get(target) if keep else None
        if sock is not None:
            self.sockets.move_to_end(target)
            self.used[sock] = now
            return sock
        if len(self.busy) >= MAX_OPEN_SOCKETS:  # the idle kept ones go first
            idle = [t for t, s in self.sockets.items() if not self.busy[s]]
            for old in idle[:len(self.busy) - MAX_OPEN_SOCKETS + 1]:
                self._close(self.sockets.pop(old), LINGER_MS)
            if len(self.busy) >= MAX_OPEN_SOCKETS:
                raise QueueFull(f"{MAX_OPEN_SOCKETS} deliveries are under way; retry shortly",
                                "too_many_deliveries")
        sock = self.context.socket(zmq.PUSH)
        self.busy[sock] = 0
        try:
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # a message waits for a connection, not in a pipe to nowhere
            sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
            # libzmq takes a peer whose first bytes are not ZMTP 3's greeting (an HTTP server's answer among them)
            # for a ZMTP 1.0 one and sends to it; with a ZAP domain it refuses ZMTP 1.0 and 2.0 peers, so with
            # IMMEDIATE a message goes only to a peer that completed ZMTP 3's handshake. This context has no ZAP
            # handler: ZMTP 3 peers are not authenticated (SGLang's receivers speak ZMTP 3, mechanism NULL).
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
            if target.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                                              | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                              | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                              | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            self.watches[sock] = (monitor, asyncio.ensure_future(self._watch(monitor)))
            sock.connect(target)
        except zmq.ZMQError as e:
            self._close(sock, 0)
            raise InputRejected(f"cannot connect to {target}: {e}", "invalid_receiver") from None
        if keep:
            self.sockets[target] = sock
            self.used[sock] = now
            idle = [t for t, s in self.sockets.items() if not self.busy[s] and s is not sock]
            for old in idle[:max(0, len(self.sockets) - MAX_SOCKETS)]:
                self._close(self.sockets.pop(old), LINGER_MS)
        return sock

    async def _watch(self, monitor) -> int:
        """Read a socket's monitor until its peer proves to speak no ZMQ: a failed handshake, or a connection closed
        before ZMQ's handshake completed on it (a peer refused as ZMTP 1.0 or 2.0 is only disconnected, and never
        reconnected to); returns that event. A connection closed after a completed handshake is a receiver gone
        for now: the socket reconnects."""
        from zmq.utils.monitor import parse_monitor_message

        zmq, shaken = self.zmq, False
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                shaken = True
            elif event == zmq.EVENT_DISCONNECTED and shaken:
                shaken = False
            else:
                return event

    def _close(self, sock, linger: int) -> None:
        self.busy.pop(sock, None)
        self.used.pop(sock, None)
        monitor, failed = self.watches.pop(sock, (None, None))
        if monitor is not None:
            failed.cancel()
            sock.disable_monitor()
            monitor.close(linger=0)
        sock.close(linger=linger)

    async def _push(self, target: str, frames: list, keep: bool) -> None:
        """Hand the message to `target`'s socket (its frames by reference, not copied), which sends only to a peer
        that completed ZMTP 3's handshake; a socket that cannot take it within the timeout (no connection), or whose
        peer speaks no ZMQ (`_watch`: at once, not retried until the timeout), is closed, a 502. A socket opened for
        this message alone is closed after it, sending what it holds for up to `LINGER_MS`."""
        sock = self._socket(target, keep)
        self.busy[sock] += 1
        send = asyncio.ensure_future(sock.send_multipart(frames, copy=False))
        try:
            failed = self.watches[sock][1]
            await asyncio.wait((send, failed), timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
            if not send.done():
                send.cancel()
                if failed.done():
                    raise self._broken(target, sock, "delivery_failures", "no ZMQ there (a failed handshake)")
                raise self._broken(target, sock, "delivery_timeouts", f"no connection within {self.timeout:g} s")
            try:
                send.result()
            except self.zmq.ZMQError as e:
                raise self._broken(target, sock, "delivery_failures", str(e)) from None
            self.counts["deliveries"] += 1
        except BaseException:
            send.cancel()
            raise
        finally:
            if sock in self.busy:
                self.busy[sock] -= 1
                if not keep:
                    self._close(sock, LINGER_MS)

    def _broken(self, target: str, sock, count: str, why: str) -> DeliveryFailed:
        """A delivery that failed: counted under `count`, its socket closed (a kept one forgotten); the 502."""
        self.counts[count] += 1
        if self.sockets.get(target) is sock:
            del self.sockets[target]
        self._close(sock, 0)
        return DeliveryFailed(f"embedding delivery to {target} failed: {why}", "delivery_failed")

    async def close(self) -> None:
        """Close every socket (what they still hold is sent for up to `LINGER_MS`), then the context."""
        for sock in list(self.busy):
            self._close(sock, LINGER_MS)
        self.sockets.clear()
        await asyncio.sleep(0)  # the monitors' reads see their cancellation
        await asyncio.to_thread(self.context.term)
