"""A request's videos through the pipeline: each video's header read by a decode worker (the frames it keeps, their
size, its slices; a video seen before keeps its plan in the backend, for every front end), its slices looked up in
the embedding cache, the videos with a slice to compute decoded, those slices run as items of the image queue beside
images, and each video's answer joined from its slices in order.

A slice's cache key is its video's (the bytes as sent, the model, every sampling and size setting of the request,
the client where the cache is per client) and its place; a slice's entry is its token features, whatever the request
pools, so a video sent again (every turn of a chat resends it) is answered from the cache without decoding, and two
requests for one video at once compute it once (the second waits for the first's slices)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from ...encoder.features import Features
from ...encoder.video import VideoConfig, unavailable
from ..decoding import spool
from ..decoding.decoder import Decoder
from ..devices.scheduler import WorkItem
from ..ground.metrics import Metrics
from ..ground.settings import Settings
from .cache import CacheKeys
from .encoded import Encoded

log = logging.getLogger("vitserve.engine")


def videos_unavailable(say: bool = True) -> str | None:
    """Why this process cannot decode videos (None: it can), said in the server's log where `say` (a server's front
    ends all find the same: one says it)."""
    why = unavailable()
    if why and say:
        log.warning("videos cannot be decoded here: %s; video requests are answered 501", why)
    return why


class Pipeline(Protocol):
    """What the video path takes from the engine."""

    settings: Settings
    metrics: Metrics
    decoder: Decoder
    cache_keys: CacheKeys
    backend: Any  # LocalBackend or HubBackend: lookup, release, video_plans, keep_video_plans

    async def decoded(self, decoding, disconnected: asyncio.Future | None, dropped: int = 0) -> Any: ...

    async def looked_up(self, keys: list[bytes], outputs: list) -> tuple[list[int], list]: ...

    def submit_items(self, items: list[WorkItem]) -> None: ...

    async def finish_items(self, items: list[WorkItem], disconnected: asyncio.Future | None) -> list: ...

    def abandon_items(self, items: list[WorkItem]) -> None: ...


async def encode_videos(
    engine: Pipeline,
    videos: list,
    cfg: VideoConfig,
    mean_pooling: bool,
    disconnected: asyncio.Future | None,
    field: str,
    client: int | None,
    float32: bool = False,
) -> Encoded:
    """The request's videos' Features, in order (engine.encode_videos: its options checked, its URLs fetched);
    `float32`: their slices answered in float32 (WorkItem.float32)."""
    cached = engine.settings.cache.cache_bytes > 0
    video_keys = await engine.cache_keys.video_keys(videos, cfg, client) if cached else None
    plans, plan_s = await known_plans(engine, video_keys), 0.0
    if plans is None:
        start = time.perf_counter()
        plans = await engine.decoded(engine.decoder.plan_videos(videos, cfg, field), disconnected)
        plan_s = time.perf_counter() - start
        if video_keys is not None:
            engine.backend.keep_video_plans(video_keys, plans)
    grids = [plan.sampling.grid(cfg.patch_size) for plan in plans]
    counts = [g[0] for g in grids]
    keys = None
    if video_keys is not None:
        keys = [engine.cache_keys.slice_keys(k, n, float32) for k, n in zip(video_keys, counts)]
    slices, waits, claimed = await looked_up(engine, keys, counts)
    hits = sum(all(s is not None for s in video) for video in slices)
    engine.metrics.cache_hits.inc(hits)
    engine.metrics.cache_misses.inc(len(videos) - hits)
    run = Runs(engine, videos, plans, cfg, field, disconnected, float32)
    try:
        try:
            await run.slices(claimed, slices, keys)
        finally:  # a claim left unanswered is let go
            if keys is not None and (unanswered := [keys[v][j] for v, j in claimed if slices[v][j] is None]):
                engine.backend.release(unanswered)
        again = []
        for v, j, other in waits:
            slices[v][j] = await other
            if slices[v][j] is None:  # the other request failed: this one computes it itself
                again.append((v, j))
        await run.slices(again, slices, None)
    finally:
        run.discard_unrun()

    def assemble() -> list[Features]:  # each video's slices joined: megabytes to copy, off the event loop
        return [
            Features.join(parts, list(grid), plan.sampling.timing(), mean=mean_pooling)
            for parts, grid, plan in zip(slices, grids, plans)
        ]

    outputs = await asyncio.to_thread(assemble)
    return Encoded(outputs, plan_s + run.decode_s, run.queue_s, run.inference_s, hits)


async def known_plans(engine: Pipeline, video_keys: list[bytes] | None) -> list | None:
    """The request's videos' plans where every one was read before (the backend's VideoPlans, whichever front end
    read it) and together they are within the request's decode work (else the decode workers read them again, and
    refuse the request as they would); else None."""
    if video_keys is None:
        return None
    plans = await engine.backend.video_plans(video_keys)
    if any(plan is None for plan in plans):
        return None
    if sum(plan.cost.work for plan in plans) > engine.settings.limits.video_decode_work_per_request:
        return None
    return plans


async def looked_up(engine: Pipeline, keys: list[list[bytes]] | None, counts: list[int]) -> tuple[list, list, list]:
    """Each video's slices (`counts` of them) in the cache: their Features where found (else None), the (video,
    slice, future) of those another request computes, and the (video, slice) this one computes (claimed)."""
    places = [(v, j) for v, n in enumerate(counts) for j in range(n)]
    if keys is None:
        return [[None] * n for n in counts], [], places
    found: list = [None] * len(places)
    todo, waits = await engine.looked_up([k for video in keys for k in video], found)
    slices, flat = [], iter(found)
    for n in counts:
        slices.append([next(flat) for _ in range(n)])
    return slices, [(*places[i], future) for i, future in waits], [places[i] for i in todo]


class Runs:
    """The slices a request computes: their videos decoded once each (as they are first needed), each part's slices
    queued as soon as the part is decoded (a split video's first slices run while the rest decode), the slices run;
    the decoded slices not run (answered from the cache) discarded at the end."""

    def __init__(
        self,
        engine: Pipeline,
        videos: list,
        plans: list,
        cfg: VideoConfig,
        field: str,
        disconnected,
        float32: bool = False,
    ):
        self.engine, self.videos, self.plans, self.cfg = engine, videos, plans, cfg
        self.field, self.disconnected, self.float32 = field, disconnected, float32
        self.decoded: dict[int, list] = {}  # video -> its slices (pixels, spooled or not; None until decoded)
        self.ran: set[tuple[int, int]] = set()
        self.decode_s = self.queue_s = self.inference_s = 0.0

    async def slices(self, todo: list[tuple[int, int]], out: list[list], keys: list[list[bytes]] | None) -> None:
        """Compute the slices `todo` ((video, slice) pairs) into `out`, under their `keys` where given (the backend
        keeps their answers there)."""
        if not todo:
            return
        engine, wanted, items = self.engine, set(todo), {}
        loop = asyncio.get_running_loop()

        def submit(places: list[tuple[int, int]]) -> None:  # the decoded slices at `places` that `todo` wants
            new = []
            for v, j in places:
                if (v, j) in wanted and (v, j) not in items:
                    _, h, w = self.plans[v].sampling.grid(self.cfg.patch_size)
                    key = keys[v][j] if keys is not None else None
                    items[v, j] = WorkItem(
                        self.decoded[v][j],
                        (1, h, w),
                        loop.create_future(),
                        False,
                        f"{self.field}[{v}]",
                        key,
                        modality="video",
                        float32=self.float32,
                    )
                    new.append(items[v, j])
                    self.ran.add((v, j))
            if new:
                engine.submit_items(new)

        need = sorted({v for v, _ in todo} - set(self.decoded))
        if need:
            start = time.perf_counter()
            for v in need:
                self.decoded[v] = [None] * self.plans[v].sampling.grid(self.cfg.patch_size)[0]

            def on_part(k: int, first: int, part: list) -> None:
                v = need[k]
                self.decoded[v][first : first + len(part)] = part
                submit([(v, first + j) for j in range(len(part))])

            plans = [self.plans[v] for v in need]
            decoding = engine.decoder.decode_planned(
                [self.videos[v] for v in need], plans, self.cfg, self.field, need, on_part
            )
            try:
                await engine.decoded(decoding, self.disconnected)
            except BaseException:  # the parts queued already wait for no one
                engine.abandon_items(list(items.values()))
                raise
            self.decode_s += time.perf_counter() - start
        submit(todo)  # (slices decoded for an earlier call)
        ordered = [items[place] for place in todo]
        for (v, j), output in zip(todo, await engine.finish_items(ordered, self.disconnected)):
            out[v][j] = output
        self.queue_s = max([self.queue_s, *(i.queue_s for i in ordered)])
        self.inference_s = max([self.inference_s, *(i.inference_s for i in ordered)])

    def discard_unrun(self) -> None:
        for v, video_slices in self.decoded.items():
            for j, pixels in enumerate(video_slices):
                if (v, j) not in self.ran and pixels is not None:
                    spool.discard(pixels)
