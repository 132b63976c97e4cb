"""Decoding a request's images: decode + resize in worker processes (or threads), pixels back through the spool.

Before any pixel is decoded, each image's header is read in a thread from its first bytes (`first_headers`: a walk
bounded in bytes and steps, microseconds whatever the bytes hold; where the header is not within them, a decode
worker reads it from the whole image): its format must be allowed, its pixels under `--max-image-pixels`, and the
memory its decode takes (estimated from the size and mode, alpha and palette expansion included) counts against the
request's limit (`--decode-memory-per-request`, 413 beyond) and the server's (`--decode-memory`, a `MemoryBudget`:
an image waits until its share fits, in its request's turn, round-robin by request, so large images queue instead of
overcommitting the host and one request's many large images take one turn at a time). Where the probe saw
the image's end, only the bytes up to it are decoded (what follows, junk or a phone's motion video, stays behind).
An image of a request body in a body file (bodies.py) goes to its worker as where it lies there (`SharedText`): no
byte of it crosses the worker's socket. No byte of an image is touched on the event loop. The decode pool hands
waiting images to the workers round-robin by request, so one large request cannot stall a small one behind it.

The decoder owns the decode pool, this server's spool prefix and the retry: a worker that dies on an image (a
decoder crash, the OOM killer) fails only that image, which is tried once more; only an image that kills a worker
twice is refused. An image that takes a worker longer than `--decode-timeout` is refused (413 `decode_timeout`, not
retried) and its worker killed and replaced; so is the worker of an image whose request is gone, a second after. (In
threads, `--decode-processes false`, nothing can be killed: the request gets its 413 at the limit, and the thread
finishes the image for nobody.) Failures become the request's domain errors (errors.py), naming the image
(`input[i]`), in the service's own words: the decoder's text goes to the log only. Text sent where an image goes is
told so (`text_input`).
"""

from __future__ import annotations

import asyncio
import binascii
import functools
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import pybase64

from ..encoder.headers import ImageHeader, probe
from ..encoder.preprocess import (Base64Data, HeaderNotFound, ImageError, ImageTooLarge, InvalidBase64, PreprocessConfig,
                                  UndecodableImage, UnsupportedFormat, decode_base64, target_size)

from . import spool
from .budget import MemoryBudget
from .bodies import SharedBodies
from .decode import (VIDEO_DECODE_THREADS, DecodedImage, DecodedVideo, SharedText, decode_and_resize, decode_video,
                     measure_video, read_header)
from .decode_pool import DecodePool, JobTimedOut, PoolUnavailable, WorkerDied
from .errors import InputRejected, InputTooLarge, Unavailable
from .metrics import Metrics
from .settings import Settings

log = logging.getLogger("vitserve.decoder")

Decoded = tuple[np.ndarray | spool.Spooled, tuple[int, int, int]]  # pixels (maybe in a spool file) and patch grid


PROBE_BYTES = 64 * 2**10  # of an image, where its header is read first (by a worker from all of it where not there)
TEXT_SAMPLE = 1024  # characters of an input that is no image, read to tell whether it is text
_CONTROLS = {9: None, 10: None, 13: None}  # tab and line breaks: printable enough for text
TEXT_INPUT = ("this is text, not an image: this server encodes images and videos, not text, and its pooled "
              "vectors are the vision tower's, not text-aligned retrieval embeddings")


