"""What flows below the HTTP edge for one item of a request: `MediaItem` (its modality, its bytes, vLLM's uuid for it
where given, its place in the request), over `MediaBytes` (encoder/media.py: the item's input bytes wherever they
lie, base64 or raw)."""

from __future__ import annotations

from dataclasses import dataclass

from ...encoder.media import MediaBytes, MediaHandle

__all__ = ["MediaBytes", "MediaHandle", "MediaItem"]


@dataclass
class MediaItem:
    """One item of a request: its `modality` ("image" or "video"); `data`, what the client sent (MediaBytes, raw
    bytes, or an http(s) URL left for the fetcher); vLLM's `uuid` for it where given; `param`, where it is in the
    request (`images[0]`, `messages[1].content[0]`), which its errors name."""

    modality: str
    data: MediaBytes | bytes | str
    uuid: str | None = None
    param: str = ""

    @property
    def media(self) -> MediaBytes:
        """Its bytes as MediaBytes (a URL's once fetched)."""
        return MediaBytes.of(self.data)
