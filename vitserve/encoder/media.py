"""An item's input bytes, wherever they lie: `MediaBytes`, and `MediaHandle`, what a decode worker is sent of them.

A request's image or video arrives as base64 text (a `str`, or a view of the request body's bytes: json_body.py) or
as raw bytes (a multipart upload, a fetched URL). `MediaBytes` holds it as it came, never copied to be told apart:
where its payload starts (after a data URI's header), whether it is base64, and where the text also lies in a body
file other processes can map (bodies.py). It answers what each reader needs, each bounded to what it reads: `prefix`
(the first units as sent), `head` (the first decoded bytes), `ascii` (the base64 as ASCII bytes, what a cache key
hashes), `decode` (all the bytes), `payload` (what goes to a decode worker: a `MediaHandle` where the text lies in a
body file, else the text or bytes themselves, made when a worker takes the job).
"""

from __future__ import annotations

import binascii
import functools
import mmap
import os
import re
from dataclasses import dataclass
from typing import cast

import pybase64

from .image_errors import InvalidBase64

_WHITESPACE = re.compile(r"\s")
_WHITESPACE_BYTES = re.compile(rb"\s")
_Bytes = bytes | bytearray | memoryview  # MediaBytes.data where it is not a str


def decode_base64(text: str | bytes | bytearray | memoryview) -> bytes:
    """Strict base64 (whitespace allowed, e.g. line breaks), or InvalidBase64. Decoded in place (SIMD, without the
    GIL) where it holds no whitespace; only text that does is copied without it first."""
    try:
        return pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        pass
    if isinstance(text, memoryview):
        text = bytes(text)
    try:
        return pybase64.b64decode(
            "".join(text.split()) if isinstance(text, str) else b"".join(text.split()), validate=True
        )
    except (binascii.Error, ValueError):
        raise InvalidBase64("not valid base64") from None


