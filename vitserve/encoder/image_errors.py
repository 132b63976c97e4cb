"""The errors of an image (or video) a client sent that cannot be used: each with a short machine `code` and a
`public` message without the decoder's own text (what a server tells a client; `str()` keeps the detail)."""

from __future__ import annotations


class ImageError(ValueError):
    """Base class for client-side image problems. ``code`` is a short machine code; ``public`` the message without
    the decoder's own text (what a server tells a client; ``str()`` keeps the detail)."""

    code = "image_error"

    def __init__(self, message: str, detail: str | None = None):
        super().__init__(f"{message}: {detail}" if detail else message)
        self.public = message


class InvalidBase64(ImageError):
    """Image data sent as base64 text that does not decode."""

    code = "invalid_base64"


class UndecodableImage(ImageError):
    """Empty data, not an image, truncated/corrupt file, or unsupported format/mode."""

    code = "undecodable_image"


class NotAnImage(UndecodableImage):
    """Data in no image format PIL knows."""


class HeaderNotFound(UndecodableImage):
    """A bounded probe did not find the header within the bytes and steps it looks at, or the format is not one it
    reads: the whole image must be looked at (a server does that off its event loop)."""


class ImageTooLarge(ImageError):
    """The image declares more pixels than allowed (decompression-bomb guard)."""

    code = "image_too_large"


class UnsupportedFormat(ImageError):
    """An image format outside ``ALLOWED_FORMATS``."""

    code = "unsupported_format"


class BadAspectRatio(ImageError):
    """max(h, w) / min(h, w) > 200 (the limit enforced by Qwen-VL's smart_resize)."""

    code = "bad_aspect_ratio"
