"""JSON request bodies, read so that their size costs the event loop little more than a scan for quotes.

A request's images are long strings (base64, often megabytes each). Handing the whole body to pydantic would build a
Python string of each (one more copy, at about the speed of a copy), and the service would then encode each back to
bytes to hash it and send it to a decode worker (two more). Here the body is first scanned for its strings (`find`
is memchr: gigabytes a second), and every string longer than `LONG` bytes is cut out of it: pydantic validates the
short skeleton that is left, where each long string is a placeholder, and the long strings come back as `Text`, a
view of the body's own bytes (a MediaBytes). An image is then never copied on the event loop; only a long string with
backslash escapes is decoded as JSON (a `str`), as a short one is.

The scan also bounds the work before any is paid: a body with more strings, or more values of any type (numbers,
nulls, objects, lists), than `max_images` images and a few fields could hold is a 413 before it is parsed.
"""

from __future__ import annotations

import asyncio
import json
import mmap
from typing import TypeVar, cast

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from ...encoder.json_splice import MARK, MARK_JSON
from ...encoder.media import MediaBytes
from ..decoding.bodies import SHARED, Body, SharedBodies, anonymous
from ..ground.timeline import mark
from .http_errors import ServiceError
from .landing import LAND

LONG = 4096  # bytes of a string beyond which it stays in the body, unparsed
Model = TypeVar("Model", bound=BaseModel)  # what a body is parsed as


class Text(MediaBytes):
    """A JSON string of a request body, unparsed: MediaBytes over a view of the body's bytes between its quotes (no
    escapes in it), with `shared` where those bytes lie in a body file the decode workers can read (its path, the
    offset of the first), else None. What it holds is ASCII when it is base64; anything else is left for the decoder
    to refuse."""

    __slots__ = ()
    data: memoryview  # (MediaBytes.data: always this view here)

    def __init__(self, view: memoryview, shared: tuple[str, int] | None = None):
        super().__init__(view, 0, True, shared)

    @property
    def view(self) -> memoryview:
        return self.data

    def __str__(self) -> str:
        return bytes(self.data).decode("latin-1")


def _escaped(body: bytes | bytearray | mmap.mmap, start: int, end: int) -> bool:
    """Whether the quote at `end` is escaped: after an odd run of backslashes (within the string, from `start`).
    Looks back through windows that double while they hold only backslashes: a C-speed step per window."""
    window = 64
    while True:
        low = max(start, end - window)
        segment = body[low:end]
        run = len(segment) - len(segment.rstrip(b"\\"))
        if run < len(segment) or low == start:
            return run % 2 == 1
        window *= 2


class Scan:
    """The strings of a JSON text (where each opens and closes) and the commas outside them (one per array item or
    object member but the first), found as the text arrives: each `feed` goes on where the last stopped. A Python
    step per quote, C for the bytes between (memchr). Over once more than `limit` quotes, or commas, are seen: the
    text is refused then, before the rest of it is read."""

    def __init__(self, limit: int):
        self.limit, self.quotes, self.commas = limit, 0, 0
        self.spans: list[tuple[int, int]] = []
        self._next = 0  # the next byte to look at
        self._open: int | None = None  # where the string being read opened

    @property
    def over(self) -> bool:
        return self.quotes > self.limit or self.commas > self.limit

    def feed(self, text: bytes | bytearray | mmap.mmap, end: int) -> bool:
        """Scan `text` up to `end` (it holds everything fed before, unchanged); False once over."""
        at = self._next
        while at < end and not self.over:
            quote = text.find(b'"', at, end)
            if self._open is None:
                self._count_commas(text, at, end if quote < 0 else quote)
                if quote < 0:
                    break
                self.quotes, self._open = self.quotes + 1, quote
            elif quote < 0:
                break
            else:
                self.quotes += 1
                if text[quote - 1] != 0x5C or not _escaped(text, self._open + 1, quote):  # else an escaped one
                    self.spans.append((self._open, quote))
                    self._open = None
            at = quote + 1
        self._next = end if not self.over else at
        return not self.over

    def _count_commas(self, text, start: int, end: int) -> None:
        """Count the commas in text[start:end], stopping once over the limit (memchr between them)."""
        while self.commas <= self.limit and (comma := text.find(b",", start, end)) >= 0:
            self.commas, start = self.commas + 1, comma + 1


def too_many(max_images: int) -> ServiceError:
    return ServiceError(
        413,
        f"more than {max_images} images (or values) in one request",
        "too_many_images",
        headers={"Connection": "close"},
    )  # the rest of the body is not read


