"""The serving engine: preprocessing pool, token-budget batching, one worker thread per device.

Data flow: request -> decode + resize each image in a pool of worker processes (off the event loop and out of the
GIL; they return uint8 pixels, 8x smaller than float patch rows, in a RAM spool file that stays until the device
reads it) -> one WorkItem per image on the shared ImageQueue -> a device's thread takes a batch of items from
concurrent requests, up to `max_batch_tokens` or `max_batch_wait_ms`, and runs it through the encoder's graph
runner -> each item's future is resolved on the event loop, so every request gets exactly its own images back.

Device threads pull their batches: a device that frees up takes the next batch itself, with no trip through the
event loop between one batch landing and the next one launching (on two H200s, a batcher on the event loop left
each GPU idle a third of the time). A thread keeps its GPU fed: it launches batch k+1 behind batch k, then collects
batch k. At most two batches per device are in flight: while both run, images pile up and the next batch is bigger
(three measured 8% fewer images/s on an H200, its batches being smaller:
bench/results/h200-bench_http-28budgets-3slots.json against h200-bench_http.json). Several devices
(`--devices`): one encoder, graph set and thread per device, all taking from the one queue. A CUDA device (or any,
with `--device-processes`) runs in a process of its own and its thread here only moves batches (device_process.py):
on two H200s, 356 images/s against 312 with threads, in one run; on one, 212 against 198.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from encoder import VisionEncoder
from encoder.config import VisionConfig
from encoder.vision_encoder import load_configs
from encoder.preprocess import Base64Data, ImageError, ImageTooLarge, PreprocessConfig, normalize_lut

from . import spool
from .decode import decode_and_resize
from .decode_pool import DecodePool, PoolUnavailable, WorkerDied
from .device_process import DeviceLost, DeviceProcess
from .errors import ServiceError
from .metrics import Metrics
from .settings import Settings

log = logging.getLogger("vitserve.engine")


def _discard_result(job: asyncio.Future) -> None:
    """For an image's decode whose request is gone: a spooled image it made has nobody to read it."""
    if job.done() and not job.cancelled() and job.exception() is None:
        spool.discard(job.result()[0])


def make_preprocess_pool(workers: int, processes: bool) -> DecodePool | ThreadPoolExecutor:
    """Worker processes (decode_pool.py): decode and resize never contend for this process's GIL; or threads."""
    if not processes:
        return ThreadPoolExecutor(workers, thread_name_prefix="vitserve-pre")
    pool = DecodePool(workers)
    pool.on_orphan = lambda result: spool.discard(result[0])  # decoded for a request that is gone
    return pool


class ClientDisconnected(Exception):
    """The client went away while its images waited: they were dropped from the queue."""


