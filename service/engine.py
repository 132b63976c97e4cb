"""The serving engine: preprocessing pool, token-budget batcher, one worker thread per device.

Data flow: request -> decode + resize each image in a pool of worker processes (off the event loop and out of the
GIL; they return uint8 pixels, 8x smaller than float patch rows) -> one WorkItem per image
on an asyncio queue -> the batcher gathers items from concurrent requests up to `max_batch_tokens` or
`max_batch_wait_ms` -> the worker thread runs the batch through the encoder's graph runner -> each item's future is
resolved on the event loop, so every request gets exactly its own images back.

While the worker runs one batch, new items queue up and form the next batch at once (dynamic batching under load).
Several devices (`--devices`): one encoder, graph set and worker thread per device; each batch goes to the device
with the fewest batches in flight. A worker keeps its GPU fed: it launches batch k+1 before it collects batch k.
At most two batches per device are handed over at once: while both run, images pile up and the next batch is bigger
(three measured 8% fewer images/s on an H200, its batches being smaller:
bench/results/h200-bench_http-28budgets-3slots.json against h200-bench_http.json).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import queue
import threading
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

import numpy as np
import torch

from encoder import VisionEncoder
from encoder.preprocess import (Base64Data, ImageError, ImageTooLarge, PreprocessConfig, load_image, normalize_lut,
                                resize_rgb)

from .errors import ServiceError
from .metrics import Metrics
from .settings import Settings

log = logging.getLogger("vitserve.engine")


def decode_and_resize(data, max_image_pixels: int, cfg: PreprocessConfig) -> tuple[np.ndarray, float]:
    """Runs in a worker process: encoded bytes -> the resized (H, W, 3) uint8 image, and the seconds it took."""
    start = time.perf_counter()
    if isinstance(data, Base64Data):
        data = data.decode()
    return resize_rgb(load_image(data, max_image_pixels=max_image_pixels), cfg), time.perf_counter() - start


def make_preprocess_pool(workers: int, processes: bool) -> Executor:
    """Worker processes forked from a clean fork server that has imported only encoder.preprocess (numpy + PIL):
    decode and resize never contend for this process's GIL, and no worker inherits CUDA or threads."""
    if not processes:
        return ThreadPoolExecutor(workers, thread_name_prefix="vitserve-pre")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["encoder.preprocess"])
    return ProcessPoolExecutor(workers, mp_context=context)


class ClientDisconnected(Exception):
    """The client went away while its images waited: they were dropped from the queue."""


@dataclass
class WorkItem:
    image: np.ndarray  # resized uint8 [H, W, 3]; normalized and cut into patches on the device
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


@dataclass
class Landed:
    """Posted to a worker's job queue by its watcher thread when a launch's results have reached the host."""

    launch: object


class DeviceWorker:
    """One device: its encoder (runner and graphs), the one thread that uses it, and its batch queue.

    The thread launches batch k+1 (planning, pinned copies, replay, all enqueued without waiting) as soon as it comes,
    behind batch k still on the GPU, and only then collects batch k, so host work overlaps device work and the GPU
    never waits for planning. A watcher thread blocks on each launch's completion event (no GIL held, no polling) and
    posts `Landed`, so a batch is answered as soon as it lands even when no next batch comes. Results are resolved on
    the event loop."""

    def __init__(self, engine: Engine, encoder: VisionEncoder):
        self.engine, self.encoder, self.device = engine, encoder, str(encoder.device)
        self.jobs: queue.Queue = queue.Queue()
        self.launches: queue.Queue = queue.Queue()  # for the watcher, in launch order
        self.in_flight = 0  # batches handed over and not yet resolved (event-loop side)
        self.patches_in_flight = 0
        self.batches = self.images = 0
        self.thread = threading.Thread(target=self._loop, name=f"vitserve-{self.device}", daemon=True)
        self.watcher = threading.Thread(target=self._watch, name=f"vitserve-{self.device}-watch", daemon=True)

    def start(self) -> None:
        self.thread.start()
        self.watcher.start()

    def _watch(self) -> None:
        while (launch := self.launches.get()) is not None:
            if launch.done is not None:
                launch.done.synchronize()
            self.jobs.put(Landed(launch))

    def _loop(self) -> None:
        if self.encoder.device.type == "cuda":
            torch.cuda.set_device(self.encoder.device)
        runner, pending = self.encoder.runner, None
        try:
            while True:
                job = self.jobs.get()
                if job is None:  # stop: finish what is held, then exit
                    if pending is not None:
                        self._collect(*pending)
                    return
                if isinstance(job, Landed):  # stale when that launch was already collected behind a newer one
                    if pending is not None and pending[2] is job.launch:
                        self._collect(*pending)
                        pending = None
                    continue
                batch, start = job
                try:
                    launch = runner.launch_images([i.image for i in batch], self.engine.pixel_lut,
                                                  [i.pool_mean for i in batch])
                except Exception as e:
                    self.engine.finish(self, batch, error=self.engine.error_for(e, batch))
                    continue
                self.launches.put(launch)
                if pending is not None:
                    self._collect(*pending)
                pending = (batch, start, launch)
        finally:
            self.launches.put(None)

    def _collect(self, batch: list[WorkItem], start: float, launch) -> None:
        try:
            outputs = self.encoder.runner.collect(launch)
        except Exception as e:
            self.engine.finish(self, batch, error=self.engine.error_for(e, batch))
        else:
            self.engine.finish(self, batch, outputs=outputs, seconds=time.perf_counter() - start)

    def stats(self) -> dict:
        return {"batches": self.batches, "images": self.images, "batches_in_flight": self.in_flight,
                "runner": self.encoder.runner.stats.as_dict()}