async def read_json(
    request, model: type[Model], max_images: int, raw_fields: tuple[str, ...] = (), bodies: SharedBodies | None = None
) -> Model:
    """A request's JSON body as `model` (`parse_body`), scanned as it arrives: a body with more values than
    `max_images` images and a few fields could hold is refused at the chunk that shows it. The body goes into one
    buffer, a chunk's copy at a time, and is never joined from pieces afterwards. A large one of declared length
    (`SHARED` bytes or more) goes into a mapping of that size whose pages are allocated and mapped in a thread
    before it arrives: a body file of `bodies` where given, which the decode workers read in place (its images'
    `Text` say where), else an anonymous mapping, and is handed to the HTTP protocol (its `vitserve.land`
    extension: service/api/http.py), which receives the rest of the body from the socket straight into it: the
    chunks that come are then views of it where they landed, not copied again. A chunk that came before (or where the
    protocol cannot) is copied in: no page first touched on the event loop, no buffer regrown and copied again as it
    fills. The body file is given back when the request ends, whatever its outcome (the gate calls what the
    request's state holds under `on_end`)."""
    length = request.headers.get("content-length")
    size, scan = 0, Scan(2 * (max_images + 32))
    shared: Body | None = None
    body: bytearray | mmap.mmap
    if length is not None and length.isdigit() and int(length) >= SHARED:
        if bodies is not None:
            shared = await bodies.take(int(length))
            request.scope.setdefault("state", {}).setdefault("on_end", []).append(shared.release)
            body = cast(mmap.mmap, shared.buffer)  # a body just taken holds its mapping (`release` empties it)
        else:
            body = await asyncio.get_running_loop().run_in_executor(None, anonymous, int(length))
        if len(body) < int(length):
            raise AssertionError("a body buffer smaller than its body")
        land = request.scope.get("extensions", {}).get(LAND)  # (the HTTP protocol's: api/http.py)
        if land is not None:
            land(body)
    else:
        body = bytearray()
    mapped = not isinstance(body, bytearray)
    async for chunk in request.stream():
        if mapped:
            if size + len(chunk) > int(length):  # (the HTTP layer frames by the declared length)
                raise ServiceError(400, "the body is longer than its Content-Length", "invalid_request")
            if not (isinstance(chunk, memoryview) and chunk.obj is body):  # (one that landed lies there already)
                body[size : size + len(chunk)] = chunk
        else:
            body += chunk
        size += len(chunk)
        if not scan.feed(body, size):
            raise too_many(max_images)
    parsed = parse_body(model, body, max_images, raw_fields, scan, size, shared.path if shared is not None else None)
    mark("parsed")
    return parsed


def parse_body(
    model: type[Model],
    body: bytes | bytearray | mmap.mmap,
    max_images: int,
    raw_fields: tuple[str, ...] = (),
    scan: Scan | None = None,
    size: int | None = None,
    path: str | None = None,
) -> Model:
    """`body` (its first `size` bytes; default all) validated as `model`: not JSON (or nested too deeply) is a 400,
    invalid fields a 422, more values than `max_images` images and a few fields could hold a 413. The long strings of
    `raw_fields` (a string or a list of strings each) come back as `Text` where they hold no escapes; every other
    value is what pydantic makes of it. `scan`: the body's, made as it arrived (`read_json`), else made here.
    `path`: the body file `body` maps, for the `Text` to say where they lie."""
    size = len(body) if size is None else size
    if scan is None:
        scan = Scan(2 * (max_images + 32))
        scan.feed(body, size)
    if scan.over:
        raise too_many(max_images)
    long = [(s, e) for s, e in scan.spans if e - s > LONG and body[e + 1 : e + 64].lstrip()[:1] != b":"]  # values
    pieces, previous = [], 0
    for i, (start, end) in enumerate(long):
        pieces += [body[previous : start + 1], MARK_JSON + str(i).encode()]
        previous = end
    whole = isinstance(body, (bytes, bytearray)) and size == len(body)
    # a mapping is never whole: its slice, bytes, is what is parsed
    skeleton = (
        b"".join([*pieces, body[previous:size]]) if long else cast("bytes | bytearray", body) if whole else body[:size]
    )
    try:
        parsed = model.model_validate_json(skeleton)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False)
        if errors and errors[0]["type"] == "json_invalid":
            raise ServiceError(400, f"body must be JSON ({errors[0]['msg']})", "invalid_json") from None
        raise RequestValidationError(errors) from None
    if not long:
        return parsed
    _restore_fields(parsed, raw_fields, body, memoryview(body), long, path)
    return parsed


def _restore_fields(
    model: BaseModel, raw_fields: tuple[str, ...], body, view: memoryview, long: list[tuple[int, int]], path: str | None
) -> None:
    """`_restore` every field of a parsed model (strings, and those in its lists and dicts), and of the models within
    it (a chat request's content parts), the fields named in `raw_fields` at any depth as `Text`."""
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            _restore_fields(value, raw_fields, body, view, long, path)
        elif isinstance(value, list) and any(isinstance(v, BaseModel) for v in value):
            for v in value:
                if isinstance(v, BaseModel):
                    _restore_fields(v, raw_fields, body, view, long, path)
        elif isinstance(value, (str, list, dict)):
            setattr(model, name, _restore(value, name in raw_fields, body, view, long, path))


def _restore(value, raw: bool, body, view: memoryview, long: list[tuple[int, int]], path: str | None):
    """A parsed value with its placeholders replaced by the long strings they stand for (a module function, not a
    closure: a recursive closure is a reference cycle, which would keep the body alive until the garbage collector
    ran, past its request's end)."""
    if isinstance(value, list):
        return [_restore(v, raw, body, view, long, path) for v in value]
    if isinstance(value, dict):  # its keys are never cut out (a string before a colon stays in the skeleton)
        return {k: _restore(v, raw, body, view, long, path) for k, v in value.items()}
    if not isinstance(value, str) or not value.startswith(MARK):
        return value
    start, end = long[int(value[len(MARK) :])]
    if raw and body.find(b"\\", start, end) < 0:
        return Text(view[start + 1 : end], None if path is None else (path, start + 1))
    return json.loads(body[start : end + 1])  # escapes (or not an image field): decoded as JSON does
