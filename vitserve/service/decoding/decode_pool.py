"""Decode worker processes driven from the event loop: jobs go out and results come back on the loop's own sockets.

Each worker has a socket of its own, read and written by the event loop (uvloop does the I/O in C, without giving
up the GIL); no thread of the server takes part, and an image's bytes are written as they are, not pickled (a job
that waits holds only what its caller gave: the bytes to send are made when a worker takes it), or not sent at all
where the worker can map them itself (a body in shared memory: only where it lies is sent). Each worker runs one
job at a time, so a worker that dies (a decoder crash, the OOM killer) fails only its own job (`WorkerDied`), and is
replaced at once. A job that runs past the pool's `timeout` is killed with its worker (`JobTimedOut`), and so is one
whose caller is gone (its future cancelled) and that still runs `grace` seconds later: no worker grinds on for
nobody.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import multiprocessing
import pickle
import socket
from typing import Callable, cast

from .decode import serve_jobs
from .decode_protocol import ANSWER_HEADER, Call, JobResult, job_frames

log = logging.getLogger("vitserve.decode")
_BYTES = (bytes, bytearray, memoryview)  # payloads sent as they are


class WorkerDied(Exception):
    """The worker running this job died; the others and their jobs are unaffected."""


class JobTimedOut(Exception):
    """The job ran past the time it may take (`seconds`): its worker was killed (and replaced)."""

    def __init__(self, message: str, seconds: float):
        super().__init__(message, seconds)
        self.seconds = seconds

    def __str__(self) -> str:
        return self.args[0]


class PoolUnavailable(Exception):
    """The pool cannot run jobs: it was closed, or its last worker died and none could be started in its place."""


class _Link(asyncio.Protocol):
    """The server's end of one worker's socket (decode_protocol.py: a Call and its payload out, a JobResult in)."""

    def __init__(self, pool: DecodePool, process):
        self.pool, self.process = pool, process
        self.transport: asyncio.Transport | None = None
        self.job: _Job | None = None
        self.timer: asyncio.TimerHandle | None = None  # the running job's deadline (or its grace, once cancelled)
        self.killed: str | None = None  # why the pool killed this worker
        self._buffer = bytearray()

    def connection_made(self, transport):
        self.transport = transport

    def send(self, call: bytes, payload) -> None:
        assert self.transport is not None  # (the pool takes a link once it is connected)
        self.transport.writelines(job_frames(call, payload))

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        head = ANSWER_HEADER.size
        while len(self._buffer) >= head:
            size = ANSWER_HEADER.unpack_from(self._buffer)[0]
            if len(self._buffer) < head + size:
                return
            result = pickle.loads(bytes(self._buffer[head : head + size]))
            del self._buffer[: head + size]
            self.pool._answered(self, result)

    def connection_lost(self, exc) -> None:
        self.pool._lost(self)


class _Job:
    """A submitted call: the pickled function and arguments, the payload (or what makes it, called when a worker
    takes the job), the caller's future, and what to do if its worker dies while it runs."""

    __slots__ = ("call", "payload", "future", "on_lost", "timeout")

    def __init__(
        self, call: bytes, payload, future: asyncio.Future, on_lost: Callable[[], None] | None, timeout: float | None
    ):
        self.call, self.payload, self.future, self.on_lost, self.timeout = call, payload, future, on_lost, timeout


class FairQueue:
    """Jobs waiting for a worker, taken round-robin by owner (a request): one request's many images interleave with
    the others' instead of all going first."""

    def __init__(self) -> None:
        self._by_owner: collections.OrderedDict[object, collections.deque] = collections.OrderedDict()

    def __len__(self) -> int:
        return sum(len(jobs) for jobs in self._by_owner.values())

    def __iter__(self):
        for jobs in list(self._by_owner.values()):
            yield from jobs

    def append(self, owner, job) -> None:
        self._by_owner.setdefault(owner, collections.deque()).append(job)

    def popleft(self):
        owner, jobs = next(iter(self._by_owner.items()))
        job = jobs.popleft()
        del self._by_owner[owner]
        if jobs:  # its next job waits behind every other owner's
            self._by_owner[owner] = jobs
        return job

    def clear(self) -> None:
        self._by_owner.clear()


