"""Work items and the image queue that every device worker takes its batches from.

One item per image of a request, in arrival order; a device worker takes a batch of items from concurrent
requests up to `max_patches`. A device with nothing in flight launches as soon as its first image is there; a busy
one waits up to `wait_s` (the batch window) after the first for more, and leaves the images to an idle device when
there is one (continuous batching: images pile up while the devices run, and the next batch takes them all). A
request's future per image is resolved on the event loop, so every request gets exactly its own images back.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ...encoder.preprocess import EncodedJpeg
from ...encoder.video_planes import SlicePlanes
from ..decoding import spool
from ..ground.metrics import Metrics


class Origin(Protocol):
    """Where items' answers go (`WorkItem.origin`): backend.Futures, or a front end's core.Link."""

    def deliver(self, results: list) -> None: ...


@dataclass
class WorkItem:
    """One image waiting for (or in) a batch."""

    image: np.ndarray | spool.Spooled | EncodedJpeg | SlicePlanes  # uint8 [H, W, 3] (resized, or full size where
    # the device resizes: --image-resize, fast preprocessing), maybe still in its spool file; a JPEG nvJPEG decodes
    # there; a video slice ([T, h, w, 3], or its frames' planes that the device converts and resizes)
    grid: tuple[int, int, int]  # (t, h, w) in patches
    future: asyncio.Future | None  # resolved on the event loop with (tokens, deepstack) or (mean vector, []); in
    # the core (several front ends), None: its answer goes back to its front end's link
    mean_pooling: bool = False  # answer with the mean of the tokens (taken on the device) instead of the tokens
    param: str = "input[0]"  # the image as its request names it, in errors
    key: bytes | None = None  # its embedding cache key: the backend's cache keeps its answer under it
    origin: Origin | None = None  # where its answer goes (`deliver`): backend.Futures, or a front end's core.Link
    id: int = -1  # between a front end and the core: the item's id in their records
    enqueued: float = field(default_factory=time.perf_counter)
    queue_s: float = 0.0
    inference_s: float = 0.0
    cancelled: bool = False  # its client went away (`ImageQueue.drop`): a batch taking it drops it
    modality: str = "image"  # or "video": a video's slice (counted apart in the metrics)
    float32: bool = False  # its tokens are answered in float32: widened on the device (runner.launch_images)

    @property
    def patches(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    def size(self, patch_size: int) -> tuple[int, int]:
        """The (height, width) in pixels it runs at."""
        return self.grid[1] * patch_size, self.grid[2] * patch_size


class ImageQueue:
    """Images waiting for a batch, shared by the device worker threads (thread-safe). Each `put` (a request's images,
    or a video's slices) is a group; batches take the groups' items round-robin, each group's in order, so a long
    video's hundreds of slices share every batch with the requests that come after it instead of going first."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self._groups: collections.deque[collections.deque[WorkItem]] = collections.deque()
        self._count = 0
        self._ready = threading.Condition()
        self._idle = 0  # takers waiting with nothing in flight on their device
        self.closed = False

    def __len__(self) -> int:
        return self._count

    def put(self, items: list[WorkItem]) -> None:
        if not items:
            return
        with self._ready:
            self._groups.append(collections.deque(items))
            self._count += len(items)
            self.metrics.queue_depth.set(self._count)
            self._ready.notify_all()

    def drop(self, items: list[WorkItem]) -> None:
        """Take a gone client's images out of the queue (those a batch has taken already run, unanswered): they are
        counted as dropped and their pixels freed now, not when a batch would have reached them."""
        for item in items:
            item.cancelled = True  # for one a batch is taking right now: dropped there
        gone = {id(item) for item in items}
        dropped = []
        with self._ready:
            groups: collections.deque[collections.deque[WorkItem]] = collections.deque()
            for group in self._groups:
                dropped += [item for item in group if id(item) in gone]
                kept = collections.deque(item for item in group if id(item) not in gone)
                if kept:
                    groups.append(kept)
            self._groups, self._count = groups, self._count - len(dropped)
            self.metrics.queue_depth.set(self._count)
        self.metrics.dropped.inc(len(dropped))
        for item in dropped:
            spool.discard(item.image)

    def _pop(self) -> WorkItem:
        """The next item: the first group's first; that group then goes last (or away, emptied)."""
        group = self._groups[0]
        item = group.popleft()
        if group:
            self._groups.rotate(-1)
        else:
            self._groups.popleft()
        self._count -= 1
        return item

    def close(self) -> None:
        """Wake every taker with None: the engine is stopping (images still queued are left)."""
        with self._ready:
            self.closed = True
            self._ready.notify_all()

    def take(self, max_patches: int, wait_s: float, block: bool) -> list[WorkItem] | None:
        """A batch: images in turn (round-robin over the groups) up to `max_patches` (the first one whatever its size;
        one that does not fit stays first in line). `block`: the taker's device has nothing in flight, so it waits
        for the first image and takes what is there at once. Otherwise [] while another device is idle (the images
        are its to take), else it waits up to `wait_s` after the first image for more. [] when there was nothing to
        take, None once closed. Images whose client left are dropped."""
        with self._ready:
            if block:
                self._idle += 1
                try:
                    while not self._groups and not self.closed:
                        self._ready.wait()
                finally:
                    self._idle -= 1
                wait_s = 0.0
            if self.closed:
                return None
            if not block and self._idle:
                return []
            batch: list[WorkItem] = []
            patches, deadline = 0, time.monotonic() + wait_s
            while True:
                while self._groups and (not batch or patches + self._groups[0][0].patches <= max_patches):
                    item = self._pop()
                    batch.append(item)
                    patches += item.patches
                if not batch or self._groups or patches >= max_patches or self.closed:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._ready.wait(remaining) and not self._groups:
                    break
            self.metrics.queue_depth.set(self._count)
        live = [item for item in batch if not item.cancelled]  # a client may have left while its batch formed
        if len(live) < len(batch):
            self.metrics.dropped.inc(len(batch) - len(live))
            for item in batch:
                if item.cancelled:
                    spool.discard(item.image)
        return live
