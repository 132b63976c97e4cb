"""The embedding cache: an image that comes again (every turn of a multi-turn chat) is answered from host memory,
without decoding it or touching the device.

The key is a SHA-256 digest (server CPUs compute it in hardware) of the image as sent (the base64 text, or the bytes
of a file part or a fetched URL), told apart by how it was sent (base64 text sent as a file is not an image, whatever
the same text sent as base64 is), and of everything that changes the engine's output for it: the model, the resize
bounds, and whether the tokens or their mean are wanted. The output dtype and layout are applied to the cached float32 tensors after the cache, so
they need no key: a cached answer is bit-identical to a computed one. An LRU bounded in bytes (`--cache-bytes`, 0:
off); only successful encodings are stored. Identical images in flight at once are computed once: the later ones
wait for the first (`claim`).

A hit answers at once, which tells a client that an image was sent before. `--cache-scope api-key` keys every entry
by the client's API key too: a client learns only of its own images.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib

import torch

from ..encoder.preprocess import Base64Data, PreprocessConfig
from .metrics import Metrics

Output = tuple[tuple[torch.Tensor, list[torch.Tensor]], tuple[int, int, int]]  # (tokens or mean, deepstack), grid

def nbytes(output: Output) -> int:
    (first, deepstack), _ = output
    return sum(t.numel() * t.element_size() for t in (first, *deepstack))


class EmbeddingCache:
    def __init__(self, limit: int, model: str, metrics: Metrics, per_client: bool = False):
        self.limit, self.model, self.metrics, self.per_client = limit, model, metrics, per_client
        self.bytes = 0
        self._entries: collections.OrderedDict[bytes, Output] = collections.OrderedDict()
        self._pending: dict[bytes, asyncio.Future] = {}

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    async def keys(self, images: list, cfg: PreprocessConfig, mean_pooling: bool,
                   client: int | None = None) -> list[bytes]:
        """`key` of each image, all of them in one go in a thread (hashlib lets go of the GIL while it hashes): no
        byte of an image is hashed on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: [self.key(data, cfg, mean_pooling, client) for data in images])

    def key(self, data, cfg: PreprocessConfig, mean_pooling: bool, client: int | None = None) -> bytes:
        """`client`: the API key the request came with (its index), which scopes the entry when per_client."""
        digest = hashlib.sha256()
        base64 = isinstance(data, Base64Data)
        digest.update(data.ascii() if base64 else data)
        digest.update(f"\0{'base64' if base64 else 'bytes'}\0{self.model}\0{cfg.min_pixels}\0{cfg.max_pixels}\0"
                      f"{int(mean_pooling)}\0{client if self.per_client else ''}".encode())
        return digest.digest()

    def get(self, key: bytes) -> Output | None:
        output = self._entries.get(key)
        if output is None:
            return None
        self._entries.move_to_end(key)
        return output

    def claim(self, key: bytes) -> asyncio.Future | None:
        """None: the caller computes this image (and must `settle` it); else a future the caller awaits for another
        request's result (None when that one failed: then the caller computes it)."""
        if key in self._pending:
            return self._pending[key]
        self._pending[key] = asyncio.get_running_loop().create_future()
        return None

    def settle(self, key: bytes, output: Output | None) -> None:
        """The claimed image's result (None: it failed, and is not stored)."""
        if output is not None:
            self.put(key, output)
        future = self._pending.pop(key, None)
        if future is not None and not future.done():
            future.set_result(output)

    def put(self, key: bytes, output: Output) -> None:
        size = nbytes(output)
        if size > self.limit or key in self._entries:
            return
        while self.bytes + size > self.limit:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= nbytes(evicted)
            self.metrics.cache_evictions.inc()
        self._entries[key] = output
        self.bytes += size
        self.metrics.cache_bytes.set(self.bytes)
        self.metrics.cache_entries.set(len(self._entries))

    def stats(self) -> dict:
        count = lambda name: int(self.metrics.registry.get_sample_value(name) or 0)  # noqa: E731 (counters: whole)
        return {"enabled": self.enabled, "limit_bytes": self.limit, "bytes": self.bytes, "entries": len(self._entries),
                "hits": count("vitserve_cache_hits_total"), "misses": count("vitserve_cache_misses_total"),
                "evictions": count("vitserve_cache_evictions_total")}
