"""A Python client for a vitserve server, sync (`Client`) and async (`AsyncClient`), on httpx.

    from vitserve.client import Client
    with Client("http://localhost:8000") as client:
        item = client.encode("examples/sample.jpg")             # one image in: one EncodedImage out
        items = client.encode(["examples/sample.jpg", "examples/portrait.png"])  # a list in: a list out
        vectors = client.embed(["examples/sample.jpg"])         # one pooled vector per image
        clip = client.encode_videos("clip.mp4", fps=2)          # an EncodedVideo: tokens, grid and timing
        vector = client.embed("clip.mp4", modality="video")     # one pooled vector per video

Token embeddings travel as one safetensors body (no base64). Inputs are paths, bytes, PIL images, data URIs or
http(s) URLs (fetched by the server, with --allow-url-fetch): one of them gives one result, a list (any iterable) a
list of results. A request of more images or videos than the server takes at once is split. Connection failures
and 429 and 503 answers are retried (a bounded number of times, waiting as the answer's Retry-After says, else 0.5,
1, 2 s ...); every failure left raises `VitserveError`.
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
    raise TypeError(f"an image or a video is a path, a URL, a data URI, bytes or a PIL image, not "
                    f"{type(image).__name__}")


def _payload(item: Any) -> bytes | str:
    """What is sent for an input: an http(s) URL or a data URI as it is (the server reads it: a URL only with
    --allow-url-fetch), anything else as its bytes (image_bytes)."""
    if isinstance(item, str) and item.startswith(("http://", "https://", "data:")):
        return item
    return image_bytes(item)


def _inputs(items) -> tuple[list[bytes | str], bool]:
    """One input (a path, a URL, a data URI, bytes or a PIL image) or an iterable of them as what is sent for
    each, and whether it was one."""
    if isinstance(items, (str, os.PathLike, bytes, bytearray, memoryview)) or hasattr(items, "save"):
        return [_payload(items)], True
    try:
        items = list(items)
    except TypeError:
        raise TypeError(f"give an image or a video (a path, a URL, a data URI, bytes or a PIL image) or a list of "
                        f"them, not {type(items).__name__}") from None
    return [_payload(x) for x in items], False


def _is_video(payload: bytes | str, modality: str | None) -> bool:
    """Whether an input goes as a video: `modality` where the call says, else by its bytes (a video container's
    signature) or its data URI's media type; a URL is an image unless the call says."""
    if modality is not None:
        return modality == "video"
    if isinstance(payload, str):
        return payload.startswith("data:video/")
    return sniff(payload[:512]) is not None


def _split(kinds: list[bool], image_limit: int, video_limit: int) -> list[list[int]]:
    """The inputs' indices in requests, in order, each holding at most `image_limit` images and `video_limit`
    videos (`kinds`: whether each is a video)."""
    chunks, images, videos = [], 0, 0
    for i, video in enumerate(kinds):
        if not chunks or (videos >= video_limit if video else images >= image_limit):
            chunks.append([])
            images = videos = 0
        chunks[-1].append(i)
        videos, images = videos + video, images + (not video)
    return chunks


def _in_order(chunk: list[int], kinds: list[bool], answers: list) -> list:
    """A request's answers in its inputs' order: the server answers its images first, then its videos."""
    order = [i for i in chunk if not kinds[i]] + [i for i in chunk if kinds[i]]
    by_input = dict(zip(order, answers))
    return [by_input[i] for i in chunk]


def _error(response: httpx.Response) -> VitserveError:
    try:
        err = response.json()["error"]
        return VitserveError(response.status_code, err.get("code"), err.get("message", ""), err.get("param"))
    except (ValueError, KeyError, TypeError):
        return VitserveError(response.status_code, None, response.text[:500])


def _no_answer(error: httpx.TransportError, url: str, attempts: int, call: str) -> VitserveError:
    """A request that got no HTTP answer (status None), for the client's method `call`."""
    if isinstance(error, CONNECT_ERRORS):
        tries = f"{attempts} attempt{'s' * (attempts > 1)}"
        return VitserveError(None, "unreachable", f"{call}: cannot connect to {url} ({tries}): {error!r}")
    if isinstance(error, httpx.TimeoutException):
        return VitserveError(None, "timeout", f"{call}: no answer from {url} within the timeout: {error!r}")
    return VitserveError(None, "transport_error", f"{call}: the connection to {url} broke: {error!r}")


def _wait(outcome: httpx.Response | httpx.TransportError, attempt: int) -> float:
    """Seconds before retrying: the answer's Retry-After, else a backoff (0.5, 1, 2 s ...), at most 30."""
    try:
        return min(30.0, float(outcome.headers["retry-after"]))
    except (AttributeError, KeyError, ValueError):
        return min(30.0, 0.5 * 2**attempt)


