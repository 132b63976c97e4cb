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

`SGLangTier` serves both endpoints from its parts, one module a job:

* sglang_schemas.py: the two bodies and their bounds (`EncodeCall`, `Registration`, `bounded`);
* sglang_addresses.py: where features may go (`ReceiverNetworks`, `--sglang-receivers`), the address checked;
* sglang_pairing.py: a part and its registrations paired (`Pairing`), the waits and their bounds;
* sglang_frames.py: the message, SGLang's two frames (`message`);
* sglang_push.py: the PUSH sockets the message leaves by (`PushSockets`).

The parts being encoded are bounded by admission (the gate admits /encode), the sockets by
`sglang_push.MAX_OPEN_SOCKETS`.
"""

from __future__ import annotations

import asyncio
from typing import cast

from ...encoder.vision_encoder import DTYPES
from ..api.outputs import OFF_LOOP_BYTES, answer_bytes
from ..ground.errors import NotAllowed, TimedOut
from ..pipeline.engine import Encoded
from .sglang_addresses import ReceiverNetworks, address_of, endpoint, receiver_address
from .sglang_frames import message
from .sglang_pairing import MAX_PENDING, TIMEOUT, Pairing
from .sglang_push import COUNTED, PushSockets, pyzmq
from .sglang_schemas import EncodeCall, Registration


class SGLangTier:
    """One front end's SGLang encoder side: the pairing of parts with receivers, and the PUSH sockets the messages
    leave by. Features go only to the allowed networks (`receivers`: `--sglang-receivers`, see `ReceiverNetworks`),
    and a receiver registers itself: a registration comes from the address it names."""

    def __init__(
        self, dtype: str, timeout: float = TIMEOUT, max_pending: int = MAX_PENDING, receivers: str | None = None
    ):
        zmq = pyzmq()  # first: without pyzmq there is no tier
        self.dtype, self.timeout = DTYPES[dtype], timeout  # the model's dtype: SGLang's choice
        self.pairing = Pairing(timeout, max_pending)
        self.networks = ReceiverNetworks(receivers)
        self.sockets = PushSockets(zmq, timeout)
        self.registration_timeouts = 0

    def stats(self) -> dict:
        """The tier's figures for /stats and /metrics."""
        return {
            "parts_encoding": self.pairing.held,
            "parts_waiting_for_encode": sum(self.pairing.unheld.values()),
            "sockets": len(self.sockets.busy),
            **{k: self.sockets.counts[k] for k in COUNTED},
            "registration_timeouts": self.registration_timeouts,
        }

    async def register(self, body: Registration, sender: str | None) -> None:
        """Record a receiver of a part. It registers itself: `sender` (the registration's peer address) must be the
        address its `receive_url` names (a 403 else), in the allowed networks."""
        host, port = receiver_address(body.receive_url)
        ip = await self.networks.resolve(host, "receive_url")
        peer = address_of(sender or "")
        if str(peer) != ip:
            raise NotAllowed(
                f"receive_url: a receiver registers itself, from its own address; {ip} is not "
                f"the address this registration came from ({peer or 'unknown'})",
                "receiver_not_sender",
                "receive_url",
            )
        self.pairing.register(body, endpoint(ip, port), ip)

    async def serve(self, call: EncodeCall, encode, family) -> None:
        """Serve one /encode part: `encode()` (the part's items, an `Encoded`; its receivers may register
        meanwhile), then the message, built off the event loop when large, pushed to every receiver once all have
        registered. `family()`: the model's family, once the items are encoded. An `embedding_port`'s host is
        checked before anything is encoded. A failure is raised (a domain error where it is this tier's); nothing is
        pushed then."""
        targets = None
        if call.embedding_port is not None:
            host = cast(str, call.prefill_host)  # an embedding_port comes with its host (EncodeCall's check)
            ip = await self.networks.resolve(host, "prefill_host")
            ports = call.embedding_port if isinstance(call.embedding_port, list) else [call.embedding_port]
            targets = [endpoint(ip, port) for port in dict.fromkeys(ports)]
        entry = self.pairing.hold(call.req_id) if targets is None else None
        try:
            result = await encode()
            frames = await self._message(call, result, family())
            keep = entry is not None
            if entry is not None:  # (keep)
                try:
                    targets = await self.pairing.receivers(call.req_id, entry)
                except TimedOut:
                    self.registration_timeouts += 1
                    raise
            assert targets is not None  # the embedding_port's, else the registered ones
            sent = await asyncio.gather(
                *(self.sockets.push(target, frames, keep) for target in targets), return_exceptions=True
            )
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

    async def close(self) -> None:
        """Close every socket (what they still hold is sent for up to `sglang_push.LINGER_MS`), then the context."""
        await self.sockets.close()
