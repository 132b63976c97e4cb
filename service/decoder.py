"""Decoding a request's images: decode + resize in worker processes (or threads), pixels back through the spool.

Before any pixel is decoded, each image's header is read on the event loop from its first bytes (`probe`): its
format must be allowed, its pixels under `--max-image-pixels`, and the memory its decode takes (estimated from the
size and mode, alpha and palette expansion included) counts against the request's limit
(`--decode-memory-per-request`, 413 beyond) and the server's (`--decode-memory`, a `MemoryBudget`: an image waits
until its share fits, so large images queue instead of overcommitting the host). The decode pool hands waiting
images to the workers round-robin by request, so one large request cannot stall a small one behind it.

The decoder owns the decode pool, this server's spool prefix and the retry: a worker that dies on an image (a
decoder crash, the OOM killer) fails only that image, which is tried once more; only an image that kills a worker
twice is refused. Failures become the request's domain errors (errors.py), naming the image (`input[i]`), in the
service's own words: the decoder's text goes to the log only.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from ..encoder.preprocess import (Base64Data, ImageError, ImageHeader, ImageTooLarge, PreprocessConfig,
                                  UndecodableImage, decode_base64, probe, target_size)

from . import spool
from .budget import MemoryBudget
from .decode import decode_and_resize
from .decode_pool import DecodePool, PoolUnavailable, WorkerDied
from .errors import InputRejected, InputTooLarge, Unavailable
from .metrics import Metrics
from .settings import Settings

log = logging.getLogger("vitserve.decoder")

Decoded = tuple[np.ndarray | spool.Spooled, tuple[int, int, int]]  # pixels (maybe in a spool file) and patch grid


PROBE_BYTES = 64 * 2**10  # of an image, where its header is read first (the whole image where that does not do)


def head(data) -> bytes:
    """The first PROBE_BYTES of an image's bytes (of its base64 text: decoded from a 4-aligned prefix)."""
    if not isinstance(data, Base64Data):
        return bytes(data[:PROBE_BYTES])
    chunk = data.prefix(PROBE_BYTES * 4 // 3 + 256)
    text = "".join(chunk.split())  # base64 may hold line breaks
    if len(chunk) < len(data):
        text = text[:len(text) // 4 * 4]
    return decode_base64(text)


def header_of(data) -> ImageHeader:
    """The image's header, from its first bytes, else from all of them."""
    first = head(data)
    try:
        return probe(first)
    except UndecodableImage:
        whole = data.decode() if isinstance(data, Base64Data) else bytes(data)
        if len(whole) <= len(first):
            raise
        return probe(whole)


def _discard_result(job: asyncio.Future) -> None:
    """For an image's decode whose request is gone: a spooled image it made has nobody to read it."""
    if job.done() and not job.cancelled() and job.exception() is None:
        spool.discard(job.result()[0])


class Decoder:
    """`settings.decode_workers` worker processes (`decode_processes`; else threads) and the spool they write to.
    `on_broken(reason)` is called on the event loop when the last worker is gone and none can be started."""

    def __init__(self, settings: Settings, metrics: Metrics, on_broken: Callable[[str], None]):
        self.settings, self.metrics = settings, metrics
        self.fast = settings.preprocess == "fast"  # the device resizes: images stay full size here
        self.jpeg_on_device = False  # fast, and nvJPEG on the devices: JPEGs stay encoded (set by the engine)
        self.workers = workers = settings.decode_worker_count()
        self.pool: DecodePool | None = None
        self.threads: ThreadPoolExecutor | None = None
        if settings.decode_processes:
            self.pool = DecodePool(workers, on_orphan=lambda result: spool.discard(result[0]), on_broken=on_broken)
        else:
            self.threads = ThreadPoolExecutor(workers, thread_name_prefix="vitserve-decode")
        self.spool_prefix: str | None = None
        if settings.decode_processes and settings.spool_dir != "none":
            self.spool_prefix = spool.spool_prefix(settings.spool_dir)
            if self.spool_prefix is None:
                log.warning("no usable spool directory (%s): decoded images cross through a pipe, which costs the "
                            "server about 2 ms of CPU per megabyte", settings.spool_dir or "/dev/shm")
        self._names = itertools.count()
        self.budget = MemoryBudget(settings.decode_memory)

    @property
    def workers_replaced(self) -> int:
        return self.pool.replaced if self.pool else 0

    async def start(self) -> None:
        if self.pool:
            await self.pool.start()

    async def close(self) -> None:
        if self.pool:
            await self.pool.close()
        else:
            self.threads.shutdown(wait=False, cancel_futures=True)
        spool.clear(self.spool_prefix)

    def abandon(self) -> None:
        """A forced exit: remove the spool files without waiting for anyone (the processes are killed by then)."""
        spool.clear(self.spool_prefix)

    def costs(self, images: list, field: str, names: list[int]) -> list[int]:
        """Each image's decode memory from its header; the request's errors before anything is decoded."""
        costs = []
        for index, data in zip(names, images):
            try:
                header = header_of(data)
                if header.width * header.height > self.settings.max_image_pixels:
                    raise ImageTooLarge(f"image is {header.width}x{header.height} = {header.width * header.height} "
                                        f"pixels, more than the limit of {self.settings.max_image_pixels}")
            except Exception as e:
                raise self.rejection(f"{field}[{index}]", e) from None
            costs.append(header.decode_bytes)
        limit = self.settings.decode_memory_per_request
        if sum(costs) > limit:
            raise InputTooLarge(f"decoding these {len(images)} image(s) takes about {sum(costs) / 2**20:.0f} MB; a "
                                f"request may take {limit / 2**20:.0f} MB (send fewer or smaller images)",
                                "decode_memory", field)
        return costs

    async def decode(self, images: list, cfg: PreprocessConfig, field: str = "input",
                     names: list[int] | None = None) -> list[Decoded]:
        """Decode and resize concurrently; the first bad image fails the request (only it), named `field[i]` with
        i its index in `names` (default: its position)."""
        names = list(range(len(images))) if names is None else names
        costs, owner = self.costs(images, field, names), object()  # the request, for the decode pool's fair queue
        jobs = [asyncio.ensure_future(self._decode(data, cfg, cost, owner)) for data, cost in zip(images, costs)]
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
            index, error = next((i, e) for i, e in zip(names, errors) if e is not None)
            raise self.rejection(f"{field}[{index}]", error) from None
        out, p = [], cfg.patch_size
        for job in jobs:
            image, seconds = job.result()
            self.metrics.preprocess_seconds.observe(seconds)
            self.metrics.record("decode", seconds)
            h, w = target_size(image, cfg) if self.fast else image.shape[:2]  # fast: the size the device resizes to
            out.append((image, (1, h // p, w // p)))
        return out

    @staticmethod
    def rejection(param: str, e: BaseException) -> Exception:
        """The domain error a request gets for its image `param` that could not be decoded (`e`)."""
        if isinstance(e, ImageError):
            if str(e) != e.public:
                log.info("%s: %s", param, e)  # the decoder's own words: for the log, not the client
            return (InputTooLarge if isinstance(e, ImageTooLarge) else InputRejected)(f"{param}: {e.public}", e.code,
                                                                                     param)
        if isinstance(e, WorkerDied):  # twice: this image kills decode workers
            return InputRejected(f"{param}: the image crashed the decoder", "undecodable_image", param)
        if isinstance(e, PoolUnavailable):  # not about this image
            return Unavailable(f"{e}; the server is restarting", "decode_unavailable")
        # anything else the decoder raised is still about this client's bytes
        log.info("%s: cannot decode: %s: %s", param, type(e).__name__, e)
        return InputRejected(f"{param}: cannot decode the image", "undecodable_image", param)

    async def _decode(self, data, cfg: PreprocessConfig, cost: int, owner):
        share = await self.budget.acquire(cost)
        try:
            for attempt in (1, 2):
                try:
                    return await self._decode_once(data, cfg, owner)
                except WorkerDied:
                    if attempt == 2:
                        raise
        finally:
            self.budget.release(share)
        raise AssertionError("unreachable")

    async def _decode_once(self, data, cfg: PreprocessConfig, owner):
        limit = self.settings.max_image_pixels
        if is_base64 := isinstance(data, Base64Data):  # as bytes: a str pickles at twice the server's CPU
            data = data.ascii()
        start = time.perf_counter()
        if self.pool is None:
            result = await asyncio.get_running_loop().run_in_executor(self.threads, decode_and_resize, data,
                                                                      is_base64, limit, cfg, None, self.fast,
                                                                      self.jpeg_on_device)
        else:
            path = self.spool_prefix and f"{self.spool_prefix}{next(self._names)}"
            job = self.pool.submit(decode_and_resize, data, is_base64, limit, cfg, path, self.fast,
                                   self.jpeg_on_device, owner=owner)
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