def _encode_request(items: list[bytes | str], videos: list[bool], dtype: str, deepstack: bool, layout: str,
                    max_pixels: int | None, **video) -> dict:
    """A /v1/encode request: multipart where every input is bytes (the server tells videos from images by their
    bytes), else JSON (URLs and data URIs as they are, bytes in base64, each in `images` or `videos`); `video`: fps,
    num_frames, max_frames where given. The answer is safetensors either way."""
    fields = {"dtype": dtype, "deepstack": deepstack, "layout": layout, **dict(video, max_pixels=max_pixels)}
    fields = {name: value for name, value in fields.items() if value is not None}
    headers = {"accept": "application/octet-stream"}
    if all(isinstance(x, bytes) for x in items):
        form = {name: str(value).lower() if isinstance(value, bool) else str(value) for name, value in fields.items()}
        return dict(files=[("images", (f"{i}", data, "application/octet-stream")) for i, data in enumerate(items)],
                    data=form, headers=headers)
    text = [x if isinstance(x, str) else base64.b64encode(x).decode() for x in items]
    return dict(json={**fields, "images": [t for t, v in zip(text, videos) if not v],
                      "videos": [t for t, v in zip(text, videos) if v]}, headers=headers)


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


def _embed_request(items: list[bytes | str], pooling: str, normalize: bool, max_pixels: int | None,
                   modality: str = "image", **video) -> dict:
    body = {"input": [x if isinstance(x, str) else base64.b64encode(x).decode() for x in items], "pooling": pooling,
            "normalize": normalize, "encoding_format": "base64"}
    if modality != "image":
        body["modality"] = modality
    for name, value in dict(video, max_pixels=max_pixels).items():
        if value is not None:
            body[name] = value
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

    def _needs_limits(self, kinds: list[bool]) -> bool:
        """Whether the server's limits must be asked before these inputs (`kinds`: which are videos) are split."""
        return self.batch is None or (any(kinds) and self.video_batch is None)

    def _learn(self, model: dict) -> None:
        self.batch = self.batch or model.get("max_images_per_request") or 64
        self.video_batch = model.get("max_videos_per_request") or 1

    def _retry_in(self, outcome: httpx.Response | httpx.TransportError, attempt: int) -> float | None:
        """Seconds to wait before sending again after `outcome` (the answer, or the error of a request that got
        none), or None when it is final: connection failures, 429 and 503 are retried, `retries` times at most."""
        retried = isinstance(outcome, CONNECT_ERRORS) or getattr(outcome, "status_code", None) in RETRIED
        return _wait(outcome, attempt) if retried and attempt < self.retries else None

    def _final(self, outcome: httpx.Response | httpx.TransportError, attempts: int, call: str) -> httpx.Response:
        """The answer; VitserveError for an error answer, or for none (naming the method called, `call`)."""
        if isinstance(outcome, httpx.TransportError):
            raise _no_answer(outcome, self.base_url, attempts, call) from outcome
        if outcome.status_code >= 400:
            raise _error(outcome)
        return outcome


