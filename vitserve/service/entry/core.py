"""Several front ends on one port (`--api-servers N`): the core, its links to the front ends, and the processes.

    `vitserve serve` (the core)                          N front ends (processes), one listening socket
      the device processes (one per device)      <--->     HTTP, admission, parsing, cache keys, decoding
      the image queue and a device worker each               (their own decode workers), answers
      the embedding cache's index
      the whole server's /metrics and /stats

The core holds a backend.LocalBackend (the same queue, devices, cache and batch accounting as a server of one
process) and each front end's engine a hub.HubBackend, whose calls arrive here as records on its link. The core
binds the port, starts the device processes and the front ends, and then only moves small records: a
front end sends each decoded image as the name of its spool file (the pixels never cross the core), the core puts
it in the one image queue that every device takes its batches from (batches fill from every front end at once),
and a device process writes each image's answer to a spool file of its own whose name the core hands back. No byte
of a request or an answer passes through the core.

The embedding cache lives in the core, so that a repeat is answered whichever front end receives it: its entries
are the answers' spool files (kept instead of removed), its index is the core's, a hit is a file's name, and a
front end maps the file (no copy). An image being computed is computed once: a front end that asks for it while
another computes it waits for that answer (single flight, as in one process).

Lifecycle: the core is ready when every device is; each front end mirrors the core's state on /ready. On SIGTERM
the core tells every front end to drain (each stops accepting and answers what it admitted), waits for them to
exit, then stops the devices. A front end that dies is started again on the same socket while the others serve
(its images leave the queue, the cache keys it was computing are let go); one that dies before it is up is tried
again after 1 s and 4 s, then the server fails. A device process that dies fails the whole server (exit 1, for a
supervisor to restart it), as a single process would.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, cast

from ..devices.scheduler import WorkItem
from ..ground.errors import ErrorRecord
from ..ground.metrics import merged_metrics
from ..ground.settings import Settings
from ..ground.timeline import mark
from ..pipeline.backend import LocalBackend, Result
from ..pipeline.core_link import (
    SCRAPE_SECONDS,
    Answers,
    Collect,
    Collected,
    Done,
    Drop,
    Evicted,
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
from ..pipeline.lifecycle import Lifecycle, State
from ..pipeline.stats import server_stats
from .fronts import front_settings

if TYPE_CHECKING:
    from ..devices.device_protocol import Output

log = logging.getLogger("vitserve.core")


# ---- the core ----------------------------------------------------------------------------------------------------
class Link:
    """The core's end of one front end's pipe: sends from any thread, one reader thread; the origin of the items
    it submitted (`items`, by id, until answered). `up`: the front end said it has started. A front end started
    again gets a new Link (same index)."""

    def __init__(self, index: int, conn, process):
        self.index, self.conn, self.process = index, conn, process
        self.lock = threading.RLock()  # sends, one at a time; held over a lookup and its answer (Core._handle)
        self.open, self.up = True, False
        self.items: dict[int, WorkItem] = {}  # item id -> its WorkItem, while queued or running
        self.items_lock = threading.Lock()

    def send(self, message) -> None:
        if not self.open:
            return
        try:
            with self.lock:
                self.conn.send(message)
        except (OSError, ValueError):  # the front end is gone: the core notices on its reader
            self.open = False

    def deliver(self, results: list[Result]) -> None:
        """A batch's answers for this front end, in one record."""
        with self.items_lock:
            for result in results:
                self.items.pop(result.item.id, None)
        answers = [
            Done(
                r.item.id,
                r.output,
                ErrorRecord.of(r.error) if r.error is not None else None,
                r.keep,
                r.item.queue_s,
                r.inference_s,
            )
            for r in results
        ]
        mark("core answered")
        self.send(Answers(answers))
        if not self.open:  # its front end is gone: nobody maps these files
            for done in answers:
                if done.output is not None and not done.keep:
                    done.output.discard()


