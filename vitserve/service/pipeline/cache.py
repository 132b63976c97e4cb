"""The embedding cache: an image that comes again (every turn of a multi-turn chat) is answered without decoding it
or touching the device.

The key is a SHA-256 digest (server CPUs compute it in hardware) of the image as sent (the base64 text, or the bytes
of a file part or a fetched URL: their length, then the digest of each `PIECE_BYTES` piece, the pieces hashed side by
side on the key threads, so that a 6 MB body costs one piece's time where there are cores for its pieces), told
apart by how it was sent (base64 text sent as a file is not an image, whatever the same text sent as base64 is), and
of everything that changes the devices' answer for it: the model, the resize bounds, whether the tokens or their
mean are wanted, and whether the tokens are widened to float32 on the device (WorkItem.float32, asked by a float32
request). An entry holds the devices' answer as it came, so a hit is its bytes sent as they lie in the wanted dtype,
with no conversion: a client that asks in float32 and one that asks in the tower's dtype each have their own entry.
Other dtypes (float16 from a bfloat16 tower) and the layouts are applied after the cache.

`Cache` is an LRU bounded in bytes (`--cache-bytes`, 0: off) over entries that have `nbytes` and `discard()`: an
image's `Features` (encoder/features.py: tensors in this process's memory, with the grid) where the devices answer
in this process, a device process's `Output` record (its spool file, which a front end maps) in the core of a server
with several front ends. Only successful
encodings are stored. Identical images in flight at once are computed once (single flight): the first lookup claims
the key, the later ones register a waiter (a callback: an asyncio future's, or a front end's link record) that the
claim's end calls with the entry, or None when it was not stored (the waiter then computes it itself).

A video's slices are entries of their own, each under its video's key (its bytes as sent, the model, its
preprocessing settings: sampling, sizes, normalization) and its place: a video sent again is answered from its
slices without decoding (pipeline/videos.py). A slice's entry is its tokens whatever the request pools (the pooled
mean is taken over the joined slices), so the key leaves pooling out.

A hit answers at once, which tells a client that an image was sent before. `--cache-scope api-key` keys every entry
by the client's API key too: a client learns only of its own images.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from ...encoder.media import MediaBytes
from ...encoder.preprocess import PreprocessConfig
from ...encoder.video import VideoConfig
from ...encoder.vision_encoder import DTYPES
from ..ground.metrics import Metrics

if TYPE_CHECKING:
    from ...encoder.features import Features
    from ..devices.device_protocol import Output

WAIT = "wait"  # a lookup's answer for a key another caller computes: its waiter is called when that one ends
Waiter = Callable[["Features | Output | None"], None]  # called with the entry, or None
PIECE_BYTES = 512 * 2**10  # an item's bytes are hashed in pieces of this size, side by side where there are several
_pieces_pool: ThreadPoolExecutor | None = None
_pieces_lock = threading.Lock()


def pieces_pool() -> ThreadPoolExecutor:
    """The threads that hash pieces (one per CPU this process may use; hashlib lets go of the GIL while it hashes).
    Only pieces run there, and they wait for nothing, so a request's job that waits for its pieces never starves."""
    global _pieces_pool
    with _pieces_lock:
        if _pieces_pool is None:
            _pieces_pool = ThreadPoolExecutor(len(os.sched_getaffinity(0)), thread_name_prefix="vitserve-hash")
        return _pieces_pool


def _piece_digest(piece) -> bytes:
    return hashlib.sha256(piece).digest()


def pieces_digests(items: list) -> list[list[bytes]]:
    """Per item (bytes-like), the SHA-256 digest of each PIECE_BYTES piece in order (one, empty, for no bytes); the
    pieces of all the items hashed side by side when there are several."""
    views = [memoryview(item).cast("B") for item in items]
    pieces = [[v[at : at + PIECE_BYTES] for at in range(0, max(len(v), 1), PIECE_BYTES)] for v in views]
    flat = [p for item in pieces for p in item]
    digests = iter(list(pieces_pool().map(_piece_digest, flat)) if len(flat) > 1 else map(_piece_digest, flat))
    return [[next(digests) for _ in item] for item in pieces]