class Client(_Base):
    """`base_url` of the server; `api_key` if it has one; `timeout` seconds per request; `retries` of a failed
    connection, a 429 or a 503; `max_images_per_request`: the split (default: what the server reports).

    Inputs are paths, bytes, PIL images, data URIs, or http(s) URLs (which the server fetches, with
    --allow-url-fetch); `encode` takes images and videos side by side (told apart by their bytes or media type)
    and splits them at the server's limits of each."""

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

    def _send(self, method: str, path: str, call: str, **request) -> httpx.Response:
        attempt = 0
        while True:
            try:
                outcome = self.http.request(method, path, **request)
            except httpx.TransportError as e:
                outcome = e
            wait = self._retry_in(outcome, attempt)
            if wait is None:
                return self._final(outcome, attempt + 1, call)
            time.sleep(wait)
            attempt += 1

    def model(self) -> dict:
        """The served model: id, family, embedding_dim, deepstack_layers, max_images_per_request,
        max_videos_per_request, capabilities, ready."""
        return self._send("GET", "/v1/models", "model").json()["data"][0]

    def _split(self, kinds: list[bool], call: str) -> list[list[int]]:
        if self._needs_limits(kinds):
            self._learn(self._send("GET", "/v1/models", call).json()["data"][0])
        return _split(kinds, self.batch, self.video_batch or 1)

    def _encode(self, inputs, modality: str | None, call: str, *options, **video) -> list:
        items, single = _inputs(inputs)
        kinds = [_is_video(x, modality) for x in items]
        out = []
        for chunk in self._split(kinds, call):
            reply = self._send("POST", "/v1/encode", call, **_encode_request(
                [items[i] for i in chunk], [kinds[i] for i in chunk], *options, **video))
            out += _in_order(chunk, kinds, _encoded(reply))
        return out[0] if single else out

    def encode(self, images, dtype: str = "float32", deepstack: bool = True, layout: str = "tokens",
               max_pixels: int | None = None) -> EncodedImage | list[EncodedImage | EncodedVideo]:
        """Token embeddings (+ Qwen3 deepstack) of one input as an EncodedImage (an EncodedVideo for a video, at
        the server's default sampling), or of a list of them as a list, in order."""
        return self._encode(images, None, "encode", dtype, deepstack, layout, max_pixels)

    def encode_videos(self, videos, fps: float | None = None, num_frames: int | None = None,
                      max_frames: int | None = None, dtype: str = "float32", deepstack: bool = True,
                      layout: str = "tokens", max_pixels: int | None = None) -> EncodedVideo | list[EncodedVideo]:
        """Token embeddings (+ Qwen3 deepstack) and timing of one video as an EncodedVideo, or of a list of them as
        a list, in order; sampled at `fps` or as `num_frames` (else the server's default), at most `max_frames`."""
        return self._encode(videos, "video", "encode_videos", dtype, deepstack, layout, max_pixels, fps=fps,
                            num_frames=num_frames, max_frames=max_frames)

    def embed(self, images, pooling: str = "mean", normalize: bool = False, max_pixels: int | None = None,
              modality: str = "image", fps: float | None = None, num_frames: int | None = None,
              max_frames: int | None = None) -> torch.Tensor | list[torch.Tensor]:
        """The vector (`pooling="none"`: the token matrix), float32, of one input, or a list of them for a list;
        `modality="video"`: the inputs are videos (one vector each, sampled as for `encode_videos`)."""
        items, single = _inputs(images)
        out = []
        for chunk in self._split([modality == "video"] * len(items), "embed"):
            out += _embedded(self._send("POST", "/v1/embeddings", "embed", **_embed_request(
                [items[i] for i in chunk], pooling, normalize, max_pixels, modality, fps=fps, num_frames=num_frames,
                max_frames=max_frames)))
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

    async def _send(self, method: str, path: str, call: str, **request) -> httpx.Response:
        attempt = 0
        while True:
            try:
                outcome = await self.http.request(method, path, **request)
            except httpx.TransportError as e:
                outcome = e
            wait = self._retry_in(outcome, attempt)
            if wait is None:
                return self._final(outcome, attempt + 1, call)
            await asyncio.sleep(wait)
            attempt += 1

    async def model(self) -> dict:
        return (await self._send("GET", "/v1/models", "model")).json()["data"][0]

    async def _split(self, kinds: list[bool], call: str) -> list[list[int]]:
        if self._needs_limits(kinds):
            self._learn((await self._send("GET", "/v1/models", call)).json()["data"][0])
        return _split(kinds, self.batch, self.video_batch or 1)

    async def _encode(self, inputs, modality: str | None, call: str, *options, **video) -> list:
        items, single = _inputs(inputs)
        kinds = [_is_video(x, modality) for x in items]
        chunks = await self._split(kinds, call)
        replies = await asyncio.gather(*(self._send("POST", "/v1/encode", call, **_encode_request(
            [items[i] for i in chunk], [kinds[i] for i in chunk], *options, **video)) for chunk in chunks))
        out = [item for chunk, reply in zip(chunks, replies) for item in _in_order(chunk, kinds, _encoded(reply))]
        return out[0] if single else out

    async def encode(self, images, dtype: str = "float32", deepstack: bool = True, layout: str = "tokens",
                     max_pixels: int | None = None) -> EncodedImage | list[EncodedImage | EncodedVideo]:
        return await self._encode(images, None, "encode", dtype, deepstack, layout, max_pixels)

    async def encode_videos(self, videos, fps: float | None = None, num_frames: int | None = None,
                            max_frames: int | None = None, dtype: str = "float32", deepstack: bool = True,
                            layout: str = "tokens", max_pixels: int | None = None) -> EncodedVideo | list[EncodedVideo]:
        return await self._encode(videos, "video", "encode_videos", dtype, deepstack, layout, max_pixels, fps=fps,
                                  num_frames=num_frames, max_frames=max_frames)

    async def embed(self, images, pooling: str = "mean", normalize: bool = False, max_pixels: int | None = None,
                    modality: str = "image", fps: float | None = None, num_frames: int | None = None,
                    max_frames: int | None = None) -> torch.Tensor | list[torch.Tensor]:
        items, single = _inputs(images)
        chunks = await self._split([modality == "video"] * len(items), "embed")
        replies = await asyncio.gather(*(self._send("POST", "/v1/embeddings", "embed", **_embed_request(
            [items[i] for i in chunk], pooling, normalize, max_pixels, modality, fps=fps, num_frames=num_frames,
            max_frames=max_frames)) for chunk in chunks))
        out = [item for reply in replies for item in _embedded(reply)]
        return out[0] if single else out
