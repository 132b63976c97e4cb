"""A Python client for a vitserve server, sync (`Client`) and async (`AsyncClient`), on httpx.

    from vitserve.client import Client
    with Client("http://localhost:8000") as client:
        item = client.encode("examples/sample.jpg")             # one image in: one EncodedImage out
        items = client.encode(["examples/sample.jpg", "examples/portrait.png"])  # a list in: a list out
        vectors = client.embed(["examples/sample.jpg"])         # one pooled vector per image
        clip = client.encode_videos("clip.mp4", fps=2)          # an EncodedVideo: tokens, grid and timing

Token embeddings travel as one safetensors body (no base64). Images are paths, bytes or PIL images: one of them
gives one result, a list (any iterable) a list of results. A request of more images than the server takes at once
is split. Connection failures and 429 and 503 answers are retried (a bounded number of times, waiting as the
answer's Retry-After says, else 0.5, 1, 2 s ...); every failure left raises `VitserveError`.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import time
from typing import Any, Iterable

import httpx
import torch

from .encoder.vision_encoder import EncodedImage, EncodedVideo, as_list, videos_list

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
    raise TypeError(f"an image is a path, bytes or a PIL image, not {type(image).__name__}")


def _images(images) -> tuple[list[bytes], bool]:
    """An image or an iterable of them as encoded bytes each, and whether it was one image."""
    items, single = as_list(images)
    return [image_bytes(x) for x in items], single


def _videos(videos) -> tuple[list[bytes], bool]:
    """A video (a path or its bytes) or an iterable of them as bytes each, and whether it was one video."""
    items, single = videos_list(videos)
    return [image_bytes(x) for x in items], single


def _error(response: httpx.Response) -> VitserveError:
    try:
        err = response.json()["error"]
        return VitserveError(response.status_code, err.get("code"), err.get("message", ""), err.get("param"))
    except (ValueError, KeyError, TypeError):
        return VitserveError(response.status_code, None, response.text[:500])


def _no_answer(error: httpx.TransportError, url: str, attempts: int) -> VitserveError:
    """A request that got no HTTP answer (status None)."""
    if isinstance(error, CONNECT_ERRORS):
        tries = f"{attempts} attempt{'s' * (attempts > 1)}"
        return VitserveError(None, "unreachable", f"cannot connect to {url} ({tries}): {error!r}")
    if isinstance(error, httpx.TimeoutException):
        return VitserveError(None, "timeout", f"no answer from {url} within the timeout: {error!r}")
    return VitserveError(None, "transport_error", f"the connection to {url} broke: {error!r}")


def _wait(outcome: httpx.Response | httpx.TransportError, attempt: int) -> float:
    """Seconds before retrying: the answer's Retry-After, else a backoff (0.5, 1, 2 s ...), at most 30."""
    try:
        return min(30.0, float(outcome.headers["retry-after"]))
    except (AttributeError, KeyError, ValueError):
        return min(30.0, 0.5 * 2**attempt)


def _uuids(uuids, count: int, single: bool, kind: str) -> list[str | None]:
    """Each item's uuid (vLLM's name for it where the server is vLLM's encoder tier), None where it has none."""
    if uuids is None:
        return [None] * count
    names = [uuids] if single and isinstance(uuids, str) else list(uuids)
    if len(names) != count:
        raise ValueError(f"{len(names)} uuids for {count} {kind}s")
    return names


def _encode_request(images: list[bytes], dtype: str, deepstack: bool, layout: str,
                    max_pixels: int | None, uuids: list[str | None] = (), kind: str = "image", **video) -> dict:
    """A multipart /v1/encode request (the server tells videos from images by their bytes); `uuids`: the items'
    (the `multi_modal_uuids` field, for `kind`), where any is given; `video`: fps, num_frames, max_frames where
    given."""
    fields = {"dtype": dtype, "deepstack": str(deepstack).lower(), "layout": layout}
    if any(name is not None for name in uuids):
        fields["multi_modal_uuids"] = json.dumps({kind: list(uuids)})
    for name, value in dict(video, max_pixels=max_pixels).items():
        if value is not None:
            fields[name] = str(value)
    return dict(files=[("images", (f"{i}", data, "application/octet-stream")) for i, data in enumerate(images)],
                data=fields, headers={"accept": "application/octet-stream"})


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
    return json.loads(body[8:8 + size]).get("__metadata__", {})


def _embed_request(images: list[bytes], pooling: str, normalize: bool, max_pixels: int | None) -> dict:
    body = {"input": [base64.b64encode(data).decode() for data in images], "pooling": pooling, "normalize": normalize,
            "encoding_format": "base64"}
    if max_pixels is not None:
        body["max_pixels"] = max_pixels
    return dict(json=body)


def _embedded(response: httpx.Response) -> list[torch.Tensor]:
    out = []
    for item in response.json()["data"]:
        raw = torch.frombuffer(bytearray(base64.b64decode(item["embedding"])), dtype=torch.float32)
        out.append(raw.reshape(item["shape"]) if "shape" in item else raw)
    return out


def _chunks(images: list, size: int) -> Iterable[list]:
    for start in range(0, len(images), size):
        yield images[start:start + size]


class _Base:
    def __init__(self, base_url: str, api_key: str | None, timeout: float, retries: int,
                 max_images_per_request: int | None):
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
            raise _no_answer(outcome, self.base_url + path, attempts) from outcome
        if outcome.status_code >= 400:
            raise _error(outcome)
        return outcome


