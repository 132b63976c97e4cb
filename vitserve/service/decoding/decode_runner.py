"""Where a request's decodes run: `--decode-workers` worker processes (a DecodePool; `--decode-processes
false`: threads), the spool they write pixels to, and the body files they read images from (bodies.py).

A job runs `fn(payload, is_base64, *args)` there: the payload is what `MediaBytes.payload` makes of the item (where
its base64 lies in its request's body file, else its bytes, made only when a worker takes the job). A worker that
dies on a job (a decoder crash, the OOM killer) fails only that job, which is tried once more (`tried_twice`); a job
past its timeout is refused (JobTimedOut) and its worker killed and replaced; so is the worker of a job whose
request is gone, a second after. (In threads, nothing can be killed: the request gets JobTimedOut at the limit, and
the thread finishes the job for nobody.) A request's decodes run side by side (`run_all`): the first failure is the
request's rejection (rejection.py), the others dropped and what they decoded discarded."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import pybase64

from ...encoder.media import MediaBytes
from ..ground.settings_media import DecodingSettings
from . import spool
from .bodies import SharedBodies
from .decode import DecodedImage, DecodedVideo
from .decode_pool import DecodePool, JobTimedOut, WorkerDied
from .rejection import rejection

log = logging.getLogger("vitserve.decoder")


def discard_decoded(result) -> None:
    """A decoded image or video nobody will run: its spooled pixels go (a header's answer holds none)."""
    if isinstance(result, DecodedVideo):
        for piece in result.slices:
            spool.discard(piece)
    elif isinstance(result, DecodedImage):
        spool.discard(result.image)


def discard_result(job: asyncio.Future) -> None:
    """For an image's or a video's decode whose request is gone: what it spooled has nobody to read it."""
    if job.done() and not job.cancelled() and job.exception() is None:
        discard_decoded(job.result())


class DecodeRunner:
    """The decode workers (processes, else threads), this server's spool prefix and its body files.
    `on_broken(reason)` is called on the event loop when the last worker is gone and none can be started."""

    def __init__(self, decoding: DecodingSettings, on_broken: Callable[[str], None]):
        self.decoding = decoding
        self.workers = workers = decoding.worker_count()
        self.pool: DecodePool | None = None
        self.threads: ThreadPoolExecutor | None = None
        if decoding.decode_processes:
            self.pool = DecodePool(
                workers, on_orphan=discard_decoded, on_broken=on_broken, timeout=decoding.decode_timeout
            )
        else:
            self.threads = ThreadPoolExecutor(workers, thread_name_prefix="vitserve-decode")
        self.spool_prefix: str | None = None
        if decoding.decode_processes and decoding.spool_dir != "none":
            self.spool_prefix = spool.spool_prefix(decoding.spool_dir)
            if self.spool_prefix is None:
                log.warning(
                    "no usable spool directory (%s): decoded images cross through a pipe, which costs the "
                    "server about 2 ms of CPU per megabyte",
                    decoding.spool_dir or "/dev/shm",
                )
        if "C extension active" not in pybase64.get_version():  # its pure-Python fallback is the standard library's
            log.warning(
                "pybase64 runs without its C extension (%s): base64 decodes at a quarter of the speed",
                pybase64.get_version(),
            )
        # large request bodies in files of the spool, which the workers read in place (bodies.py)
        self.bodies = SharedBodies(self.spool_prefix) if self.spool_prefix else None

    @property
    def workers_replaced(self) -> int:
        return self.pool.replaced if self.pool else 0

    async def start(self) -> None:
        if self.pool:
            await self.pool.start()

    async def close(self) -> None:
        if self.pool:
            await self.pool.close()
        elif self.threads is not None:  # (no pool: the threads decode)
            self.threads.shutdown(wait=False, cancel_futures=True)
        if self.bodies:
            self.bodies.clear()
        spool.clear(self.spool_prefix)

    def abandon(self) -> None:
        """A forced exit: remove the spool files without waiting for anyone (the processes are killed by then)."""
        spool.clear(self.spool_prefix)

    async def run_all(self, decodes: list, field: str, names: list[int], kind: str = "image") -> list:
        """Run a request's decodes concurrently; their results in order, or at the first failure the request's
        rejection (naming `field[i]`, i from `names`; where several have failed by then, the first in the request's
        order): the decodes still running are dropped and what the others decoded discarded, as it is not run. The
        error goes on once the dropped decodes have unwound (a cancelled decode stops at its next await), so their
        memory and work are back in the server's budgets by then."""
        jobs = [asyncio.ensure_future(decode) for decode in decodes]
        try:
            await asyncio.wait(jobs, return_when=asyncio.FIRST_EXCEPTION)
            failed = next(
                ((i, job.exception()) for i, job in zip(names, jobs) if job.done() and job.exception() is not None),
                None,
            )
            if failed is not None:
                raise rejection(f"{field}[{failed[0]}]", failed[1], kind=kind) from None
        except BaseException:  # one failed, or the request was cancelled: what was decoded goes, the rest is dropped
            for job in jobs:
                job.cancel()
                job.add_done_callback(discard_result)
            if jobs:
                await asyncio.wait(jobs)
            raise
        return [job.result() for job in jobs]

    @staticmethod
    async def tried_twice(run):
        """`run()`, a job of a decode worker, once more where its worker died (the OOM killer, a crash): an item under
        which two die is the one that kills them (WorkerDied)."""
        try:
            return await run()
        except WorkerDied:
            return await run()

    async def run(
        self,
        fn,
        data,
        owner,
        *args,
        end: int | None = None,
        timeout: float | None = None,
        lost: Callable[[], None] | None = None,
    ):
        """fn(payload, is_base64, *args) in a decode worker (or thread), under the decode timeout. The payload is
        `MediaBytes.payload`'s of `data` up to its `end`: where its base64 lies in its request's body file (the
        worker reads it there, nothing is sent), else its bytes (its base64 as ASCII bytes: a str pickles at twice
        the server's CPU), made only when a worker takes the job; `lost()`: removes what the job writes to the
        spool, called if its worker dies; `timeout`: the job's limit instead of `--decode-timeout`."""
        media = MediaBytes.of(data)
        payload = media.payload(end, in_file=self.pool is not None)
        if self.pool is None:
            return await self._in_thread(
                lambda: fn(payload() if callable(payload) else payload, media.base64, *args), timeout
            )
        job = self.pool.submit(fn, payload, media.base64, *args, owner=owner, timeout=timeout, on_lost=lost)
        try:
            return await job
        except asyncio.CancelledError:  # the request is gone: the pool drops a result still to come, this one here
            discard_result(job)
            raise

    async def _in_thread(self, run, timeout: float | None = None):
        """run() on a decode thread; past the decode timeout (counted from when a thread takes it) JobTimedOut, while
        the thread, which cannot be stopped, finishes it for nobody."""
        loop, timeout = asyncio.get_running_loop(), timeout or self.decoding.decode_timeout
        expired, timer = loop.create_future(), []

        def arm():
            if not job.done():
                timer.append(loop.call_later(timeout, lambda: expired.done() or expired.set_result(None)))

        def started():
            loop.call_soon_threadsafe(arm)
            return run()

        job = loop.run_in_executor(self.threads, started)
        try:
            await asyncio.wait((job, expired), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            job.cancel()
            raise
        finally:
            for handle in timer:
                handle.cancel()
        if not job.done():
            job.add_done_callback(lambda job: job.cancelled() or job.exception())
            raise JobTimedOut(f"the decode thread ran past {timeout:g} s (it goes on)", timeout)
        return job.result()
