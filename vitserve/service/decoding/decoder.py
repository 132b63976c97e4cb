"""Decoding a request's images and videos: decode + resize in the decode workers (decode_runner.py), pixels back
through the spool.

Before any pixel is decoded, each image's header is read in a thread from its first bytes (first_bytes.py: a walk
bounded in bytes and steps, microseconds whatever the bytes hold; where the header is not within them, a decode
worker reads it from the whole image): its format must be allowed, its pixels under `--max-image-pixels`, and the
memory its decode takes (estimated from the size and mode, alpha and palette expansion included) counts against the
request's limit (`--decode-memory-per-request`, 413 beyond) and the server's (`--decode-memory`, a `MemoryBudget`:
an image waits until its share fits, in its request's turn, round-robin by request, so large images queue instead of
overcommitting the host and one request's many large images take one turn at a time). Where the probe saw
the image's end, only the bytes up to it are decoded (what follows, junk or a phone's motion video, stays behind).
An image of a request body in a body file (bodies.py) goes to its worker as where it lies there (a `MediaHandle`):
no byte of it crosses the worker's socket. No byte of an image is touched on the event loop. The decode pool hands
waiting images to the workers round-robin by request, so one large request cannot stall a small one behind it.

A video's first bytes must be a video container's; its decode work and memory, read from its header by a worker
first, are held to the request's limits and taken from the server's budgets while it decodes, at most
`--video-decode-workers` workers holding videos at once. Failures become the request's domain errors (rejection.py).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from typing import Callable

import numpy as np

from ...encoder.headers import ImageHeader
from ...encoder.image_errors import HeaderNotFound
from ...encoder.preprocess import PreprocessConfig, target_size
from ..ground.errors import InputRejected, InputTooLarge
from ..ground.metrics import Metrics
from ..ground.settings_media import DecodingSettings, LimitSettings
from ..ground.timeline import mark
from . import spool
from .budget import MemoryBudget
from .decode import (
    VIDEO_DECODE_THREADS,
    DecodedVideo,
    decode_and_resize,
    decode_video,
    plan_groups,
    plan_video,
    read_header,
)
from .decode_runner import DecodeRunner
from .first_bytes import first_headers, head, head_or_error, looks_like_text  # noqa: F401 (head, looks_like_text: re-exported)
from .rejection import rejection

Decoded = tuple[np.ndarray | spool.Spooled, tuple[int, int, int]]  # pixels (maybe in a spool file) and patch grid


class Decoder(DecodeRunner):
    """The decode workers (DecodeRunner) with the memory and work budgets of the images and videos they decode.
    `on_broken(reason)` is called on the event loop when the last worker is gone and none can be started."""

    rejection = staticmethod(rejection)

    def __init__(
        self, decoding: DecodingSettings, limits: LimitSettings, metrics: Metrics, on_broken: Callable[[str], None]
    ):
        super().__init__(decoding, on_broken)
        self.limits = limits
        self.metrics = metrics
        self.full_size = False  # the devices resize: images stay full size here (set by the engine)
        self.jpeg_on_device = False  # fast, and nvJPEG on the devices: JPEGs stay encoded (set by the engine)
        self.video_planes = False  # videos' frames go as planes, the devices convert them (set by the engine)
        self._names = itertools.count()
        self._videos = 0  # videos being decoded now
        self._cpus = decoding.worker_count()
        self.budget = MemoryBudget(limits.decode_memory)
        self.video_work = MemoryBudget(limits.video_decode_work)  # decode work, not bytes: the same waiting rules
        # the workers videos may hold at once: the others stay for images, whatever videos come
        self.video_slot_count = decoding.video_decode_workers or max(1, self.workers // 2)
        self.video_slots = asyncio.Semaphore(self.video_slot_count)

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
                header.check(self.limits.max_image_pixels)
            except Exception as e:
                raise self.rejection(f"{field}[{names[i]}]", e, images[i]) from None
            return header

        try:
            for i, data in enumerate(images):
                if isinstance(first[i], HeaderNotFound):
                    later[i] = asyncio.ensure_future(self.run(read_header, data, owner))
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

    async def decode(
        self, images: list, cfg: PreprocessConfig, field: str = "input", names: list[int] | None = None
    ) -> list[Decoded]:
        """Decode and resize concurrently; the first bad image fails the request (only it), named `field[i]` with
        i its index in `names` (default: its position)."""
        mark("decode")
        names = list(range(len(images))) if names is None else names
        owner = object()  # the request, for the decode pool's fair queue
        headers = await self.headers(images, field, names, owner)
        mark("headers")
        costs, limit = [header.decode_bytes for header in headers], self.limits.decode_memory_per_request
        if sum(costs) > limit:
            raise InputTooLarge(
                f"decoding these {len(images)} image(s) takes about {sum(costs) / 2**20:.0f} MB; a "
                f"request may take {limit / 2**20:.0f} MB (send fewer or smaller images)",
                "decode_memory",
                field,
            )
        results = await self.run_all(
            [self._decode(data, header.end, cfg, cost, owner) for data, header, cost in zip(images, headers, costs)],
            field,
            names,
        )
        out, p = [], cfg.patch_size
        for decoded in results:
            image = decoded.image
            self.metrics.preprocess_seconds.observe(decoded.seconds)
            self.metrics.record("decode", decoded.seconds)
            h, w = target_size(image, cfg) if self.full_size else image.shape[:2]  # (the size the device resizes to)
            out.append((image, (1, h // p, w // p)))
        mark("decoded")
        return out

    async def decode_videos(self, videos: list, cfg, field: str = "videos", names: list[int] | None = None) -> list:
        """Decode, sample and resize videos concurrently in the decode workers: `plan_videos`, then `decode_planned`;
        per video its (slices, grid, timing)."""
        return await self.decode_planned(videos, await self.plan_videos(videos, cfg, field, names), cfg, field, names)

    async def plan_videos(self, videos: list, cfg, field: str = "videos", names: list[int] | None = None) -> list:
        """Each video's VideoPlan (which frames it keeps, at what size, and what decoding them takes), read from
        its header by a decode worker (decode.plan_video, under `--video-decode-timeout`). Each one's first bytes
        must be a video container's (video.sniff: an image sent as a video is told so); each may keep at most the
        per-request decode memory of resized frames; their decode work (encoder.video.decode_work) together is held
        to --video-decode-work-per-request. The first bad video fails the request (only it)."""
        from ...encoder.video import sniff

        names = list(range(len(videos))) if names is None else names
        loop, owner = asyncio.get_running_loop(), object()
        heads = await loop.run_in_executor(None, lambda: [head_or_error(v) for v in videos])
        for i, data, first in zip(names, videos, heads):
            param = f"{field}[{i}]"
            if isinstance(first, Exception):  # its base64 does not decode
                raise self.rejection(param, first, data) from None
            if not sniff(first):
                raise InputRejected(
                    f"{param}: not a video (send MP4, WebM, MKV, AVI, MPEG-TS, FLV or Ogg; images go in images)",
                    "not_a_video",
                    param,
                )
        limits = self._video_limits()
        plans = await self.run_all(
            [self._video_job(plan_video, data, owner, cfg, limits, self.video_planes) for data in videos],
            field,
            names,
            "video",
        )
        work, limit = sum(plan.cost.work for plan in plans), self.limits.video_decode_work_per_request
        if work > limit:
            raise InputTooLarge(
                f"decoding these {len(videos)} videos is {work / 1e9:.1f} G pixels of work; a request "
                f"may take {limit / 1e9:.1f} G (send fewer, shorter or smaller videos)",
                "decode_work",
                field,
            )
        return plans

    async def decode_planned(
        self,
        videos: list,
        plans: list,
        cfg,
        field: str = "videos",
        names: list[int] | None = None,
        on_part: Callable[[int, int, list], None] | None = None,
    ) -> list:
        """Decode videos whose `plan_videos` are `plans`, concurrently in the decode workers (decode.decode_video,
        under `--video-decode-timeout`); per video its (slices, grid, timing). Each takes the memory and the decode
        work its plan declares from the server's decode memory and --video-decode-work while it decodes; at most
        --video-decode-workers workers hold videos at once, so that images always find the others.
        `on_part(video, first, slices)`, where given, is called on the event loop as each part of a video is
        decoded (`video` its place in `videos`, `first` its first slice's; a video not split is one part), so that
        its slices can run before the rest are decoded: they are the caller's from then on, whatever happens to the
        rest of their video."""
        names = list(range(len(videos))) if names is None else names
        limits, owner = self._video_limits(), object()
        results = await self.run_all(
            [
                self._decode_video(data, cfg, limits, plan, owner, on_part and functools.partial(on_part, k))
                for k, (data, plan) in enumerate(zip(videos, plans))
            ],
            field,
            names,
            "video",
        )
        out, m = [], self.metrics
        for video in results:
            m.videos.labels(video.decoder).inc()
            m.video_frames.inc(len(video.timing["frame_indices"]))
            m.video_seconds.inc(video.duration)
            m.preprocess_seconds.observe(video.seconds)
            m.record("decode", video.seconds)
            out.append((video.slices, video.grid, video.timing))
        return out

    def _video_limits(self):
        from ...encoder.video import VideoLimits

        s = self.limits
        return VideoLimits(
            max_seconds=s.max_video_seconds,
            max_frame_pixels=s.max_image_pixels,
            max_bytes=s.decode_memory_per_request,
            max_work=s.video_decode_work_per_request,
        )

    async def _video_job(self, fn, data, owner, *args):
        """fn(video, *args) in a decode worker once one of the videos' workers (--video-decode-workers) is free,
        under --video-decode-timeout."""
        async with self.video_slots:
            return await self.tried_twice(
                lambda: self.run(fn, data, owner, *args, timeout=self.decoding.video_decode_timeout)
            )

    async def _decode_video(self, data, cfg, limits, plan, owner, on_part=None):
        """A video's decode, once the memory and the decode work its header declares (`plan.cost`) are taken from
        the server's budgets; all given back when it is done. Its slices are split among the videos' workers free
        now, by its groups of pictures (`VideoPlan.parts`: a lone long video decodes on several cores at once,
        under load each video on one worker; its groups are read, one demux pass in a worker, only where it may be
        split, so that a cache hit never pays for them; `on_part(first, slices)` as each part is decoded:
        decode_planned). Its wall time from there to its frames back is observed in vitserve_decode_seconds, as an
        image's."""
        share = await self.budget.acquire(plan.cost.memory, owner)
        try:
            work = await self.video_work.acquire(plan.cost.work, owner)
            try:
                start = time.perf_counter()
                if self._split_into() > 1 and plan.sampling.grid(1)[0] > 1:
                    plan = await self._video_job(plan_groups, data, owner, plan, limits)
                parts = plan.parts(self._split_into())
                # the parts share the cores the workers' others leave (a video not split: as it starts)
                threads = max(VIDEO_DECODE_THREADS, self._cpus // (self._videos + len(parts))) if parts[1:] else None

                async def decode(part: tuple[int, int]) -> DecodedVideo:
                    video = await self._decode_part(data, cfg, limits, owner, part if parts[1:] else None, threads)
                    if on_part is not None:
                        on_part(part[0], video.slices)
                    return video

                decoded = await asyncio.gather(*(decode(part) for part in parts), return_exceptions=True)
                if failed := [d for d in decoded if isinstance(d, BaseException)]:
                    if on_part is None:  # the parts decoded: their spool files go (else they are the caller's)
                        for d in decoded:
                            if isinstance(d, DecodedVideo):
                                for pixels in d.slices:
                                    spool.discard(pixels)
                    raise failed[0]
                video = decoded[0] if len(decoded) == 1 else DecodedVideo.joined(decoded, plan.sampling.timing())
                self.metrics.decode_seconds.observe(time.perf_counter() - start)
                return video
            finally:
                self.video_work.release(work)
        finally:
            self.budget.release(share)

    def _split_into(self) -> int:
        """The parts a video starting to decode now may be split into: the video workers free, one part per
        VIDEO_DECODE_THREADS cores at most."""
        return min(self.video_slot_count - self._videos, self._cpus // VIDEO_DECODE_THREADS)

    async def _decode_part(
        self, data, cfg, limits, owner, part: tuple[int, int] | None, threads: int | None
    ) -> DecodedVideo:
        """A video's slices `part` (None: all) decoded by one of the videos' workers with FFmpeg's `threads` (None:
        the workers' cores shared among the videos decoding: a lone one gets them all; many get
        VIDEO_DECODE_THREADS each, as the workers decode them side by side)."""
        async with self.video_slots:
            threads = threads or max(VIDEO_DECODE_THREADS, self._cpus // (self._videos + 1))
            self._videos += 1

            def run():
                path = self.pool and self.spool_prefix and f"{self.spool_prefix}{next(self._names)}"
                return self.run(
                    decode_video,
                    data,
                    owner,
                    cfg,
                    limits,
                    path or None,
                    threads,
                    self.video_planes,
                    part,
                    timeout=self.decoding.video_decode_timeout,
                    lost=path and functools.partial(spool.clear, f"{path}-"),
                )

            try:
                return await self.tried_twice(run)
            finally:
                self._videos -= 1

    async def _decode(self, data, end: int | None, cfg: PreprocessConfig, cost: int, owner):
        def run():
            path = self.pool and self.spool_prefix and f"{self.spool_prefix}{next(self._names)}"
            return self.run(
                decode_and_resize,
                data,
                owner,
                self.limits.max_image_pixels,
                cfg,
                path or None,
                self.full_size,
                self.jpeg_on_device,
                end=end,
                lost=path and functools.partial(spool.remove, path),
            )

        share = await self.budget.acquire(cost, owner)
        try:
            start = time.perf_counter()
            result = await self.tried_twice(run)
            self.metrics.decode_seconds.observe(time.perf_counter() - start)
            return result
        finally:
            self.budget.release(share)
