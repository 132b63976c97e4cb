"""The steps every encoding route shares: a request's images and videos to the engine (side by side, while the
client is connected), one answer of both in the request's order, and the response built from it with its phases
timed in the headers."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from typing import cast

from fastapi import Request
from fastapi.responses import Response

from ..ground.errors import Unsupported
from ..ground.media import MediaItem
from ..ground.timeline import mark
from ..pipeline.encoded import Encoded
from ..pipeline.loader import ModelInfo
from .outputs import OFF_LOOP_BYTES, answer_bytes
from .served import Served


def noted(served: Served, request: Request, result: Encoded) -> Encoded:
    """The request's counts and phases on its state, for its access line."""
    unit = cast(ModelInfo, served.engine.model).config.merge_unit  # (loaded: the request was admitted)
    grids = [cast("Sequence[int]", item.grid) for item in result.outputs]  # (an answer's Features have their grids)
    request.state.images, request.state.tokens = len(grids), sum(math.prod(g) // unit for g in grids)
    for phase in ("decode", "queue", "inference"):
        setattr(request.state, f"{phase}_ms", round(getattr(result, f"{phase}_s") * 1e3, 2))
    request.state.cache_hits = result.cache_hits
    return result


async def while_connected(request: Request, run) -> Encoded:
    """`run(disconnected)`, with a future that resolves if the client leaves first."""
    disconnected = asyncio.ensure_future(wait_disconnect(request))
    try:
        return await run(disconnected)
    finally:
        disconnected.cancel()


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def encode_images(
    served: Served,
    request: Request,
    images: list,
    field: str,
    mean_pooling: bool = False,
    max_pixels: int | None = None,
    float32: bool = False,
) -> Encoded:
    """A request's images encoded, its counts and phases noted; `float32`: its tokens answered in float32 (the
    devices widen them: engine.encode)."""
    served.limits.check_images(len(images), field)
    client = request.scope["state"].get("client")
    return noted(
        served,
        request,
        await while_connected(
            request,
            lambda disconnected: served.engine.encode(
                images, mean_pooling, disconnected, field, max_pixels, client, float32
            ),
        ),
    )


async def encode_videos(
    served: Served,
    request: Request,
    videos: list,
    field: str,
    options: dict,
    mean_pooling: bool = False,
    max_pixels: int | None = None,
    float32: bool = False,
) -> Encoded:
    engine = served.engine
    if engine.videos_unavailable:  # the server's condition, not the request's fault
        raise Unsupported(f"this server cannot decode videos: {engine.videos_unavailable}", "videos_unavailable", field)
    served.limits.check_videos(len(videos), field)
    client = request.scope["state"].get("client")
    return await while_connected(
        request,
        lambda disconnected: engine.encode_videos(
            videos, options, mean_pooling, disconnected, field, max_pixels, client, float32
        ),
    )


async def encode_media(
    served: Served,
    request: Request,
    images: list,
    videos: list,
    body,
    order: list[bool] | None = None,
    mean_pooling: bool = False,
    image_field: str = "images",
    video_field: str = "videos",
    float32: bool = False,
) -> Encoded:
    """A request's images and videos encoded side by side; one answer of both, its items in the request's `order`
    (per item whether it is a video; None: the images, then the videos); its counts and phases noted. `body` gives
    `max_pixels` and the videos' sampling options; `float32` as for `encode_images`."""
    jobs = []
    if images:
        jobs.append(encode_images(served, request, images, image_field, mean_pooling, body.max_pixels, float32))
    if videos:
        jobs.append(
            encode_videos(
                served, request, videos, video_field, body.video_options(), mean_pooling, body.max_pixels, float32
            )
        )
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        parts = await asyncio.gather(*tasks)
    except BaseException:  # one failed (or the request is gone): the other's work is not needed
        for task in tasks:
            task.cancel()
        raise
    if not videos:
        return parts[0]
    image_part, video_part = (parts[0], parts[1]) if images else (None, parts[0])
    order = order if order is not None else [False] * len(images) + [True] * len(videos)
    return noted(served, request, merged(image_part, video_part, order))


def merged(images: Encoded | None, videos: Encoded, order: list[bool]) -> Encoded:
    """The images' and the videos' answers as one, its items in the request's order (`order`: per item whether it
    is a video). Phases: the longer of the two (they ran side by side); cache hits: both's (items answered from the
    cache)."""
    image_at, video_at = iter(range(len(images.outputs) if images else 0)), iter(range(len(videos.outputs)))
    where = [(videos, next(video_at)) if is_video else (images, next(image_at)) for is_video in order]
    parts = [part for part in (images, videos) if part is not None]
    return Encoded(
        [cast(Encoded, part).outputs[i] for part, i in where],  # (images only where there are images)
        max(p.decode_s for p in parts),
        max(p.queue_s for p in parts),
        max(p.inference_s for p in parts),
        sum(p.cache_hits for p in parts),
    )


async def answer(served: Served, request: Request, result: Encoded, build, work: int | None = None) -> Response:
    """The response `build()` makes (in a thread where it works over `OFF_LOOP_BYTES` or more: conversions and
    base64 are bytes work; `work`: the bytes it converts or encodes, outputs.work_bytes, default all of the
    answer's), timed as the serialize phase; every phase in the headers (ms), and the server's whole time so far
    (`x-server-time`: from the request reaching the app to its answer built, the phases included)."""
    start = time.perf_counter()
    mark("answering")
    work = answer_bytes(result.outputs) if work is None else work
    response = await asyncio.to_thread(build) if work >= OFF_LOOP_BYTES else build()
    seconds = time.perf_counter() - start
    served.engine.metrics.serialize_seconds.observe(seconds)
    served.engine.metrics.record("serialize", seconds)
    request.state.serialize_ms = round(seconds * 1e3, 2)
    response.headers.update(
        {
            "x-decode-time": f"{result.decode_s * 1e3:.2f}",
            "x-queue-time": f"{result.queue_s * 1e3:.2f}",
            "x-inference-time": f"{result.inference_s * 1e3:.2f}",
            "x-serialize-time": f"{seconds * 1e3:.2f}",
            "x-server-time": f"{(time.perf_counter() - request.state.arrived) * 1e3:.2f}",
            "x-cache-hits": str(result.cache_hits),
        }
    )
    return response


async def encode_with_identifiers(served: Served, items: list[MediaItem], encode, kwargs: dict | None = None):
    """`encode()`'s result and, where the items are also written (`served.files`), their identifiers (computed beside
    the encode; a bad item's own error comes first), else None."""
    if served.files is None:
        return await encode(), None
    identifiers = asyncio.ensure_future(served.files.identifiers(items, kwargs))
    try:
        result = await encode()
    except BaseException:
        identifiers.cancel()
        raise
    return result, await identifiers


async def answer_beside_files(
    served: Served,
    request: Request,
    result: Encoded,
    build,
    ids: list[str] | None,
    wait: bool = True,
    work: int | None = None,
) -> Response:
    """`answer` (`work`: its build's bytes work), with the items' files written beside its serialization (where
    `ids`). `wait`: the answer is sent once the files are in place too (whoever has it finds them: the proxy's
    request); else as soon as it is built (/v1/encode: its answer is the embeddings, never slowed by the files), the
    files following within milliseconds (a failure is logged and counted)."""
    if ids is None:
        return await answer(served, request, result, build, work)
    assert served.files is not None  # (identifiers only where the tier writes files)
    files = asyncio.ensure_future(served.files.write(ids, result.outputs))
    if not wait:
        files.add_done_callback(served.files.written)
        return await answer(served, request, result, build, work)
    try:
        response = await answer(served, request, result, build, work)
    finally:
        await files
    return response
