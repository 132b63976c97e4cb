"""The serving engine: one `encode` call for the app, behind it the decoder, the embedding cache and a backend.

    request -> admit (the gate) -> fetch URLs (when enabled) -> the embedding cache (a hit is answered here)
            -> Decoder.decode (worker processes; pixels in spool files) -> one WorkItem per image, submitted to the
            backend -> its image queue, where a DeviceWorker takes batches from concurrent requests -> its device
            (this process, or a process of its own) runs them -> each image's future is resolved on the event loop

The engine owns admission, decoding, the cache keys and the answers; its backend owns the queue, the devices, the
cache's entries, the loading and the lifecycle it shares with the engine: a `LocalBackend` (backend.py) in a server
of one process, a `HubBackend` (hub.py) in a front end of a server with several, whose calls go to the core
(entry/core.py). When a part the engine cannot run without is gone (a device, the last decode worker, the core),
the server turns FAILED, and the CLI exits for a supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import TypeAlias, cast

from ...encoder import VisionEncoder
from ...encoder.features import Features
from ...encoder.video import VideoConfig
from ..decoding.budget import MemoryBudget
from ..decoding.decoder import Decoder
from ..devices.scheduler import WorkItem
from ..ground.errors import ClientDisconnected, NotReady, QueueFull
from ..ground.metrics import Metrics
from ..ground.settings import Settings
from ..ground.timeline import mark
from . import fetch
from .backend import LocalBackend
from .cache import CacheKeys
from .encoded import Encoded
from .hub import HubBackend
from .lifecycle import NOT_READY, Lifecycle, State
from .loader import ModelInfo, serving_text
from .options import checked_image_config, checked_video_config
from .stats import front_stats
from .videos import encode_videos as videos_through
from .videos import videos_unavailable

__all__ = ["NOT_READY", "Encoded", "Engine", "ModelInfo", "State", "serving_text"]
log = logging.getLogger("vitserve.engine")
Preloaded: TypeAlias = (
    VisionEncoder | list[VisionEncoder] | None
)  # encoders already loaded, to serve instead of loading


class Engine:
    """`encoders`: already loaded encoders to serve (one per device; tests), else the settings' model is loaded by
    `start`. `core`: a front end's pipe to the core of a server with several (its backend is then the core's)."""

    def __init__(self, settings: Settings, encoders: Preloaded = None, metrics: Metrics | None = None, core=None):
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.life = Lifecycle(self.metrics)
        self.started = time.time()
        self.decoder = Decoder(settings.decoding, settings.limits, self.metrics, on_broken=self.fail)
        self.videos_unavailable = videos_unavailable(say=core is None)  # (several front ends: serve_front says it)
        devices, self.dtype = settings.devices.resolve()
        if encoders is not None:  # served as loaded: theirs is the tower's dtype
            self.dtype = str((encoders if isinstance(encoders, list) else [encoders])[0].dtype).removeprefix("torch.")
        self.decoder.video_planes = settings.decoding.video_planes(devices)
        self.decoder.full_size = settings.decoding.images_full_size(devices)
        if settings.decoding.preprocess == "fast" and any(d.startswith("cuda") for d in devices):
            from ...encoder.preprocess_fast import nvjpeg_available

            self.decoder.jpeg_on_device = nvjpeg_available()  # else the decode workers decode JPEGs too
        self.fetch_budget = fetch.FetchBudget(settings.limits.url_fetch_memory)
        # the gate's: small bodies never wait
        self.bodies = MemoryBudget(settings.limits.body_memory, patience=math.inf)
        self.metrics.memory_held.labels("bodies").set_function(lambda: self.bodies.used)  # on a large one
        self.metrics.memory_held.labels("decode").set_function(lambda: self.decoder.budget.used)
        self.cache_keys = CacheKeys(settings.model.name or "", settings.cache.cache_scope == "api-key", self.dtype)
        self.in_flight = 0
        self.tiers: dict[str, Callable[[], dict]] = {}  # an encoder tier's figures, by name (the app sets them)
        self.metrics.watch_tiers(self.tier_figures)
        processes = settings.devices.device_processes  # default: on GPUs (faster for one and for two)
        self.device_processes = any(d.startswith("cuda") for d in devices) if processes is None else processes
        preloaded = [] if encoders is None else encoders if isinstance(encoders, list) else [encoders]
        if core is not None:
            self.backend: LocalBackend | HubBackend = HubBackend(core, self.life, devices, self.collect, self.metrics)
        else:
            own = (self.dtype, self.decoder.spool_prefix, self.process_each())
            collect, ready = self.collect, self.ready_text
            self.backend = LocalBackend(
                settings, self.metrics, self.life, devices, *own, collect=collect, preloaded=preloaded, ready_text=ready
            )

    def process_each(self) -> bool:
        """A process per device: where asked for (the default on GPUs) and a spool directory holds their answers."""
        if self.device_processes and self.decoder.spool_prefix is None:
            log.warning(
                "a process per device needs a spool directory (/dev/shm or --spool-dir): serving the "
                "devices from threads of this process"
            )
        return bool(self.device_processes and self.decoder.spool_prefix is not None)

    def ready_text(self, process_each: bool, attention: dict) -> str:
        return serving_text(self.settings, self.devices, process_each, self.dtype, attention, self.decoder.workers)

    @property
    def state(self) -> State:
        return self.life.state

    @property
    def error(self) -> str | None:
        return self.life.error

    @property
    def model(self) -> ModelInfo | None:
        return self.backend.model

    @property
    def devices(self) -> list[str]:
        return self.backend.devices

    # ---- lifecycle -----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.decoder.start()
        await self.backend.start()

    def fail(self, reason: str) -> None:
        self.life.fail(reason)

    def drain(self) -> None:
        self.life.drain()

    async def stop(self) -> None:
        await self.backend.stop()
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
            reason = (
                f"server failed: {self.error}"
                if self.state is State.FAILED
                else "server is shutting down"
                if self.state is State.DRAINING
                else f"model is not ready yet ({self.state.value})"
            )
            raise NotReady(reason)
        if self.in_flight >= self.settings.limits.max_concurrent_requests:
            raise QueueFull(f"too many requests in flight ({self.in_flight}); retry shortly")
        self.in_flight += 1
        self.metrics.requests_in_flight.set(self.in_flight)
        try:
            yield
        finally:
            self.in_flight -= 1
            self.metrics.requests_in_flight.set(self.in_flight)

    # ---- work ----------------------------------------------------------------------------------------------------
    def preprocess_config(self, max_pixels: int | None):
        """The model's image preprocessing, its resized size capped at a request's `max_pixels`."""
        if self.model is None:
            raise NotReady(f"model is not ready yet ({self.state.value})")
        return checked_image_config(self.model.preprocess_config, max_pixels)

    async def encode(
        self,
        images: list,
        mean_pooling: bool = False,
        disconnected: asyncio.Future | None = None,
        field: str = "input",
        max_pixels: int | None = None,
        client: int | None = None,
        float32: bool = False,
    ) -> Encoded:
        """Encode a request's images (MediaBytes, bytes, or URLs when fetching is on): decoding, then batching.
        If `disconnected` resolves first, its images are dropped from the queue (ClientDisconnected). `field`
        names the images in errors (`input[2]`); `max_pixels` caps their resized size below the server's; `client`
        is the API key the request came with (the cache's scope); `float32`: the tokens are wanted in float32, so
        the devices widen them before their copy to the host (WorkItem.float32). Admission (`admitted`) is the
        caller's: the gate admits a request from its first byte."""
        cfg = self.preprocess_config(max_pixels)
        if self.settings.server.allow_url_fetch:
            images = await fetch.fetch_all(images, self.settings, field, self.fetch_budget)
        outputs: list[Features | None] = [None] * len(images)
        cached = self.settings.cache.cache_bytes > 0
        keys = await self.cache_keys.keys(images, cfg, mean_pooling, client, float32) if cached else []
        todo, waits = (await self.looked_up(keys, outputs)) if keys else (list(range(len(images))), [])
        hits = len(images) - len(todo) - len(waits)
        if keys:
            self.metrics.cache_hits.inc(hits)
            self.metrics.cache_misses.inc(len(todo))
        times = (0.0, 0.0, 0.0)
        try:
            if todo:
                times = await self._compute(
                    images, todo, outputs, cfg, field, mean_pooling, disconnected, keys, float32
                )
        finally:  # the backend keeps what its devices answer; a claim left unanswered is let go
            if unanswered := [keys[i] for i in todo if keys and outputs[i] is None]:
                self.backend.release(unanswered)
        for i, other in waits:
            outputs[i] = await other
            if outputs[i] is None:  # the other request failed: this one encodes it itself
                times = await self._compute(images, [i], outputs, cfg, field, mean_pooling, disconnected, None, float32)
        return Encoded(cast("list[Features]", outputs), *times, hits)  # each one filled by now

    async def looked_up(self, keys: list[bytes], outputs: list) -> tuple[list[int], list]:
        """The cache's answers for `keys` filled into `outputs` (hits); the indices to compute (claimed for this
        request), and the (index, future) of those another request computes."""
        todo, waits = [], []
        for i, found in enumerate(await self.backend.lookup(keys)):
            if isinstance(found, asyncio.Future):  # the same item is being encoded already
                waits.append((i, found))
            elif found is not None:
                outputs[i] = found
            else:
                todo.append(i)
        return todo, waits

    async def _compute(
        self,
        images: list,
        todo: list[int],
        outputs: list,
        cfg,
        field: str,
        mean_pooling: bool,
        disconnected: asyncio.Future | None,
        keys: list | None = None,
        float32: bool = False,
    ) -> tuple[float, float, float]:
        """Decode and run the images at `todo` (indices of `images`), filling `outputs`; the seconds their decoding
        took, and the longest queue and inference seconds among them. `keys`: the images' cache keys, under which
        the backend keeps their answers."""
        start = time.perf_counter()
        decoded = await self.decoded(
            self.decoder.decode([images[i] for i in todo], cfg, field, todo), disconnected, len(todo)
        )
        decode_s = time.perf_counter() - start
        new_future = asyncio.get_running_loop().create_future
        items = [
            WorkItem(
                image, grid, new_future(), mean_pooling, f"{field}[{i}]", keys[i] if keys else None, float32=float32
            )
            for i, (image, grid) in zip(todo, decoded)
        ]
        for i, output in zip(todo, await self.run_items(items, disconnected)):
            outputs[i] = output
        return decode_s, max(i.queue_s for i in items), max(i.inference_s for i in items)

    async def decoded(self, decoding, disconnected: asyncio.Future | None, dropped: int = 0):
        """The result of a request's decoding; a client that leaves first frees its decode workers
        (ClientDisconnected; `dropped` images counted as dropped before they were queued)."""
        decoding = asyncio.ensure_future(decoding)
        try:
            await asyncio.wait(
                {decoding} if disconnected is None else {decoding, disconnected}, return_when=asyncio.FIRST_COMPLETED
            )
            if not decoding.done():
                self.metrics.dropped.inc(dropped)
                raise ClientDisconnected("the client went away")
        except BaseException:
            decoding.cancel()
            raise
        return decoding.result()

    async def run_items(self, items: list[WorkItem], disconnected: asyncio.Future | None) -> list:
        """Submit decoded items to the backend and wait for their Features (each with its item's grid); when the
        client leaves first, they are taken out of the queue (ClientDisconnected)."""
        self.submit_items(items)
        return await self.finish_items(items, disconnected)

    def submit_items(self, items: list[WorkItem]) -> None:
        """Decoded items into the backend's queue (`finish_items` waits for them)."""
        self.backend.submit(items)

    async def finish_items(self, items: list[WorkItem], disconnected: asyncio.Future | None) -> list:
        """The Features of submitted items, in order; when the client leaves first, they are abandoned
        (ClientDisconnected)."""
        results = asyncio.gather(*(cast(asyncio.Future, item.future) for item in items))  # (this process's items)
        await asyncio.wait(
            {results} if disconnected is None else {results, disconnected}, return_when=asyncio.FIRST_COMPLETED
        )
        if not results.done():
            self.abandon_items(items)
            results.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved"
            raise ClientDisconnected("the client went away")
        mark("answered")
        return results.result()

    def abandon_items(self, items: list[WorkItem]) -> None:
        """Submitted items no answer waits for any more: taken out of the queue where they still are, their futures
        cancelled (an answer that comes is dropped)."""
        self.backend.drop(items)
        for item in items:
            future = cast(asyncio.Future, item.future)
            future.cancel()
            future.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved"

    def video_config(self, **request) -> VideoConfig:
        """The model's video preprocessing with a request's sampling (options.checked_video_config)."""
        return checked_video_config(
            cast(ModelInfo, self.model).video_config, self.settings.limits, self.settings.decoding, **request
        )

    async def encode_videos(
        self,
        videos: list,
        options: dict,
        mean_pooling: bool = False,
        disconnected: asyncio.Future | None = None,
        field: str = "videos",
        max_pixels: int | None = None,
        client: int | None = None,
        float32: bool = False,
    ) -> Encoded:
        """Encode a request's videos (MediaBytes, bytes, or URLs when fetching is on): each is sampled and resized
        by a decode worker into slices of T frames, which join the image queue as items of their own (they batch
        beside images and other videos, over as many replays as they need) or come from the cache (videos.py); the
        answer per video is its Features: its slices' tokens in order (their mean with `mean_pooling`), its grid and
        timing. `options`: the request's fps, num_frames and max_frames (`video_config`); `client` and `float32` as
        for images."""
        if self.model is None:
            raise NotReady(f"model is not ready yet ({self.state.value})")
        cfg = self.video_config(max_pixels=max_pixels, **options)
        if self.settings.server.allow_url_fetch:
            videos = await fetch.fetch_all(videos, self.settings, field, self.fetch_budget)
        return await videos_through(self, videos, cfg, mean_pooling, disconnected, field, client, float32)

    # ---- /stats and /metrics -------------------------------------------------------------------------------------
    def collect(self, kind: str):
        """This process's front part of the server's /metrics (its exposition text) or /stats (from the core link's
        thread, in a front end of a server with several)."""
        if kind == "metrics":
            from prometheus_client import generate_latest

            return generate_latest(self.metrics.registry).decode()
        return front_stats(self)

    async def server_stats(self) -> dict:
        """/stats of the whole server (the backend gathers its part and every front end's)."""
        return await self.backend.scrape("stats")

    async def server_metrics(self) -> bytes:
        """/metrics' exposition text of the whole server (every process's series summed)."""
        return await self.backend.scrape("metrics")

    def tier_figures(self) -> dict:
        """Each encoder tier's figures (/stats' `tiers`, the vitserve_ec_* and vitserve_sglang_* series)."""
        return {name: figures() for name, figures in self.tiers.items()}
