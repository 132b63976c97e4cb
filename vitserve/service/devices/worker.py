"""A device worker: the one thread per device that takes batches from the image queue and keeps the device fed.

The thread takes a batch whenever its device has fewer than `device.depth` batches in flight, and launches it
(planning, pinned copies, replays: all enqueued without waiting) behind the ones still running; then it collects
the oldest, which waits for it to land. Host work overlaps device work, and the device waits for neither planning
nor the event loop. With nothing queued it waits for the batches in flight, answers them, and waits for images.
Two batches in flight per device: while both run, images pile up and the next batch is bigger.

A device is anything with `launch(batch) -> handle`, `collect(handle) -> outputs` (an image the device could not
decode has its ImageError in its place: only its request fails), `runner_stats()`, `depth`,
`name`, `bind_thread()` and `close()`: `LocalDevice` here (an encoder in this process) or
`device_process.ProcessDevice` (a process of its own). The worker reports every batch's outcome to its `on_done`
callback; it knows nothing of the engine.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

import torch

from ..decoding import spool
from ..ground.errors import EngineError, ImageLost, InferenceFailed, OutOfMemory
from ..ground.timeline import mark
from .scheduler import ImageQueue, WorkItem

log = logging.getLogger("vitserve.worker")

BATCHES_IN_FLIGHT = 2  # per device: one running, the next launched behind it
STOP = object()  # what `take` returns for `pipeline` to end


def pipeline(take: Callable, launch: Callable, finish: Callable, depth: int) -> None:
    """Keep up to `depth` launched batches in flight, finishing them in launch order.

    `take(block)`: the next batch, None when nothing waits (only when not `block`), STOP to end; it blocks only when
    nothing is in flight. `launch(batch)`: starts it and returns a handle, or None when it failed and was answered.
    `finish(batch, handle)`: waits for it and answers it. Batches still in flight are finished on the way out."""
    pending: collections.deque = collections.deque()
    try:
        while True:
            if len(pending) < depth:
                batch = take(not pending)
                if batch is STOP:
                    return
                if batch is not None:
                    handle = launch(batch)
                    if handle is not None:
                        pending.append((batch, handle))
                    continue
                if not pending:
                    continue
            finish(*pending.popleft())
    finally:
        while pending:
            finish(*pending.popleft())


def launch_decoded(encoder, images: list, sizes: list, mean_pooling: list, float32: list):
    """`encoder.launch` of a batch's decoded images, those in spool files read there, and all let go once it has
    copied them, on another thread (spool.release: freeing a mapped file's pages costs the batch's thread more than
    its copy), also when it fails."""
    pixels: list = []
    try:
        pixels = spool.pixels(images)
        mark("device read")
        return encoder.launch(pixels, sizes, mean_pooling, float32)
    finally:
        spool.release(pixels)


class LocalDevice:
    """A device run by this process: the encoder's graph runner."""

    depth = BATCHES_IN_FLIGHT

    def __init__(self, encoder):
        self.encoder, self.name = encoder, str(encoder.device)

    def bind_thread(self) -> None:
        if self.encoder.device.type == "cuda":
            torch.cuda.set_device(self.encoder.device)

    def launch(self, batch: list[WorkItem]):
        p = self.encoder.config.patch_size
        return launch_decoded(
            self.encoder,
            [i.image for i in batch],
            [i.size(p) for i in batch],
            [i.mean_pooling for i in batch],
            [i.float32 for i in batch],
        )

    def collect(self, launch) -> list:
        return self.encoder.outputs(launch)

    def runner_stats(self) -> dict:
        return self.encoder.runner.stats.as_dict()

    def close(self, timeout: float = 30) -> None:
        pass


def batch_error(e: Exception, batch: list[WorkItem]) -> EngineError:
    """What the requests of a failed batch are told."""
    if isinstance(e, EngineError):
        return e
    if isinstance(e, torch.OutOfMemoryError):
        log.warning("OOM on a batch of %d images: %s", len(batch), e)
        return OutOfMemory(
            f"the device ran out of memory for this batch ({sum(i.patches for i in batch)} patches); "
            "retry with fewer or smaller images"
        )
    if isinstance(e, ImageLost):
        log.error("batch of %d images failed: %s", len(batch), e)
        return InferenceFailed(str(e), "internal_error")
    log.error("batch of %d images failed", len(batch), exc_info=e)  # only its own requests fail
    return InferenceFailed("inference failed for this batch; the server's log has the cause")


class DeviceWorker:
    """One device and the thread that runs its batches. `on_done(worker, batch, outputs, error, seconds)` is called
    from that thread once per batch, with the outputs in batch order or the error its requests get."""

    def __init__(self, device, queue: ImageQueue, max_patches: int, wait_s: float, on_done: Callable):
        self.device, self.queue, self.max_patches, self.wait_s, self.on_done = (
            device,
            queue,
            max_patches,
            wait_s,
            on_done,
        )
        self.name = device.name
        self.in_flight = self.batches = self.images = 0
        self.thread = threading.Thread(target=self._loop, name=f"vitserve-{self.name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _loop(self) -> None:
        self.device.bind_thread()
        pipeline(self._take, self._launch, self._finish, self.device.depth)

    def _take(self, block: bool):
        batch = self.queue.take(self.max_patches, self.wait_s, block)
        return STOP if batch is None else batch or None

    def _launch(self, batch: list[WorkItem]):
        start = time.perf_counter()
        for item in batch:
            item.queue_s = start - item.enqueued
        try:
            handle = self.device.launch(batch)
        except Exception as e:
            self.on_done(self, batch, None, batch_error(e, batch), 0.0)
            return None
        self.in_flight += 1
        return start, handle

    def _finish(self, batch: list[WorkItem], launched) -> None:
        start, handle = launched
        try:
            outputs = self.device.collect(handle)
        except Exception as e:
            self.in_flight -= 1
            self.on_done(self, batch, None, batch_error(e, batch), 0.0)
            return
        self.in_flight -= 1
        self.batches += 1
        self.images += len(batch)
        self.on_done(self, batch, outputs, None, time.perf_counter() - start)

    def stats(self) -> dict:
        return {
            "batches": self.batches,
            "images": self.images,
            "batches_in_flight": self.in_flight,
            "runner": self.device.runner_stats(),
        }


def workers_stats(workers: list[DeviceWorker]) -> tuple[dict, list[dict]]:
    """/stats' `devices` (each worker's counts and its runner's, with only the budgets captured or used: none on a
    CPU), and the runners' stats in worker order."""
    runners, devices = [w.device.runner_stats() for w in workers], {}
    for worker, runner in zip(workers, runners):
        budgets = {b: v for b, v in runner.get("budgets", {}).items() if v["captured"] or v["replays"]}
        devices[worker.name] = worker.stats() | {"runner": runner | {"budgets": budgets}}
    return devices, runners
