"""A Python client for a vitserve server, sync (`Client`) and async (`AsyncClient`), on httpx.

    from vitserve.client import Client
    with Client("http://localhost:8000") as client:
        item = client.encode("examples/sample.jpg")             # one image in: one EncodedImage out
        items = client.encode(["examples/sample.jpg", "examples/portrait.png"])  # a list in: a list out
        vectors = client.embed(["examples/sample.jpg"])         # one pooled vector per image
        clip = client.encode_videos("clip.mp4", fps=2)          # an EncodedVideo: tokens, grid and timing

Token embeddings travel as one safetensors body (no base64). Images and videos are paths, bytes, PIL images (an
image), data URIs, or http(s) URLs (sent as they are: the server fetches them, with --allow-url-fetch): one of them
gives one result, a list (any iterable) a list of results, in order. A request of more images or videos than the
server takes at once is split. Connection failures and 429 and 503 answers are retried (a bounded number of times,
waiting as the answer's Retry-After says, else 0.5, 1, 2 s ...); every failure left raises `VitserveError`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import mimetypes
import os
import time
from typing import Any, cast
from urllib.parse import urlsplit

import httpx
import pybase64
import torch

from .encoder.json_splice import json_bytes, placeholder
from .encoder.video import sniff
from .encoder.vision_encoder import EncodedImage, EncodedVideo

RETRIED = (429, 503)
CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)  # nothing was sent: safe to send again
__all__ = ["Client", "AsyncClient", "EncodedImage", "EncodedVideo", "VitserveError"]


class VitserveError(Exception):
    """A request that failed. `status`: the HTTP status of the error answer, or None when no answer came; `code`:
    the server's error code (docs/api.md), or for no answer `unreachable` (no connection, after the retries),
    `timeout` (no answer within the client's timeout) or `transport_error` (the connection broke); `param`: the
    bad input the server named (`images[0]`), if any; `message`: what went wrong."""

    def __init__(self, status: int | None, code: str | None, message: str, param: str | None = None):
        super().__init__(f"{status} {code}: {message}" if status is not None else f"{code}: {message}")
        self.status, self.code, self.message, self.param = status, code, message, param


ONE = (str, os.PathLike, bytes, bytearray, memoryview)  # one image or video (or a PIL image: it has `save`)
WHAT = "an image or a video is a path, an http(s) URL, a data URI, bytes or a PIL image"


def image_bytes(image: Any) -> bytes:
    """An image as encoded bytes: a path's file, bytes as they are, a PIL image as PNG."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        with open(image, "rb") as f:
            return f.read()
    if hasattr(image, "save"):  # PIL.Image.Image
        buf = io.BytesIO()
        image.save(buf, "PNG")
        return buf.getvalue()
    raise TypeError(f"{WHAT}, not {type(image).__name__}")


def payload(item: Any) -> bytes | str:
    """What is sent of one image or video: an http(s) URL as it is (the server fetches it), a data URI's bytes, else
    `image_bytes`."""
    if isinstance(item, str) and item.startswith(("http://", "https://")):
        return item
    if isinstance(item, str) and item.startswith("data:"):
        header, comma, data = item.partition(",")
        try:
            if not comma or not header.endswith(";base64"):
                raise ValueError
            return base64.b64decode("".join(data.split()), validate=True)
        except (ValueError, binascii.Error):
            raise ValueError(f"a data URI is data:<media type>;base64,<base64>, not {item[:40]!r}...") from None
    return image_bytes(item)


def is_video(sent: bytes | str) -> bool:
    """Whether what is sent is a video: by its bytes (a video container's signature, as the server tells them), or
    for a URL by its path's extension."""
    if isinstance(sent, str):
        return (mimetypes.guess_type(urlsplit(sent).path)[0] or "").startswith("video/")
    return sniff(sent[:512]) is not None


def _items(items) -> tuple[list[bytes | str], bool]:
    """An image or video, or an iterable of them, as what is sent of each, and whether it was one."""
    if isinstance(items, ONE) or hasattr(items, "save"):
        return [payload(items)], True
    if not hasattr(items, "__iter__") or isinstance(items, dict):
        raise TypeError(f"{WHAT}, or a list of them; not {type(items).__name__}")
    return [payload(x) for x in items], False


def _kinds(sent: list[bytes | str], videos_only: bool) -> list[bool]:
    """Whether each item is a video; `videos_only`: every one must be (a URL is taken as one), else ValueError."""
    kinds = [videos_only and isinstance(x, str) or is_video(x) for x in sent]
    if videos_only and not all(kinds):
        raise ValueError(
            f"videos[{kinds.index(False)}] is not a video (MP4, WebM, MKV, AVI, MPEG-TS, FLV or Ogg): "
            "encode takes images"
        )
    return kinds


def _batches(kinds: list[bool], images: int, videos: int) -> list[range]:
    """The items (`kinds`: whether each is a video) in consecutive runs of at most `images` images and `videos`
    videos: one request each."""
    out, start, counts = [], 0, [0, 0]
    for i, video in enumerate(kinds):
        if counts[video] == (videos if video else images):
            out.append(range(start, i))
            start, counts = i, [0, 0]
        counts[video] += 1
    return out + [range(start, len(kinds))] if kinds else out


def _error(response: httpx.Response) -> VitserveError:
    try:
        err = response.json()["error"]
        return VitserveError(response.status_code, err.get("code"), err.get("message", ""), err.get("param"))
    except (ValueError, KeyError, TypeError):
        return VitserveError(response.status_code, None, response.text[:500])


def _no_answer(error: httpx.TransportError, server: str, path: str, attempts: int) -> VitserveError:
    """A request that got no HTTP answer (status None). A connection that failed names the server: whatever call
    the user made (and whichever request it sent first), no path of it was reached."""
    url = server + path
    if isinstance(error, CONNECT_ERRORS):
        tries = f"{attempts} attempt{'s' * (attempts > 1)}"
        return VitserveError(None, "unreachable", f"cannot connect to the server at {server} ({tries}): {error!r}")
    if isinstance(error, httpx.TimeoutException):
        return VitserveError(None, "timeout", f"no answer from {url} within the timeout: {error!r}")
    return VitserveError(None, "transport_error", f"the connection to {url} broke: {error!r}")


def _wait(outcome: httpx.Response | httpx.TransportError, attempt: int) -> float:
    """Seconds before retrying: the answer's Retry-After, else a backoff (0.5, 1, 2 s ...), at most 30."""
    headers = outcome.headers if isinstance(outcome, httpx.Response) else {}  # (an error has none)
    try:
        return min(30.0, float(headers["retry-after"]))
    except (KeyError, ValueError):
        return min(30.0, 0.5 * 2**attempt)


def _uuids(uuids, count: int, single: bool) -> list[str | None]:
    """Each item's uuid (vLLM's name for it where the server is vLLM's encoder tier), None where it has none."""
    if uuids is None:
        return [None] * count
    names = [uuids] if single and isinstance(uuids, str) else list(uuids)
    if len(names) != count:
        raise ValueError(f"{len(names)} uuids for {count} items")
    return names


def _multi_modal_uuids(uuids: list[str | None], kinds: list[bool]) -> dict:
    """The `multi_modal_uuids` field (each modality's uuids in the order of its items), where any uuid is given."""
    if all(name is None for name in uuids):
        return {}
    by_kind = {kind: [n for n, video in zip(uuids, kinds) if video == (kind == "video")] for kind in ("image", "video")}
    return {"multi_modal_uuids": {kind: names for kind, names in by_kind.items() if names}}


def _encode_request(
    items: list[bytes | str],
    kinds: list[bool],
    dtype: str,
    deepstack: bool,
    layout: str,
    max_pixels: int | None,
    uuids: list[str | None],
    **video,
) -> dict:
    """A /v1/encode request: multipart (the server tells videos from images by their bytes), or JSON where an item
    is a URL (`kinds`: whether each is a video); `uuids`: the items' (None where an item has none); `video`: fps,
    num_frames, max_frames where given."""
    options = {name: value for name, value in dict(video, max_pixels=max_pixels).items() if value is not None}
    named = _multi_modal_uuids(uuids, kinds)
    accept = {"accept": "application/octet-stream"}
    if any(isinstance(x, str) for x in items):
        sent, blobs = _sent(items)
        body = {
            "images": [x for x, v in zip(sent, kinds) if not v],
            "videos": [x for x, v in zip(sent, kinds) if v],
            "dtype": dtype,
            "deepstack": deepstack,
            "layout": layout,
            **options,
            **named,
        }
        return _json_request(body, blobs, accept)
    fields = {"dtype": dtype, "deepstack": str(deepstack).lower(), "layout": layout}
    fields |= {name: str(value) for name, value in options.items()}
    fields |= {name: json.dumps(value) for name, value in named.items()}
    return dict(
        files=[("images", (f"{i}", data, "application/octet-stream")) for i, data in enumerate(items)],
        data=fields,
        headers=accept,
    )


def _in_order(results: list[EncodedImage], kinds: list[bool]) -> list[EncodedImage]:
    """An answer's items in the request's order (`kinds`: whether each item sent is a video): a JSON request's answer
    has the images first, then the videos."""
    videos = [r for r in results if isinstance(r, EncodedVideo)]
    if len(videos) != sum(kinds) or len(results) != len(kinds):  # the server told them apart otherwise: as it is
        return results
    image_at, video_at = iter([r for r in results if not isinstance(r, EncodedVideo)]), iter(videos)
    return [next(video_at) if video else next(image_at) for video in kinds]


def _encoded(response: httpx.Response) -> list[EncodedImage]:
    from safetensors.torch import load

    tensors = load(response.content)
    metadata = _metadata(response.content)
    grids = json.loads(metadata["grid_thw"])
    videos = json.loads(metadata.get("videos", "null")) or [None] * len(grids)
    out = []
    for i, (grid, video) in enumerate(zip(grids, videos)):
        deepstack, j = [], 0
        while f"images.{i}.deepstack.{j}" in tensors:
            deepstack.append(tensors[f"images.{i}.deepstack.{j}"])
            j += 1
        item = (tensors[f"images.{i}.embeddings"], tuple(grid), deepstack)
        out.append(EncodedImage(*item) if video is None else EncodedVideo(*item, **video))
    return out


def _metadata(body: bytes) -> dict:
    size = int.from_bytes(body[:8], "little")
    return json.loads(body[8 : 8 + size]).get("__metadata__", {})


def _sent(items: list[bytes | str]) -> tuple[list[str], list[bytes]]:
    """Each item as its JSON string value (a URL as it is; bytes as the placeholder of their base64, json_splice),
    and the base64 of those bytes, in placeholder order."""
    sent, blobs = [], []
    for x in items:
        if not isinstance(x, str):
            blobs.append(pybase64.b64encode(x))
            x = placeholder(len(blobs) - 1)
        sent.append(x)
    return sent, blobs


def _json_request(body: dict, blobs: list[bytes], headers: dict | None = None) -> dict:
    """httpx's arguments for a JSON request whose base64 values are spliced in as bytes (json_splice), not run
    through json.dumps (which scans every character of megabytes of text)."""
    return dict(content=json_bytes(body, blobs), headers={"content-type": "application/json", **(headers or {})})


def _embed_request(
    items: list[bytes | str], pooling: str, normalize: bool, max_pixels: int | None, modality: str, **video
) -> dict:
    sent, blobs = _sent(items)
    body = {"input": sent, "pooling": pooling, "normalize": normalize, "encoding_format": "base64"}
    if modality == "video":
        body["modality"] = modality
    options = dict(video, max_pixels=max_pixels)
    return _json_request(body | {name: value for name, value in options.items() if value is not None}, blobs)


def _embedded(response: httpx.Response) -> list[torch.Tensor]:
    out = []
    for item in response.json()["data"]:
        raw = torch.frombuffer(bytearray(base64.b64decode(item["embedding"])), dtype=torch.float32)
        out.append(raw.reshape(item["shape"]) if "shape" in item else raw)
    return out


def _modality(modality: str) -> bool:
    """Whether `embed`'s modality is video (ValueError for anything but image and video)."""
    if modality not in ("image", "video"):
        raise ValueError(f"modality is image or video, not {modality!r}")
    return modality == "video"


class _Base:
    def __init__(
        self, base_url: str, api_key: str | None, timeout: float, retries: int, max_images_per_request: int | None
    ):
        self.base_url, self.retries, self.batch = base_url.rstrip("/"), retries, max_images_per_request
        self.video_batch: int | None = None  # the server's max_videos_per_request, asked once
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout

    def _retry_in(self, outcome: httpx.Response | httpx.TransportError, attempt: int) -> float | None:
        """Seconds to wait before sending again after `outcome` (the answer, or the error of a request that got
        none), or None when it is final: connection failures, 429 and 503 are retried, `retries` times at most."""
        retried = isinstance(outcome, CONNECT_ERRORS) or getattr(outcome, "status_code", None) in RETRIED
        return _wait(outcome, attempt) if retried and attempt < self.retries else None

    def _final(self, outcome: httpx.Response | httpx.TransportError, path: str, attempts: int) -> httpx.Response:
        """The answer; VitserveError for an error answer, or for none."""
        if isinstance(outcome, httpx.TransportError):
            raise _no_answer(outcome, self.base_url, path, attempts) from outcome
        if outcome.status_code >= 400:
            raise _error(outcome)
        return outcome

    def _limits_known(self, videos: bool) -> bool:
        return self.batch is not None and (not videos or self.video_batch is not None)

    def _take_limits(self, model: dict) -> None:
        """The server's limits a request (`/v1/models`), where not given."""
        if self.batch is None:
            self.batch = model.get("max_images_per_request") or 64
        if self.video_batch is None:
            self.video_batch = model.get("max_videos_per_request") or 1

    def _encode_requests(
        self, sent: list[bytes | str], kinds: list[bool], uuids: list[str | None], **options
    ) -> list[tuple[list[bool], dict]]:
        """The /v1/encode requests of what is sent (`kinds`: whether each is a video; `uuids`: each one's), one per
        run within the server's limits, each with its items' kinds."""
        return [
            (
                [kinds[i] for i in run],
                _encode_request(
                    [sent[i] for i in run], [kinds[i] for i in run], uuids=[uuids[i] for i in run], **options
                ),
            )
            for run in _batches(kinds, cast(int, self.batch), self.video_batch or 1)  # (known: _take_limits)
        ]

    def _embed_requests(
        self, sent: list[bytes | str], modality: str, pooling: str, normalize: bool, max_pixels: int | None, **video
    ) -> list[dict]:
        # (the server's limits are known by now: _take_limits)
        runs = _batches([modality == "video"] * len(sent), cast(int, self.batch), self.video_batch or 1)
        return [
            _embed_request([sent[i] for i in run], pooling, normalize, max_pixels, modality, **video) for run in runs
        ]


class Client(_Base):
    """`base_url` of the server; `api_key` if it has one; `timeout` seconds per request; `retries` of a failed
    connection, a 429 or a 503; `max_images_per_request`: the split (default: what the server reports)."""

    def __init__(
        self,
        base_url: str = "http://localhost:8000",
        api_key: str | None = None,
        timeout: float = 120.0,
        retries: int = 3,
        max_images_per_request: int | None = None,
        transport: httpx.BaseTransport | None = None,
    ):
        super().__init__(base_url, api_key, timeout, retries, max_images_per_request)
        self.http = httpx.Client(base_url=self.base_url, headers=self.headers, timeout=timeout, transport=transport)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.http.close()

    def _send(self, method: str, path: str, **request) -> httpx.Response:
        attempt = 0
        while True:
            outcome: httpx.Response | httpx.TransportError
            try:
                outcome = self.http.request(method, path, **request)
            except httpx.TransportError as e:
                outcome = e
            wait = self._retry_in(outcome, attempt)
            if wait is None:
                return self._final(outcome, path, attempt + 1)
            time.sleep(wait)
            attempt += 1

    def model(self) -> dict:
        """The served model: id, family, embedding_dim, deepstack_layers, max_images_per_request, ready."""
        return self._send("GET", "/v1/models").json()["data"][0]

    def _limits(self, videos: bool) -> None:
        if not self._limits_known(videos):
            self._take_limits(self.model())

    def encode(
        self,
        images,
        dtype: str = "float32",
        deepstack: bool = True,
        layout: str = "tokens",
        max_pixels: int | None = None,
        uuids=None,
    ) -> EncodedImage | list[EncodedImage]:
        """Token embeddings (+ Qwen3 deepstack) of one image (a path, URL, data URI, bytes or a PIL image) as an
        EncodedImage, or of a list of them as a list, in order; a video among them gives an EncodedVideo, sampled
        as the server's default does (`encode_videos` takes the sampling). `uuids`: vLLM's uuid of each item (a
        list, or a str for one item; None entries for none), the names of their files on a server with
        --ec-shared-storage."""
        return self._encode(
            images, False, uuids, dtype=dtype, deepstack=deepstack, layout=layout, max_pixels=max_pixels
        )

    def encode_videos(
        self,
        videos,
        fps: float | None = None,
        num_frames: int | None = None,
        max_frames: int | None = None,
        dtype: str = "float32",
        deepstack: bool = True,
        layout: str = "tokens",
        max_pixels: int | None = None,
        uuids=None,
    ) -> EncodedVideo | list[EncodedVideo]:
        """Token embeddings (+ Qwen3 deepstack) and timing of one video (a path, URL, data URI or its bytes) as an
        EncodedVideo, or of a list of them as a list, in order; sampled at `fps` or as `num_frames` (else the
        server's default), at most `max_frames`. `uuids`: as `encode`'s (a server with --ec-shared-storage names a
        video only by its uuid)."""
        return self._encode(
            videos,
            True,
            uuids,
            fps=fps,
            num_frames=num_frames,
            max_frames=max_frames,
            dtype=dtype,
            deepstack=deepstack,
            layout=layout,
            max_pixels=max_pixels,
        )

    def _encode(self, items, videos_only: bool, uuids, **options):
        sent, single = _items(items)
        kinds = _kinds(sent, videos_only)
        self._limits(any(kinds))
        out = []
        for chunk, request in self._encode_requests(sent, kinds, _uuids(uuids, len(sent), single), **options):
            out += _in_order(_encoded(self._send("POST", "/v1/encode", **request)), chunk)
        return out[0] if single else out

    def embed(
        self,
        images,
        pooling: str = "mean",
        normalize: bool = False,
        max_pixels: int | None = None,
        modality: str = "image",
        fps: float | None = None,
        num_frames: int | None = None,
        max_frames: int | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """The vector (`pooling="none"`: the token matrix), float32, of one image, or a list of them for a list;
        `modality="video"`: of videos (the mean of all a video's tokens), sampled by `fps`, `num_frames`,
        `max_frames` as `encode_videos`."""
        sent, single = _items(images)
        self._limits(_modality(modality))
        out = []
        for request in self._embed_requests(
            sent, modality, pooling, normalize, max_pixels, fps=fps, num_frames=num_frames, max_frames=max_frames
        ):
            out += _embedded(self._send("POST", "/v1/embeddings", **request))
        return out[0] if single else out


class AsyncClient(_Base):
    """`Client`, awaited."""

    def __init__(
        self,
        base_url: str = "http://localhost:8000",
        api_key: str | None = None,
        timeout: float = 120.0,
        retries: int = 3,
        max_images_per_request: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        super().__init__(base_url, api_key, timeout, retries, max_images_per_request)
        self.http = httpx.AsyncClient(
            base_url=self.base_url, headers=self.headers, timeout=timeout, transport=transport
        )

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        await self.http.aclose()

    async def _send(self, method: str, path: str, **request) -> httpx.Response:
        attempt = 0
        while True:
            outcome: httpx.Response | httpx.TransportError
            try:
                outcome = await self.http.request(method, path, **request)
            except httpx.TransportError as e:
                outcome = e
            wait = self._retry_in(outcome, attempt)
            if wait is None:
                return self._final(outcome, path, attempt + 1)
            await asyncio.sleep(wait)
            attempt += 1

    async def model(self) -> dict:
        return (await self._send("GET", "/v1/models")).json()["data"][0]

    async def _limits(self, videos: bool) -> None:
        if not self._limits_known(videos):
            self._take_limits(await self.model())

    async def encode(
        self,
        images,
        dtype: str = "float32",
        deepstack: bool = True,
        layout: str = "tokens",
        max_pixels: int | None = None,
        uuids=None,
    ) -> EncodedImage | list[EncodedImage]:
        return await self._encode(
            images, False, uuids, dtype=dtype, deepstack=deepstack, layout=layout, max_pixels=max_pixels
        )

    async def encode_videos(
        self,
        videos,
        fps: float | None = None,
        num_frames: int | None = None,
        max_frames: int | None = None,
        dtype: str = "float32",
        deepstack: bool = True,
        layout: str = "tokens",
        max_pixels: int | None = None,
        uuids=None,
    ) -> EncodedVideo | list[EncodedVideo]:
        return await self._encode(
            videos,
            True,
            uuids,
            fps=fps,
            num_frames=num_frames,
            max_frames=max_frames,
            dtype=dtype,
            deepstack=deepstack,
            layout=layout,
            max_pixels=max_pixels,
        )

    async def _encode(self, items, videos_only: bool, uuids, **options):
        sent, single = _items(items)
        kinds = _kinds(sent, videos_only)
        await self._limits(any(kinds))
        requests = self._encode_requests(sent, kinds, _uuids(uuids, len(sent), single), **options)
        replies = await asyncio.gather(*(self._send("POST", "/v1/encode", **request) for _, request in requests))
        out = [item for (chunk, _), reply in zip(requests, replies) for item in _in_order(_encoded(reply), chunk)]
        return out[0] if single else out

    async def embed(
        self,
        images,
        pooling: str = "mean",
        normalize: bool = False,
        max_pixels: int | None = None,
        modality: str = "image",
        fps: float | None = None,
        num_frames: int | None = None,
        max_frames: int | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        sent, single = _items(images)
        await self._limits(_modality(modality))
        requests = self._embed_requests(
            sent, modality, pooling, normalize, max_pixels, fps=fps, num_frames=num_frames, max_frames=max_frames
        )
        replies = await asyncio.gather(*(self._send("POST", "/v1/embeddings", **request) for request in requests))
        out = [item for reply in replies for item in _embedded(reply)]
        return out[0] if single else out
