"""The records between the server and a device process (device_process.py), sent whole over its pipe.

Device process -> server: `Ready` (loaded and captured) or `LoadFailed`, then one `BatchAnswer` per `Batch`.
Server -> device process: `Batch`es, then `Stop`. An image's outputs travel as an `Output` (a spool file's name and
the tensors' layout in it), an image the device could not decode as its ErrorRecord, a batch's failure as its
ErrorRecord (errors.py: the one error record of every pipe). `written` makes a batch's records: its outputs
written to spool files by several threads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ...encoder.features import Features
from ...encoder.preprocess import ImageError
from ..decoding import spool
from ..ground.errors import ErrorRecord


@dataclass
class Ready:
    """Device process -> server: loaded and captured; its runner's stats."""

    stats: dict


@dataclass
class LoadFailed:
    """Device process -> server: the model could not be loaded or captured there."""

    error: str


@dataclass
class Batch:
    """Server -> device process: a batch to run (spooled images by name, others as arrays or EncodedJpeg), each
    image's (height, width) to run at, which are mean-pooled and which are answered in float32 (widened on the
    device); `job` numbers it for its answer."""

    job: int
    images: list
    sizes: list[tuple[int, int]]
    mean_pooling: list[bool]
    float32: list[bool]


@dataclass
class Stop:
    """Server -> device process: no more batches; finish those sent and exit."""


@dataclass
class Output:
    """One image's tensors (tokens or mean, then deepstack), as (dtype name, shape, bytes) each, laid back to back in
    the spool file `path` (or in `data`, where the spool is full or gone: slower, never wrong). The file belongs to
    whoever holds this record: `features` maps it, and it is removed then unless kept (the embedding cache keeps
    it), or by `discard`."""

    entries: list
    grid: tuple[int, int, int] | None = None  # set by the core (the cache answers with it)
    path: str | None = None
    data: bytes | None = None

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.entries)

    def features(self, keep: bool = False) -> Features:
        """The image's Features with its grid (None where this record has none yet: the device process's), the
        tensors over the file's pages (mapped copy-on-write: no copy is made; OSError when the file is gone); unless
        `keep`, the file is removed once they no longer map it (spool.remove_when_unmapped)."""
        if self.data is not None:
            raw = np.frombuffer(self.data, np.uint8).copy()
        else:
            assert self.path is not None  # (an Output has its data, or its file)
            try:
                raw = spool.map_file(self.path, self.nbytes, private=True)
            except BaseException:  # (mapped or not, a file not kept goes)
                if not keep:
                    spool.remove(self.path)
                raise
            if not keep:  # once unmapped, on the release thread: whoever lets go of it does not free its pages
                spool.remove_when_unmapped(raw, self.path)
        raw, tensors, offset = torch.from_numpy(raw), [], 0
        for dtype, shape, n in self.entries:
            tensors.append(raw[offset : offset + n].view(getattr(torch, dtype)).view(shape))
            offset += n
        return Features(tensors[0], tensors[1:], None if self.grid is None else list(self.grid))

    def discard(self) -> None:
        if self.path is not None:
            spool.remove(self.path)


@dataclass
class BatchAnswer:
    """Device process -> server: a batch's outputs, one per image (an `Output`, or the ErrorRecord of an image the
    device could not decode), or the batch's `error`; and the runner's stats."""

    job: int
    stats: dict
    outputs: list[Output | ErrorRecord] | None = None
    error: ErrorRecord | None = None


def packed(output, path: str) -> Output | ErrorRecord:
    """An image's outputs (tokens, deepstack list) written to the spool file `path` (or kept as bytes where it
    cannot be written); an ImageError as its record."""
    if isinstance(output, ImageError):
        return ErrorRecord.of(output)
    arrays, entries = [], []
    first, deepstack = output
    for t in (first, *deepstack):
        t = t.contiguous()
        arrays.append(t.view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8))
        entries.append((str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size()))
    # a full or missing spool: the bytes go through the pipe (as bytes: a pickled tensor would go through shared
    # memory, /dev/shm again), slower, never wrong
    if spool.write(path, arrays):
        return Output(entries, path=path)
    return Output(entries, data=b"".join(a.tobytes() for a in arrays))


# threads of a device process writing a batch's answers to their spool files side by side: Qwen3-VL-8B's tokens
# and deepstack at its engine's rate on an H200 are ~2.5 GB/s, more than one thread writes new tmpfs pages at; a
# writer is handed answers of WRITER_BYTES together at least (a hand-off per small answer costs more than its write)
ANSWER_WRITERS = 4
WRITER_BYTES = 1 << 20


def _pack_each(pairs: list) -> list:
    """packed() of each (output, path), its exception in its place where it fails."""
    records: list = []
    for output, path in pairs:
        try:
            records.append(packed(output, path))
        except Exception as e:
            records.append(e)
    return records


def _answer_bytes(output) -> int:
    """An output's tensor bytes (tokens or mean, deepstack); 0 for anything else (an ImageError)."""
    if not isinstance(output, tuple):
        return 0
    return sum(t.numel() * t.element_size() for t in (output[0], *output[1]))


def written(outputs: list, names, writers: ThreadPoolExecutor) -> tuple[list | None, ErrorRecord | None]:
    """A batch's outputs written to spool files of their own (`names` gives their paths), in runs of WRITER_BYTES
    by the `writers` side by side and the last run by this thread: a tmpfs takes a new file's pages at a few GB/s
    per writing thread (each page allocated and cleared), which one thread would make the limit of a device whose
    answers are large (Qwen3-VL-8B's tokens and deepstack), while small answers (pooled vectors) are written here
    without a hand-off. The records in the outputs' order, or, where one cannot be made, (None, its error) with
    every file written removed: each write is waited for first, so that none lands after the removal."""
    runs: list[list] = [[]]
    size = 0
    for output in outputs:
        if size >= WRITER_BYTES:
            runs.append([])
            size = 0
        runs[-1].append((output, next(names)))
        size += _answer_bytes(output)
    pending = [writers.submit(_pack_each, run) for run in runs[:-1]]
    last = _pack_each(runs[-1])
    records = [r for future in pending for r in future.result()] + last
    error = next((ErrorRecord.of(r) for r in records if isinstance(r, Exception)), None)
    if error is None:
        return records, None
    for record in records:
        if isinstance(record, Output):
            record.discard()
    return None, error


def unpacked(output: Output | ErrorRecord) -> Features | Exception:
    """A BatchAnswer's output for one image as the backend takes it: its Features (the backend gives them the
    image's grid), or the ImageError."""
    if isinstance(output, Output):
        return output.features()
    return output.error()
