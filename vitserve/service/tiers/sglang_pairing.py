"""A part and its receivers paired (docs/sglang.md, Waiting and bounds): each scheduler rank's `/scheduler_receive_url`
registration meets its part's `/encode` here, by `req_id`, whichever comes first. An encoded part waits up to the
timeout for all its receivers; a registration whose part has not come is dropped after the timeout, and a bounded
number of such parts wait at once (in all, and per host)."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from typing import cast

from ..ground.errors import InputRejected, QueueFull, TimedOut
from .sglang_schemas import Registration

TIMEOUT = 180.0  # seconds: SGLang's SGLANG_ENCODER_SEND_TIMEOUT and SGLANG_ENCODER_REQ_TIMEOUT
MAX_PENDING = 4096  # parts (req_ids) with registrations and no /encode yet, at once
MAX_PENDING_PER_HOST = 256  # of those, the parts whose receivers are on one host


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

    def __init__(
        self,
        timeout: float = TIMEOUT,
        max_pending: int = MAX_PENDING,
        max_per_host: int = MAX_PENDING_PER_HOST,
        clock=time.monotonic,
    ):
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
            host = cast(str, entry.host)  # an unheld entry was made by a registration, with its host
            self.unheld[host] -= 1
            if not self.unheld[host]:
                del self.unheld[host]

    def register(self, body: Registration, target: str, host: str) -> None:
        """Record receiver `target` (an endpoint on `host`) of `body.req_id`; a `receive_count` unlike the part's
        earlier one, or a receiver more than it, is a 400; a new unheld part over the bounds a 429."""
        now = self._sweep()
        entry = self.entries.get(body.req_id)
        if entry is None:
            if sum(self.unheld.values()) >= self.max_pending or self.unheld[host] >= self.max_per_host:
                raise QueueFull(
                    f"{self.max_pending} parts (or {self.max_per_host} for receivers on one "
                    "host) wait for their /encode already",
                    "too_many_pending",
                    "req_id",
                )
            entry = self.entries[body.req_id] = Receivers(now + self.timeout, host)
            self.unheld[host] += 1
        if entry.count is None:
            entry.count = body.receive_count
        if body.receive_count != entry.count:
            raise InputRejected(
                f"inconsistent receive_count for req_id {body.req_id[:100]!r}: registered "
                f"{entry.count}, got {body.receive_count}",
                "inconsistent_receive_count",
                "receive_count",
            )
        if target not in entry.endpoints and len(entry.endpoints) >= entry.count:
            raise InputRejected(
                f"more receivers than receive_count ({entry.count}) for req_id {body.req_id[:100]!r}",
                "too_many_receivers",
                "receive_url",
            )
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
                raise TimedOut(
                    f"req_id {req_id[:100]!r}: {have} registered within {self.timeout:g} s", "registration_timeout"
                ) from None
        return list(entry.endpoints)
