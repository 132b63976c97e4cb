"""A Python client for a vitserve server, sync (`Client`) and async (`AsyncClient`), on httpx.

    from vitserve.client import Client
    with Client("http://localhost:8000") as client:
        images = client.encode(["cat.jpg", "dog.png"])   # per image: embeddings, grid_thw, deepstack (tensors)
        vectors = client.embed(["cat.jpg"])               # one pooled vector per image

Token embeddings travel as one safetensors body (no base64). Images are paths, bytes or PIL images. A request of
more images than the server takes at once is split. 429 and 503 answers are retried (a bounded number of times,
waiting as their Retry-After says); other errors raise `VitserveError` with the server's status and code.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable

import httpx
import torch

RETRIED = (429, 503)


class VitserveError(Exception):
    """An error answer: HTTP `status`, the server's `code` and `param` (the bad input), and its message."""

    def __init__(self, status: int, code: str | None, message: str, param: str | None = None):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.param = status, code, message, param


@dataclass
class EncodedImage:
    """One image's features: `embeddings` [tokens, width] (with layout="vllm" the deepstack features are on the
    width and `deepstack` is empty), `grid_thw` in patches (before the 2x2 merge), `deepstack` (Qwen3) one
    [tokens, out_hidden] per deepstack layer."""

    embeddings: torch.Tensor
    grid_thw: tuple[int, int, int]
    deepstack: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return self.embeddings.shape[0]


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


def _error(response: httpx.Response) -> VitserveError:
    try:
        err = response.json()["error"]
        return VitserveError(response.status_code, err.get("code"), err.get("message", ""), err.get("param"))
    except (ValueError, KeyError, TypeError):
        return VitserveError(response.status_code, None, response.text[:500])


def _wait(response: httpx.Response, attempt: int) -> float:
    """Seconds before retrying: the answer's Retry-After, else a backoff (0.5, 1, 2 s ...), at most 30."""
    try:
        return min(30.0, float(response.headers["retry-after"]))
    except (KeyError, ValueError):
        return min(30.0, 0.5 * 2**attempt)


def _encode_request(images: list[bytes], dtype: str, deepstack: bool, layout: str,
                    max_pixels: int | None) -> dict:
    fields = {"dtype": dtype, "deepstack": str(deepstack).lower(), "layout": layout}
    if max_pixels is not None:
        fields["max_pixels"] = str(max_pixels)
    return dict(files=[("images", (f"{i}", data, "application/octet-stream")) for i, data in enumerate(images)],
                data=fields, headers={"accept": "application/octet-stream"})


def _encoded(response: httpx.Response) -> list[EncodedImage]:
    from safetensors.torch import load

    tensors = load(response.content)
    grids = json.loads(_metadata(response.content)["grid_thw"])
    out = []
    for i, grid in enumerate(grids):
        deepstack, j = [], 0
        while f"images.{i}.deepstack.{j}" in tensors:
            deepstack.append(tensors[f"images.{i}.deepstack.{j}"])
            j += 1
        out.append(EncodedImage(tensors[f"images.{i}.embeddings"], tuple(grid), deepstack))
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
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout

    def _check(self, response: httpx.Response) -> httpx.Response:
        if response.status_code >= 400:
            raise _error(response)
        return response


class Client(_Base):
    """`base_url` of the server; `api_key` if it has one; `timeout` seconds per request; `retries` of a 429 or 503;
    `max_images_per_request`: the split (default: what the server reports)."""

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

    def _post(self, path: str, request: dict) -> httpx.Response:
        for attempt in range(self.retries + 1):
            response = self.http.post(path, **request)
            if response.status_code not in RETRIED or attempt == self.retries:
                return self._check(response)
            time.sleep(_wait(response, attempt))
        raise AssertionError("unreachable")

    def model(self) -> dict:
        """The served model: id, family, embedding_dim, deepstack_layers, max_images_per_request, ready."""
        return self._check(self.http.get("/v1/models")).json()["data"][0]

    def _size(self) -> int:
        if self.batch is None:
            self.batch = self.model().get("max_images_per_request") or 64
        return self.batch

    def encode(self, images: list, dtype: str = "float32", deepstack: bool = True, layout: str = "tokens",
               max_pixels: int | None = None) -> list[EncodedImage]:
        """Token embeddings (+ Qwen3 deepstack) of each image, in order."""
        data, out = [image_bytes(x) for x in images], []
        for chunk in _chunks(data, self._size()):
            out += _encoded(self._post("/v1/encode", _encode_request(chunk, dtype, deepstack, layout, max_pixels)))
        return out

    def embed(self, images: list, pooling: str = "mean", normalize: bool = False,
              max_pixels: int | None = None) -> list[torch.Tensor]:
        """One vector per image (`pooling="none"`: the token matrix), float32."""
        data, out = [image_bytes(x) for x in images], []
        for chunk in _chunks(data, self._size()):
            out += _embedded(self._post("/v1/embeddings", _embed_request(chunk, pooling, normalize, max_pixels)))
        return out


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

    async def _post(self, path: str, request: dict) -> httpx.Response:
        for attempt in range(self.retries + 1):
            response = await self.http.post(path, **request)
            if response.status_code not in RETRIED or attempt == self.retries:
                return self._check(response)
            await asyncio.sleep(_wait(response, attempt))
        raise AssertionError("unreachable")

    async def model(self) -> dict:
        return self._check(await self.http.get("/v1/models")).json()["data"][0]

    async def _size(self) -> int:
        if self.batch is None:
            self.batch = (await self.model()).get("max_images_per_request") or 64
        return self.batch

    async def encode(self, images: list, dtype: str = "float32", deepstack: bool = True, layout: str = "tokens",
                     max_pixels: int | None = None) -> list[EncodedImage]:
        data, size = [image_bytes(x) for x in images], await self._size()
        replies = await asyncio.gather(*(self._post("/v1/encode", _encode_request(c, dtype, deepstack, layout,
                                                                                    max_pixels))
                                         for c in _chunks(data, size)))
        return [item for reply in replies for item in _encoded(reply)]

    async def embed(self, images: list, pooling: str = "mean", normalize: bool = False,
                    max_pixels: int | None = None) -> list[torch.Tensor]:
        data, size = [image_bytes(x) for x in images], await self._size()
        replies = await asyncio.gather(*(self._post("/v1/embeddings", _embed_request(c, pooling, normalize,
                                                                                       max_pixels))
                                         for c in _chunks(data, size)))
        return [item for reply in replies for item in _embedded(reply)]
