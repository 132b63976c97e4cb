"""A front end's backend: the core's (service/core.py) queue, devices and cache, over the front end's pipe.

Records go out from the event loop, one reader thread takes the core's in. Answers are mapped from their spool files
on the reader thread, and their futures resolved on the event loop. The cache entries the core has named to this
front end (its lookups' hits, the answers it keeps) are remembered by key with their mapping (`known`): a key looked
up again is answered from the pages mapped already, without a round trip to the core, which is told afterwards
(`Touched`) so that its LRU stays right, and without mapping the file again (a 12.8 MB answer's fresh mapping costs
its 3,125 page faults when it is sent). The entries a batch stores for another front end are told to this one too
(`Stored`), their records kept unmapped by key (`named`): a hit on one is mapped at that hit and answered here,
without a Lookup, whichever front end computed it (one whose file is gone by then, evicted, is asked of the core).
The core tells every front end which entries it evicts (`Evicted`): their mappings and records go, so the pages of
an evicted entry outlive it only by that record's trip.

The front end's lifecycle mirrors the core's (its Status records); once the core is gone, whatever waits on it gets a
503 `core_lost` and the front end fails.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import threading
from typing import TYPE_CHECKING, cast

from ...encoder.features import Features
from ..decoding import spool
from ..devices.device_protocol import Output
from ..ground.errors import InferenceFailed, Unavailable
from .cache import WAIT
from .core_link import (
    SCRAPE_SECONDS,
    Answers,
    Collect,
    Collected,
    Drop,
    Evicted,
    Item,
    KeepPlans,
    Looked,
    Lookup,
    Plans,
    PlansLookup,
    Release,
    Scrape,
    Scraped,
    Settled,
    Status,
    Stored,
    StoredEntry,
    Submit,
    Touched,
    Up,
)
from .lifecycle import Lifecycle

if TYPE_CHECKING:
    from ..devices.scheduler import WorkItem
    from ..ground.metrics import Metrics
    from .loader import ModelInfo

log = logging.getLogger("vitserve.core")
KNOWN_ENTRIES = 16384  # cache entries a front end remembers by key (a mapping each: one of its file), and as many
# records of entries stored for other front ends (`named`: unmapped)


def _future(item: WorkItem) -> asyncio.Future:
    return cast(asyncio.Future, item.future)  # a front end's items have their futures (the core's have none)


class HubBackend:
    """`collect(kind)`: this front end's part of the server's /stats or /metrics, which the core asks for."""

    takes_signals = False  # the core drains its front ends (a Status record)

    def __init__(self, conn, life: Lifecycle, devices: list[str], collect, metrics: Metrics | None = None):
        self.conn, self.life, self.devices, self.collect, self.metrics = conn, life, devices, collect, metrics
        self.model: ModelInfo | None = None
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.items: dict[int, WorkItem] = {}  # item id -> its WorkItem, until its answer
        self.lookups: dict[int, tuple] = {}  # lookup id -> (its future, the waits it holds by index, its keys)
        self.known: collections.OrderedDict[bytes, Features] = collections.OrderedDict()  # on the event loop
        self.named: collections.OrderedDict[bytes, Output] = collections.OrderedDict()  # on the event loop
        self.scrapes: dict[int, asyncio.Future] = {}
        self.plans: dict[int, asyncio.Future] = {}  # plans lookup id -> its future
        self._loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._read, name="vitserve-core-link", daemon=True)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this front end runs on (`start`'s)."""
        if self._loop is None:
            raise RuntimeError("the core link is not started")
        return self._loop

    # -- lifecycle: the core loads, and stops the devices
    async def start(self) -> None:
        """Read the core's records from now on, and tell it this front end is up."""
        self._loop = asyncio.get_running_loop()
        self.thread.start()
        self.send(Up())

    async def stop(self) -> None:
        pass

    def send(self, message) -> None:
        try:
            with self.lock:
                self.conn.send(message)
        except (OSError, ValueError):
            raise self.lost_error() from None

    @staticmethod
    def lost_error() -> Unavailable:
        return Unavailable("the server's core is gone; it is restarting", "core_lost")

    # -- the engine's calls, on its event loop
    async def lookup(self, keys: list[bytes]) -> list:
        """Per key a hit's Features, a future (another computes it), or None (claimed: compute it); the known
        entries answered here, the rest by the core."""
        answers: list = [self._known_hit(key) for key in keys]
        if hits := [key for key, found in zip(keys, answers) if found is not None]:
            self.send(Touched(hits))
            if self.metrics is not None:
                self.metrics.cache_known_hits.inc(len(hits))
        asked = [i for i, found in enumerate(answers) if found is None]
        if asked:
            lookup = next(self.ids)
            answered = self.loop.create_future()
            self.lookups[lookup] = (answered, {}, [keys[i] for i in asked])
            self.send(Lookup(lookup, [keys[i] for i in asked]))
            for i, found in zip(asked, await answered):
                answers[i] = found
        return answers

    def _known_hit(self, key: bytes) -> Features | None:
        """The entry the core named for `key` before, as mapped then, or mapped now from the record of one it
        stored for another front end; None where none was named (or it was evicted since, or its file is gone)."""
        features = self.known.get(key)
        if features is not None:
            self.known.move_to_end(key)
        elif (record := self.named.pop(key, None)) is not None:
            features = self._features(record, True)
            self._know(key, features, record)
        return features

    def _know(self, key: bytes | None, features: Features | None, record) -> None:
        """Remember a cache entry the core holds, mapped from its file (`record`'s; one whose bytes came through the
        pipe is not kept: it would hold them)."""
        if key is None or features is None or not isinstance(record, Output) or record.path is None:
            return
        self.known[key] = features
        self.known.move_to_end(key)
        if len(self.known) > KNOWN_ENTRIES:
            spool.release([self.known.popitem(last=False)[1]])

    def _name(self, entries: list[StoredEntry]) -> None:
        """Remember the records of entries the core stored for other front ends (`Stored`), unmapped."""
        for entry in entries:
            if entry.key not in self.known:
                self.named[entry.key] = entry.output
                self.named.move_to_end(entry.key)
        while len(self.named) > KNOWN_ENTRIES:
            self.named.popitem(last=False)

    def _forget(self, keys: list[bytes]) -> None:
        """Drop the mappings and records of entries the core evicted; the mappings go on the release thread (their
        files removed by then, the last mapping's drop frees the pages, which the event loop would pay for)."""
        spool.release([self.known.pop(key, None) for key in keys])
        for key in keys:
            self.named.pop(key, None)

    def submit(self, items: list) -> None:
        records = []
        for item in items:
            item.id = next(self.ids)
            self.items[item.id] = item
            records.append(
                Item(
                    item.id, item.image, item.grid, item.mean_pooling, item.param, item.key, item.modality, item.float32
                )
            )
        self.send(Submit(records))

    def drop(self, items: list) -> None:
        for item in items:
            self.items.pop(item.id, None)
        self.send(Drop([item.id for item in items]))

    def release(self, keys: list[bytes]) -> None:
        self.send(Release(keys))

    async def video_plans(self, keys: list[bytes]) -> list:
        lookup = next(self.ids)
        future = self.plans[lookup] = self.loop.create_future()
        try:
            self.send(PlansLookup(lookup, keys))
            return await future
        finally:
            self.plans.pop(lookup, None)

    def keep_video_plans(self, keys: list[bytes], plans: list) -> None:
        self.send(KeepPlans(keys, plans))

    async def scrape(self, kind: str):
        """The whole server's /stats dict or /metrics text, gathered by the core."""
        scrape = next(self.ids)
        future = self.scrapes[scrape] = self.loop.create_future()
        self.send(Scrape(scrape, kind))
        try:
            answer = await asyncio.wait_for(future, SCRAPE_SECONDS * 2)
        finally:
            self.scrapes.pop(scrape, None)
        return answer.encode() if kind == "metrics" else answer

    # -- the reader thread
    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                # (a front end stopping closes its loop, then the core its link: nobody is left to tell)
                with contextlib.suppress(RuntimeError):
                    self.loop.call_soon_threadsafe(self._gone)
                return
            try:
                self._handle(message)
            except Exception as e:  # a fault here would leave requests waiting: this front end fails instead
                log.exception("a record from the core could not be handled")
                self.loop.call_soon_threadsafe(self.life.fail, f"internal error: {type(e).__name__}: {e}")
                return

    def _handle(self, message) -> None:
        call = self.loop.call_soon_threadsafe
        match message:
            case Status():
                call(self._mirror, message)
            case Answers(answers):
                call(
                    self._done,
                    # (the core answers in Output records)
                    [
                        (done, self._features(cast(Output, done.output), done.keep))
                        for done in answers
                        if done.error is None
                    ],
                    [done for done in answers if done.error is not None],
                )
            case Looked(lookup, found):
                features = [self._features(a, True) if a not in (None, WAIT) else a for a in found]
                call(self._looked, lookup, features, found)
            case Evicted(keys):
                call(self._forget, keys)
            case Stored(entries):
                call(self._name, entries)
            case Settled(lookup, i, output):
                settled = None if output is None else self._features(cast(Output, output), True)
                call(self._settled, lookup, i, settled, output)
            case Collect(scrape, kind):  # answered from a thread of its own: this one keeps reading
                threading.Thread(target=lambda: self.send(Collected(scrape, self.collect(kind))), daemon=True).start()
            case Scraped(scrape, answer):
                call(self._scraped, scrape, answer)
            case Plans(lookup, plans):
                call(self._planned, lookup, plans)

    @staticmethod
    def _features(output: Output, keep: bool) -> Features | None:
        """An Output record (its grid set by the core) as the image's Features; None where its file is gone (an
        evicted cache entry: a hit that is then a miss, computed here)."""
        try:
            return output.features(keep)
        except OSError:
            return None

    # -- on the event loop
    def _mirror(self, status: Status) -> None:
        if status.model is not None:
            self.model = status.model
            self.devices = status.devices or self.devices
        self.life.mirror(status.state, status.error)

    def _gone(self) -> None:
        """The core is gone: what waits on it (images, cache lookups and waits, scrapes) gets a 503 `core_lost` now,
        so that this front end's requests end and it exits, failed, instead of waiting for answers that never come."""
        error = self.lost_error()
        futures = [item.future for item in self.items.values()] + [*self.scrapes.values(), *self.plans.values()]
        for answered, waits, _ in self.lookups.values():
            futures += [answered, *waits.values()]
        self.items.clear()
        self.lookups.clear()
        for future in futures:
            if future is not None and not future.done():
                future.set_exception(error)
        self.life.fail("the server's core went away")

    def _done(self, answers: list, errors: list) -> None:
        for done, output in answers:
            item = self.items.pop(done.id, None)
            if item is None or _future(item).done():
                continue
            item.queue_s, item.inference_s = done.queue_s, done.inference_s
            if done.keep:
                self._know(item.key, output, done.output)
            if output is None:
                _future(item).set_exception(InferenceFailed(f"{item.param}: its answer was lost", "internal_error"))
            else:
                _future(item).set_result(output)
        for done in errors:
            item = self.items.pop(done.id, None)
            if item is not None and not _future(item).done():
                item.queue_s, item.inference_s = done.queue_s, done.inference_s
                _future(item).set_exception(done.error.error())

    def _looked(self, lookup: int, answers: list, records: list) -> None:
        answered, waits, keys = self.lookups[lookup]
        for key, answer, record in zip(keys, answers, records):
            self._know(key, answer, record)
        out = []
        for i, answer in enumerate(answers):
            if answer == WAIT:
                waits[i] = self.loop.create_future()
                answer = waits[i]
            out.append(answer)
        if not waits:
            del self.lookups[lookup]
        if not answered.done():
            answered.set_result(out)

    def _settled(self, lookup: int, i: int, output, record) -> None:
        answered, waits, keys = self.lookups.get(lookup, (None, {}, []))
        if i < len(keys):
            self._know(keys[i], output, record)
        future = waits.pop(i, None)
        if not waits:
            self.lookups.pop(lookup, None)
        if future is not None and not future.done():
            future.set_result(output)

    def _scraped(self, scrape: int, answer) -> None:
        future = self.scrapes.get(scrape)
        if future is not None and not future.done():
            future.set_result(answer)

    def _planned(self, lookup: int, plans: list) -> None:
        future = self.plans.get(lookup)
        if future is not None and not future.done():
            future.set_result(plans)