class MediaBytes:
    """An item's input bytes: `data` (a str, or bytes-like: the request body's own bytes, an upload, fetched bytes)
    from `start` on; `base64` whether they are base64 text (decoded where the item is decoded: a decode worker, not
    the event loop) or the bytes themselves. `shared`: where `data` lies in a file other processes can map (its path,
    the offset of data[0]), so that a decode worker reads it there instead of being sent it; else None."""

    __slots__ = ("data", "start", "base64", "shared")

    def __init__(
        self,
        data: str | bytes | bytearray | memoryview,
        start: int = 0,
        base64: bool = True,
        shared: tuple[str, int] | None = None,
    ):
        self.data, self.start, self.base64, self.shared = data, start, base64, shared

    @classmethod
    def of(cls, item) -> MediaBytes:
        """`item` as MediaBytes: itself; a str as base64 text (what a JSON field holds); bytes-like as raw bytes."""
        if isinstance(item, MediaBytes):
            return item
        return cls(item, 0, isinstance(item, str))

    def __len__(self) -> int:
        return len(self.data) - self.start

    def __repr__(self) -> str:
        return f"MediaBytes({len(self)} {'characters of base64' if self.base64 else 'bytes'})"

    def skip(self, n: int) -> MediaBytes:
        """The same item from `n` units further (a data URI's header left out), where it lies all the same."""
        return MediaBytes(self.data, self.start + n, self.base64, self.shared)

    def prefix(self, n: int) -> str | bytes:
        """The first `n` units as sent: base64's characters (a str, latin-1: a byte a character), raw bytes."""
        part = self.data[self.start : self.start + n]
        if not self.base64:
            return bytes(cast(_Bytes, part))  # raw bytes are never a str (`of`: a str is base64)
        return part if isinstance(part, str) else bytes(part).decode("latin-1")

    def head(self, n: int) -> bytes:
        """The item's first decoded bytes, a bounded prefix: raw bytes cut at `n`; base64 decoded from a 4-aligned
        prefix of `n * 4 // 3 + 256` characters, whitespace left out (at least `n` bytes where it holds none and the
        item is longer, at most 192 more). InvalidBase64 where the prefix does not decode."""
        if not self.base64:
            return bytes(cast(_Bytes, self.data[self.start : self.start + n]))  # never a str (`prefix`)
        chunk = self.data[self.start : self.start + n * 4 // 3 + 256]
        if not isinstance(chunk, str):
            chunk = bytes(chunk)
        if len(chunk) == len(self):
            return decode_base64(chunk)
        # no whitespace in the whole quads: they are the prefix (whitespace in the 3 characters after changes nothing)
        try:
            return pybase64.b64decode(
                memoryview(chunk.encode("latin-1") if isinstance(chunk, str) else chunk)[: len(chunk) // 4 * 4],
                validate=True,
            )
        except (binascii.Error, ValueError):
            pass
        # base64 may hold line breaks
        text = "".join(chunk.split()) if isinstance(chunk, str) else b"".join(chunk.split())
        return decode_base64(text[: len(text) // 4 * 4])

    def ascii(self, nbytes: int | None = None) -> bytes | bytearray | memoryview:
        """The base64 as ASCII bytes (a non-ASCII character becomes something no base64 decoder accepts); with
        `nbytes`, only the whole quads of characters that hold the first `nbytes` bytes (the image's end: what
        follows is not copied), where no whitespace comes before them."""
        text, end = self.data, len(self.data)
        if nbytes is not None and (n := -(-nbytes // 3) * 4) < len(self):
            quads = text[self.start : self.start + n]
            if not (_WHITESPACE.search(quads) if isinstance(quads, str) else _WHITESPACE_BYTES.search(quads)):
                end = self.start + n
        if isinstance(text, str):  # the whole text encoded once, or only the prefix that holds the image
            return (
                memoryview(text[self.start : end].encode("ascii", "replace"))
                if end < len(text)
                else memoryview(text.encode("ascii", "replace"))[self.start :]
            )
        return text[self.start : end]

    def raw(self):
        """Raw bytes as they lie, from `start` (no copy)."""
        return self.data if not self.start else memoryview(self.data)[self.start :]

    def keyed(self):
        """What a cache key hashes of the item: its base64 as ASCII bytes, raw bytes as they are."""
        return self.ascii() if self.base64 else self.raw()

    def decode(self) -> bytes:
        """All of the item's bytes (its base64 decoded: off the event loop)."""
        return decode_base64(self.ascii()) if self.base64 else bytes(self.raw())

    def payload(self, end: int | None = None, in_file: bool = True):
        """What a decode worker is sent for the item's first `end` bytes (None: all): where its base64 lies in a
        body file (a MediaHandle, where `in_file` and it lies in one: nothing else is sent), else what makes its
        base64 as ASCII bytes (called when a worker takes the job: a waiting job holds no copy), else its bytes."""
        if self.base64 and self.shared is not None and in_file:
            path, offset = self.shared
            return MediaHandle(path, offset + self.start, len(self), end)
        if self.base64:
            return functools.partial(self.ascii, end)
        return self.raw() if end is None else memoryview(self.raw())[:end]


def received(payload, is_base64: bool) -> bytes:
    """In a decode worker: the item's bytes from what it was sent (`MediaBytes.payload`, called where it makes)."""
    if isinstance(payload, MediaHandle):
        return payload.decode()
    return MediaBytes(payload, 0, is_base64).decode()


@dataclass(frozen=True)
class MediaHandle:
    """An item's base64 text where it lies in a request's body file: `length` bytes at `offset` of the file at
    `path`, of which only the whole quads that hold the item's first `end` bytes are decoded (None: all), as
    `MediaBytes.ascii` cuts them. What a decode worker is sent instead of the text (picklable)."""

    path: str
    offset: int
    length: int
    end: int | None = None

    def __len__(self) -> int:
        return self.length

    def decode(self) -> bytes:
        """The item's bytes, decoded from the file's pages in place (mapped read-only, unmapped after)."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            start = self.offset - self.offset % mmap.ALLOCATIONGRANULARITY
            if os.fstat(fd).st_size < self.offset + self.length:  # (a mapping read past its file's end is a SIGBUS)
                raise OSError(f"the body file {self.path} is short")
            pages = mmap.mmap(fd, self.offset + self.length - start, prot=mmap.PROT_READ, offset=start)
        finally:
            os.close(fd)
        try:
            return _decode_view(memoryview(pages), self.offset - start, self.length, self.end)
        finally:
            pages.close()


def _decode_view(pages: memoryview, at: int, length: int, end: int | None) -> bytes:
    with pages:  # every view of the mapping released on the way out: it can be closed
        with pages[at : at + length] as text:
            # a view's quads are a view of it (`ascii` slices it): released on the way out too
            with cast(memoryview, MediaBytes(text).ascii(end)) as quads:
                return decode_base64(quads)
