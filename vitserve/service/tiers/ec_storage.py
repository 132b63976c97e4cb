"""Encoder outputs as vLLM's ECExampleConnector reads them: `<directory>/<identifier>/encoder_cache.safetensors`,
one tensor `ec_cache`, the item's encoder output in the consumer's dtype (`--ec-shared-storage`; docs/llm.md).

* layout: what vLLM's Qwen2-VL, Qwen2.5-VL and Qwen3-VL models keep in their encoder cache for one item, image or
  video: its merged tokens `[t·h·w / 4, width]` in raster order (a video's slices one after another), and for Qwen3-VL
  the deepstack features after the tokens on the width (`cat([tokens, ds0, ds1, ds2], -1)`).
* atomic: the file is written under a temporary name in the directory and linked into its item's folder, so a
  consumer, which takes a file's existence as its readiness, never reads half of one; a link never replaces a file,
  so an identifier's file is its first write's until it is evicted.
* bounded: the files' bytes and the writes' in flight stay within `max_bytes`; the least recently written files go
  first (a consumer's reads are not seen here; an item written again counts as new), and a write waits where only
  writes in flight hold the room. Files already in the directory at start count, oldest first.
* confined: the directory is held open and the items' folders are reached through it without following links; only
  folders and files this server's user owns are written into, counted or removed.
* permissions: files get `file_mode`, folders the same with search (x) wherever it can be read.
* fast: the rows are written straight from the tensors' memory (gathered writes of `Features.rows`, each row its
  parts' pieces in the packed order, so nothing is concatenated first), split over `writers` threads that write
  their parts of the file side by side (the kernel copies; the GIL is released).
"""

from __future__ import annotations

import builtins
import logging
import os
import secrets
import stat
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ...encoder.features import Features, Rows
from ..api.outputs import SAFETENSORS_DTYPES, safetensors_header

FILE_NAME = "encoder_cache.safetensors"
TENSOR_NAME = "ec_cache"
IOV_MAX = 1024  # buffers per gathered write (Linux's limit)
log = logging.getLogger("vitserve.ec")


def _write_rows(fd: int, rows: Rows, first: int, last: int, offset: int) -> None:
    """Rows first..last-1 of an item, at `offset` in the file."""
    pieces = rows.pieces(first, last)
    for k in range(0, len(pieces), IOV_MAX):
        batch = pieces[k : k + IOV_MAX]
        want = sum(len(p) for p in batch)
        done = os.pwritev(fd, batch, offset)
        if done != want:  # a short write (tmpfs and disks write all of it; only a full disk stops short)
            os.pwrite(fd, b"".join(bytes(p) for p in batch)[done:], offset + done)
        offset += want


def check_identifier(identifier: str) -> str:
    """An identifier is one folder name that is not hidden: no separators, no leading `.` (the storage's own
    temporary files), at most 255 bytes."""
    if (
        not identifier
        or "/" in identifier
        or "\\" in identifier
        or "\x00" in identifier
        or identifier.startswith(".")
        or len(identifier.encode()) > 255
    ):
        raise ValueError(
            f"not a usable identifier: {identifier[:80]!r} (one folder name: no '/', no leading '.', at most 255 bytes)"
        )
    return identifier


