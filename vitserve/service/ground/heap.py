"""The C heap of a process that decodes images: freed memory kept for the next image, and given back when idle.

glibc's malloc serves a large allocation (over its threshold: 128 KiB, rising with what is freed, at most 32 MiB)
with a mapping of its own, unmapped when freed, and gives the heap's free top back to the system past a trim
threshold; an image's buffers (Pillow's, the decoders', numpy's) are megabytes, so each image's are fresh pages
again, every one faulted in and cleared as the decoder first writes it: for a JPEG, as long as decoding it
(docs/decisions.md). `keep_freed_memory` raises both thresholds for this process, so that freed buffers are reused;
`release_freed_memory` gives what the heap holds free back (malloc_trim), for a worker going idle. Both do nothing
where the C library is not glibc."""

from __future__ import annotations

import ctypes
import functools

KEEP_BYTES = 128 * 2**20  # allocations up to this come from the heap, and this much freed memory stays in it
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)


@functools.cache
def _glibc():
    """The C library's functions (this process's symbols: nothing is looked for on disk), or None where it has no
    mallopt and malloc_trim (musl, macOS)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def keep_freed_memory(nbytes: int = KEEP_BYTES) -> bool:
    """This process's allocations up to `nbytes` come from its heap, which keeps up to `nbytes` freed at its top:
    freed buffers are reused rather than unmapped and faulted in again. Whether it took (glibc)."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, nbytes)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, nbytes))


def release_freed_memory() -> None:
    """Give the heap's free memory back to the system (what `keep_freed_memory` kept)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