class Client(_Base):
    """`base_url` of the server; `api_key` if it has one; `timeout` seconds per request; `retries` of a failed
    connection, a 429 or a 503; `max_images_per_request`: the split (default: what the server reports)."""

    def __init__(self, base_url: str = "http://localhost:8000", api_key: str | None = None, timeout: float = 120.0,
                 retries: int = 3, max_images_per_request: int | None = None,
                 transport: httpx.BaseTransport | None = None):
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

    def _size(self) -> int:
        if self.batch is None:
            self.batch = self.model().get("max_images_per_request") or 64
        return self.batch

    def encode(self, images, dtype: str = "float32", deepstack: bool = True, layout: str = "tokens",
               max_pixels: int | None = None, uuids=None) -> EncodedImage | list[EncodedImage]:
        """Token embeddings (+ Qwen3 deepstack) of one image (a path, bytes or a PIL image) as an EncodedImage, or
        of a list of them as a list, in order. `uuids`: vLLM's uuid of each image (a list, or a str for one image;
        None entries for none), the names of their files on a server with --ec-shared-storage."""
        data, single = _images(images)
        names, size = _uuids(uuids, len(data), single, "image"), self._size()
        out = []
        for chunk, chunk_names in zip(_chunks(data, size), _chunks(names, size)):
            out += _encoded(self._send("POST", "/v1/encode", **_encode_request(chunk, dtype, deepstack, layout,
                                                                               max_pixels, chunk_names)))
        return out[0] if single else out

    def encode_videos(self, videos, fps: float | None = None, num_frames: int | None = None,
                      max_frames: int | None = None, dtype: str = "float32", deepstack: bool = True,
                      layout: str = "tokens", max_pixels: int | None = None,
                      uuids=None) -> EncodedVideo | list[EncodedVideo]:
        """Token embeddings (+ Qwen3 deepstack) and timing of one video (a path or its bytes) as an EncodedVideo,
        or of a list of them as a list, in order; sampled at `fps` or as `num_frames` (else the server's
        default), at most `max_frames`. `uuids`: as `encode`'s (a server with --ec-shared-storage names a video
        only by its uuid)."""
        data, single = _videos(videos)
        names, size = _uuids(uuids, len(data), single, "video"), self._video_size()
        out = []
        for chunk, chunk_names in zip(_chunks(data, size), _chunks(names, size)):
            out += _encoded(self._send("POST", "/v1/encode", **_encode_request(
                chunk, dtype, deepstack, layout, max_pixels, chunk_names, "video", fps=fps, num_frames=num_frames,
                max_frames=max_frames)))
        return out[0] if single else out

    def _video_size(self) -> int:
        if self.video_batch is None:
            self.video_batch = self.model().get("max_videos_per_request") or 1
        return self.video_batch

    def embed(self, images, pooling: str = "mean", normalize: bool = False,
              max_pixels: int | None = None) -> torch.Tensor | list[torch.Tensor]:
        """The vector (`pooling="none"`: the token matrix), float32, of one image, or a list of them for a list."""
        data, single = _images(images)
        out = []
        for chunk in _chunks(data, self._size()):
            out += _embedded(self._send("POST", "/v1/embeddings", **_embed_request(chunk, pooling, normalize,
                                                                                   max_pixels)))
        return out[0] if single else out


class AsyncClient(_Base):
    """`Client`, awaited."""

    def __init__(self, base_url: str = "http://localhost:8000", api_key: str | None = None, timeout: float = 120.0,
                 retries: int = 3, max_images_per_request: int | None = None,
                 transport: httpx.AsyncBaseTransport | None = None):
        super().__init__(base_url, api_key, timeout, retries, max_images_per_request)
        self.http = httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=timeout,
                                      transport=transport)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        await self.http.aclose()

    async def _send(self, method: str, path: str, **request) -> httpx.Response:
        attempt = 0
        while True:
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

    async def _size(self) -> int:
        if self.batch is None:
            self.batch = (await self.model()).get("max_images_per_request") or 64
        return self.batch

    async def encode(self, images, dtype: str = "float32", deepstack: bool = True, layout: str = "tokens",
                     max_pixels: int | None = None, uuids=None) -> EncodedImage | list[EncodedImage]:
        (data, single), size = _images(images), await self._size()
        names = _uuids(uuids, len(data), single, "image")
        replies = await asyncio.gather(*(self._send("POST", "/v1/encode", **_encode_request(c, dtype, deepstack,
                                                                                            layout, max_pixels, n))
                                         for c, n in zip(_chunks(data, size), _chunks(names, size))))
        out = [item for reply in replies for item in _encoded(reply)]
        return out[0] if single else out

    async def encode_videos(self, videos, fps: float | None = None, num_frames: int | None = None,
                            max_frames: int | None = None, dtype: str = "float32", deepstack: bool = True,
                            layout: str = "tokens", max_pixels: int | None = None,
                            uuids=None) -> EncodedVideo | list[EncodedVideo]:
        if self.video_batch is None:
            self.video_batch = (await self.model()).get("max_videos_per_request") or 1
        (data, single), size = _videos(videos), self.video_batch
        names = _uuids(uuids, len(data), single, "video")
        replies = await asyncio.gather(*(self._send("POST", "/v1/encode", **_encode_request(
            c, dtype, deepstack, layout, max_pixels, n, "video", fps=fps, num_frames=num_frames,
            max_frames=max_frames)) for c, n in zip(_chunks(data, size), _chunks(names, size))))
        out = [item for reply in replies for item in _encoded(reply)]
        return out[0] if single else out

    async def embed(self, images, pooling: str = "mean", normalize: bool = False,
                    max_pixels: int | None = None) -> torch.Tensor | list[torch.Tensor]:
        (data, single), size = _images(images), await self._size()
        replies = await asyncio.gather(*(self._send("POST", "/v1/embeddings", **_embed_request(c, pooling, normalize,
                                                                                               max_pixels))
                                         for c in _chunks(data, size)))
        out = [item for reply in replies for item in _embedded(reply)]
        return out[0] if single else out