class ECStorage:
    """The encoder-cache folder of one server. `write` is blocking (run it in a thread) and safe from several.

    The folder must exist; it is held open for the storage's life (a write still in flight at shutdown never meets
    a closed or reused handle), and everything in it is reached through that handle without following a link. Only
    folders this server's user owns are written into or counted (a link or another user's folder planted under an
    identifier is refused: FileExistsError), and a file already under an identifier is never replaced: the first
    write of an identifier is its file until it is evicted."""

    def __init__(
        self,
        directory: str | os.PathLike,
        max_bytes: int,
        file_mode: int = 0o644,
        dtype: torch.dtype = torch.bfloat16,
        writers: int = 4,
    ):
        self.directory, self.max_bytes, self.dtype = Path(directory), max_bytes, dtype
        self.fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.uid = os.geteuid()
        self.writers = ThreadPoolExecutor(writers, thread_name_prefix="vitserve-ec") if writers > 1 else None
        self.file_mode = file_mode
        self.dir_mode = file_mode | ((file_mode & 0o444) >> 2) | 0o700  # x wherever r, and the owner's rwx
        self._sizes: OrderedDict[str, int] = OrderedDict()  # identifier -> its file's bytes, least recently first
        self._writing: dict[str, int] = {}  # identifier -> the bytes its write in flight holds
        self._bytes = 0  # of both: files and writes in flight
        self._changed = threading.Condition()
        self.written = self.evicted = 0
        found = []
        for name in os.listdir(self.fd):
            try:
                if name.startswith(".ec-") and name.endswith(".tmp"):  # a write a stopped server left behind
                    info = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
                    if stat.S_ISREG(info.st_mode) and info.st_uid == self.uid:
                        os.unlink(name, dir_fd=self.fd)
                elif not name.startswith(".") and (item := self._file(name)) is not None:
                    found.append((item.st_mtime, name, item.st_size))
            except OSError:  # gone meanwhile, or not one of this server's items
                continue
        with self._changed:
            for _, identifier, size in sorted(found):
                self._sizes[identifier] = size
                self._bytes += size
            while self._bytes > self.max_bytes:
                self._evict_oldest()

    @property
    def bytes(self) -> int:
        return self._bytes

    def stats(self) -> dict:
        """The folder's figures for /stats and /metrics: its bytes and files (and the limit), the files written
        and evicted since start (`bytes` counts the writes in flight too: they hold their room)."""
        with self._changed:
            return {
                "limit_bytes": self.max_bytes,
                "bytes": self._bytes,
                "files": len(self._sizes),
                "writes": self.written,
                "evictions": self.evicted,
            }

    def path(self, identifier: str) -> Path:
        return self.directory / check_identifier(identifier) / FILE_NAME

    def write(self, identifier: str, item: Features) -> int:
        """Write one item's file (its packed rows, from host tensors, in this storage's dtype); the file's bytes. Older
        files go first where the new one would pass `max_bytes`, and a write waits for writes in flight where only their
        finishing makes room. Where the identifier's file is there already (or being written) at this size, it counts as
        written now; at another size, or where the identifier's folder is not this server's, FileExistsError (nothing is
        replaced)."""
        check_identifier(identifier)
        rows = item.rows(self.dtype)
        header = {
            TENSOR_NAME: {
                "dtype": SAFETENSORS_DTYPES[self.dtype],
                "shape": [rows.count, item.width],
                "data_offsets": [0, rows.nbytes],
            }
        }
        head = safetensors_header(header)
        size = len(head) + rows.nbytes  # (the data's end)
        if size > self.max_bytes:
            raise ValueError(f"an item of {size} bytes does not fit --ec-storage-bytes ({self.max_bytes})")
        with self._changed:
            while True:
                if identifier in self._writing:  # the same item from another request: its file, once written
                    self._changed.wait()
                    continue
                if self._present(identifier, size):
                    return size
                self._bytes -= self._sizes.pop(identifier, 0)  # counted, but no longer there
                if self._bytes + size <= self.max_bytes:
                    break
                if self._sizes:
                    self._evict_oldest()
                else:  # the room is held by writes in flight: freed, or their files', once they end
                    self._changed.wait()
            self._writing[identifier] = size
            self._bytes += size
        try:
            published = self._publish(identifier, head, rows, size)
        except BaseException:
            with self._changed:
                self._release(identifier, size)
            raise
        with self._changed:
            self._release(identifier, size)
            if published:
                self._sizes[identifier] = size
                self._bytes += size
                self.written += 1
            else:  # another process linked the identifier's file first: counted here if it is the same item
                self._present(identifier, size)
        return size

    def _release(self, identifier: str, size: int) -> None:
        """Under the lock: a write's hold on its bytes ends; whoever waits looks again."""
        del self._writing[identifier]
        self._bytes -= size
        self._changed.notify_all()

    def _publish(self, identifier: str, head: builtins.bytes, rows: Rows, size: int) -> bool:  # (`bytes`: a property)
        """Write the file under a temporary name and link it into its item's folder, which is created if missing;
        False where a file was linked there first (by another process)."""
        tmp = f".ec-{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
        folder = -1
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, head, 0)
            count = rows.count
            if self.writers is None or count < 2 * self.writers._max_workers:
                _write_rows(fd, rows, 0, count, len(head))
            else:
                step = -(-count // self.writers._max_workers)
                jobs = [
                    self.writers.submit(_write_rows, fd, rows, r, min(count, r + step), len(head) + r * rows.row_bytes)
                    for r in range(0, count, step)
                ]
                for job in jobs:
                    job.result()
            os.fchmod(fd, self.file_mode)
            try:
                os.mkdir(identifier, self.dir_mode, dir_fd=self.fd)
            except FileExistsError:
                pass
            folder = self._folder(identifier)
            os.fchmod(folder, self.dir_mode)  # mkdir's mode passes through the umask
            try:  # a link, unlike a rename, never replaces a file that is there
                os.link(tmp, FILE_NAME, src_dir_fd=self.fd, dst_dir_fd=folder, follow_symlinks=False)
            except FileExistsError:
                return False
            return True
        finally:
            os.close(fd)
            if folder >= 0:
                os.close(folder)
            os.unlink(tmp, dir_fd=self.fd)

    def _folder(self, identifier: str) -> int:
        """The item's folder, opened without following a link; FileExistsError where it is not a folder this
        server's user owns (FileNotFoundError where there is none)."""
        try:
            folder = os.open(identifier, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            raise
        except OSError:  # a link (ELOOP), a file (ENOTDIR), a folder this user cannot read
            raise FileExistsError(f"{self.directory / identifier} is not a folder of this server's") from None
        if os.fstat(folder).st_uid != self.uid:
            os.close(folder)
            raise FileExistsError(f"{self.directory / identifier} is another user's folder")
        return folder

    def _file(self, identifier: str) -> os.stat_result | None:
        """The item's file (None where there is none); FileExistsError where its folder or the file is not this
        server's (a link, another user's)."""
        try:
            folder = self._folder(identifier)
        except FileNotFoundError:
            return None
        try:
            info = os.stat(FILE_NAME, dir_fd=folder, follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != self.uid:
                raise FileExistsError(f"{self.directory / identifier / FILE_NAME} is not a file of this server's")
            return info
        except FileNotFoundError:
            return None
        finally:
            os.close(folder)

    def _present(self, identifier: str, size: int) -> bool:
        """Under the lock: the item's file is here already, at `size` (an identifier names one content): it counts
        as written now. FileExistsError where the identifier holds something else."""
        info = self._file(identifier)
        if info is None:
            return False
        if info.st_size != size:
            raise FileExistsError(
                f"{self.directory / identifier} holds another item already ({info.st_size} bytes, "
                f"not {size}): an identifier names one item"
            )
        os.utime(f"{identifier}/{FILE_NAME}", dir_fd=self.fd, follow_symlinks=False)
        if identifier not in self._sizes:
            self._sizes[identifier] = size
            self._bytes += size
        self._sizes.move_to_end(identifier)
        return True

    def _evict_oldest(self) -> None:
        """Under the lock: remove the least recently written item's folder."""
        identifier, size = self._sizes.popitem(last=False)
        self._bytes -= size
        remove_folder(identifier, self.fd)
        self.evicted += 1


def remove_folder(name: str, dir_fd: int) -> None:
    """Remove the item folder `name` of the folder `dir_fd` and the files in it, relative to `dir_fd` and following no
    link (shutil.rmtree's dir_fd needs Python 3.11); what cannot be removed (gone already, not a file) stays."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return
    try:
        for entry in os.listdir(fd):
            try:
                os.unlink(entry, dir_fd=fd)
            except OSError:
                pass
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except OSError:
        pass
