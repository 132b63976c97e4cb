"""The serving engine: one `encode` call for the app, behind it the decoder, the image queue and a worker per device.

    request -> admit (the gate) -> fetch URLs (when enabled) -> the embedding cache (a hit is answered here)
            -> Decoder.decode (worker processes; pixels in spool files) -> one WorkItem per image on the ImageQueue -> a DeviceWorker takes batches from concurrent requests
            -> its device (this process, or a process of its own) runs them -> each image's future is resolved
            on the event loop

The engine owns the lifecycle (`State`), loading (in this process, or one process per device, both finishing in
`_serve`), admission, and the server's failure: when a part it cannot run without is gone (a device process, the
last decode worker), it turns FAILED, and the CLI exits for a supervisor to restart it.

In a front end of a server with several (`core`: its pipe to the core, service/core.py), the queue, the devices and
the cache's entries are the core's (through service/core_link.py): the engine mirrors the core's state, looks its cache keys up there, and sends
its decoded images there (`_lookup`, `_settle`, `_enqueue`, `_dequeue` are the seams); the rest is the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import math
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .. import __version__
from ..encoder import VisionEncoder
from ..encoder.config import VisionConfig
from ..encoder.features import Features
from ..encoder.preprocess import ImageError, PreprocessConfig
from ..encoder.video import VideoConfig
from ..encoder.video import unavailable as video_unavailable

from . import fetch
from .budget import MemoryBudget
from .cache import EmbeddingCache
from .decoder import Decoder
from .device_process import ProcessDevice, start_devices
from .errors import ClientDisconnected, EngineError, InputRejected, InputTooLarge, NotReady, QueueFull
from .logs import attention_text
from .metrics import Metrics, count_items
from .scheduler import ImageQueue, WorkItem
from .settings import Settings, format_size, resolve_devices
from .worker import DeviceWorker, LocalDevice, workers_stats

log = logging.getLogger("vitserve.engine")


class State(str, enum.Enum):
    LOADING = "loading"
    CAPTURING = "capturing"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


NOT_READY = {State.LOADING: "loading model weights", State.CAPTURING: "capturing CUDA graphs",
             State.DRAINING: "draining: shutting down"}


@dataclass(frozen=True)
class ModelInfo:
    """What the server needs of the model itself: the tower's config and its preprocessing."""

    config: VisionConfig
    preprocess_config: PreprocessConfig
    video_config: VideoConfig


@dataclass
class Encoded:
    """A request's answer: per image (tokens, deepstack list), or (mean vector, []) with mean pooling; its grids;
    how long decoding its images took, and the longest queue and inference times among them."""

    outputs: list
    grids: list[list[int]]
    decode_s: float
    queue_s: float
    inference_s: float
    cache_hits: int = 0
    videos: list[dict] | None = None  # per video: frame_indices, fps, timestamps, second_per_grid_t


def serving_text(settings: Settings, devices: list[str], process_each: bool, dtype: str, attention: dict,
                 decode_workers: int) -> str:
    """What serves, for the startup's ready line: version, model, devices, dtype, attention, decode workers, cache."""
    s = settings
    cache = "off" if not s.cache_bytes else \
        f"{format_size(s.cache_bytes)} per {'API key' if s.cache_scope == 'api-key' else 'server'}"
    return (f"vitserve {__version__}, {s.model} on {', '.join(devices)}{', one process each' * process_each} "
            f"({dtype}, attention {attention_text(attention)}), {decode_workers} decode "
            f"{'processes' if s.decode_processes else 'threads'}, cache {cache}")


