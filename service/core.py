"""Several front ends on one port (`--api-servers N`): the core, and the front ends' link to it.

    `vitserve serve` (the core)                          N front ends (processes), one listening socket
      the device processes (one per device)      <--->     HTTP, admission, parsing, cache keys, decoding
      the image queue and a device worker each               (their own decode workers), answers
      the embedding cache's index
      the whole server's /metrics and /stats

The core binds the port, starts the device processes and the front ends, and then only moves small records: a
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

import collections
import dataclasses
import itertools
import logging
import math
import multiprocessing
import os
import signal
import socket
import threading
import time

from .core_link import SCRAPE_SECONDS, Done, Status, error_record
from .errors import EngineError, ErrorRecord
from .settings import Settings
from .signals import StopSignals

log = logging.getLogger("vitserve.core")



# ---- the core ----------------------------------------------------------------------------------------------------
class FileCache:
    """The embedding cache's index in the core: key -> the Output record whose spool file holds the answer, an LRU
    bounded in bytes; evicted files are removed (a front end that mapped one keeps its pages)."""

    def __init__(self, limit: int, metrics):
        self.limit, self.metrics, self.bytes = limit, metrics, 0
        self.entries: collections.OrderedDict[bytes, object] = collections.OrderedDict()
        self.claims: dict[bytes, list] = {}  # key being computed -> who waits for it: (link, lookup id, index)
        self.owners: dict[bytes, object] = {}  # key being computed -> the link of the front end computing it

    def get(self, key: bytes):
        output = self.entries.get(key)
        if output is not None:
            self.entries.move_to_end(key)
        return output

    def put(self, key: bytes, output) -> bool:
        """Keep `output`'s file as the entry of `key` (False: too large, or held already: the caller keeps it)."""
        size = output.nbytes
        if output.path is None or size > self.limit or key in self.entries:
            return False
        while self.bytes + size > self.limit:
            _, evicted = self.entries.popitem(last=False)
            self.bytes -= evicted.nbytes
            evicted.discard()
            self.metrics.cache_evictions.inc()
        self.entries[key] = output
        self.bytes += size
        self.metrics.cache_bytes.set(self.bytes)
        self.metrics.cache_entries.set(len(self.entries))
        return True

    def clear(self) -> None:
        for output in self.entries.values():
            output.discard()
        self.entries.clear()


class Link:
    """The core's end of one front end's pipe: sends from any thread, one reader thread. `up`: the front end said it
    has started. A front end started again gets a new Link (same index)."""

    def __init__(self, index: int, conn, process):
        self.index, self.conn, self.process = index, conn, process
        self.lock = threading.Lock()
        self.open, self.up = True, False

    def send(self, message) -> None:
        if not self.open:
            return
        try:
            with self.lock:
                self.conn.send(message)
        except (OSError, ValueError):  # the front end is gone: the core notices on its reader
            self.open = False


