"""What an item's first bytes tell before it is decoded: its image header (`first_headers`), whether it is a video
container (`is_video`), whether it is text sent where an image goes (`looks_like_text`). Each reads a bounded prefix
(`MediaBytes.head`), so that it costs the same whatever the item's size; run off the event loop."""

from __future__ import annotations

from ...encoder.headers import ImageHeader, probe
from ...encoder.media import MediaBytes

PROBE_BYTES = 64 * 2**10  # of an image, where its header is read first (by a worker from all of it where not there)
TEXT_SAMPLE = 1024  # characters of an input that is no image, read to tell whether it is text
_CONTROLS = {9: None, 10: None, 13: None}  # tab and line breaks: printable enough for text


def head(data, size: int = PROBE_BYTES) -> bytes:
    """The first `size` bytes of an item (MediaBytes, or raw bytes): `MediaBytes.head`."""
    return MediaBytes.of(data).head(size)


def first_headers(images: list) -> list:
    """Each image's header from its first bytes (`probe(head(data))`), or the exception that raised (HeaderNotFound:
    not within them). Bounded work per image (a 64 KB prefix decoded, a walk of at most 256 steps): the request's
    images in one go in a thread, where base64 decodes without the GIL."""
    out: list[ImageHeader | Exception] = []
    for data in images:
        try:
            out.append(probe(head(data)))
        except Exception as e:
            out.append(e)
    return out


def looks_like_text(data) -> bool:
    """Whether an input that is no image is text: words sent where an image goes (its string), or a text file
    uploaded (its bytes). Its first characters printable, three in four of them letters or whitespace, with a space or
    a letter outside ASCII (base64 has neither). Base64 stands for a file, whatever its bytes: not told as text."""
    sample = MediaBytes.of(data).prefix(TEXT_SAMPLE)
    if isinstance(sample, bytes):
        raw = sample
        try:
            sample = raw.decode()
        except UnicodeDecodeError as e:  # a character cut at the end of the sample is not binary data
            if e.start < len(raw) - 3:
                return False
            sample = raw[: e.start].decode()
    letters = sum(map(str.isalpha, sample)) + sum(map(str.isspace, sample))
    return (
        sample.translate(_CONTROLS).isprintable()
        and 4 * letters >= 3 * len(sample) > 0
        and (" " in sample or not sample.isascii())
    )


def head_or_error(data, size: int = 512):
    """An input's first bytes, or the exception reading them raised (base64 that does not decode)."""
    try:
        return head(data, size)
    except Exception as e:
        return e


def is_video(data) -> bool:
    """Whether an input's first bytes are a video container's (a bounded read: its first 512 bytes)."""
    from ...encoder.video import sniff

    try:
        return sniff(head(data, 512)) is not None
    except Exception:  # not even base64
        return False