class Engine:
    """`encoders`: already loaded encoders to serve (one per device; tests), else the settings' model is loaded by
    `start`."""

    def __init__(self, settings: Settings, encoders: VisionEncoder | list[VisionEncoder] | None = None,
                 metrics: Metrics | None = None, core=None):
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.devices, self.dtype = resolve_devices(settings)
        self.device_processes = settings.device_processes  # default: on GPUs (measured faster for one and for two)
        if self.device_processes is None:
            self.device_processes = any(d.startswith("cuda") for d in self.devices)
        self.model: ModelInfo | None = None
        self.workers: list[DeviceWorker] = []
        self.state, self.error = State.LOADING, None
        self.started, self.load_seconds = time.time(), 0.0
        self.decoder = Decoder(settings, self.metrics, on_broken=self.fail)
        self.videos_unavailable = video_unavailable()  # why videos cannot be decoded here (None: they can)
        if self.videos_unavailable:
            log.warning("videos cannot be decoded here: %s; video requests are answered 501", self.videos_unavailable)
        if settings.preprocess == "fast" and any(d.startswith("cuda") for d in self.devices):
            from ..encoder.preprocess_fast import nvjpeg_available

            self.decoder.jpeg_on_device = nvjpeg_available()  # else the decode workers decode JPEGs too
        self.queue = ImageQueue(self.metrics)
        self.fetch_budget = fetch.FetchBudget(settings.url_fetch_memory)
        self.bodies = MemoryBudget(settings.body_memory, patience=math.inf)  # the gate's: small bodies never wait
        self.metrics.memory_held.labels("bodies").set_function(lambda: self.bodies.used)  # on a large one
        self.metrics.memory_held.labels("decode").set_function(lambda: self.decoder.budget.used)
        self.cache = EmbeddingCache(settings.cache_bytes, settings.model_name or "", self.metrics,
                                    per_client=settings.cache_scope == "api-key")
        self.in_flight = 0
        self.tiers: dict[str, Callable[[], dict]] = {}  # an encoder tier's figures, by name (the app sets them)
        self.metrics.watch_tiers(self.tier_figures)
        self.batch_sizes: dict[int, int] = {}
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="vitserve-load")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._preloaded = [] if encoders is None else encoders if isinstance(encoders, list) else [encoders]
        self.core = None
        if core is not None:
            from .core_link import CoreLink

            self.core = CoreLink(core, self)

    # ---- lifecycle -----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.decoder.start()
        if self.core is not None:  # the core loads: its Status says when this front end is ready
            self.core.start(self._loop)
        elif self._preloaded:
            encoder = self._preloaded[0]
            self._serve(ModelInfo(encoder.config, encoder.preprocess_config, encoder.video_config), self._local(self._preloaded))
        else:
            self._tasks.append(asyncio.create_task(self._load(), name="vitserve-loader"))

    def _local(self, encoders: list[VisionEncoder]) -> list[LocalDevice]:
        return [LocalDevice(e) for e in encoders]

    def _serve(self, model: ModelInfo, devices: list) -> None:
        """Loading is done: serve `devices`, each with a worker taking from the queue."""
        s = self.settings
        self.model = model
        max_patches = s.max_batch_tokens * model.config.merge_unit
        self.workers = [DeviceWorker(d, self.queue, max_patches, s.max_batch_wait_ms / 1e3, self._done)
                        for d in devices]
        if len({w.name for w in self.workers}) < len(self.workers):  # replicas on one device (cpu,cpu): label apart
            for i, worker in enumerate(self.workers):
                worker.name = f"{worker.name}#{i}"
        self.devices = [w.name for w in self.workers]
        attention = devices[0].runner_stats().get("attention", {}) if devices else {}
        self.metrics.describe_build(torch=torch.__version__, model=s.model_name, family=model.config.family,
                                    dtype=self.dtype, attention="+".join(dict.fromkeys(attention.values())))
        self.metrics.watch_runners(lambda: {w.name: w.device.runner_stats() for w in self.workers})
        for worker in self.workers:
            worker.start()
        if self.state in (State.LOADING, State.CAPTURING):
            self.state = State.READY
            self.metrics.ready.set(1)

    async def _load(self) -> None:
        start = time.perf_counter()
        try:
            if self.device_processes and self.decoder.spool_prefix is None:
                log.warning("a process per device needs a spool directory (/dev/shm or --spool-dir): serving the "
                            "devices from threads of this process")
            if self.device_processes and self.decoder.spool_prefix is not None:
                model, devices = await self._load_processes()
            else:
                model, devices = await self._load_here()
        except Exception as e:  # reported on /health and /ready; the CLI exits non-zero
            self.fail(f"model load failed: {type(e).__name__}: {e}")
            return
        self.load_seconds = time.perf_counter() - start
        self._serve(model, devices)
        log.info("ready in %.2f s: %s", self.load_seconds, serving_text(
            self.settings, self.devices, bool(self.device_processes and self.decoder.spool_prefix), self.dtype,
            devices[0].runner_stats().get("attention", {}), self.decoder.workers))

    async def _load_here(self) -> tuple[ModelInfo, list[LocalDevice]]:
        s, loop = self.settings, asyncio.get_running_loop()
        encoders = []
        for device in self.devices:
            if s.gpu_memory_fraction and device.startswith("cuda"):
                torch.cuda.set_per_process_memory_fraction(s.gpu_memory_fraction, torch.device(device))
            log.info("loading %s (%s) on %s as %s", s.model, s.load_format, device, self.dtype)
            encoders.append(await loop.run_in_executor(self._loader, lambda d=device: VisionEncoder.from_pretrained(
                s.model, device=d, dtype=self.dtype, capture=False, **s.encoder_kwargs())))
        if any(e.runner.use_graphs for e in encoders):
            log.info("loaded; capturing CUDA graphs")
        if self.state is State.LOADING:
            self.state = State.CAPTURING
        for encoder in encoders:
            await loop.run_in_executor(self._loader, encoder.capture)
        first = encoders[0]
        return ModelInfo(first.config, first.preprocess_config, first.video_config), self._local(encoders)

    async def _load_processes(self) -> tuple[ModelInfo, list[ProcessDevice]]:
        """One process per device, loading and capturing side by side; done when all are."""
        s, loop = self.settings, asyncio.get_running_loop()
        log.info("loading %s (%s) on %s as %s, one process per device", s.model, s.load_format,
                 ", ".join(self.devices), self.dtype)
        config, preprocess_config, video_config, processes = await loop.run_in_executor(
            self._loader, lambda: start_devices(s, self.devices, self.dtype, self.decoder.spool_prefix,
                                                started=lambda: loop.call_soon_threadsafe(self._capturing)))
        return ModelInfo(config, preprocess_config, video_config), processes

    def _capturing(self) -> None:
        if self.state is State.LOADING:
            self.state = State.CAPTURING

    def mirror(self, status) -> None:
        """On the event loop, in a front end: the core's state (core.Status)."""
        if status.model is not None:
            self.model = status.model
            self.devices = status.devices or self.devices
        if status.state == State.FAILED.value:
            self.fail(status.error)
        elif status.state == State.DRAINING.value:
            self.drain()
        elif self.state not in (State.DRAINING, State.FAILED):
            self.state = State(status.state)

    def fail(self, reason: str) -> None:
        """On the event loop: the server cannot serve (its model did not load, or a part it cannot run without is
        gone). /health turns failed and the CLI exits non-zero, so an orchestrator restarts it."""
        if self.state is not State.FAILED:
            log.error("%s", reason)
            self.state, self.error = State.FAILED, reason
            self.metrics.ready.set(0)

    def drain(self) -> None:
        """Stop admitting requests (ready -> 503); requests already admitted are still answered."""
        if self.state in (State.READY, State.LOADING, State.CAPTURING):
            self.state = State.DRAINING
        self.metrics.ready.set(0)

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.queue.close()  # each worker finishes what it holds, then exits
        for worker in self.workers:
            if worker.thread.is_alive():
                await loop.run_in_executor(None, worker.thread.join)
            await loop.run_in_executor(None, worker.device.close)
        self._loader.shutdown(wait=True)
        await self.decoder.close()

    def abandon(self) -> None:
        """A forced exit: kill the decode and device processes and remove the spool files, without waiting."""
        for child in multiprocessing.active_children():
            child.kill()
        self.decoder.abandon()

    # ---- admission -----------------------------------------------------------------------------------------------
    @contextmanager
    def admitted(self):
        """A request in flight: refused (503 while not ready, 429 over --max-concurrent-requests), else counted."""
        if self.state is not State.READY:
            reason = f"server failed: {self.error}" if self.state is State.FAILED else \
                "server is shutting down" if self.state is State.DRAINING else \
                f"model is not ready yet ({self.state.value})"
            raise NotReady(reason)
        if self.in_flight >= self.settings.max_concurrent_requests:
            raise QueueFull(f"too many requests in flight ({self.in_flight}); retry shortly")
        self.in_flight += 1
        self.metrics.requests_in_flight.set(self.in_flight)
        try:
            yield
        finally:
            self.in_flight -= 1
            self.metrics.requests_in_flight.set(self.in_flight)

    # ---- work ----------------------------------------------------------------------------------------------------
    async def encode(self, images: list, mean_pooling: bool = False, disconnected: asyncio.Future | None = None,
                     field: str = "input", max_pixels: int | None = None, client: int | None = None) -> Encoded:
        """Encode a request's images (Base64Data, bytes, or URLs when fetching is on): decoding, then batching.
        If `disconnected` resolves first, its images are dropped from the queue (ClientDisconnected). `field`
        names the images in errors (`input[2]`); `max_pixels` caps their resized size below the server's; `client`
        is the API key the request came with (the cache's scope). Admission (`admitted`) is the caller's: the gate
        admits a request from its first byte."""
        if self.model is None:
            raise NotReady(f"model is not ready yet ({self.state.value})")
        cfg = self.model.preprocess_config
        if max_pixels is not None:
            if max_pixels < cfg.min_pixels:
                raise InputRejected(f"max_pixels must be at least this server's min_pixels ({cfg.min_pixels})",
                                    "invalid_max_pixels", "max_pixels")
            cfg = dataclasses.replace(cfg, max_pixels=min(max_pixels, cfg.max_pixels))
        if self.settings.allow_url_fetch:
            images = await fetch.fetch_all(images, self.settings, field, self.fetch_budget)
        outputs: list = [None] * len(images)
        keys = await self.cache.keys(images, cfg, mean_pooling, client) if self.cache.enabled else []
        todo, waits, hits = list(range(len(images))), [], 0
        if keys:
            todo = []
            for i, found in enumerate(await self._lookup(keys)):
                if isinstance(found, asyncio.Future):  # the same image is being encoded already
                    waits.append((i, found))
                elif found is not None:
                    outputs[i], hits = found, hits + 1
                else:
                    todo.append(i)
            self.metrics.cache_hits.inc(hits)
            self.metrics.cache_misses.inc(len(todo))
        times = (0.0, 0.0, 0.0)
        try:
            if todo:
                times = await self._compute(images, todo, outputs, cfg, field, mean_pooling, disconnected, keys)
        finally:
            for i in todo if keys else ():
                self._settle(keys[i], outputs[i])
        for i, other in waits:
            outputs[i] = await other
            if outputs[i] is None:  # the other request failed: this one encodes it itself
                times = await self._compute(images, [i], outputs, cfg, field, mean_pooling, disconnected)
        return Encoded([o[0] for o in outputs], [list(o[1]) for o in outputs], *times, hits)

    async def _lookup(self, keys: list[bytes]) -> list:
        """Per cache key: its (output, grid) (a hit), a future of it (the same image being encoded for another
        request; of None when that one fails), or None: a miss, claimed for the caller, who settles it."""
        if self.core is not None:
            return await self.core.lookup(keys)
        return [self.cache.get(key) or self.cache.claim(key) for key in keys]

    def _settle(self, key: bytes, output) -> None:
        """A claimed image's (output, grid), or None when it was not encoded."""
        if self.core is None:
            self.cache.settle(key, output)
        elif output is None:  # the core settles what its devices answer; a claim left unanswered is let go
            self.core.release([key])

    def _enqueue(self, items: list[WorkItem]) -> None:
        if self.core is not None:
            self.core.submit(items)
        else:
            self.queue.put(items)

    def _dequeue(self, items: list[WorkItem]) -> None:
        if self.core is not None:
            self.core.drop(items)
        else:
            self.queue.drop(items)

    async def _compute(self, images: list, todo: list[int], outputs: list, cfg, field: str, mean_pooling: bool,
                       disconnected: asyncio.Future | None, keys: list | None = None) -> tuple[float, float, float]:
        """Decode and run the images at `todo` (indices of `images`), filling `outputs`; the seconds their decoding
        took, and the longest queue and inference seconds among them. `keys`: the images' cache keys, where the
        core caches their answers."""
        start = time.perf_counter()
        decoded = await self._decoded(self.decoder.decode([images[i] for i in todo], cfg, field, todo), disconnected,
                                      len(todo))
        decode_s = time.perf_counter() - start
        loop = asyncio.get_running_loop()
        items = [WorkItem(image, grid, loop.create_future(), mean_pooling, f"{field}[{i}]", keys[i] if keys else None)
                 for i, (image, grid) in zip(todo, decoded)]
        for i, item, output in zip(todo, items, await self._run(items, disconnected)):
            outputs[i] = (output, item.grid)
        return decode_s, max(i.queue_s for i in items), max(i.inference_s for i in items)

    async def _decoded(self, decoding, disconnected: asyncio.Future | None, dropped: int = 0):
        """The result of a request's decoding; a client that leaves first frees its decode workers
        (ClientDisconnected; `dropped` images counted as dropped before they were queued)."""
        decoding = asyncio.ensure_future(decoding)
        try:
            await asyncio.wait({decoding} if disconnected is None else {decoding, disconnected},
                               return_when=asyncio.FIRST_COMPLETED)
            if not decoding.done():
                self.metrics.dropped.inc(dropped)
                raise ClientDisconnected("the client went away")
        except BaseException:
            decoding.cancel()
            raise
        return decoding.result()

    async def _run(self, items: list[WorkItem], disconnected: asyncio.Future | None) -> list:
        """Queue decoded items for the devices and wait for their outputs; when the client leaves first, they are
        taken out of the queue (ClientDisconnected)."""
        self._enqueue(items)
        results = asyncio.gather(*(item.future for item in items))
        await asyncio.wait({results} if disconnected is None else {results, disconnected},
                           return_when=asyncio.FIRST_COMPLETED)
        if not results.done():
            self._dequeue(items)
            results.cancel()
            results.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved"
            raise ClientDisconnected("the client went away")
        return results.result()

    def video_config(self, fps: float | None = None, num_frames: int | None = None, max_frames: int | None = None,
                     max_pixels: int | None = None, truncate_frames: bool = False) -> VideoConfig:
        """The model's video preprocessing with a request's sampling (else --video-fps where set), within the
        server's limits: at most --max-video-frames frames (a larger num_frames is refused, 413)."""
        s = self.settings
        if num_frames is not None and num_frames > s.max_video_frames:
            raise InputTooLarge(f"num_frames {num_frames} is over this server's limit of {s.max_video_frames} frames "
                                "a video", "too_many_frames", "num_frames")
        if fps is None and num_frames is None and s.video_fps is not None:
            fps = s.video_fps
        cfg = self.model.video_config
        if num_frames is not None and num_frames < cfg.temporal_patch_size:
            raise InputRejected(f"num_frames must be at least {cfg.temporal_patch_size} (one temporal patch), got "
                                f"{num_frames}", "invalid_num_frames", "num_frames")
        if max_pixels is not None and max_pixels < cfg.min_pixels:
            raise InputRejected(f"max_pixels must be at least this server's video min_pixels ({cfg.min_pixels})",
                                "invalid_max_pixels", "max_pixels")
        return cfg.with_request(fps, num_frames, min(max_frames or s.max_video_frames, s.max_video_frames),
                                max_pixels, truncate_frames)

    async def encode_videos(self, videos: list, options: dict, mean_pooling: bool = False,
                            disconnected: asyncio.Future | None = None, field: str = "videos",
                            max_pixels: int | None = None) -> Encoded:
        """Encode a request's videos (Base64Data, bytes, or URLs when fetching is on): each is decoded, sampled
        and resized by a decode worker into slices of T frames, and its slices join the image queue as items of
        their own (they batch beside images and other videos, over as many replays as they need); the answer per
        video is its slices' tokens in order (their mean with `mean_pooling`), and its timing (Encoded.videos).
        `options`: the request's fps, num_frames and max_frames (`video_config`). Not cached."""
        if self.model is None:
            raise NotReady(f"model is not ready yet ({self.state.value})")
        cfg = self.video_config(max_pixels=max_pixels, **options)
        if self.settings.allow_url_fetch:
            videos = await fetch.fetch_all(videos, self.settings, field, self.fetch_budget)
        start = time.perf_counter()
        decoded = await self._decoded(self.decoder.decode_videos(videos, cfg, field), disconnected)
        decode_s = time.perf_counter() - start
        loop, items, owners = asyncio.get_running_loop(), [], []
        for j, (slices, (t, h, w), _) in enumerate(decoded):
            items += [WorkItem(s, (1, h, w), loop.create_future(), False, f"{field}[{j}]", modality="video")
                      for s in slices]
            owners += [j] * len(slices)
        results = await self._run(items, disconnected)

        def assemble() -> list:  # each video's slices joined (Features.join): megabytes to copy, off the event loop
            outputs = []
            for j in range(len(decoded)):
                video = Features.join([output for owner, output in zip(owners, results) if owner == j],
                                      mean=mean_pooling)
                outputs.append((video.tokens, video.deepstack))
            return outputs

        outputs = await asyncio.to_thread(assemble)
        return Encoded(outputs, [list(grid) for _, grid, _ in decoded], decode_s,
                       max((i.queue_s for i in items), default=0.0), max((i.inference_s for i in items), default=0.0),
                       videos=[timing for _, _, timing in decoded])

    def _done(self, worker: DeviceWorker, batch: list[WorkItem], outputs, error: EngineError | None,
              seconds: float) -> None:
        """From a worker's thread: a batch is done; its futures are resolved on the event loop."""
        self._loop.call_soon_threadsafe(self._resolve, worker, batch, outputs, error, seconds)

    def _resolve(self, worker: DeviceWorker, batch: list[WorkItem], outputs, error: EngineError | None,
                 seconds: float) -> None:
        if error is not None:
            if error.code == "device_lost":
                self.fail(error.message)
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(error)
            return
        m = self.metrics
        m.inference_seconds.labels(worker.name).observe(seconds)
        m.batch_tokens.observe(sum(i.patches for i in batch) // self.model.config.merge_unit)
        m.batch_images.observe(len(batch))
        count_items(m, worker.name, batch)
        self.batch_sizes[len(batch)] = self.batch_sizes.get(len(batch), 0) + 1
        m.record("inference", seconds)
        for item, output in zip(batch, outputs):
            m.queue_seconds.observe(item.queue_s)
            m.record("queue", item.queue_s)
            item.inference_s = seconds
            if item.future.done():
                continue
            if isinstance(output, ImageError):  # the device could not decode it (fast preprocessing)
                item.future.set_exception(Decoder.rejection(item.param, output))
            else:
                item.future.set_result(output)

    def collect(self, kind: str):
        """From the core link's thread, in a front end: this process's part of the server's /metrics or /stats."""
        if kind == "metrics":
            from prometheus_client import generate_latest

            return generate_latest(self.metrics.registry).decode()
        count = lambda name: int(self.metrics.registry.get_sample_value(name) or 0)  # noqa: E731
        return {"recent": self.metrics.recent(), "requests_in_flight": self.in_flight,
                "tiers": self.tier_figures(),
                "decode_workers": self.decoder.workers, "decode_workers_replaced": self.decoder.workers_replaced,
                "memory": {"bodies": {"limit_bytes": self.bodies.limit, "bytes": self.bodies.used},
                           "decode": {"limit_bytes": self.decoder.budget.limit, "bytes": self.decoder.budget.used}},
                "counters": {"hits": count("vitserve_cache_hits_total"),
                             "misses": count("vitserve_cache_misses_total")}}

    async def server_stats(self) -> dict:
        """/stats: of the whole server (in a front end, the core gathers every process's part)."""
        return await self.core.scrape("stats") if self.core is not None else self.stats()

    async def server_metrics(self) -> bytes:
        """/metrics' exposition text: of the whole server (in a front end, every process's series summed)."""
        if self.core is not None:
            return (await self.core.scrape("metrics")).encode()
        from prometheus_client import generate_latest

        return generate_latest(self.metrics.registry)

    def tier_figures(self) -> dict:
        """Each encoder tier's figures (/stats' `tiers`, the vitserve_ec_* and vitserve_sglang_* series)."""
        return {name: figures() for name, figures in self.tiers.items()}

    def stats(self) -> dict:
        s = self.settings
        devices, runners = workers_stats(self.workers)
        batching = s.batching(self.decoder.workers)
        return {"version": __version__, "model": s.model_name, "state": self.state.value, "error": self.error,
                "device": self.devices[0], "devices": devices, "latency": self.metrics.percentiles(),
                "dtype": self.dtype, "family": self.model.config.family if self.model else None,
                "uptime_seconds": round(time.time() - self.started, 3), "load_seconds": round(self.load_seconds, 3),
                "requests_in_flight": self.in_flight, "queue_depth": len(self.queue),
                "tiers": self.tier_figures(),
                "batch_size_histogram": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "spool": self.decoder.spool_prefix and os.path.dirname(self.decoder.spool_prefix),
                "device_processes": any(isinstance(w.device, ProcessDevice) for w in self.workers),
                "decode_workers_replaced": self.decoder.workers_replaced, "cache": self.cache.stats(),
                "batching": batching, "eager_runs": sum(r.get("eager_runs", 0) for r in runners),
                "videos": {"available": self.videos_unavailable is None, "reason": self.videos_unavailable},
                "memory": {"bodies": {"limit_bytes": self.bodies.limit, "bytes": self.bodies.used},
                           "decode": {"limit_bytes": self.decoder.budget.limit, "bytes": self.decoder.budget.used}},
                "eager_fallbacks": sum(r.get("eager_fallbacks", 0) for r in runners)}
