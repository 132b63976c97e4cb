"""Decoded pixels from the decode worker processes to whoever runs them, through files in RAM (a tmpfs: /dev/shm).

A decode worker writes an image's pixels to a spool file and returns only its name (a `Spooled` image): no pixels
cross a pipe, nor the server's GIL. The file stays until the one who runs the image reads it (the device's thread,
or the device's own process, so that the server's process never touches the pixels); whoever drops an image
instead (a failed sibling, a client gone) removes its file (`discard`). When the directory is missing, not
writable, or full (Docker's default /dev/shm is 64 MB), the worker returns the pixels through its socket instead:
slower, never wrong. Each server holds a lock file while it lives, so that the next server on the directory can
remove what a killed one left behind.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import glob
import mmap
import os
import queue
import re
import tempfile
import threading
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ...encoder.video_planes import SlicePlanes
from ..ground.errors import ImageLost


@dataclass
class Spooled:
    """A decoded image waiting in a spool file (written by a decode worker), until it is read or discarded: its
    pixels are the file's bytes from `offset` on (a header before them: `put_image`'s)."""

    path: str
    shape: tuple[int, ...]
    offset: int = 0

    def read(self) -> np.ndarray:
        """The pixels, mapped from the file (no copy: its pages are read where they are used, by the one copy into
        the device's pinned buffer); the file is removed, also when that fails (OSError)."""
        return mapped(self.path, self.offset + int(np.prod(self.shape)))[self.offset :].reshape(self.shape)


def pixels(images: list) -> list[np.ndarray]:
    """Decoded images as arrays: spooled ones read in (each file removed, every one of them even when a read fails,
    which is raised after), arrays as they are."""
    out, lost = [], None
    for image in images:
        try:
            if isinstance(image, SlicePlanes) and isinstance(image.rows, Spooled):
                image = dataclasses.replace(image, rows=image.rows.read())
            out.append(image.read() if isinstance(image, Spooled) else image)
        except OSError as e:
            lost = lost or e
    if lost is not None:
        raise ImageLost(f"a decoded image was lost on its way from the decode worker ({type(lost).__name__}: {lost})")
    return out


_released: queue.SimpleQueue | None = None
_released_lock = threading.RLock()  # (a finalizer may call in while the thread is being started)


def release(arrays: list) -> None:
    """Let go of a batch's decoded images (`pixels`' arrays) on this process's release thread, emptying `arrays`
    there: the last reference to a mapped spool file unmaps it and frees its pages (its file was removed when it
    was mapped), which costs more than copying them, and the thread that runs a device's batches would wait for it
    (munmap gives up the GIL). The caller holds no other reference to them (their bytes have been copied by then)."""
    _on_release_thread(arrays.clear)


def remove_when_unmapped(array: np.ndarray, path: str) -> None:
    """Remove the file at `path` once `array` (`map_file`'s) no longer maps it, on the release thread: whichever
    thread lets go of the mapping then only unmaps it, and its pages are freed there, not by an event loop that
    answered from it."""
    if array.base is None:  # (nothing mapped: no bytes)
        remove(path)
    else:  # (not at the interpreter's exit, when no thread starts: the spool is cleared then)
        weakref.finalize(array.base, _on_release_thread, functools.partial(remove, path)).atexit = False


def _on_release_thread(work) -> None:
    """`work()` on this process's release thread (started at its first use)."""
    global _released
    with _released_lock:
        if _released is None:
            released: queue.SimpleQueue = queue.SimpleQueue()
            _released = released  # set first: a call while the thread starts only queues its work
            threading.Thread(target=_let_go, args=(released,), name="vitserve-release", daemon=True).start()
    _released.put(work)


def _let_go(released: queue.SimpleQueue) -> None:
    while True:
        released.get()()


def discard(image) -> None:
    """Drop a decoded image nobody will run: a spooled one's file is removed (an array needs nothing)."""
    if isinstance(image, SlicePlanes):
        image = image.rows
    if isinstance(image, Spooled):
        remove(image.path)


_locks: dict[str, int] = {}  # prefix -> the open, locked descriptor of its lock file (held while this process lives)


def spool_prefix(directory: str | None = None) -> str | None:
    """A unique path prefix for this server's spool files, in `directory` (default: /dev/shm, else the temporary
    directory when that is a tmpfs too), or None when there is no writable one: results then go through the pipe.

    The prefix's lock file stays locked while this process lives. A server killed before it could clear its files
    (SIGKILL, the OOM killer) leaves them behind, with its lock file no longer locked: the next server starting on
    the directory removes them (in a pod, the memory-backed /dev/shm outlives a restarted container)."""
    candidates = [directory] if directory else ["/dev/shm", tempfile.gettempdir()]
    for d in candidates:
        if d and os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK) and (directory or _is_tmpfs(d)):
            sweep(d)
            prefix = os.path.join(d, f"vitserve-{os.getpid()}-{uuid.uuid4().hex[:8]}-")
            try:  # locked before it appears under its name, so that a sweep never takes a live server for dead
                fd = os.open(prefix + "lock.new", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.rename(prefix + "lock.new", prefix + "lock")
            except OSError:
                continue
            _locks[prefix] = fd
            return prefix
    return None


LOCK = re.compile(r"vitserve-\d+-[0-9a-f]{8}-lock")  # a server's lock file, as spool_prefix names it
FILE = re.compile(r"\d+(-\d+)?|dev\d+-out-\d+|body-\d+|lock(\.new)?")  # what follows a prefix in a spool file's name


def sweep(directory: str) -> None:
    """Remove the spool files of servers that are gone: those whose lock file nobody holds. Only lock files named as
    spool_prefix names them and owned by this process's user count (a shared sticky directory such as /dev/shm may
    hold anybody's files), and a held lock is never touched."""
    for name in os.listdir(directory):
        lock = os.path.join(directory, name)
        if not LOCK.fullmatch(name):
            continue
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.getuid():
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its server is alive
            continue
        else:
            clear(lock.removesuffix("lock"), own=True)
        finally:
            os.close(fd)


def _is_tmpfs(path: str) -> bool:
    """Whether `path` is on a RAM-backed file system (a spool on disk would write every image out)."""
    try:
        with open("/proc/self/mounts") as mounts:
            best = max(
                (line.split() for line in mounts if path.startswith(line.split()[1])),
                key=lambda fields: len(fields[1]),
                default=None,
            )
    except OSError:
        return False
    return best is not None and best[2] in ("tmpfs", "ramfs")


@dataclass
class Reserved:
    """A spool file being made at `path` for `nbytes` of pixels, its pages allocated (fallocate) by the decode
    worker's reserving thread while the image decodes: a new tmpfs file's page allocation is most of its write, so
    `put` then only copies. `fd`: a future of the open file, None where it could not be made."""

    path: str
    nbytes: int
    fd: Future


_reserving: ThreadPoolExecutor | None = None


def reserve(path: str, nbytes: int) -> Reserved:
    """In a worker: start making the spool file at `path` with `nbytes` allocated, on the reserving thread."""
    global _reserving
    if _reserving is None:
        _reserving = ThreadPoolExecutor(1, thread_name_prefix="vitserve-reserve")
    return Reserved(path, nbytes, _reserving.submit(_allocated, path, nbytes))


def _created(path: str) -> int | None:
    """A new file at `path`, open for writing; None where it cannot be made (the directory gone, the name taken)."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None


def _allocated(path: str, nbytes: int) -> int | None:
    if (fd := _created(path)) is None:
        return None
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:  # full (ENOSPC)
        os.close(fd)
        remove(path)
        return None
    return fd


def unreserve(reserved: Reserved | None) -> None:
    """A reservation not used (the image failed, or came out another size): its file closed and removed."""
    if reserved is not None and (fd := reserved.fd.result()) is not None:
        os.close(fd)
        remove(reserved.path)


def _opened(path: str, nbytes: int, reserved: Reserved | None) -> int | None:
    """The new file at `path` that `nbytes` are written into: the `reserved` one where it was made for them (else
    the reservation is given up), or one made now; None where none can be."""
    if reserved is not None:
        if reserved.path == path and reserved.nbytes == nbytes and (fd := reserved.fd.result()) is not None:
            return fd
        unreserve(reserved)
    return _created(path)


def put(path: str, array: np.ndarray, reserved: Reserved | None = None) -> Spooled | None:
    """In a worker: write `array` (uint8) to a new spool file at `path`, into its `reserved` pages where they were
    made for it (else the reservation is given up); None when it cannot (the caller pipes it instead)."""
    fd = _opened(path, array.nbytes, reserved)
    return Spooled(path, array.shape) if fd is not None and _written(fd, path, [array]) else None


def put_image(path: str, image: Image.Image, reserved: Reserved | None = None) -> Spooled | None:
    """In a worker: an RGB PIL image's pixels streamed into a new spool file at `path` (into its `reserved` pages
    where they were made for them), never whole in this process's memory again: Pillow's PPM writer packs and
    writes them a block at a time after its header, which the record's offset skips. Packed whole first (`np.asarray`
    of the image), they would take 3 more bytes a pixel at once, twice over while joined, pushing a worker's buffers
    out of its kept heap past ~12 MP (ground/heap.py). None when it cannot (the caller pipes them instead)."""
    if image.mode != "RGB":  # (the writer's layout, and the record's shape, are RGB's)
        raise ValueError(f"put_image takes an RGB image, not {image.mode}")
    nbytes = image.width * image.height * 3
    if (fd := _opened(path, nbytes, reserved)) is None:
        return None
    try:
        with os.fdopen(fd, "wb") as file:
            image.save(file, "PPM")  # "P6 <width> <height> 255", then the rows, packed
            size = file.tell()
    except OSError:  # full (ENOSPC): Pillow's encoder error
        remove(path)
        return None
    return Spooled(path, (image.height, image.width, 3), size - nbytes)


def write(path: str, arrays: list) -> bool:
    """Write the arrays' bytes back to back to a new file at `path`; False (and nothing left behind) when it
    cannot: the directory is gone or full (ENOSPC)."""
    fd = _created(path)
    return fd is not None and _written(fd, path, arrays)


def _written(fd: int, path: str, arrays: list) -> bool:
    """The arrays' bytes written back to back from the start of `fd` (the new file at `path`), which is closed;
    False, and the file removed, where a write fails."""
    try:
        for array in arrays:
            # (numpy types its buffer protocol for Python 3.12+ only)
            view, done = memoryview(np.ascontiguousarray(array)).cast("B"), 0  # type: ignore[arg-type]
            while done < len(view):
                done += os.write(fd, view[done:])
    except OSError:
        os.close(fd)
        remove(path)
        return False
    os.close(fd)
    return True


def map_file(path: str, nbytes: int, private: bool = False) -> np.ndarray:
    """The first `nbytes` bytes of the file at `path` (uint8), mapped read-only or, `private`, copy-on-write (writes
    stay in this process; the tensors made over an answer are writable); OSError when it is gone or short."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise OSError(f"spool file {path} is short: {size} of {nbytes} bytes")
        if nbytes == 0:
            return np.empty(0, np.uint8)
        if private:
            pages = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        else:
            pages = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        return np.frombuffer(pages, np.uint8)
    finally:
        os.close(fd)


def mapped(path: str, nbytes: int) -> np.ndarray:
    """The `nbytes` bytes of the file at `path` (uint8), mapped read-only; the file is removed (the mapping keeps its
    pages while it lives), also when mapping fails (OSError: gone, or short)."""
    try:
        return map_file(path, nbytes)
    finally:
        remove(path)


def clear(prefix: str | None, own: bool = False) -> None:
    """Remove the leftover spool files of a prefix (at shutdown: images still queued, a device process's last), and
    with this process's own prefix, its lock. `own` (a dead server's): only files named as servers name them and
    owned by this process's user."""
    if prefix:
        for path in glob.glob(glob.escape(prefix) + "*"):
            try:
                if own and (not FILE.fullmatch(path[len(prefix) :]) or os.lstat(path).st_uid != os.getuid()):
                    continue
            except OSError:
                continue
            remove(path)
        if prefix in _locks:
            os.close(_locks.pop(prefix))


def remove(path: str) -> None:
    """Remove a file if it is there; a file that cannot be removed (another user's, a read-only mount) stays."""
    try:
        os.unlink(path)
    except OSError:
        pass
