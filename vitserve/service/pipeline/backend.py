"""The engine's backend: where its images are run, and the cache index, behind one interface.

    lookup(keys)   per cache key: the image's Features (a hit), a future of them or of None (being computed for
                   another request; None: it failed, the caller computes it), or None (a miss, claimed for the caller)
    submit(items)  decoded items for the devices; each item's future is resolved with its Features (with its grid)
    drop(items)    a gone client's items leave the queue
    release(keys)  claims the caller let go unanswered (their waiters compute them)
    video_plans(keys), keep_video_plans(keys, plans)
                   the header plans of the videos seen before, by video key (cache.VideoPlans), for every front end
    scrape(kind)   the whole server's /stats dict or /metrics text
    model, devices, life (the server's Lifecycle), start(), stop(), abandon()

`LocalBackend` (here) runs it all in this process: the image queue, a DeviceWorker per device, the cache, the one
batch accounting (`done`) and the loading. `hub.HubBackend` makes the same calls over a front end's pipe to the core
(service/core.py), which holds a LocalBackend of its own and answers each front end's items through its link.

An item's answer goes to its `origin`, grouped per origin so a batch costs one delivery each: `Futures` (an event
loop's futures, in this process) or a front end's link in the core (`core.Link`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, cast

from ...encoder.features import Features
from ...encoder.preprocess import ImageError
from ..decoding.decoder import Decoder
from ..devices.device_protocol import Output
from ..devices.scheduler import ImageQueue, Origin, WorkItem
from ..devices.worker import DeviceWorker, LocalDevice, workers_stats
from ..ground.errors import EngineError, ErrorRecord
from ..ground.metrics import Metrics, count_items, merged_metrics
from ..ground.settings import Settings
from .cache import WAIT, Cache, VideoPlans
from .lifecycle import Lifecycle
from .loader import ModelInfo, load_here, load_processes
from .stats import server_stats

log = logging.getLogger("vitserve.engine")


@dataclass
class Result:
    """One item's end, for its origin: its answer (its Features, or in the core its Output record, the grid set), or
    the error its request gets; `keep`: the cache holds the output (its file stays)."""

    item: WorkItem
    output: Features | Output | None = None
    error: EngineError | None = None
    keep: bool = False
    inference_s: float = 0.0


class Futures:
    """The origin of items submitted in this process: their futures, resolved on their event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop

    def deliver(self, results: list[Result]) -> None:
        self.loop.call_soon_threadsafe(self._resolve, results)

    @staticmethod
    def _resolve(results: list[Result]) -> None:
        for result in results:
            future = cast(asyncio.Future, result.item.future)  # an item of this process has its future
            result.item.inference_s = result.inference_s
            if future.done():
                continue
            if result.error is not None:
                future.set_exception(result.error)
            else:
                future.set_result(result.output)