class DecodePool:
    """`workers` processes forked from a clean fork server that has imported only `preload` (what they run: numpy and
    PIL, no torch; and SIGTERM and SIGINT left to the server): none inherits CUDA or threads. Use from one event
    loop: `start`, `submit`, `close`.
    `on_orphan(result)`: a result whose caller is gone (a spooled image's file to remove); `on_broken(reason)`: the
    last worker died and none could be started in its place. `timeout`: seconds a job may run (None: no limit);
    `grace`: seconds a cancelled job may still run before its worker is killed."""

    def __init__(
        self,
        workers: int,
        preload: str = "vitserve.service.decoding.forkserver_preload",
        on_orphan: Callable = lambda result: None,
        on_broken: Callable[[str], None] = lambda reason: None,
        timeout: float | None = None,
        grace: float = 1.0,
    ):
        self.size, self.timeout, self.grace = workers, timeout, grace
        self.on_orphan, self.on_broken = on_orphan, on_broken
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload([preload])
        self._links: set[_Link] = set()
        self._idle: collections.deque[_Link] = collections.deque()
        self._waiting = FairQueue()  # of _Job
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.replaced = 0  # workers that died and were replaced
        self.submitted = 0  # jobs submitted since the start
        self.broken: str | None = None  # why no worker is left, when none could be started again
        self._spawning: set[asyncio.Task] = set()  # replacing dead workers
        self.respawn_delays = (1.0, 4.0)  # between tries at starting a replacement

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the pool runs on (`start`'s)."""
        if self._loop is None:
            raise RuntimeError("the decode pool is not started")
        return self._loop

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.gather(*(self.start_worker() for _ in range(self.size)))

    async def start_worker(self) -> None:
        """Start one worker and put it to work."""
        ours, theirs = socket.socketpair()
        # room for a whole image in the socket (as far as the system allows): one write, not one per 200 KB
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        process = self._context.Process(target=serve_jobs, args=(theirs,), name="vitserve-decode", daemon=True)
        try:
            await self.loop.run_in_executor(None, process.start)  # the fork server's round trip, off the loop
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the worker's copy only: its death then reads as end-of-file here
        _, link = await self.loop.connect_accepted_socket(lambda: _Link(self, process), ours)
        self._links.add(link)
        if not self._closed:
            self._ready(link)

    def workers(self) -> list[tuple[multiprocessing.Process, int | None]]:
        """Each live worker's process and the payload size of the job it runs (None when idle)."""
        return [(link.process, None if link.job is None else len(link.job.payload)) for link in self._links]

    @property
    def idle(self) -> int:
        """Live workers waiting for a job."""
        return len(self._idle)

    def submit(
        self, fn, payload, *args, owner=None, on_lost: Callable[[], None] | None = None, timeout: float | None = None
    ) -> asyncio.Future:
        """Run fn(payload, *args) in a worker; the future's result is its return value, or the exception it raised as
        its ErrorRecord brings it back (`WorkerDied` if the worker died on it, `JobTimedOut` past the timeout).
        `payload`: bytes-like (sent as they are), a function that makes them when a worker takes the job, or any other
        object, pickled with the call (a description of where the worker finds the bytes itself, `len()` its size). A
        cancelled future's job is skipped, its result dropped, or its worker killed after the grace. `on_lost()` is
        called when the worker dies (or is killed) while it runs the job, whatever became of the future (what it was
        writing may be left half done). Waiting jobs go to the workers round-robin by `owner` (FairQueue). `timeout`:
        this job's limit instead of the pool's (a video's decode is longer than an image's)."""
        future = self.loop.create_future()
        self.submitted += 1
        if self._closed or self.broken:
            future.set_exception(PoolUnavailable(self.broken or "the decode pool is closed"))
            return future
        inline = not (callable(payload) or isinstance(payload, _BYTES))
        call = Call(fn, args, payload, True) if inline else Call(fn, args)
        self._waiting.append(
            owner,
            _Job(
                pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL), payload, future, on_lost, timeout or self.timeout
            ),
        )
        self._dispatch()
        return future

    def _ready(self, link: _Link) -> None:
        self._idle.append(link)
        self._dispatch()

    def _dispatch(self) -> None:
        while self._idle and self._waiting:
            job = self._waiting.popleft()
            if job.future.done():  # cancelled while it waited
                continue
            link = self._idle.popleft()
            if callable(job.payload):
                job.payload = job.payload()
            link.job = job
            link.send(job.call, job.payload if isinstance(job.payload, _BYTES) else b"")
            if job.timeout is not None:
                link.timer = self.loop.call_later(job.timeout, self._kill, link, f"its job ran past {job.timeout:g} s")
            job.future.add_done_callback(functools.partial(self._cancelled, link, job))

    def _cancelled(self, link: _Link, job: _Job, future: asyncio.Future) -> None:
        """A running job's caller is gone: its worker gets `grace` seconds to finish, then is killed."""
        if future.cancelled() and link.job is job and link.killed is None:
            if link.timer is not None:
                link.timer.cancel()
            link.timer = self.loop.call_later(
                self.grace, self._kill, link, f"its job's caller was gone for {self.grace:g} s"
            )

    def _kill(self, link: _Link, reason: str) -> None:
        """Kill a worker that holds a job too long (SIGKILL: a decoder does not stop on request); it is replaced like
        one that died, and its job fails with JobTimedOut, never retried."""
        if link.job is None or link.killed is not None:
            return
        link.killed = reason
        if not link.job.future.done():
            # killed while its future waits: past its job's own timeout (the grace is for a cancelled future)
            timeout = cast(float, link.job.timeout)
            link.job.future.set_exception(JobTimedOut(f"the decode worker was killed: {reason}", timeout))
        link.process.kill()

    def _answered(self, link: _Link, result: JobResult) -> None:
        if link.killed is not None:  # an answer sent as it was killed: not ready again
            return
        job, link.job = link.job, None
        assert job is not None  # (a worker answers the job it was given)
        if link.timer is not None:
            link.timer.cancel()
        if job.future.done():  # its request is gone: what was made is dropped
            if result.error is None:
                self.on_orphan(result.value)
        elif result.error is None:
            job.future.set_result(result.value)
        else:
            job.future.set_exception(result.error.error())
        self._ready(link)

    def _lost(self, link: _Link) -> None:
        self._links.discard(link)
        if link in self._idle:
            self._idle.remove(link)
        if link.timer is not None:
            link.timer.cancel()
        if link.job is not None and link.job.on_lost is not None:
            link.job.on_lost()
        if self._closed:
            if link.job is not None and not link.job.future.done():
                link.job.future.set_exception(PoolUnavailable("the decode pool is closed"))
        else:
            task = self.loop.create_task(self._replace(link))
            self._spawning.add(task)
            task.add_done_callback(self._replaced)

    async def _replace(self, link: _Link) -> None:
        """A worker hung up on its own: it died. Fail its job (with its exit code, which takes the fork server a
        moment to report) and start another."""
        await self.loop.run_in_executor(None, link.process.join, 5)
        reason = f"the decode worker died (exit code {link.process.exitcode})"
        if link.job is not None and not link.job.future.done():
            link.job.future.set_exception(WorkerDied(reason))
        if link.killed is not None:
            log.info("killed a decode worker: %s; starting another", link.killed)
        else:
            log.warning("%s; starting another", reason)
        self.replaced += 1
        for delay in (*self.respawn_delays, None):  # a failed start (out of memory or processes) may pass
            try:
                return await self.start_worker()
            except OSError as e:
                if delay is None or self._closed:
                    raise
                log.warning("could not start a decode worker (%s); trying again in %g s", e, delay)
                await asyncio.sleep(delay)

    def _replaced(self, task: asyncio.Task) -> None:
        self._spawning.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        log.error("could not start a decode worker: %s", task.exception())
        if not self._links and not self._spawning and not self._closed:  # the last one: jobs would wait forever
            self.broken = f"no decode worker is left, and none could be started ({task.exception()})"
            self._fail_waiting(PoolUnavailable(self.broken))
            self.on_broken(self.broken)

    def _fail_waiting(self, error: Exception) -> None:
        for job in self._waiting:
            if not job.future.done():
                job.future.set_exception(error)
        self._waiting.clear()

    async def close(self, timeout: float = 10) -> None:
        """Fail what waits or runs, hang up on every worker (each exits once its job is done) and wait for them."""
        self._closed = True
        self._fail_waiting(PoolUnavailable("the decode pool is closed"))
        await asyncio.gather(*self._spawning, return_exceptions=True)
        links = list(self._links)
        for link in links:
            assert link.transport is not None  # (connected before it was added)
            link.transport.close()
        for link in links:
            await self.loop.run_in_executor(None, link.process.join, timeout)
            if link.process.is_alive():
                link.process.kill()