class CacheKeys:
    """The cache key of an image of a request (see the module docstring)."""

    def __init__(self, model: str, per_client: bool = False, dtype: str = "bfloat16"):
        """`dtype`: the tower's. Where it is narrower than float32, a float32 request's answer is another (its tokens
        widened on the device); a float32 tower's answer is the same for every request."""
        self.model, self.per_client, self.widens = model, per_client, DTYPES[dtype] != torch.float32

    async def keys(
        self, images: list, cfg: PreprocessConfig, mean_pooling: bool, client: int | None = None, float32: bool = False
    ) -> list[bytes]:
        """`key` of each image, all of them in one go in a thread (hashlib lets go of the GIL while it hashes): no
        byte of an image is hashed on the event loop."""
        settings = self._settings(cfg, mean_pooling, float32)
        return await asyncio.get_running_loop().run_in_executor(None, lambda: self._digests(images, settings, client))

    def key(
        self, data, cfg: PreprocessConfig, mean_pooling: bool, client: int | None = None, float32: bool = False
    ) -> bytes:
        """`client`: the API key the request came with (its index), which scopes the entry when per_client;
        `float32`: the tokens widened on the device (a pooled mean is one answer whatever the request's dtype)."""
        return self._digests([data], self._settings(cfg, mean_pooling, float32), client)[0]

    def _settings(self, cfg: PreprocessConfig, mean_pooling: bool, float32: bool) -> str:
        widened = float32 and self.widens and not mean_pooling
        return f"{cfg.min_pixels}\0{cfg.max_pixels}\0{int(mean_pooling)}\0{int(widened)}"

    async def video_keys(self, videos: list, cfg: VideoConfig, client: int | None = None) -> list[bytes]:
        """Each video's key (its bytes, the model, every sampling and size setting, the client where per client),
        hashed in a thread; its slices' keys are `slice_keys` of it."""
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: self._digests(videos, f"video\0{cfg!r}", client)
        )

    def slice_keys(self, video_key: bytes, slices: int, float32: bool = False) -> list[bytes]:
        """The keys of a video's slices: its key, each place, and whether the slice's tokens are widened to float32
        on the device (the video's key alone also keys its plan, which no dtype changes)."""
        return [video_key + j.to_bytes(4, "big") + bytes([float32 and self.widens]) for j in range(slices)]

    def _digests(self, items: list, settings: str, client: int | None) -> list[bytes]:
        """Each item's key: SHA-256 of its length (8 bytes), its pieces' digests, how it was sent, the model, the
        settings and the client where per client (a layout of fixed-size fields up to the text, so no two items'
        share one)."""
        media = [MediaBytes.of(data) for data in items]
        keyed = [m.keyed() for m in media]
        keys = []
        for m, data, digests in zip(media, keyed, pieces_digests(keyed)):
            digest = hashlib.sha256(len(memoryview(data).cast("B")).to_bytes(8, "big"))
            for piece in digests:
                digest.update(piece)
            digest.update(
                f"\0{'base64' if m.base64 else 'bytes'}\0{self.model}\0{settings}\0"
                f"{client if self.per_client else ''}".encode()
            )
            keys.append(digest.digest())
        return keys


class VideoPlans:
    """The header plans (encoder.video.VideoPlan) of the videos last seen, by video key (CacheKeys.video_keys), at
    most `limit`: a video sent again (every turn of a chat) is looked up in the cache without a decode worker
    reading its header again, whichever front end it reaches (the backend holds them: the core's, with several).
    A plan depends only on what its key holds and on the server's fixed limits."""

    def __init__(self, limit: int = 1024):
        self.limit, self.plans = limit, collections.OrderedDict[bytes, object]()
        self.lock = threading.Lock()  # (the core's front end links each read on a thread of their own)

    def get_all(self, keys: list[bytes]) -> list:
        """Per key its plan, or None."""
        with self.lock:
            plans = [self.plans.get(key) for key in keys]
            for key, plan in zip(keys, plans):
                if plan is not None:
                    self.plans.move_to_end(key)
        return plans

    def put_all(self, keys: list[bytes], plans: list) -> None:
        with self.lock:
            for key, plan in zip(keys, plans):
                self.plans[key] = plan
                self.plans.move_to_end(key)
            while len(self.plans) > self.limit:
                self.plans.popitem(last=False)