def resolved(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


class LocalBackend:
    """The queue, the devices, the cache and the loading of this process. `process_each`: a process per device
    (`records`: their answers stay spool-file records, for front ends to map). For an engine in this process (not
    the core, which makes these calls itself): `collect(kind)`, its front part of /stats and /metrics;
    `preloaded`, encoders to serve instead of loading; `ready_text(process_each, attention)`, the ready line's."""

    takes_signals = True  # this process drains on SIGTERM itself

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        life: Lifecycle,
        devices: list[str],
        dtype: str,
        spool_prefix: str | None,
        process_each: bool,
        records: bool = False,
        collect=None,
        preloaded: list | None = None,
        ready_text=None,
    ):
        self.settings, self.metrics, self.life = settings, metrics, life
        self.devices, self.dtype, self.prefix = devices, dtype, spool_prefix
        self.process_each, self.records, self.collect = process_each, records, collect
        self.preloaded, self.ready_text = preloaded or [], ready_text
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="vitserve-load")
        self._loading: asyncio.Task | None = None
        self.queue = ImageQueue(metrics)
        self.cache = Cache(settings.cache.cache_bytes, metrics)
        self.plans = VideoPlans()  # the headers of videos seen before (with the cache on)
        self.model: ModelInfo | None = None
        self.workers: list[DeviceWorker] = []
        self.batch_sizes: collections.Counter[int] = collections.Counter()
        self.started, self.load_seconds = time.time(), 0.0
        self.origin: Futures | None = None
        # each batch's Results the cache stored as records (the core tells its front ends of them)
        self.stored: Callable[[list[Result]], None] = lambda results: None

    # -- lifecycle
    async def start(self) -> None:
        """Serve the preloaded encoders, else load the model off the event loop (`load`)."""
        if self.preloaded:
            self.process_each = False
            self.serve(ModelInfo.of(self.preloaded[0]), [LocalDevice(e) for e in self.preloaded])
        else:
            self._loading = asyncio.create_task(self._load(), name="vitserve-loader")

    async def _load(self) -> None:
        if await asyncio.get_running_loop().run_in_executor(self._loader, self.load):
            log.info("ready in %.2f s: %s", self.load_seconds, self.ready_text(self.process_each, self.attention()))

    async def stop(self) -> None:
        if self._loading is not None:
            self._loading.cancel()
            await asyncio.gather(self._loading, return_exceptions=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.close)
        self._loader.shutdown(wait=True)

    def load(self, also: str = "") -> bool:
        """Blocking: load the model and serve it (False: it failed, and so did the server)."""
        s, start = self.settings, time.perf_counter()
        try:
            if self.process_each:
                prefix = cast(str, self.prefix)  # processes each only where there is a spool (Engine.process_each)
                model, devices = load_processes(s, self.devices, self.dtype, prefix, self.life, self.records, also)
            else:
                model, devices = load_here(s, self.devices, self.dtype, self.life)
        except Exception as e:  # reported on /health and /ready; the process exits non-zero
            self.life.fail(f"model load failed: {type(e).__name__}: {e}")
            return False
        self.load_seconds = time.perf_counter() - start
        self.serve(model, devices)
        return True

    def serve(self, model: ModelInfo, devices: list) -> None:
        """Loading is done: serve `devices`, each with a worker taking from the queue."""
        import torch

        s = self.settings
        self.model = model
        max_patches = s.batching.max_batch_tokens * model.config.merge_unit
        self.workers = [
            DeviceWorker(d, self.queue, max_patches, s.batching.max_batch_wait_ms / 1e3, self.done) for d in devices
        ]
        if len({w.name for w in self.workers}) < len(self.workers):  # replicas on one device (cpu,cpu): label apart
            for i, worker in enumerate(self.workers):
                worker.name = f"{worker.name}#{i}"
        self.devices = [w.name for w in self.workers]
        self.metrics.describe_build(
            torch=torch.__version__,
            model=s.model.name,
            family=model.config.family,
            dtype=self.dtype,
            attention="+".join(dict.fromkeys(self.attention().values())),
        )
        self.metrics.watch_runners(lambda: {w.name: w.device.runner_stats() for w in self.workers})
        for worker in self.workers:
            worker.start()
        self.life.ready()

    def attention(self) -> dict:
        return self.workers[0].device.runner_stats().get("attention", {}) if self.workers else {}

    def close(self) -> None:
        """Blocking: the workers finish what they hold, the devices close, the cache's entries go."""
        self.queue.close()
        for worker in self.workers:
            worker.thread.join(60)
            worker.device.close()
        self.cache.clear()

    # -- the engine's calls, on its event loop
    async def lookup(self, keys: list[bytes]) -> list:
        loop, waits = asyncio.get_running_loop(), {}

        def waiter(i: int):
            future = waits[i] = loop.create_future()
            return lambda entry: loop.call_soon_threadsafe(resolved, future, entry)

        found = self.cache.lookup(keys, None, waiter)
        return [waits[i] if hit is WAIT else hit for i, hit in enumerate(found)]

    def submit(self, items: list[WorkItem]) -> None:
        if self.origin is None:
            self.origin = Futures(asyncio.get_running_loop())
        for item in items:
            item.origin = self.origin
        self.queue.put(items)

    def drop(self, items: list[WorkItem]) -> None:
        self.queue.drop(items)

    def release(self, keys: list[bytes]) -> None:
        self.cache.release(keys)

    async def video_plans(self, keys: list[bytes]) -> list:
        return self.plans.get_all(keys)

    def keep_video_plans(self, keys: list[bytes], plans: list) -> None:
        self.plans.put_all(keys, plans)

    async def scrape(self, kind: str):
        """/stats or /metrics of this process (its front part, `collect`, and this part)."""
        if kind == "metrics":
            return merged_metrics([self.collect("metrics")]).encode()
        return server_stats(self.settings, self.stats(recent=False), [self.collect("stats")])

    # -- a device's batch, on its worker's thread
    def done(
        self, worker: DeviceWorker, batch: list[WorkItem], outputs, error: EngineError | None, seconds: float
    ) -> None:
        """The one batch accounting: the batch's metrics, each item's answer kept by the cache where it has a key
        (those kept as records told to `stored` first), and delivered to its origin (one delivery per origin)."""
        try:
            if error is not None and error.code == "device_lost":
                self.life.fail(error.message)
            if error is None:
                self._count(worker, batch, seconds)
            by_origin: dict[Origin, list[Result]] = collections.defaultdict(list)
            stored = []
            for n, item in enumerate(batch):
                result = Result(item, error=error) if error is not None else self._result(item, outputs[n], seconds)
                if item.key is not None:
                    result.keep = self.cache.settle(item.key, self._entry(result))
                    if result.keep and isinstance(result.output, Output):
                        stored.append(result)
                by_origin[cast(Origin, item.origin)].append(result)  # (set where it was submitted)
            if stored:
                self.stored(stored)
            for origin, results in by_origin.items():
                origin.deliver(results)
        except Exception as e:  # a fault here would leave the batch's requests waiting: the server restarts instead
            log.exception("a batch's answers could not be handed back")
            self.life.fail(f"internal error: {type(e).__name__}: {e}")

    def _count(self, worker: DeviceWorker, batch: list[WorkItem], seconds: float) -> None:
        m = self.metrics
        m.inference_seconds.labels(worker.name).observe(seconds)
        assert self.model is not None  # (batches run once it is served)
        m.batch_tokens.observe(sum(i.patches for i in batch) // self.model.config.merge_unit)
        m.batch_images.observe(len(batch))
        count_items(m, worker.name, batch)
        self.batch_sizes[len(batch)] += 1
        m.record("inference", seconds)
        for item in batch:
            m.queue_seconds.observe(item.queue_s)
            m.record("queue", item.queue_s)

    @staticmethod
    def _result(item: WorkItem, output, seconds: float) -> Result:
        """The one place an item's answer is made: a device's output for it (the encoder's `(tokens, deepstack)`, a
        device process's Features) as its Features with its grid, a record kept as the Output it is (in the core,
        its grid set), or its error."""
        if isinstance(output, ErrorRecord):  # the record of an image a device process refused
            output = output.error()
        if isinstance(output, ImageError):  # the device could not decode it (fast preprocessing)
            return Result(item, error=Decoder.rejection(item.param, output), inference_s=seconds)
        if isinstance(output, Output):
            output.grid = item.grid
            return Result(item, output, inference_s=seconds)
        return Result(item, Features.of(output, list(item.grid)), inference_s=seconds)

    @staticmethod
    def _entry(result: Result) -> Features | Output | None:
        """What the cache keeps of an answer: its Features, or its record where it lies in a spool file."""
        if result.error is not None:
            return None
        if isinstance(result.output, Output):
            return result.output if result.output.path is not None else None
        return result.output

    # -- /stats
    def stats(self, recent: bool) -> dict:
        """This backend's part of /stats (`recent`: with its latencies, where its metrics are its own)."""
        devices, runners = workers_stats(self.workers)
        return {
            "state": self.life.state.value,
            "error": self.life.error,
            "device": self.devices[0],
            "devices": devices,
            "dtype": self.dtype,
            "family": self.model.config.family if self.model else None,
            "uptime_seconds": round(time.time() - self.started, 3),
            "load_seconds": round(self.load_seconds, 3),
            "queue_depth": len(self.queue),
            "batch_size_histogram": {str(k): v for k, v in sorted(self.batch_sizes.items())},
            "spool": self.prefix and os.path.dirname(self.prefix),
            "device_processes": self.process_each,
            "cache": self.cache.stats(),
            "eager_runs": sum(r.get("eager_runs", 0) for r in runners),
            "eager_fallbacks": sum(r.get("eager_fallbacks", 0) for r in runners),
            "recent": self.metrics.recent() if recent else {},
        }
