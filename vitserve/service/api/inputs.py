"""An item as a JSON request writes it: a data URI, bare base64, or (when enabled) an http(s) URL. Only its head is
read here; its payload stays where it lies for a decode worker."""

from __future__ import annotations

import re
from typing import cast

from ...encoder.media import MediaBytes
from ..ground.errors import InputRejected, clip
from .json_body import Text

URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]{0,15})://")  # file://, ftp://...: a URL, never base64


def decode_input(
    item: str | Text, index: int, allow_url: bool, field: str = "input", kind: str = "image"
) -> MediaBytes | str:
    """A data URI, bare base64, or (when enabled) an http(s) URL left for the fetcher; `kind`: image or video (the
    data URI's media type). Only the item's head is read here: its payload is not copied (a `Text` stays a view of
    the request's body)."""
    param = f"{field}[{index}]"
    media = MediaBytes.of(item)  # a str or a Text: base64 text, where it lies
    head = cast(str, media.prefix(5120))  # base64 text: a str (`prefix`)
    if head.startswith(("http://", "https://")):
        if not allow_url:
            raise InputRejected(
                f"{param}: {kind} URLs are disabled on this server; send a data URI or base64",
                "url_fetch_disabled",
                param,
            )
        return str(item)
    if scheme := URL_SCHEME.match(head):
        raise InputRejected(
            f"{param}: {scheme[1]}:// URLs are not read; send a data URI or base64"
            + (", or an http(s) URL" if allow_url else ""),
            "invalid_url",
            param,
        )
    start = 0
    if head.startswith("data:"):
        start = payload_start(head, param, kind)
    if not head[start : start + 4096].strip():  # (a payload that opens with 4 KB of whitespace is no image either)
        raise InputRejected(f"{param}: empty {kind}", f"invalid_{kind}", param)
    return media.skip(start)  # decoded by a decode worker (in place, where the body is shared)


def payload_start(head: str, param: str, kind: str) -> int:
    """Where a data URI's payload starts, after checking its header names base64 of the `kind` expected."""
    comma = head.find(",", 0, 1024)  # a data URI's header is short
    media = head[5 : comma if comma >= 0 else 1024].split(";")
    if kind == "image" and media[0].startswith("video/"):
        raise InputRejected(
            f"{param}: this is a video, not an image: send it in `videos` (/v1/encode) or "
            "with modality video (/v1/embeddings)",
            "video_input",
            param,
        )
    if kind == "video" and media[0].startswith("image/"):
        raise InputRejected(
            f"{param}: this is an image, not a video: send it in `images` (/v1/encode) or "
            "without modality video (/v1/embeddings)",
            "not_a_video",
            param,
        )
    if comma < 0 or not media[0].startswith(f"{kind}/") or "base64" not in media[1:]:
        raise InputRejected(
            f"{param}: expected data:{kind}/<type>;base64,<data>, got media type {clip(';'.join(media))!r}",
            "invalid_media_type",
            param,
        )
    return comma + 1