class Cache:
    """Entries by key, least recently used first, and the claims on keys being computed. Thread-safe: waiters are
    called after the lock is let go (a link's send may wait for a full pipe)."""

    def __init__(self, limit: int, metrics: Metrics):
        self.limit, self.metrics, self.bytes = limit, metrics, 0
        self.entries: collections.OrderedDict[bytes, Features | Output] = collections.OrderedDict()
        # told the keys of the entries each store evicted (their files removed), after the lock is let go
        self.evicted: Callable[[list[bytes]], None] = lambda keys: None
        self.claims: dict[bytes, list[Waiter]] = {}  # key being computed -> its waiters
        self.owners: dict[bytes, object] = {}  # key being computed -> who computes it
        self.lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def lookup(self, keys: list[bytes], owner: object, waiter: Callable[[int], Waiter]) -> list:
        """Per key: its entry (a hit), WAIT (another computes it: `waiter(i)` is registered), or None (a miss, now
        claimed by `owner`, who ends the claim with `settle` or `release`)."""
        answers = []
        with self.lock:
            for i, key in enumerate(keys):
                if (entry := self._get(key)) is not None:
                    answers.append(entry)
                elif key in self.claims:
                    self.claims[key].append(waiter(i))
                    answers.append(WAIT)
                else:
                    self.claims[key], self.owners[key] = [], owner
                    answers.append(None)
        return answers

    def get(self, key: bytes):
        with self.lock:
            return self._get(key)

    def touch(self, keys: list[bytes]) -> None:
        """Count hits answered elsewhere (a front end's known entries): each held key becomes the most recently
        used."""
        with self.lock:
            for key in keys:
                self._get(key)

    def _get(self, key: bytes):
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def settle(self, key: bytes, entry) -> bool:
        """A claim ends with `entry` (None: its computation failed): stored where it fits, and its waiters are
        called with it (with None where it was not stored). False: not stored (the caller keeps the entry)."""
        with self.lock:
            evicted = self._put(key, entry) if entry is not None else None
            waiters = self._unclaim(key)
        if evicted:
            self.evicted(evicted)
        for waiter in waiters:
            waiter(entry if evicted is not None else None)
        return evicted is not None

    def release(self, keys: list[bytes] | None = None, owner: object = None) -> None:
        """Claims let go unanswered (`keys`, or every one of `owner`): their waiters compute it themselves."""
        with self.lock:
            if keys is None:
                keys = [key for key, held in self.owners.items() if held is owner]
            waiters = [w for key in keys for w in self._unclaim(key)]
        for waiter in waiters:
            waiter(None)

    def _unclaim(self, key: bytes) -> list[Waiter]:
        self.owners.pop(key, None)
        return self.claims.pop(key, [])

    def put(self, key: bytes, entry) -> bool:
        with self.lock:
            evicted = self._put(key, entry)
        if evicted:
            self.evicted(evicted)
        return evicted is not None

    def _put(self, key: bytes, entry) -> list[bytes] | None:
        """Keep `entry`: the keys it evicted (None: not kept, too large or held already)."""
        size = entry.nbytes
        if size > self.limit or key in self.entries:
            return None
        evicted = []
        while self.bytes + size > self.limit:
            old, entry_out = self.entries.popitem(last=False)
            self.bytes -= entry_out.nbytes
            entry_out.discard()  # a front end that mapped its file keeps its pages until it hears (`evicted`)
            evicted.append(old)
            self.metrics.cache_evictions.inc()
        self.entries[key] = entry
        self.bytes += size
        self.metrics.cache_bytes.set(self.bytes)
        self.metrics.cache_entries.set(len(self.entries))
        return evicted

    def clear(self) -> None:
        with self.lock:
            for entry in self.entries.values():
                entry.discard()
            self.entries.clear()

    def stats(self) -> dict:
        """Its figures for /stats (the hits and misses are counted where the lookups are: the front ends)."""
        evictions = self.metrics.registry.get_sample_value("vitserve_cache_evictions_total") or 0
        with self.lock:
            return {
                "enabled": self.enabled,
                "limit_bytes": self.limit,
                "bytes": self.bytes,
                "entries": len(self.entries),
                "evictions": int(evictions),
            }