@dataclass
class WorkItem:
    image: np.ndarray | spool.Spooled  # resized uint8 [H, W, 3], maybe still in its spool file; normalized and
    # cut into patches on the device
    grid: tuple[int, int, int]
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)
    queue_s: float = 0.0
    inference_s: float = 0.0
    cancelled: bool = False
    pool_mean: bool = False  # answer with the mean of the tokens (taken on the device) instead of the tokens

    @property
    def patches(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


def resolve_devices(settings: Settings) -> tuple[list[str], str]:
    """The devices to serve on (`--devices` list or "all", else `--device`) and the dtype."""
    if settings.devices:
        if settings.devices == "all":
            count = torch.cuda.device_count()
            devices = [f"cuda:{i}" for i in range(count)] if count else ["cpu"]
        else:
            devices = [d.strip() for d in settings.devices.split(",") if d.strip()]
    else:
        devices = ["cuda:0" if torch.cuda.is_available() else "cpu"] if settings.device == "auto" else [settings.device]
    dtype = settings.dtype
    if dtype == "auto":
        dtype = "bfloat16" if devices[0].startswith("cuda") else "float32"
    return devices, dtype


MAX_BATCHES_IN_FLIGHT = 2  # per device: one running, the next launched behind it; a third made batches smaller


class ImageQueue:
    """Images waiting for a batch, in arrival order, shared by the device threads (thread-safe)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self._items: collections.deque[WorkItem] = collections.deque()
        self._ready = threading.Condition()
        self.closed = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, items: list[WorkItem]) -> None:
        with self._ready:
            self._items.extend(items)
            self.metrics.queue_depth.set(len(self._items))
            self._ready.notify_all()

    def close(self) -> None:
        """Wake every taker with None: the engine is stopping (images still queued are left)."""
        with self._ready:
            self.closed = True
            self._ready.notify_all()

    def take(self, max_patches: int, wait_s: float, block: bool) -> list[WorkItem] | None:
        """A batch: images in arrival order up to `max_patches` (the first one whatever its size; one that does not
        fit stays first in line), waiting up to `wait_s` after the first for more. Waits for the first only when
        `block`. [] when there was nothing to take, None once closed. Images whose client left are dropped."""
        with self._ready:
            while block and not self._items and not self.closed:
                self._ready.wait()
            if self.closed:
                return None
            batch, patches, deadline = [], 0, time.monotonic() + wait_s
            while True:
                while self._items and (not batch or patches + self._items[0].patches <= max_patches):
                    item = self._items.popleft()
                    batch.append(item)
                    patches += item.patches
                if not batch or self._items or patches >= max_patches or self.closed:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._ready.wait(remaining) and not self._items:
                    break
            self.metrics.queue_depth.set(len(self._items))
        live = [item for item in batch if not item.cancelled]  # a client may have left while its batch formed
        if len(live) < len(batch):
            self.metrics.dropped.inc(len(batch) - len(live))
            for item in batch:
                if item.cancelled:
                    spool.discard(item.image)
        return live


class DeviceWorker:
    """One device: its encoder (runner and graphs) and the one thread that uses it.

    The thread takes a batch from the queue whenever its device has fewer than two in flight, and launches it
    (planning, pinned copies, replays, all enqueued without waiting) behind the one still on the GPU; then it
    collects the older one, which waits for it to land. Host work overlaps device work, and the GPU waits for
    neither planning nor the event loop. With nothing queued it waits for its batch in flight to land, answers it,
    and waits for images. Results are resolved on the event loop."""

    max_in_flight = MAX_BATCHES_IN_FLIGHT

    def __init__(self, engine: Engine, encoder: VisionEncoder | None, device: str | None = None):
        self.engine, self.encoder, self.device = engine, encoder, device or str(encoder.device)
        self.in_flight = 0  # batches launched and not yet collected
        self.batches = self.images = 0
        self.thread = threading.Thread(target=self._loop, name=f"vitserve-{self.device}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    # what runs a batch: the encoder in this process (ProcessWorker: a process of the device's own)
    def launch(self, batch: list[WorkItem]):
        return self.encoder.runner.launch_images(spool.pixels([i.image for i in batch]), self.engine.pixel_lut,
                                                 [i.pool_mean for i in batch])

    def collect(self, launch) -> list:
        return self.encoder.runner.collect(launch)

    def runner_stats(self) -> dict:
        return self.encoder.runner.stats.as_dict()

    def _loop(self) -> None:
        if self.encoder is not None and self.encoder.device.type == "cuda":
            torch.cuda.set_device(self.encoder.device)
        engine = self.engine
        max_patches, wait_s = engine.settings.max_batch_tokens * 4, engine.settings.max_batch_wait_ms / 1e3
        pending: collections.deque = collections.deque()
        try:
            while True:
                if len(pending) < self.max_in_flight:
                    batch = engine.images.take(max_patches, wait_s, block=not pending)
                    if batch is None:
                        return
                    if batch:
                        start = time.perf_counter()
                        for item in batch:
                            item.queue_s = start - item.enqueued
                            engine.metrics.queue_seconds.observe(item.queue_s)
                        try:
                            launch = self.launch(batch)
                        except Exception as e:
                            if isinstance(e, DeviceLost):
                                engine.device_lost(self, str(e))
                            engine.finish(self, batch, error=engine.error_for(e, batch))
                            continue
                        pending.append((batch, start, launch))
                        self.in_flight = len(pending)
                        continue
                    if not pending:
                        continue
                self._collect(*pending.popleft())  # waits for that batch to land
                self.in_flight = len(pending)
        finally:
            while pending:
                self._collect(*pending.popleft())
            self.in_flight = 0

    def _collect(self, batch: list[WorkItem], start: float, launch) -> None:
        try:
            outputs = self.collect(launch)
        except Exception as e:
            if isinstance(e, DeviceLost):
                self.engine.device_lost(self, str(e))
            self.engine.finish(self, batch, error=self.engine.error_for(e, batch))
        else:
            self.engine.finish(self, batch, outputs=outputs, seconds=time.perf_counter() - start)

    def stats(self) -> dict:
        return {"batches": self.batches, "images": self.images, "batches_in_flight": self.in_flight,
                "runner": self.runner_stats()}


class ProcessWorker(DeviceWorker):
    """A device served by a process of its own (`--device-processes`); this thread only moves its batches."""

    max_in_flight = MAX_BATCHES_IN_FLIGHT + 1  # the device process runs two; one more waits in its pipe

    def __init__(self, engine: Engine, process: DeviceProcess):
        super().__init__(engine, None, process.device)
        self.process = process

    def launch(self, batch: list[WorkItem]) -> int:
        return self.process.launch([i.image for i in batch], [i.pool_mean for i in batch])

    def collect(self, job: int) -> list:
        return self.process.collect(job)

    def runner_stats(self) -> dict:
        return self.process.stats


@dataclass
class ModelInfo:
    """What the server needs of the model when its devices run in processes of their own."""

    config: VisionConfig
    preprocess_config: PreprocessConfig


class Engine:
    def __init__(self, settings: Settings, encoder: VisionEncoder | list[VisionEncoder] | None = None,
                 metrics: Metrics | None = None):
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.devices, self.dtype = resolve_devices(settings)
        self.device_processes = settings.device_processes  # default: on GPUs (measured faster for one and for two)
        if self.device_processes is None:
            self.device_processes = any(d.startswith("cuda") for d in self.devices)
        self.encoder: VisionEncoder | None = None  # the first device's (preprocessing config, family)
        self.workers: list[DeviceWorker] = []
        self.state = "loading"
        self.error: str | None = None
        self.started = time.time()
        self.load_seconds = 0.0
        self.preprocess_pool = make_preprocess_pool(settings.preprocess_workers or os.cpu_count() or 4,
                                                    settings.preprocess_processes)
        if isinstance(self.preprocess_pool, DecodePool):
            self.preprocess_pool.on_broken = self._fail_server  # no decode worker left: nothing can be served
        self._spool_base = None
        if settings.preprocess_processes and settings.spool_dir != "none":
            self._spool_base = spool.spool_prefix(settings.spool_dir)
            if self._spool_base is None:
                log.warning("no usable spool directory (%s): decoded images cross through a pipe, which costs the "
                            "server about 2 ms of CPU per megabyte", settings.spool_dir or "/dev/shm")
        self._spool_names = itertools.count()
        self.pixel_lut: np.ndarray | None = None
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="vitserve-load")
        self.images = ImageQueue(self.metrics)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.in_flight = 0
        self.batch_sizes: dict[int, int] = {}
        self._tasks: list[asyncio.Task] = []
        self.on_failure = None  # called when the model cannot be loaded (the CLI exits non-zero)
        if encoder is not None:
            self._use(encoder if isinstance(encoder, list) else [encoder])
            self.state = "ready"
            self.metrics.ready.set(1)

    # ---- lifecycle -----------------------------------------------------------------------------------------------
    def _use(self, encoders: list[VisionEncoder]) -> None:
        self._use_workers(encoders[0], [DeviceWorker(self, e) for e in encoders])

    def _use_workers(self, model: VisionEncoder | ModelInfo, workers: list[DeviceWorker]) -> None:
        self.encoder = model
        cfg = self.encoder.preprocess_config
        self.pixel_lut = normalize_lut(cfg.image_mean, cfg.image_std)
        self.workers = workers
        if len({w.device for w in self.workers}) < len(self.workers):  # replicas on one device (cpu,cpu): label apart
            for i, worker in enumerate(self.workers):
                worker.device = f"{worker.device}#{i}"
        self.devices = [w.device for w in self.workers]
        self.metrics.watch_runners(lambda: {w.device: w.runner_stats() for w in self.workers})

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if isinstance(self.preprocess_pool, DecodePool):
            await self.preprocess_pool.start()
        if self.workers:
            self._start_workers()
        else:
            self._tasks.append(asyncio.create_task(self._load(), name="vitserve-loader"))

    def _start_workers(self) -> None:
        for worker in self.workers:
            worker.start()

    async def _load(self) -> None:
        if self.device_processes:
            if self._spool_base is not None:
                return await self._load_processes()
            log.warning("a process per device needs a spool directory (/dev/shm or --spool-dir): serving the "
                        "devices from threads of this process")
        s = self.settings
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        encoders = []
        try:
            for device in self.devices:
                if s.gpu_memory_fraction and device.startswith("cuda"):
                    torch.cuda.set_per_process_memory_fraction(s.gpu_memory_fraction, torch.device(device))
                log.info("loading %s (%s) on %s as %s", s.model, s.load_format, device, self.dtype)
                encoders.append(await loop.run_in_executor(self.loader, lambda d=device: VisionEncoder.from_pretrained(
                    s.model, device=d, dtype=self.dtype, capture=False, **s.encoder_kwargs())))
            log.info("loaded in %.2f s; capturing CUDA graphs", time.perf_counter() - start)
            if self.state == "loading":
                self.state = "capturing"
            for encoder in encoders:
                await loop.run_in_executor(self.loader, encoder.capture)
        except Exception as e:  # reported on /health and /ready; the CLI exits non-zero
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            log.error("model load failed: %s", self.error)
            if self.on_failure is not None:
                self.on_failure()
            return
        self._use(encoders)
        self._start_workers()
        self.load_seconds = time.perf_counter() - start
        if self.state == "capturing":
            self.state = "ready"
            self.metrics.ready.set(1)
        log.info("ready in %.2f s on %s (graph capture %s s)", self.load_seconds, ", ".join(self.devices),
                 ", ".join(f"{e.runner.stats.capture_seconds:.2f}" for e in encoders))

    async def _load_processes(self) -> None:
        """One process per device, loading and capturing side by side; ready when all are."""
        s, start, loop = self.settings, time.perf_counter(), asyncio.get_running_loop()
        processes = []
        try:
            config, preprocess_config, _ = await loop.run_in_executor(self.loader, lambda: load_configs(
                s.model, s.load_format, s.revision, min_pixels=s.min_pixels, max_pixels=s.max_pixels))
            log.info("loading %s (%s) on %s as %s, one process per device", s.model, s.load_format,
                     ", ".join(self.devices), self.dtype)
            for i, device in enumerate(self.devices):
                processes.append(DeviceProcess(s, device, self.dtype, f"{self._spool_base}dev{i}-"))
            self.state = "capturing" if self.state == "loading" else self.state
            await asyncio.gather(*(loop.run_in_executor(None, p.wait_ready) for p in processes))
        except Exception as e:
            for p in processes:
                await loop.run_in_executor(None, p.stop, 5)
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            log.error("model load failed: %s", self.error)
            if self.on_failure is not None:
                self.on_failure()
            return
        self._use_workers(ModelInfo(config, preprocess_config), [ProcessWorker(self, p) for p in processes])
        self._start_workers()
        self.load_seconds = time.perf_counter() - start
        if self.state == "capturing":
            self.state = "ready"
            self.metrics.ready.set(1)
        log.info("ready in %.2f s on %s, one process each", self.load_seconds, ", ".join(self.devices))

    def device_lost(self, worker: DeviceWorker, reason: str) -> None:
        """From a worker thread: its device process died."""
        self._loop.call_soon_threadsafe(self._fail_server, reason)

    def _fail_server(self, reason: str) -> None:
        """On the event loop: a part the server cannot run without is gone. /health turns failed and the CLI exits
        non-zero, so an orchestrator restarts us."""
        if self.state != "failed":
            log.error("%s", reason)
            self.state, self.error = "failed", reason
            self.metrics.ready.set(0)
            if self.on_failure is not None:
                self.on_failure()

    def drain(self) -> None:
        """Stop admitting requests (ready -> 503); requests already admitted are still answered."""
        if self.state in ("ready", "loading", "capturing"):
            self.state = "draining"
        self.metrics.ready.set(0)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.images.close()  # each worker finishes what it holds, then exits
        for worker in self.workers:
            if worker.thread.is_alive():
                await asyncio.get_running_loop().run_in_executor(None, worker.thread.join)
            if isinstance(worker, ProcessWorker):
                await asyncio.get_running_loop().run_in_executor(None, worker.process.stop)
        self.loader.shutdown(wait=True)
        if isinstance(self.preprocess_pool, DecodePool):
            await self.preprocess_pool.close()
        else:
            self.preprocess_pool.shutdown(wait=False, cancel_futures=True)
        spool.clear(self._spool_base)

    def abandon(self) -> None:
        """A forced exit: kill the decode and device processes and remove the spool files, without waiting."""
        for child in multiprocessing.active_children():
            child.kill()
        spool.clear(self._spool_base)

    # ---- admission -----------------------------------------------------------------------------------------------
    def admit(self) -> None:
        if self.state != "ready":
            reason = {"draining": "server is shutting down", "failed": f"server failed: {self.error}"}.get(
                self.state, f"model is not ready yet ({self.state})")
            raise ServiceError(503, reason, "not_ready", headers={"Retry-After": "5"})
        if self.in_flight >= self.settings.max_concurrent_requests:
            raise ServiceError(429, f"too many requests in flight ({self.in_flight}); retry shortly", "queue_full",
                               headers={"Retry-After": "1"})
        self.in_flight += 1
        self.metrics.requests_in_flight.set(self.in_flight)

    def release(self) -> None:
        self.in_flight -= 1
        self.metrics.requests_in_flight.set(self.in_flight)

    # ---- work ----------------------------------------------------------------------------------------------------
    async def preprocess(self, images: list) -> list[tuple[np.ndarray, tuple[int, int, int]]]:
        """Decode and resize concurrently in the pool; the first bad image fails the request (only it)."""
        jobs = [asyncio.ensure_future(self._decode(data)) for data in images]
        try:
            await asyncio.wait(jobs)
        except BaseException:  # the request was cancelled: what was decoded goes, the rest is dropped when done
            for job in jobs:
                job.cancel()
                job.add_done_callback(_discard_result)
            raise
        errors = [job.exception() for job in jobs]  # retrieve every one: only the first is reported
        if any(errors):  # the request fails: its images that did decode are not run
            for job, error in zip(jobs, errors):
                if error is None:
                    spool.discard(job.result()[0])
        out, p = [], self.encoder.preprocess_config.patch_size
        for index, job in enumerate(jobs):
            try:
                if errors[index] is not None:
                    raise errors[index]
                image, seconds = job.result()
            except ServiceError:
                raise
            except ImageTooLarge as e:
                raise ServiceError(413, f"input[{index}]: {e}", e.code, param=f"input[{index}]") from None
            except ImageError as e:
                raise ServiceError(400, f"input[{index}]: {e}", e.code, param=f"input[{index}]") from None
            except WorkerDied:  # twice: this image kills decode workers
                raise ServiceError(400, f"input[{index}]: the image crashed the decoder", "undecodable_image",
                                   param=f"input[{index}]") from None
            except PoolUnavailable as e:  # not about this image
                raise ServiceError(503, f"{e}; the server is restarting", "decode_unavailable",
                                   headers={"Retry-After": "5"}) from None
            except Exception as e:  # anything else the decoder raised is still about this client's bytes
                raise ServiceError(400, f"input[{index}]: cannot decode: {type(e).__name__}: {e}",
                                   "undecodable_image", param=f"input[{index}]") from None
            self.metrics.preprocess_seconds.observe(seconds)
            out.append((image, (1, image.shape[0] // p, image.shape[1] // p)))
        return out

    async def _decode(self, data) -> tuple[np.ndarray | spool.Spooled, float]:
        """One image through the decode pool. A worker that dies on it (a decoder crash, the OOM killer) fails only
        this image, which is tried once more: only an image that kills a worker twice is refused."""
        for attempt in (1, 2):
            try:
                return await self._decode_once(data)
            except WorkerDied:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def _decode_once(self, data) -> tuple[np.ndarray | spool.Spooled, float]:
        cfg, limit, pool = self.encoder.preprocess_config, self.settings.max_image_pixels, self.preprocess_pool
        if is_base64 := isinstance(data, Base64Data):  # as bytes: a str pickles at twice the server's CPU
            data = data.encode("ascii", "replace")  # a non-ASCII character is still invalid base64 there
        start = time.perf_counter()
        if not isinstance(pool, DecodePool):
            result = await asyncio.get_running_loop().run_in_executor(pool, decode_and_resize, data, is_base64, limit,
                                                                      cfg)
        else:
            path = self._spool_base and f"{self._spool_base}{next(self._spool_names)}"
            job = pool.submit(decode_and_resize, data, is_base64, limit, cfg, path)
            try:
                result = await job
            except WorkerDied:
                if path:
                    spool.remove(path)  # in case it wrote the image before it died
                raise
            except asyncio.CancelledError:  # the request is gone: the pool drops a result still to come, this one here
                _discard_result(job)
                raise
        self.metrics.decode_seconds.observe(time.perf_counter() - start)
        return result

    async def infer(self, prepared, disconnected: asyncio.Future | None = None, pool_mean: bool = False
                    ) -> list[WorkItem]:
        """Queue the images, wait for their results; if `disconnected` resolves first, drop them from the queue.
        Each result is (tokens, deepstack list), or (mean of the tokens in float32, []) with `pool_mean`."""
        loop = asyncio.get_running_loop()
        items = [WorkItem(image, grid, loop.create_future(), pool_mean=pool_mean) for image, grid in prepared]
        self.images.put(items)
        results = asyncio.gather(*(item.future for item in items))
        waiters = {results} if disconnected is None else {results, disconnected}
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if not results.done():
            for item in items:
                item.cancelled = True
            results.cancel()
            results.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved" log
            raise ClientDisconnected()
        results.result()  # raises the batch's error, if any
        return items

    def error_for(self, e: Exception, batch: list[WorkItem]) -> ServiceError:
        if isinstance(e, DeviceLost):
            return ServiceError(503, f"{e}; the server is restarting", "device_lost", headers={"Retry-After": "5"})
        if isinstance(e, torch.OutOfMemoryError):
            log.warning("OOM on a batch of %d images: %s", len(batch), e)
            return ServiceError(507, f"the device ran out of memory for this batch ({sum(i.patches for i in batch)} "
                                     f"patches); retry with fewer or smaller images", "out_of_memory")
        log.error("batch of %d images failed", len(batch), exc_info=e)  # only its own requests fail
        return ServiceError(500, f"inference failed for this batch: {type(e).__name__}: {e}", "inference_failed")

    def finish(self, worker: DeviceWorker, batch, outputs=None, seconds: float = 0.0,
               error: ServiceError | None = None) -> None:
        """From a worker thread: resolve the batch's futures on the event loop."""

        def resolve():
            if error is not None:
                self._fail(batch, error)
                return
            worker.batches += 1
            worker.images += len(batch)
            self.metrics.inference_seconds.labels(worker.device).observe(seconds)
            self.metrics.batch_tokens.observe(sum(i.patches for i in batch) // 4)
            self.metrics.batch_images.observe(len(batch))
            self.metrics.images.labels(worker.device).inc(len(batch))
            self.batch_sizes[len(batch)] = self.batch_sizes.get(len(batch), 0) + 1
            for item, output in zip(batch, outputs):
                item.inference_s = seconds
                if not item.future.done():
                    item.future.set_result(output)

        self._loop.call_soon_threadsafe(resolve)

    @staticmethod
    def _fail(batch: list[WorkItem], error: ServiceError) -> None:
        for item in batch:
            if not item.future.done():
                item.future.set_exception(error)

    def stats(self) -> dict:
        enc = self.encoder
        return {"model": self.settings.model_name, "state": self.state, "error": self.error,
                "device": self.devices[0], "devices": {w.device: w.stats() for w in self.workers},
                "dtype": self.dtype, "family": enc.config.family if enc else None,
                "uptime_seconds": round(time.time() - self.started, 3), "load_seconds": round(self.load_seconds, 3),
                "requests_in_flight": self.in_flight, "queue_depth": len(self.images),
                "batch_size_histogram": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "spool": self._spool_base and os.path.dirname(self._spool_base),
                "device_processes": any(isinstance(w, ProcessWorker) for w in self.workers),
                "decode_workers_replaced": getattr(self.preprocess_pool, "replaced", 0),
                "eager_fallbacks": sum(w.runner_stats().get("eager_fallbacks", 0) for w in self.workers),
                "runner": self.workers[0].runner_stats() if self.workers else None}
