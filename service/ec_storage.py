"""Encoder outputs as vLLM's ECExampleConnector reads them: `<directory>/<identifier>/encoder_cache.safetensors`,
one tensor `ec_cache`, the item's encoder output in the consumer's dtype (`--ec-shared-storage`; docs/llm.md).

* layout: what vLLM's Qwen2-VL, Qwen2.5-VL and Qwen3-VL models keep in their encoder cache for one item, image or
  video: its merged tokens `[t·h·w / 4, width]` in raster order (a video's slices one after another), and for Qwen3-VL
  the deepstack features after the tokens on the width (`cat([tokens, ds0, ds1, ds2], -1)`).
* atomic: the file is written under a temporary name in the directory and renamed into its item's folder, so a
  consumer, which takes a file's existence as its readiness, never reads half of one.
* bounded: the files' bytes stay within `max_bytes`; the least recently written go first (a consumer's reads are
  not seen here; an item written again counts as new). Files already in the directory at start count, oldest first.
* permissions: files get `file_mode`, folders the same with search (x) wherever it can be read.
* fast: the rows are written straight from the tensors' memory (gathered writes: a row is its tokens' row, then
  each deepstack feature's, so nothing is concatenated first), split over `writers` threads that write their parts
  of the file side by side (the kernel copies; the GIL is released).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .outputs import SAFETENSORS_DTYPES, converted, raw_view, safetensors_header

FILE_NAME = "encoder_cache.safetensors"
TENSOR_NAME = "ec_cache"
IOV_MAX = 1024  # buffers per gathered write (Linux's limit)
log = logging.getLogger("vitserve.ec")


def _write_rows(fd: int, parts: list[np.ndarray], first: int, last: int, offset: int) -> None:
    """Rows first..last-1 of the concatenation of `parts` on the width, at `offset` in the file."""
    pieces = [memoryview(part[r]) for r in range(first, last) for part in parts]
    for k in range(0, len(pieces), IOV_MAX):
        batch = pieces[k:k + IOV_MAX]
        want = sum(len(p) for p in batch)
        done = os.pwritev(fd, batch, offset)
        if done != want:  # a short write (tmpfs and disks write all of it; only a full disk stops short)
            os.pwrite(fd, b"".join(bytes(p) for p in batch)[done:], offset + done)
        offset += want


def check_identifier(identifier: str) -> str:
    """An identifier is one folder name: no separators, not `.` or `..`, at most 255 bytes."""
    if (not identifier or "/" in identifier or "\\" in identifier or "\x00" in identifier
            or identifier in (".", "..") or len(identifier.encode()) > 255):
        raise ValueError(f"not a usable identifier: {identifier[:80]!r} (one folder name: no '/', at most 255 bytes)")
    return identifier


class ECStorage:
    """The encoder-cache folder of one server. `write` is blocking (run it in a thread) and safe from several."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int, file_mode: int = 0o644,
                 dtype: torch.dtype = torch.bfloat16, writers: int = 4):
        self.directory, self.max_bytes, self.dtype = Path(directory), max_bytes, dtype
        self.writers = ThreadPoolExecutor(writers, thread_name_prefix="vitserve-ec") if writers > 1 else None
        self.file_mode = file_mode
        self.dir_mode = file_mode | ((file_mode & 0o444) >> 2) | 0o700  # x wherever r, and the owner's rwx
        self.directory.mkdir(parents=True, exist_ok=True)
        self._sizes: OrderedDict[str, int] = OrderedDict()  # identifier -> bytes, least recently written first
        self._bytes = 0
        self._lock = threading.Lock()
        self.written = self.evicted = 0
        found = []
        for path in self.directory.glob(f"*/{FILE_NAME}"):
            try:
                found.append((path.stat().st_mtime, path.parent.name, path.stat().st_size))
            except FileNotFoundError:
                continue
        for _, identifier, size in sorted(found):
            self._sizes[identifier] = size
            self._bytes += size
        for stale in self.directory.glob(".ec-*.tmp"):  # a write a stopped server left behind
            stale.unlink(missing_ok=True)
        with self._lock:
            self._evict(0)

    @property
    def bytes(self) -> int:
        return self._bytes

    def stats(self) -> dict:
        """The folder's figures for /stats and /metrics: its bytes and files (and the limit), the files written
        and evicted since start."""
        with self._lock:
            return {"limit_bytes": self.max_bytes, "bytes": self._bytes, "files": len(self._sizes),
                    "writes": self.written, "evictions": self.evicted}

    def path(self, identifier: str) -> Path:
        return self.directory / check_identifier(identifier) / FILE_NAME

    def write(self, identifier: str, tokens: torch.Tensor, deepstack: list[torch.Tensor] = ()) -> int:
        """Write one item's file (its tokens and deepstack features, host tensors, in this storage's dtype); the
        file's bytes. Older files go first where the new one would pass `max_bytes`."""
        parts = [raw_view(converted(t, self.dtype)).reshape(t.shape[0], -1) for t in (tokens, *deepstack)]
        rows, width = tokens.shape[0], sum(t.shape[1] for t in (tokens, *deepstack))
        header = {TENSOR_NAME: {"dtype": SAFETENSORS_DTYPES[self.dtype], "shape": [rows, width],
                                "data_offsets": [0, sum(part.nbytes for part in parts)]}}
        head = safetensors_header(header)
        start = len(head)
        size = start + header[TENSOR_NAME]["data_offsets"][1]
        final = self.path(identifier)
        if self._present(identifier, final, size):
            return size
        if size > self.max_bytes:
            raise ValueError(f"an item of {size} bytes does not fit --ec-storage-bytes ({self.max_bytes})")
        with self._lock:
            self._evict(size)
            self._sizes[identifier] = self._sizes.pop(identifier, 0) + size  # held while it is written
            self._bytes += size
        fd, tmp = tempfile.mkstemp(prefix=".ec-", suffix=".tmp", dir=self.directory)
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, head, 0)
            row_bytes = sum(part.shape[1] for part in parts)
            if self.writers is None or rows < 2 * self.writers._max_workers:
                _write_rows(fd, parts, 0, rows, start)
            else:
                step = -(-rows // self.writers._max_workers)
                jobs = [self.writers.submit(_write_rows, fd, parts, r, min(rows, r + step), start + r * row_bytes)
                        for r in range(0, rows, step)]
                for job in jobs:
                    job.result()
            os.fchmod(fd, self.file_mode)
            os.close(fd)
            fd = -1
            final.parent.mkdir(mode=self.dir_mode, exist_ok=True)
            os.chmod(final.parent, self.dir_mode)  # mkdir's mode passes through the umask
            os.replace(tmp, final)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            Path(tmp).unlink(missing_ok=True)
            with self._lock:
                self._forget(identifier, size)
            raise
        with self._lock:
            previous = self._sizes.get(identifier, size) - size  # the file this one replaced
            if previous:
                self._sizes[identifier] = size
                self._bytes -= previous
            self.written += 1
        return size

    def _present(self, identifier: str, final: Path, size: int) -> bool:
        """The item's file is here already, at the size this write would give it (an identifier names one content):
        it counts as written now instead."""
        try:
            if final.stat().st_size != size:
                return False
            os.utime(final)
        except FileNotFoundError:
            return False
        with self._lock:
            if identifier not in self._sizes:
                self._sizes[identifier] = size
                self._bytes += size
            self._sizes.move_to_end(identifier)
        return True

    def _forget(self, identifier: str, size: int) -> None:
        left = self._sizes.pop(identifier, 0) - size
        self._bytes -= size
        if left > 0:
            self._sizes[identifier] = left

    def _evict(self, incoming: int) -> None:
        """Under the lock: remove the least recently written items until `incoming` more bytes fit."""
        while self._sizes and self._bytes + incoming > self.max_bytes:
            identifier, size = self._sizes.popitem(last=False)
            self._bytes -= size
            shutil.rmtree(self.directory / identifier, ignore_errors=True)
            self.evicted += 1
