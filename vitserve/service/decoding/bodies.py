"""Large request bodies in shared memory: read once by the server, read in place by the decode workers.

A JSON body of at least `SHARED` bytes (declared length) is read into a file of the spool directory (a tmpfs:
`/dev/shm`) mapped into the server; an image of it reaches its decode worker as (file, offset, length), never as
bytes over the worker's socket: the body's one copy is the one from the HTTP layer into the mapping, and the worker
decodes the base64 straight from the file's pages.

What costs is the memory, not the copy: a page touched for the first time takes the kernel a fault and a zeroing
(about 1 ms a MB, on the event loop, where it is written). So the files are kept and used again: a body takes an
idle file at least its size (else one is made and its pages allocated), mapped with its page tables filled
(MAP_POPULATE), both in a thread; the event loop only copies the body in. When the request ends (`release`, called
whatever its outcome) the mapping is closed in a thread and the file goes back to the idle ones, unless a view of the
mapping is still alive somewhere (an exception's traceback, a hash still running in a thread): then the file is
removed instead, never used again while anybody may read it, and its memory goes with the last view. A decode
worker that still reads a file when it is used again (its request gone, its result to be dropped) reads another
body: what it makes is dropped all the same.

Idle files beyond `idle_bytes` are removed, the oldest first. The files are named `<prefix>body-<n>`: a killed
server's are removed by the next server's sweep, like its spool files (spool.py). Where a file cannot be made (the
directory full: Docker's default /dev/shm is 64 MB), the body goes into an anonymous mapping, whose images go to the
workers over their sockets (slower, same answers).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import mmap
import os
import threading

SHARED = 2**20  # bytes of a declared body from which it is read into a mapping (shared where it can be)
GRAIN = 2**20  # a body file's size is a multiple of this
IDLE_BYTES = 64 * 2**20  # of body files kept for the next bodies


class Body:
    """A request's body buffer: `buffer` (an mmap of at least `size` bytes), and `path`, the file it lies in where the
    decode workers can read it (None: an anonymous mapping, private to the server)."""

    __slots__ = ("buffer", "path", "capacity", "_owner")

    def __init__(self, buffer: mmap.mmap, path: str | None, capacity: int, owner: "SharedBodies | None"):
        self.buffer: mmap.mmap | None = buffer  # None once released
        self.path, self.capacity, self._owner = path, capacity, owner

    def release(self) -> None:
        """The request is over: its file goes back to the idle ones (or is removed, see the module), its mapping is
        closed in a thread. Idempotent."""
        owner, self._owner = self._owner, None
        buffer, self.buffer = self.buffer, None
        if owner is not None and buffer is not None and self.path is not None:  # (an owner's body has its file)
            owner._release(self.path, self.capacity, buffer)


def _populated(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)


def anonymous(size: int) -> mmap.mmap:
    """A private mapping of `size` bytes with its pages allocated (run it in a thread: the kernel zeroes them)."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)


class SharedBodies:
    """The body files of one server, under its spool prefix (`<prefix>body-<n>`). Use from one event loop (`take`,
    and `Body.release`)."""

    def __init__(self, prefix: str, idle_bytes: int = IDLE_BYTES):
        self.prefix, self.idle_bytes = prefix, idle_bytes
        self._idle: collections.OrderedDict[str, int] = collections.OrderedDict()  # path -> capacity, oldest first
        self._lock = threading.Lock()
        self._names = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.made = 0  # files made since the start

    async def take(self, size: int) -> Body:
        """A buffer for a body of `size` bytes: an idle file (at most twice the size), else a new one, else an
        anonymous mapping; its pages allocated and mapped in a thread."""
        self._loop = loop = asyncio.get_running_loop()
        with self._lock:
            path = next((p for p, capacity in self._idle.items() if size <= capacity <= 2 * size + GRAIN), None)
            capacity = self._idle.pop(path) if path is not None else -(-size // GRAIN) * GRAIN
        mapping = loop.run_in_executor(None, self._map, path, capacity)
        try:
            buffer, path = await asyncio.shield(mapping)
        except OSError:  # no room in the directory (or it is gone): a private mapping
            return Body(await loop.run_in_executor(None, anonymous, size), None, size, None)
        except asyncio.CancelledError:  # the request is gone: the file goes back once mapped

            def give_back(done: asyncio.Future) -> None:
                if not (done.cancelled() or done.exception()):
                    self._release(done.result()[1], capacity, done.result()[0])

            mapping.add_done_callback(give_back)
            raise
        return Body(buffer, path, capacity, self)

    def _map(self, path: str | None, capacity: int) -> tuple[mmap.mmap, str]:
        """In a thread: map an idle file, or make one of `capacity` bytes (its pages allocated: ENOSPC here, not a
        SIGBUS when written)."""
        if path is not None:
            fd = os.open(path, os.O_RDWR)
        else:
            path = f"{self.prefix}body-{next(self._names)}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, capacity)
            except OSError:
                os.close(fd)
                _unlink(path)
                raise
            self.made += 1
        try:
            return _populated(fd, capacity), path
        except OSError:
            _unlink(path)
            raise
        finally:
            os.close(fd)

    def _release(self, path: str, capacity: int, buffer: mmap.mmap) -> None:
        def close():
            try:
                buffer.close()
            except BufferError:  # a view of it lives on: the file is never used again
                _unlink(path)
                return
            with self._lock:
                self._idle[path] = capacity
                while sum(self._idle.values()) > self.idle_bytes:
                    _unlink(self._idle.popitem(last=False)[0])

        if self._loop is not None and not self._loop.is_closed():
            self._loop.run_in_executor(None, close)
        else:
            close()

    def clear(self) -> None:
        """Remove the idle files (at shutdown; the spool's clear removes every file of the prefix too)."""
        with self._lock:
            while self._idle:
                _unlink(self._idle.popitem()[0])


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