class Core:
    """The queue, the devices and the cache of a server with several front ends (see the module docstring)."""

    def __init__(self, settings: Settings, fronts: int):
        from .metrics import Metrics
        from .scheduler import ImageQueue
        from .spool import spool_prefix
        from .settings import resolve_devices

        self.settings, self.fronts = settings, fronts
        self.metrics = Metrics()
        self.queue = ImageQueue(self.metrics)
        self.cache = FileCache(settings.cache_bytes, self.metrics)
        self.devices, self.dtype = resolve_devices(settings)
        self.prefix = spool_prefix(settings.spool_dir)
        self.state, self.error, self.model = "loading", None, None
        self.workers: list = []
        self.links: list[Link] = []
        self.items: dict[tuple[Link, int], object] = {}  # (front end's link, item id) -> its WorkItem, while queued
        self.replaced = 0  # front ends that died and were started again
        self.batch_sizes: dict[int, int] = {}
        self.lock = threading.Lock()  # the cache, the claims and the items (the readers' and the workers' threads)
        self.scrapes: dict[int, dict] = {}
        self.scrape_ids = itertools.count()
        self.scraped = threading.Condition()
        self.started, self.load_seconds = time.time(), 0.0
        self.failed = threading.Event()

    # -- lifecycle
    def load(self) -> None:
        """Load the model in one process per device (side by side), then serve: the workers start and every front
        end hears that the server is ready. A failure is the server's (`fail`)."""
        from .device_process import start_devices
        from .engine import ModelInfo, serving_text
        from .worker import DeviceWorker

        s, start = self.settings, time.perf_counter()
        log.info("loading %s (%s) on %s as %s, one process per device, %d front ends", s.model, s.load_format,
                 ", ".join(self.devices), self.dtype, self.fronts)
        try:
            config, preprocess_config, video_config, processes = start_devices(
                s, self.devices, self.dtype, self.prefix, records=True, started=lambda: self.set_state("capturing"))
        except Exception as e:
            self.fail(f"model load failed: {type(e).__name__}: {e}")
            return
        self.model = ModelInfo(config, preprocess_config, video_config)
        max_patches = s.max_batch_tokens * config.merge_unit
        self.workers = [DeviceWorker(p, self.queue, max_patches, s.max_batch_wait_ms / 1e3, self.done)
                        for p in processes]
        self.metrics.watch_runners(lambda: {w.name: w.device.runner_stats() for w in self.workers})
        for worker in self.workers:
            worker.start()
        self.load_seconds = time.perf_counter() - start
        if self.state == "capturing":
            self.set_state("ready")
            self.metrics.ready.set(1)
            log.info("ready in %.2f s: %s, %d front ends on port %d", self.load_seconds, serving_text(
                s, [w.name for w in self.workers], True, self.dtype, processes[0].runner_stats().get("attention", {}),
                front_settings(s, self.fronts).decode_workers * self.fronts), self.fronts, s.port)

    def set_state(self, state: str, error: str | None = None) -> None:
        self.state, self.error = state, error
        status = Status(state, error, self.model, [w.name for w in self.workers])
        for link in self.links:
            link.send(status)

    def fail(self, reason: str) -> None:
        if self.state != "failed":
            log.error("%s", reason)
            self.metrics.ready.set(0)
            self.set_state("failed", reason)
            self.failed.set()

    def stop(self) -> None:
        """After the front ends are gone: the workers finish what they hold, the devices close, the files go."""
        from . import spool

        self.queue.close()
        for worker in self.workers:
            worker.thread.join(60)
            worker.device.close()
        with self.lock:
            self.cache.clear()
        spool.clear(self.prefix)

    def lost(self, link: Link) -> None:
        """A front end is gone: its images leave the queue (nobody would read their answers), and the cache keys it
        was computing are let go (whoever waits on one computes it)."""
        link.open = False
        with self.lock:
            dropped = [self.items.pop(key) for key in [key for key in self.items if key[0] is link]]
            settled = [m for key in [k for k, owner in self.cache.owners.items() if owner is link]
                       for m in self._settle(key, None)]
        self.queue.drop(dropped)
        for waiter, record in settled:
            waiter.send(record)

    # -- one front end's records, on its reader thread
    def serve_link(self, link: Link) -> None:
        link.send(Status(self.state, self.error, self.model, [w.name for w in self.workers]))
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
        from .scheduler import WorkItem

        kind = message[0]
        if kind == "submit":
            items = []
            with self.lock:
                for item in message[1]:
                    work = WorkItem(item.image, item.grid, None, item.mean_pooling, item.param,
                                    origin=(link, item.id, item.key), modality=item.modality)
                    self.items[link, item.id] = work
                    items.append(work)
            self.queue.put(items)
        elif kind == "lookup":
            _, lookup, keys = message
            answers = []
            with self.lock:
                for i, key in enumerate(keys):
                    if (hit := self.cache.get(key)) is not None:
                        answers.append(hit)
                    elif key in self.cache.claims:
                        self.cache.claims[key].append((link, lookup, i))
                        answers.append("wait")
                    else:
                        self.cache.claims[key] = []
                        self.cache.owners[key] = link
                        answers.append(None)
            link.send(("looked", lookup, answers))
        elif kind == "drop":
            with self.lock:
                dropped = [w for w in (self.items.pop((link, i), None) for i in message[1]) if w]
            self.queue.drop(dropped)
        elif kind == "release":
            with self.lock:
                settled = [m for key in message[1] for m in self._settle(key, None)]
            for waiter, record in settled:
                waiter.send(record)
        elif kind == "up":
            link.up = True
        elif kind == "scrape":
            threading.Thread(target=self._scrape, args=(link, message[1], message[2]), daemon=True).start()
        elif kind == "collected":
            with self.scraped:
                self.scrapes.get(message[1], {})[link.index] = message[2]
                self.scraped.notify_all()

    def _settle(self, key: bytes, output) -> list:
        """Under the lock: the claim on `key` ends with `output` (kept by the cache) or None (waiters compute);
        the records to send its waiters (after the lock: a send may wait for a full pipe)."""
        self.cache.owners.pop(key, None)
        return [(link, ("settled", lookup, i, output)) for link, lookup, i in self.cache.claims.pop(key, ())]

    # -- a device's batch, on its worker's thread
    def done(self, worker, batch: list, outputs, error: EngineError | None, seconds: float) -> None:
        try:
            self._done(worker, batch, outputs, error, seconds)
        except Exception as e:  # a fault here would leave the batch's requests waiting: the server restarts instead
            log.exception("a batch's answers could not be handed back")
            self.fail(f"internal error in the core: {type(e).__name__}: {e}")

    def _done(self, worker, batch: list, outputs, error: EngineError | None, seconds: float) -> None:
        from .metrics import count_items

        m = self.metrics
        if error is not None and error.code == "device_lost":
            self.fail(error.message)
        if error is None:
            m.inference_seconds.labels(worker.name).observe(seconds)
            m.batch_tokens.observe(sum(i.patches for i in batch) // self.model.config.merge_unit)
            m.batch_images.observe(len(batch))
            count_items(m, worker.name, batch)
            m.record("inference", seconds)
        by_link: dict[Link, list] = collections.defaultdict(list)
        settled = []
        with self.lock:
            if error is None:
                self.batch_sizes[len(batch)] = self.batch_sizes.get(len(batch), 0) + 1
            for n, item in enumerate(batch):
                link, id, key = item.origin
                self.items.pop((link, id), None)
                m.queue_seconds.observe(item.queue_s)
                m.record("queue", item.queue_s)
                output = None if error is not None else outputs[n]
                if output is None or isinstance(output, ErrorRecord):  # the batch's error, or this image's
                    record = error_record(error) if error is not None else \
                        ("InputRejected", f"{item.param}: {output.message}", output.code, item.param)
                    if key is not None:
                        settled += self._settle(key, None)
                    by_link[link].append(Done(id, error=record, queue_s=item.queue_s, inference_s=seconds))
                    continue
                output.grid = item.grid
                keep = key is not None and self.cache.put(key, output)
                if key is not None:
                    settled += self._settle(key, output if keep else None)
                by_link[link].append(Done(id, output, keep=keep, queue_s=item.queue_s, inference_s=seconds))
        for link, answers in by_link.items():
            link.send(("done", answers))
            if not link.open:  # its front end is gone: nobody maps these files
                for done in answers:
                    if done.output is not None and not done.keep:
                        done.output.discard()
        for waiter, record in settled:
            waiter.send(record)

    # -- the whole server's /metrics and /stats
    def _scrape(self, asker: Link, scrape: int, kind: str) -> None:
        ident = next(self.scrape_ids)
        with self.scraped:
            self.scrapes[ident] = {}
        live = [link for link in self.links if link.open]
        for link in live:
            link.send(("collect", ident, kind))
        deadline = time.monotonic() + SCRAPE_SECONDS
        with self.scraped:
            while len(self.scrapes[ident]) < len(live) and (left := deadline - time.monotonic()) > 0:
                self.scraped.wait(left)
            parts = [part for _, part in sorted(self.scrapes.pop(ident).items())]
        try:
            answer = merged_metrics(self.metrics, parts) if kind == "metrics" else self.stats(parts)
        except Exception as e:  # a scrape never takes the core down
            log.exception("scrape failed")
            answer = {"error": f"{type(e).__name__}: {e}"} if kind == "stats" else ""
        asker.send(("scraped", scrape, answer))

    def stats(self, fronts: list[dict]) -> dict:
        """/stats of the whole server: the core's (devices, queue, batches, cache) and every front end's summed."""
        from .. import __version__
        from .metrics import percentiles
        from .worker import workers_stats

        s = self.settings
        devices, runners = workers_stats(self.workers)
        recent = collections.defaultdict(list)
        for part in [{"recent": self.metrics.recent()}, *fronts]:
            for phase, values in part["recent"].items():
                recent[phase] += values
        total = lambda name: sum(part[name] for part in fronts)  # noqa: E731
        count = lambda name: sum(int(part["counters"].get(name, 0)) for part in fronts)  # noqa: E731
        memory = {use: {"limit_bytes": sum(p["memory"][use]["limit_bytes"] for p in fronts),
                        "bytes": sum(p["memory"][use]["bytes"] for p in fronts)} for use in ("bodies", "decode")}
        with self.lock:
            cache = {"enabled": self.cache.limit > 0, "limit_bytes": self.cache.limit, "bytes": self.cache.bytes,
                     "entries": len(self.cache.entries), "hits": count("hits"), "misses": count("misses"),
                     "evictions": int(self.metrics.registry.get_sample_value("vitserve_cache_evictions_total") or 0)}
            histogram = {str(k): v for k, v in sorted(self.batch_sizes.items())}
        batching = s.batching(total("decode_workers")) | {"api_servers": self.fronts}
        tiers: dict[str, dict] = {}
        for part in fronts:  # each front end's encoder tiers, summed
            for name, figures in part.get("tiers", {}).items():
                summed = tiers.setdefault(name, dict.fromkeys(figures, 0))
                for key, value in figures.items():
                    summed[key] = summed.get(key, 0) + value
        return {"version": __version__, "model": s.model_name, "state": self.state, "error": self.error,
                "device": self.devices[0], "devices": devices, "latency": percentiles(recent),
                "dtype": self.dtype, "family": self.model.config.family if self.model else None,
                "uptime_seconds": round(time.time() - self.started, 3), "load_seconds": round(self.load_seconds, 3),
                "requests_in_flight": total("requests_in_flight"), "queue_depth": len(self.queue),
                "tiers": tiers, "batch_size_histogram": histogram, "spool": self.prefix and os.path.dirname(self.prefix),
                "device_processes": True, "decode_workers_replaced": total("decode_workers_replaced"),
                "api_servers_replaced": self.replaced,
                "cache": cache, "batching": batching, "api_servers": len(fronts),
                "eager_runs": sum(r.get("eager_runs", 0) for r in runners), "memory": memory,
                "eager_fallbacks": sum(r.get("eager_fallbacks", 0) for r in runners)}


def merged_metrics(core_metrics, fronts: list[str]) -> str:
    """The exposition text of every process's registry in one: the same series summed (counters, histograms, the
    gauges of what each holds), where one value stands for the server (its build, its readiness, the start time) the
    core's."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, list] = {}  # name -> [type, help, {(sample name, labels): value}]
    own = {"vitserve_build_info", "vitserve_ready", "process_start_time_seconds", "process_max_fds"}
    for n, text in enumerate([generate_latest(core_metrics.registry).decode(), *fronts]):
        for family in text_string_to_metric_families(text):
            entry = families.setdefault(family.name, [family.type, family.documentation, {}])
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if sample.name in own:
                    entry[2].setdefault(key, sample.value) if n == 0 else None
                else:
                    entry[2][key] = entry[2].get(key, 0.0) + sample.value
    lines = []
    for name, (kind, help, samples) in families.items():
        name += "_total" if kind == "counter" else ""  # the parser names a counter without its suffix
        lines += [f"# HELP {name} {help.replace(chr(92), chr(92) * 2).replace(chr(10), chr(92) + 'n')}",
                  f"# TYPE {name} {kind}"]
        for (sample, labels), value in samples.items():
            text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            lines.append(f"{sample}{{{text}}} {_number(value)}" if text else f"{sample} {_number(value)}")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    return repr(float(value)) if not math.isinf(value) else ("+Inf" if value > 0 else "-Inf")


# ---- processes ---------------------------------------------------------------------------------------------------
def front_settings(settings: Settings, fronts: int) -> Settings:
    """One front end's share of the server's limits (connections, requests in flight, memory budgets, decode
    workers, the encoder-cache files' space): each is split evenly, so that the server's totals hold."""
    share = lambda n: max(1, math.ceil(n / fronts))  # noqa: E731
    return dataclasses.replace(
        settings, decode_workers=max(1, settings.decode_worker_count() // fronts),
        max_concurrent_requests=share(settings.max_concurrent_requests),
        max_connections=share(settings.max_connections), body_memory=share(settings.body_memory),
        decode_memory=share(settings.decode_memory), url_fetch_memory=share(settings.url_fetch_memory),
        video_decode_work=share(settings.video_decode_work),
        video_decode_workers=settings.video_decode_workers and max(1, settings.video_decode_workers // fronts),
        ec_storage_bytes=share(settings.ec_storage_bytes))


def serve_front(index: int, settings: Settings, sock: socket.socket, conn) -> None:
    """A front end's process: this server's app on the shared socket, with the core behind its engine. Signals are
    the core's: it drains the front end with a Status record, and one whose core is gone exits."""
    from .engine import Engine
    from .server import run_server
    from .logs import configure_logging
    from .signals import leave_to_owner

    leave_to_owner()
    import torch

    configure_logging(settings.log_format, settings.log_level, bar=False, source=f"api{index}")
    torch.set_num_threads(1)  # a front end runs no tower: its torch work is small, and OpenMP's barrier waits
    engine = Engine(settings, core=conn)
    code = run_server(settings, engine, sockets=[sock])
    os._exit(code)


RESTART_DELAYS = (1.0, 4.0)  # seconds before a front end that died before it was up starts again; then: failed


class Restarts:
    """When a front end that died starts again: at once where it had come up, else after each of `delays` in turn
    (a start that fails may pass: memory, processes); never once those are spent."""

    def __init__(self, delays: tuple[float, ...] = RESTART_DELAYS):
        self.delays = delays
        self.failed: collections.Counter[int] = collections.Counter()  # front end -> failed starts in a row

    def after(self, index: int, up: bool) -> float | None:
        """Seconds before front end `index`, which died (`up`: after it had come up), starts again; None: never."""
        if up:
            self.failed[index] = 0
            return 0.0
        self.failed[index] += 1
        return self.delays[self.failed[index] - 1] if self.failed[index] <= len(self.delays) else None


def start_front(core: Core, index: int, settings: Settings, sock: socket.socket, context) -> Link:
    """Start front end `index` on the listening socket, and the core's reader of its records."""
    parent, child = context.Pipe()
    # not a daemon: a front end has decode workers of its own; one whose core is gone exits (its link ends)
    process = context.Process(target=serve_front, args=(index, settings, sock, child), name=f"vitserve-api{index}")
    process.start()
    child.close()
    link = Link(index, parent, process)
    threading.Thread(target=core.serve_link, args=(link,), name=f"vitserve-link{index}", daemon=True).start()
    return link


def serve(settings: Settings, fronts: int) -> int:
    """`vitserve serve` with several front ends: bind the port, start the core and the front ends, and supervise
    them until SIGTERM (drained: exit 0) or a failure (exit 1). A front end that dies is started again (`Restarts`)
    while the others serve; the core keeps the listening socket for that until it drains."""
    core = Core(settings, fronts)
    if core.prefix is None:
        raise ValueError("--api-servers above 1 needs a spool directory (/dev/shm or --spool-dir)")
    sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.host, settings.port))
    sock.listen(2048)
    sock.set_inheritable(True)
    context = multiprocessing.get_context("spawn")
    share = front_settings(settings, fronts)
    core.links = [start_front(core, i, share, sock, context) for i in range(fronts)]
    threading.Thread(target=core.load, name="vitserve-load", daemon=True).start()

    stopping, forced, stops = threading.Event(), threading.Event(), StopSignals()

    def on_signal(sig, frame):
        if stops.add():
            forced.set()
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code, restarts, due = 0, Restarts(), {}  # due: front end -> when it starts again
    while True:
        if stopping.wait(0.2):
            break
        if core.failed.is_set():
            code = 1
            break
        now = time.monotonic()
        for link in list(core.links):
            if link.index in due or link.process.is_alive():
                continue  # its reader thread lets go of what it held (Core.lost) once it has read all it sent
            delay = restarts.after(link.index, link.up)
            if delay is None:
                core.fail(f"front end {link.index} exited (exit code {link.process.exitcode}) before it was up, "
                          f"{len(restarts.delays) + 1} times in a row; the server is restarting")
                break
            log.warning("front end %d exited (exit code %s); starting it again%s", link.index,
                        link.process.exitcode, f" in {delay:g} s" if delay else "")
            due[link.index] = now + delay
        for index, when in list(due.items()):
            if when <= now and not core.failed.is_set():
                del due[index]
                core.links[index] = start_front(core, index, share, sock, context)
                core.replaced += 1
        if dead := next((w.device.process for w in core.workers if not w.device.process.is_alive()), None):
            core.fail(f"the process serving {dead.name} exited (exit code {dead.exitcode}); the server is restarting")
            code = 1
            break
    if code == 0:  # drained: every front end hears it, answers what it admitted and exits; then the devices stop
        sock.close()  # the front ends hold it: once they have all closed it, the port is free
        core.set_state("draining")
        core.metrics.ready.set(0)
        live = [link for link in core.links if link.process.is_alive()]
        while any(link.process.is_alive() for link in live):
            if forced.is_set():  # another signal, later: now
                return _abandon(core)
            time.sleep(0.05)
        if any(link.process.exitcode for link in live):
            code = 1
        core.stop()
        return code
    return _abandon(core)


def _abandon(core: Core) -> int:
    """Exit now: every child killed, the spool files removed."""
    from . import spool

    for child in multiprocessing.active_children():
        child.kill()
    with core.lock:
        core.cache.clear()
    spool.clear(core.prefix)
    for worker in core.workers:
        spool.clear(worker.device.prefix)
    logging.shutdown()
    os._exit(1)