def head(data, size: int = PROBE_BYTES) -> bytes:
    """The first `size` bytes of an image's bytes (of its base64 text: decoded from a 4-aligned prefix, whitespace
    left out). Reads a bounded prefix only; run off the event loop (`first_headers`)."""
    if not isinstance(data, Base64Data):
        return bytes(data[:size])
    chunk = data.text[data.start:data.start + size * 4 // 3 + 256]
    if not isinstance(chunk, str):
        chunk = bytes(chunk)
    if len(chunk) == len(data):
        return decode_base64(chunk)
    try:  # no whitespace in the whole quads: they are the prefix (whitespace in the 3 characters after changes nothing)
        return pybase64.b64decode(memoryview(chunk.encode("latin-1") if isinstance(chunk, str) else chunk)
                                  [:len(chunk) // 4 * 4], validate=True)
    except (binascii.Error, ValueError):
        pass
    text = type(chunk)().join(chunk.split())  # base64 may hold line breaks
    return decode_base64(text[:len(text) // 4 * 4])


def first_headers(images: list) -> list:
    """Each image's header from its first bytes (`probe(head(data))`), or the exception that raised (HeaderNotFound:
    not within them). Bounded work per image (a 64 KB prefix decoded, a walk of at most 256 steps): the request's
    images in one go in a thread, where base64 decodes without the GIL."""
    out = []
    for data in images:
        try:
            out.append(probe(head(data)))
        except Exception as e:
            out.append(e)
    return out


def looks_like_text(data) -> bool:
    """Whether an input that is no image is text: words sent where an image goes (its string), or a text file
    uploaded (its bytes). Its first characters printable, three in four of them letters or whitespace, with a space or
    a letter outside ASCII (base64 has neither). Base64 stands for a file, whatever its bytes: not told as text."""
    sample = data.prefix(TEXT_SAMPLE) if isinstance(data, Base64Data) else bytes(data[:TEXT_SAMPLE])
    if isinstance(sample, bytes):
        try:
            sample = sample.decode()
        except UnicodeDecodeError as e:  # a character cut at the end of the sample is not binary data
            if e.start < len(sample) - 3:
                return False
            sample = sample[:e.start].decode()
    letters = sum(map(str.isalpha, sample)) + sum(map(str.isspace, sample))
    return sample.translate(_CONTROLS).isprintable() and 4 * letters >= 3 * len(sample) > 0 and \
        (" " in sample or not sample.isascii())


def _head_or_error(data, size: int = 512):
    """An input's first bytes, or the exception reading them raised (base64 that does not decode)."""
    try:
        return head(data, size)
    except Exception as e:
        return e


def _is_video(data) -> bool:
    """Whether an input's first bytes are a video container's (a bounded read: its first 512 bytes)."""
    from ..encoder.video import sniff

    try:
        return sniff(head(data, 512)) is not None
    except Exception:  # not even base64
        return False


def _discard_decoded(result) -> None:
    """A decoded image or video nobody will run: its spooled pixels go (a header's answer holds none)."""
    if isinstance(result, DecodedVideo):
        for piece in result.slices:
            spool.discard(piece)
    elif isinstance(result, DecodedImage):
        spool.discard(result.image)


def _discard_result(job: asyncio.Future) -> None:
    """For an image's or a video's decode whose request is gone: what it spooled has nobody to read it."""
    if job.done() and not job.cancelled() and job.exception() is None:
        _discard_decoded(job.result())


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
            self.pool = DecodePool(workers, on_orphan=_discard_decoded, on_broken=on_broken,
                                   timeout=settings.decode_timeout)
        else:
            self.threads = ThreadPoolExecutor(workers, thread_name_prefix="vitserve-decode")
        self.spool_prefix: str | None = None
        if settings.decode_processes and settings.spool_dir != "none":
            self.spool_prefix = spool.spool_prefix(settings.spool_dir)
            if self.spool_prefix is None:
                log.warning("no usable spool directory (%s): decoded images cross through a pipe, which costs the "
                            "server about 2 ms of CPU per megabyte", settings.spool_dir or "/dev/shm")
        if "C extension active" not in pybase64.get_version():  # its pure-Python fallback is the standard library's
            log.warning("pybase64 runs without its C extension (%s): base64 decodes at a quarter of the speed",
                        pybase64.get_version())
        # large request bodies in files of the spool, which the workers read in place (bodies.py)
        self.bodies = SharedBodies(self.spool_prefix) if self.spool_prefix else None
        self._names = itertools.count()
        self._videos = 0  # videos being decoded now
        self._cpus = settings.decode_worker_count()
        self.budget = MemoryBudget(settings.decode_memory)
        self.video_work = MemoryBudget(settings.video_decode_work)  # decode work, not bytes: the same waiting rules
        # the workers videos may hold at once: the others stay for images, whatever videos come
        self.video_slots = asyncio.Semaphore(settings.video_decode_workers or max(1, workers // 2))

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
        if self.bodies:
            self.bodies.clear()
        spool.clear(self.spool_prefix)

    def abandon(self) -> None:
        """A forced exit: remove the spool files without waiting for anyone (the processes are killed by then)."""
        spool.clear(self.spool_prefix)

    async def headers(self, images: list, field: str, names: list[int], owner) -> list[ImageHeader]:
        """Each image's header (its size checked against the limits), read in a thread from its first bytes, else by
        a decode worker from all of them; the request's first error before anything is decoded, as soon as it is
        known (the headers still being read are then dropped)."""
        first = await asyncio.get_running_loop().run_in_executor(None, first_headers, images)
        headers: list = [None] * len(images)
        later: dict[int, asyncio.Future] = {}  # headers not within the first bytes: read by a decode worker

        def checked(i: int, header) -> ImageHeader:
            if isinstance(header, Exception):
                raise self.rejection(f"{field}[{names[i]}]", header, images[i])
            try:
                header.check(self.settings.max_image_pixels)
            except Exception as e:
                raise self.rejection(f"{field}[{names[i]}]", e, images[i]) from None
            return header

        try:
            for i, data in enumerate(images):
                if isinstance(first[i], HeaderNotFound):
                    later[i] = asyncio.ensure_future(self._run(read_header, data, owner))
                else:
                    headers[i] = checked(i, first[i])
            if later:
                await asyncio.wait(later.values(), return_when=asyncio.FIRST_EXCEPTION)
            for i, job in later.items():  # all read, or one failed: the first in the request's order that did
                if job.done() and job.exception() is not None:
                    checked(i, job.exception())
            for i, job in later.items():
                headers[i] = checked(i, job.result())
        except BaseException:  # a bad image, or the request cancelled: the other headers are not needed
            for job in later.values():
                job.cancel()
                job.add_done_callback(lambda job: job.cancelled() or job.exception())  # retrieved: one is reported
            raise
        return headers

    async def decode(self, images: list, cfg: PreprocessConfig, field: str = "input",
                     names: list[int] | None = None) -> list[Decoded]:
        """Decode and resize concurrently; the first bad image fails the request (only it), named `field[i]` with
        i its index in `names` (default: its position)."""
        names = list(range(len(images))) if names is None else names
        owner = object()  # the request, for the decode pool's fair queue
        headers = await self.headers(images, field, names, owner)
        costs, limit = [header.decode_bytes for header in headers], self.settings.decode_memory_per_request
        if sum(costs) > limit:
            raise InputTooLarge(f"decoding these {len(images)} image(s) takes about {sum(costs) / 2**20:.0f} MB; a "
                                f"request may take {limit / 2**20:.0f} MB (send fewer or smaller images)",
                                "decode_memory", field)
        results = await self._all([self._decode(data, header.end, cfg, cost, owner)
                                   for data, header, cost in zip(images, headers, costs)], field, names)
        out, p = [], cfg.patch_size
        for decoded in results:
            image = decoded.image
            self.metrics.preprocess_seconds.observe(decoded.seconds)
            self.metrics.record("decode", decoded.seconds)
            h, w = target_size(image, cfg) if self.fast else image.shape[:2]  # fast: the size the device resizes to
            out.append((image, (1, h // p, w // p)))
        return out

    async def decode_videos(self, videos: list, cfg, field: str = "videos", names: list[int] | None = None) -> list:
        """Decode, sample and resize videos concurrently in the decode workers (decode.decode_video, under
        `--video-decode-timeout`); per video its (slices, grid, timing). Each one's first bytes must be a video
        container's (video.sniff: an image sent as a video is told so); each may keep at most the per-request decode
        memory of resized frames, and takes what it keeps from the server's decode memory while it decodes. Their
        decode work (encoder.video.decode_work), read from their headers first, is held to
        --video-decode-work-per-request and taken from --video-decode-work while they decode; at most
        --video-decode-workers workers hold videos at once (headers read or frames decoded), so that images always
        find the others. The first bad video fails the request (only it)."""
        from ..encoder.video import VideoLimits, sniff

        names = list(range(len(videos))) if names is None else names
        loop, owner = asyncio.get_running_loop(), object()
        heads = await loop.run_in_executor(None, lambda: [_head_or_error(v) for v in videos])
        for i, data, first in zip(names, videos, heads):
            param = f"{field}[{i}]"
            if isinstance(first, Exception):  # its base64 does not decode
                raise self.rejection(param, first, data) from None
            if not sniff(first):
                raise InputRejected(f"{param}: not a video (send MP4, WebM, MKV, AVI, MPEG-TS, FLV or Ogg; images go "
                                    "in images)", "not_a_video", param)
        s = self.settings
        limits = VideoLimits(max_seconds=s.max_video_seconds, max_frame_pixels=s.max_image_pixels,
                             max_bytes=s.decode_memory_per_request, max_work=s.video_decode_work_per_request)
        costs = await self._all([self._video_job(measure_video, data, owner, cfg, limits) for data in videos], field,
                                names, "video")
        work, limit = sum(cost.work for cost in costs), s.video_decode_work_per_request
        if work > limit:
            raise InputTooLarge(f"decoding these {len(videos)} videos is {work / 1e9:.1f} G pixels of work; a request "
                                f"may take {limit / 1e9:.1f} G (send fewer, shorter or smaller videos)", "decode_work",
                                field)
        results = await self._all([self._decode_video(data, cfg, limits, cost, owner)
                                   for data, cost in zip(videos, costs)], field, names, "video")
        out, m = [], self.metrics
        for video in results:
            m.videos.labels(video.decoder).inc()
            m.video_frames.inc(len(video.timing["frame_indices"]))
            m.video_seconds.inc(video.duration)
            m.preprocess_seconds.observe(video.seconds)
            m.record("decode", video.seconds)
            out.append((video.slices, video.grid, video.timing))
        return out

    async def _all(self, decodes: list, field: str, names: list[int], kind: str = "image") -> list:
        """Run a request's decodes concurrently; their results in order, or at the first failure the request's
        rejection (naming `field[i]`, i from `names`; where several have failed by then, the first in the request's
        order): the decodes still running are dropped and what the others decoded discarded, as it is not run. The
        error goes on once the dropped decodes have unwound (a cancelled decode stops at its next await), so their
        memory and work are back in the server's budgets by then."""
        jobs = [asyncio.ensure_future(decode) for decode in decodes]
        try:
            await asyncio.wait(jobs, return_when=asyncio.FIRST_EXCEPTION)
            failed = next(((i, job.exception()) for i, job in zip(names, jobs)
                           if job.done() and job.exception() is not None), None)
            if failed is not None:
                raise self.rejection(f"{field}[{failed[0]}]", failed[1], kind=kind) from None
        except BaseException:  # one failed, or the request was cancelled: what was decoded goes, the rest is dropped
            for job in jobs:
                job.cancel()
                job.add_done_callback(_discard_result)
            if jobs:
                await asyncio.wait(jobs)
            raise
        return [job.result() for job in jobs]

    @staticmethod
    async def _tried_twice(run):
        """`run()`, a job of a decode worker, once more where its worker died (the OOM killer, a crash): an item under
        which two die is the one that kills them (WorkerDied)."""
        try:
            return await run()
        except WorkerDied:
            return await run()

    async def _video_job(self, fn, data, owner, *args):
        """fn(video, *args) in a decode worker once one of the videos' workers (--video-decode-workers) is free,
        under --video-decode-timeout."""
        async with self.video_slots:
            return await self._tried_twice(lambda: self._run(fn, data, owner, *args,
                                                             timeout=self.settings.video_decode_timeout))

    async def _decode_video(self, data, cfg, limits, cost, owner):
        """A video's decode, once the memory and the work its header declares (`cost`) are taken from the server's
        budgets and one of the videos' workers is free; all given back when it is done. Its wall time from there to
        its frames back is observed in vitserve_decode_seconds, as an image's."""
        share = await self.budget.acquire(cost.memory, owner)
        try:
            work = await self.video_work.acquire(cost.work, owner)
            try:
                async with self.video_slots:
                    # FFmpeg's threads for this video: the workers' cores shared among the videos decoding (a lone
                    # video gets them all; many get VIDEO_DECODE_THREADS each, as the workers decode them side by side)
                    threads = max(VIDEO_DECODE_THREADS, self._cpus // (self._videos + 1))
                    self._videos += 1
                    def run():
                        path = self.pool and self.spool_prefix and f"{self.spool_prefix}{next(self._names)}"
                        return self._run(decode_video, data, owner, cfg, limits, path or None, threads,
                                         timeout=self.settings.video_decode_timeout,
                                         lost=path and functools.partial(spool.clear, f"{path}-"))

                    try:
                        start = time.perf_counter()
                        video = await self._tried_twice(run)
                        self.metrics.decode_seconds.observe(time.perf_counter() - start)
                        return video
                    finally:
                        self._videos -= 1
            finally:
                self.video_work.release(work)
        finally:
            self.budget.release(share)

    @staticmethod
    def rejection(param: str, e: BaseException, data=None, kind: str = "image") -> Exception:
        """The domain error a request gets for its image `param` that could not be decoded (`e`); `data`, where
        given, is what the client sent, told apart as text where it is no image and reads as text."""
        if data is not None and isinstance(e, (InvalidBase64, UndecodableImage)) and looks_like_text(data):
            return InputRejected(f"{param}: {TEXT_INPUT}", "text_input", param)
        if data is not None and isinstance(e, (UndecodableImage, UnsupportedFormat)) and _is_video(data):
            return InputRejected(f"{param}: this is a video, not an image: send it in `videos` (/v1/encode) or with "
                                 "modality video (/v1/embeddings)", "video_input", param)
        if isinstance(e, JobTimedOut):
            log.info("%s: %s", param, e)
            return InputTooLarge(f"{param}: the {kind} took longer than {e.seconds:g} s to decode", "decode_timeout",
                                 param)
        if isinstance(e, ImageError):
            if str(e) != e.public:
                log.info("%s: %s", param, e)  # the decoder's own words: for the log, not the client
            return (InputTooLarge if isinstance(e, ImageTooLarge) else InputRejected)(f"{param}: {e.public}", e.code,
                                                                                     param)
        if isinstance(e, WorkerDied):  # twice: this image or video kills decode workers
            return InputRejected(f"{param}: the {kind} crashed the decoder", f"undecodable_{kind}", param)
        if isinstance(e, PoolUnavailable):  # not about this image
            return Unavailable(f"{e}; the server is restarting", "decode_unavailable")
        # anything else the decoder raised is still about this client's bytes
        log.info("%s: cannot decode: %s: %s", param, type(e).__name__, e)
        return InputRejected(f"{param}: cannot decode the {kind}", f"undecodable_{kind}", param)

    async def _decode(self, data, end: int | None, cfg: PreprocessConfig, cost: int, owner):
        def run():
            path = self.pool and self.spool_prefix and f"{self.spool_prefix}{next(self._names)}"
            return self._run(decode_and_resize, data, owner, self.settings.max_image_pixels, cfg, path or None,
                             self.fast, self.jpeg_on_device, end=end,
                             lost=path and functools.partial(spool.remove, path))

        share = await self.budget.acquire(cost, owner)
        try:
            start = time.perf_counter()
            result = await self._tried_twice(run)
            self.metrics.decode_seconds.observe(time.perf_counter() - start)
            return result
        finally:
            self.budget.release(share)

    async def _run(self, fn, data, owner, *args, end: int | None = None, timeout: float | None = None,
                   lost: Callable[[], None] | None = None):
        """fn(payload, is_base64, *args) in a decode worker (or thread), under the decode timeout. The payload is
        where the image's base64 lies in its request's body file (SharedText: the worker reads it there, nothing is
        sent), else the image's bytes up to `end` (its base64 as ASCII bytes: a str pickles at twice the server's
        CPU), made only when a worker takes the job; `lost()`: removes what the job writes to the spool, called if its
        worker dies; `timeout`: the job's limit instead of `--decode-timeout`."""
        is_base64 = isinstance(data, Base64Data)
        if is_base64 and data.shared is not None and self.pool is not None:
            path, offset = data.shared
            payload = SharedText(path, offset + data.start, len(data), end)
        else:
            payload = functools.partial(data.ascii, end) if is_base64 else data if end is None else \
                memoryview(data)[:end]
        if self.pool is None:
            return await self._in_thread(lambda: fn(payload() if is_base64 else payload, is_base64, *args), timeout)
        job = self.pool.submit(fn, payload, is_base64, *args, owner=owner, timeout=timeout,
                               on_lost=lost)
        try:
            return await job
        except asyncio.CancelledError:  # the request is gone: the pool drops a result still to come, this one here
            _discard_result(job)
            raise

    async def _in_thread(self, run, timeout: float | None = None):
        """run() on a decode thread; past the decode timeout (counted from when a thread takes it) JobTimedOut, while
        the thread, which cannot be stopped, finishes it for nobody."""
        loop, timeout = asyncio.get_running_loop(), timeout or self.settings.decode_timeout
        expired, timer = loop.create_future(), []

        def arm():
            if not job.done():
                timer.append(loop.call_later(timeout, lambda: expired.done() or expired.set_result(None)))

        def started():
            loop.call_soon_threadsafe(arm)
            return run()

        job = loop.run_in_executor(self.threads, started)
        try:
            await asyncio.wait((job, expired), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            job.cancel()
            raise
        finally:
            for handle in timer:
                handle.cancel()
        if not job.done():
            job.add_done_callback(lambda job: job.cancelled() or job.exception())
            raise JobTimedOut(f"the decode thread ran past {timeout:g} s (it goes on)", timeout)
        return job.result()
