"""The domain error (errors.py) a request gets for an item that could not be decoded: in the service's own words,
naming the item (`input[i]`); the decoder's text goes to the log only. Text sent where an image goes is told so
(`text_input`), and so is a video sent as an image (`video_input`)."""

from __future__ import annotations

import logging

from ...encoder.image_errors import ImageError, ImageTooLarge, InvalidBase64, UndecodableImage, UnsupportedFormat
from ..ground.errors import EngineError, InputRejected, InputTooLarge, Unavailable
from .decode_pool import JobTimedOut, PoolUnavailable, WorkerDied
from .first_bytes import is_video, looks_like_text

log = logging.getLogger("vitserve.decoder")

TEXT_INPUT = (
    "this is text, not an image: this server encodes images and videos, not text, and its pooled "
    "vectors are the vision tower's, not text-aligned retrieval embeddings"
)


def rejection(param: str, e: BaseException, data=None, kind: str = "image") -> EngineError:
    """The domain error a request gets for its image `param` that could not be decoded (`e`); `data`, where given,
    is what the client sent, told apart as text where it is no image and reads as text."""
    if data is not None and isinstance(e, (InvalidBase64, UndecodableImage)) and looks_like_text(data):
        return InputRejected(f"{param}: {TEXT_INPUT}", "text_input", param)
    if data is not None and isinstance(e, (UndecodableImage, UnsupportedFormat)) and is_video(data):
        return InputRejected(
            f"{param}: this is a video, not an image: send it in `videos` (/v1/encode) or with "
            "modality video (/v1/embeddings)",
            "video_input",
            param,
        )
    if isinstance(e, JobTimedOut):
        log.info("%s: %s", param, e)
        return InputTooLarge(f"{param}: the {kind} took longer than {e.seconds:g} s to decode", "decode_timeout", param)
    if isinstance(e, ImageError):
        if str(e) != e.public:
            log.info("%s: %s", param, e)  # the decoder's own words: for the log, not the client
        return (InputTooLarge if isinstance(e, ImageTooLarge) else InputRejected)(f"{param}: {e.public}", e.code, param)
    if isinstance(e, WorkerDied):  # twice: this image or video kills decode workers
        return InputRejected(f"{param}: the {kind} crashed the decoder", f"undecodable_{kind}", param)
    if isinstance(e, PoolUnavailable):  # not about this image
        return Unavailable(f"{e}; the server is restarting", "decode_unavailable")
    # anything else the decoder raised is still about this client's bytes
    log.info("%s: cannot decode: %s: %s", param, type(e).__name__, e)
    return InputRejected(f"{param}: cannot decode the {kind}", f"undecodable_{kind}", param)