class Core:
    """A LocalBackend (the queue, the devices, the cache) behind the links of a server's front ends (see the
    module docstring)."""

    def __init__(self, settings: Settings, fronts: int):
        from ..decoding.spool import spool_prefix
        from ..ground.metrics import Metrics

        self.settings, self.fronts = settings, fronts
        self.metrics = Metrics()
        self.life = Lifecycle(self.metrics, log)
        self.life.listeners.append(self.broadcast)
        devices, dtype = settings.devices.resolve()
        self.prefix = spool_prefix(settings.decoding.spool_dir)
        self.backend = LocalBackend(
            settings, self.metrics, self.life, devices, dtype, self.prefix, process_each=True, records=True
        )
        self.links: list[Link] = []
        self.backend.cache.evicted = self.evicted
        self.backend.stored = self.stored
        self.replaced = 0  # front ends that died and were started again
        self.scrapes: dict[int, dict] = {}
        self.scrape_ids = itertools.count()
        self.scraped = threading.Condition()
        self.failed = threading.Event()
        self.front_up = lambda: None  # called as each front end comes up (before it accepts on the port)

    # -- lifecycle
    def load(self) -> None:
        """Load the model (a process per device), then serve: every front end hears that the server is ready."""
        from ..pipeline.loader import serving_text

        s, backend = self.settings, self.backend
        if backend.load(also=f", {self.fronts} front ends") and self.life.state is State.READY:
            log.info(
                "ready in %.2f s: %s, %d front ends on port %d",
                backend.load_seconds,
                serving_text(
                    s,
                    backend.devices,
                    True,
                    backend.dtype,
                    backend.attention(),
                    front_settings(s, self.fronts).decoding.decode_workers * self.fronts,
                ),
                self.fronts,
                s.server.port,
            )

    def status(self) -> Status:
        return Status(
            self.life.state, self.life.error, self.backend.model, self.backend.devices if self.backend.workers else []
        )

    def broadcast(self) -> None:
        """The lifecycle moved: every front end hears it."""
        if self.life.state is State.FAILED:
            self.failed.set()
        status = self.status()
        for link in self.links:
            link.send(status)

    def evicted(self, keys: list[bytes]) -> None:
        """Cache entries evicted (their files removed): every front end forgets them and lets their mappings go."""
        record = Evicted(keys)
        for link in list(self.links):
            link.send(record)

    def stored(self, results: list[Result]) -> None:
        """A batch's answers the cache stored (Output records): every front end but each one's own hears of them
        before that one is answered, so that a hit on one is answered from its file by whichever front end gets
        it, without a Lookup."""
        for link in list(self.links):
            told = [
                StoredEntry(cast(bytes, r.item.key), cast("Output", r.output))
                for r in results
                if r.item.origin is not link
            ]
            if told:
                link.send(Stored(told))

    def fail(self, reason: str) -> None:
        self.life.fail(reason)

    def stop(self) -> None:
        """After the front ends are gone: the workers finish what they hold, the devices close, the files go."""
        from ..decoding import spool

        self.backend.close()
        spool.clear(self.prefix)

    def lost(self, link: Link) -> None:
        """A front end is gone: its images leave the queue (nobody would read their answers), and the cache keys it
        was computing are let go (whoever waits on one computes it)."""
        link.open = False
        with link.items_lock:
            dropped = list(link.items.values())
            link.items.clear()
        self.backend.queue.drop(dropped)
        self.backend.cache.release(owner=link)

    # -- one front end's records, on its reader thread
    def serve_link(self, link: Link) -> None:
        link.send(self.status())
        while True:
            try:
                message = link.conn.recv()
            except (EOFError, OSError):  # the front end is gone, and every record it sent has been handled
                self.lost(link)
                return
            try:
                self._handle(link, message)
            except Exception as e:  # a fault here would leave the front end waiting: the server restarts instead
                log.exception("a record from front end %d could not be handled", link.index)
                self.fail(f"internal error in the core: {type(e).__name__}: {e}")

    def _handle(self, link: Link, message) -> None:
        match message:
            case Submit(records):
                self._submit(link, records)
            case Lookup(lookup, keys):
                with link.lock:  # a key settled meanwhile is told to this front end after the lookup's answer
                    answers = self.backend.cache.lookup(
                        keys, link, lambda i: lambda entry: link.send(Settled(lookup, i, entry))
                    )
                    link.send(Looked(lookup, answers))
            case Drop(ids):
                with link.items_lock:
                    dropped = [w for w in (link.items.pop(i, None) for i in ids) if w]
                self.backend.queue.drop(dropped)
            case Release(keys):
                self.backend.cache.release(keys)
            case Touched(keys):
                self.backend.cache.touch(keys)
            case PlansLookup(lookup, keys):
                link.send(Plans(lookup, self.backend.plans.get_all(keys)))
            case KeepPlans(keys, plans):
                self.backend.plans.put_all(keys, plans)
            case Up():
                link.up = True
                self.front_up()
            case Scrape(scrape, kind):
                threading.Thread(target=self._scrape, args=(link, scrape, kind), daemon=True).start()
            case Collected(scrape, part):
                with self.scraped:
                    self.scrapes.get(scrape, {})[link.index] = part
                    self.scraped.notify_all()

    def _submit(self, link: Link, records: list) -> None:
        from ..devices.scheduler import WorkItem

        mark("core queued")
        items = [
            WorkItem(
                r.image,
                r.grid,
                None,
                r.mean_pooling,
                r.param,
                r.key,
                origin=link,
                id=r.id,
                modality=r.modality,
                float32=r.float32,
            )
            for r in records
        ]
        with link.items_lock:
            link.items.update((item.id, item) for item in items)
        self.backend.queue.put(items)

    # -- the whole server's /metrics and /stats
    def _scrape(self, asker: Link, scrape: int, kind: str) -> None:
        parts = self._collect(kind)
        try:
            answer = self.merged(kind, parts)
        except Exception as e:  # a scrape never takes the core down
            log.exception("scrape failed")
            answer = {"error": f"{type(e).__name__}: {e}"} if kind == "stats" else ""
        asker.send(Scraped(scrape, answer))

    def _collect(self, kind: str) -> list:
        """Every live front end's part, in front end order; one that does not answer in time is left out."""
        ident = next(self.scrape_ids)
        with self.scraped:
            self.scrapes[ident] = {}
        live = [link for link in self.links if link.open]
        for link in live:
            link.send(Collect(ident, kind))
        deadline = time.monotonic() + SCRAPE_SECONDS
        with self.scraped:
            while len(self.scrapes[ident]) < len(live) and (left := deadline - time.monotonic()) > 0:
                self.scraped.wait(left)
            return [part for _, part in sorted(self.scrapes.pop(ident).items())]

    def merged(self, kind: str, parts: list):
        from prometheus_client import generate_latest

        if kind == "metrics":
            return merged_metrics([generate_latest(self.metrics.registry).decode(), *parts])
        return server_stats(
            self.settings,
            self.backend.stats(recent=True),
            parts,
            api_servers=self.fronts,
            api_servers_replaced=self.replaced,
        )


# ---- processes ---------------------------------------------------------------------------------------------------
