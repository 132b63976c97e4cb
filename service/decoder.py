"""Decoding a request's images: decode + resize in worker processes (or threads), pixels back through the spool.

The decoder owns the decode pool, this server's spool prefix and the retry: a worker that dies on an image (a
decoder crash, the OOM killer) fails only that image, which is tried once more; only an image that kills a worker
twice is refused. Failures become the request's domain errors (errors.py), naming the image (`input[i]`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from ..encoder.preprocess import Base64Data, ImageError, ImageTooLarge, PreprocessConfig

from . import spool
from .decode import decode_and_resize
from .decode_pool import DecodePool, PoolUnavailable, WorkerDied
from .errors import InputRejected, InputTooLarge, Unavailable
from .metrics import Metrics
from .settings import Settings

log = logging.getLogger("vitserve.decoder")

Decoded = tuple[np.ndarray | spool.Spooled, tuple[int, int, int]]  # pixels (maybe in a spool file) and patch grid


def _discard_result(job: asyncio.Future) -> None:
    """For an image's decode whose request is gone: a spooled image it made has nobody to read it."""
    if job.done() and not job.cancelled() and job.exception() is None:
        spool.discard(job.result()[0])


class Decoder:
    """`settings.decode_workers` worker processes (`decode_processes`; else threads) and the spool they write to.
    `on_broken(reason)` is called on the event loop when the last worker is gone and none can be started."""

    def __init__(self, settings: Settings, metrics: Metrics, on_broken: Callable[[str], None]):
        self.settings, self.metrics = settings, metrics
        workers = settings.decode_workers or os.cpu_count() or 4
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

    async def decode(self, images: list, cfg: PreprocessConfig, field: str = "input") -> list[Decoded]:
        """Decode and resize concurrently; the first bad image fails the request (only it), named `field[i]`."""
        jobs = [asyncio.ensure_future(self._decode(data, cfg)) for data in images]
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
            index, error = next((i, e) for i, e in enumerate(errors) if e is not None)
            raise self._error(f"{field}[{index}]", error) from None
        out, p = [], cfg.patch_size
        for job in jobs:
            image, seconds = job.result()
            self.metrics.preprocess_seconds.observe(seconds)
            self.metrics.record("decode", seconds)
            out.append((image, (1, image.shape[0] // p, image.shape[1] // p)))
        return out

    @staticmethod
    def _error(param: str, e: BaseException) -> Exception:
        if isinstance(e, ImageTooLarge):
            return InputTooLarge(f"{param}: {e}", e.code, param)
        if isinstance(e, ImageError):
            return InputRejected(f"{param}: {e}", e.code, param)
        if isinstance(e, WorkerDied):  # twice: this image kills decode workers
            return InputRejected(f"{param}: the image crashed the decoder", "undecodable_image", param)
        if isinstance(e, PoolUnavailable):  # not about this image
            return Unavailable(f"{e}; the server is restarting", "decode_unavailable")
        # anything else the decoder raised is still about this client's bytes
        return InputRejected(f"{param}: cannot decode: {type(e).__name__}: {e}", "undecodable_image", param)

    async def _decode(self, data, cfg: PreprocessConfig):
        for attempt in (1, 2):
            try:
                return await self._decode_once(data, cfg)
            except WorkerDied:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def _decode_once(self, data, cfg: PreprocessConfig):
        limit = self.settings.max_image_pixels
        if is_base64 := isinstance(data, Base64Data):  # as bytes: a str pickles at twice the server's CPU
            data = data.encode("ascii", "replace")  # a non-ASCII character is still invalid base64 there
        start = time.perf_counter()
        if self.pool is None:
            result = await asyncio.get_running_loop().run_in_executor(self.threads, decode_and_resize, data,
                                                                      is_base64, limit, cfg)
        else:
            path = self.spool_prefix and f"{self.spool_prefix}{next(self._names)}"
            job = self.pool.submit(decode_and_resize, data, is_base64, limit, cfg, path)
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