class Engine:
    def __init__(self, settings: Settings, encoder: VisionEncoder | list[VisionEncoder] | None = None,
                 metrics: Metrics | None = None):
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.devices, self.dtype = resolve_devices(settings)
        self.encoder: VisionEncoder | None = None  # the first device's (preprocessing config, family)
        self.workers: list[DeviceWorker] = []
        self.state = "loading"
        self.error: str | None = None
        self.started = time.time()
        self.load_seconds = 0.0
        self._pool_size = settings.preprocess_workers or os.cpu_count() or 4
        self.preprocess_pool = make_preprocess_pool(self._pool_size, settings.preprocess_processes)
        self.pixel_lut: np.ndarray | None = None
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="vitserve-load")
        self.queue: asyncio.Queue[WorkItem] | None = None
        self._capacity: asyncio.Event | None = None  # set when some device can take another batch
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
        self.encoder = encoders[0]
        cfg = self.encoder.preprocess_config
        self.pixel_lut = normalize_lut(cfg.image_mean, cfg.image_std)
        self.workers = [DeviceWorker(self, e) for e in encoders]
        if len({w.device for w in self.workers}) < len(self.workers):  # replicas on one device (cpu,cpu): label apart
            for i, worker in enumerate(self.workers):
                worker.device = f"{worker.device}#{i}"
        self.devices = [w.device for w in self.workers]
        self.metrics.watch_runners(lambda: {w.device: w.encoder.runner.stats.as_dict() for w in self.workers})

    async def start(self) -> None:
        self.queue, self._capacity, self._loop = asyncio.Queue(), asyncio.Event(), asyncio.get_running_loop()
        self._tasks.append(asyncio.create_task(self._batch_loop(), name="vitserve-batcher"))
        if self.workers:
            self._start_workers()
        else:
            self._tasks.append(asyncio.create_task(self._load(), name="vitserve-loader"))

    def _start_workers(self) -> None:
        for worker in self.workers:
            worker.start()
        self._capacity.set()

    async def _load(self) -> None:
        s = self.settings
        start = time.perf_counter()
        budgets = s.budget_list()
        extra = {} if budgets is None else {"budgets": budgets}
        loop = asyncio.get_running_loop()
        encoders = []
        try:
            for device in self.devices:
                if s.gpu_memory_fraction and device.startswith("cuda"):
                    torch.cuda.set_per_process_memory_fraction(s.gpu_memory_fraction, torch.device(device))
                log.info("loading %s (%s) on %s as %s", s.model, s.load_format, device, self.dtype)
                encoders.append(await loop.run_in_executor(self.loader, lambda d=device: VisionEncoder.from_pretrained(
                    s.model, device=d, dtype=self.dtype, load_format=s.load_format, revision=s.revision,
                    min_pixels=s.min_pixels, max_pixels=s.max_pixels, capture=False, **extra)))
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

    def drain(self) -> None:
        """Stop admitting requests (ready -> 503); requests already admitted are still answered."""
        if self.state in ("ready", "loading", "capturing"):
            self.state = "draining"
        self.metrics.ready.set(0)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for worker in self.workers:
            if worker.thread.is_alive():
                worker.jobs.put(None)  # each worker finishes what it holds, then exits
                await asyncio.get_running_loop().run_in_executor(None, worker.thread.join)
        self.loader.shutdown(wait=True)
        self.preprocess_pool.shutdown(wait=False, cancel_futures=True)

    # ---- admission -----------------------------------------------------------------------------------------------
    def admit(self) -> None:
        if self.state != "ready":
            reason = {"draining": "server is shutting down", "failed": f"model failed to load: {self.error}"}.get(
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
        loop = asyncio.get_running_loop()
        cfg, limit = self.encoder.preprocess_config, self.settings.max_image_pixels
        jobs = [loop.run_in_executor(self.preprocess_pool, decode_and_resize, data, limit, cfg) for data in images]
        try:
            await asyncio.wait(jobs)
        except BaseException:
            for job in jobs:
                job.cancel()
            raise
        errors = [job.exception() for job in jobs]  # retrieve every one: only the first is reported
        out, p = [], cfg.patch_size
        for index, job in enumerate(jobs):
            try:
                if errors[index] is not None:
                    raise errors[index]
                image, seconds = job.result()
            except ImageTooLarge as e:
                raise ServiceError(413, f"input[{index}]: {e}", e.code, param=f"input[{index}]") from None
            except ImageError as e:
                raise ServiceError(400, f"input[{index}]: {e}", e.code, param=f"input[{index}]") from None
            except BrokenProcessPool:  # an image crashed a decode worker: replace the pool, refuse that request
                log.warning("a decode worker died on input[%d]; restarting the pool", index)
                old, self.preprocess_pool = self.preprocess_pool, make_preprocess_pool(self._pool_size,
                                                                                       self.settings.preprocess_processes)
                old.shutdown(wait=False, cancel_futures=True)
                raise ServiceError(400, f"input[{index}]: the image crashed the decoder", "undecodable_image",
                                   param=f"input[{index}]") from None
            except Exception as e:  # anything else the decoder raised is still about this client's bytes
                raise ServiceError(400, f"input[{index}]: cannot decode: {type(e).__name__}: {e}",
                                   "undecodable_image", param=f"input[{index}]") from None
            self.metrics.preprocess_seconds.observe(seconds)
            out.append((image, (1, image.shape[0] // p, image.shape[1] // p)))
        return out

    async def infer(self, prepared, disconnected: asyncio.Future | None = None, pool_mean: bool = False
                    ) -> list[WorkItem]:
        """Queue the images, wait for their results; if `disconnected` resolves first, drop them from the queue.
        Each result is (tokens, deepstack list), or (mean of the tokens in float32, []) with `pool_mean`."""
        loop = asyncio.get_running_loop()
        items = [WorkItem(image, grid, loop.create_future(), pool_mean=pool_mean) for image, grid in prepared]
        for item in items:
            self.queue.put_nowait(item)
        self.metrics.queue_depth.set(self.queue.qsize())
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

    async def _batch_loop(self) -> None:
        max_patches = self.settings.max_batch_tokens * 4
        wait = self.settings.max_batch_wait_ms / 1e3
        loop = asyncio.get_running_loop()
        carry: WorkItem | None = None
        while True:
            worker = await self._free_worker()  # while all are busy, images pile up for a bigger next batch
            first = carry or await self.queue.get()
            carry, batch, patches = None, [first], first.patches
            deadline = loop.time() + wait
            while patches < max_patches:
                try:
                    item = self.queue.get_nowait()
                except asyncio.QueueEmpty:
                    if loop.time() >= deadline:
                        break
                    try:
                        item = await asyncio.wait_for(self.queue.get(), deadline - loop.time())
                    except TimeoutError:
                        break
                if patches + item.patches > max_patches:
                    carry = item
                    break
                batch.append(item)
                patches += item.patches
            self.metrics.queue_depth.set(self.queue.qsize() + (carry is not None))
            live = [item for item in batch if not item.cancelled and not item.future.done()]
            self.metrics.dropped.inc(len(batch) - len(live))
            if not live:
                continue
            worker = self._least_loaded() or worker  # a device may have freed up while the batch formed
            start = time.perf_counter()
            for item in live:
                item.queue_s = start - item.enqueued
                self.metrics.queue_seconds.observe(item.queue_s)
            worker.in_flight += 1
            worker.patches_in_flight += sum(i.patches for i in live)
            worker.jobs.put((live, start))

    def _least_loaded(self) -> DeviceWorker | None:
        """The device with the fewest batches (then patches) in flight, among those that can take one more."""
        free = [w for w in self.workers if w.in_flight < MAX_BATCHES_IN_FLIGHT]
        return min(free, key=lambda w: (w.in_flight, w.patches_in_flight), default=None)

    async def _free_worker(self) -> DeviceWorker:
        while (worker := self._least_loaded()) is None:
            self._capacity.clear()
            await self._capacity.wait()
        return worker

    def error_for(self, e: Exception, batch: list[WorkItem]) -> ServiceError:
        if isinstance(e, torch.OutOfMemoryError):
            log.warning("OOM on a batch of %d images: %s", len(batch), e)
            return ServiceError(507, f"the device ran out of memory for this batch ({sum(i.patches for i in batch)} "
                                     f"patches); retry with fewer or smaller images", "out_of_memory")
        log.error("batch of %d images failed", len(batch), exc_info=e)  # only its own requests fail
        return ServiceError(500, f"inference failed for this batch: {type(e).__name__}: {e}", "inference_failed")

    def finish(self, worker: DeviceWorker, batch, outputs=None, seconds: float = 0.0,
               error: ServiceError | None = None) -> None:
        """From a worker thread: resolve the batch's futures on the event loop and free its slot."""

        def resolve():
            worker.in_flight -= 1
            worker.patches_in_flight -= sum(i.patches for i in batch)
            self._capacity.set()
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
                "requests_in_flight": self.in_flight, "queue_depth": self.queue.qsize() if self.queue else 0,
                "batch_size_histogram": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "eager_fallbacks": sum(w.encoder.runner.stats.eager_fallbacks for w in self.workers),
                "runner": enc.runner.stats.as_dict() if enc else None}
