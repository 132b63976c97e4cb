"""What can go wrong, in the server's own terms: the domain errors a request can end with (each with a
machine-readable `code` and the bad input, `param`), and `ErrorRecord`, the one form an error takes on any pipe
between processes (a decode worker's, a device process's, a front end's link to the core). No web framework here:
the HTTP edge (http_errors.py) turns these into statuses and bodies."""

from __future__ import annotations

import builtins
import functools
import sys
from dataclasses import dataclass

CLIP = 200  # characters of a client's value that an error message repeats


def clip(value: str) -> str:
    """A client's value as an error message repeats it: its first `CLIP` characters."""
    return value if len(value) <= CLIP else value[:CLIP] + "..."


class EngineError(Exception):
    """A request the server could not serve, and why: `code` (machine-readable) and `param` (the bad input)."""

    code = "error"

    def __init__(self, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param
        if code is not None:
            self.code = code


class InputRejected(EngineError):
    """Something the client sent cannot be served: bad bytes, not an image, an unusable URL, a malformed field."""


class InputTooLarge(EngineError):
    """Over a limit: pixels of an image, images in a request, bytes at a URL."""


class NotAllowed(EngineError):
    """The client may not ask this of the server: a receiver outside the networks features go to, a registration
    from another address than the one it names."""


class NotServed(EngineError):
    """What the request names is not served here: another model, or a tier the server was started without."""


class Unsupported(EngineError):
    """Something this server cannot do for any request (videos, where it has no video decoder): the server's
    condition, not the request's fault."""


class Conflict(EngineError):
    """The request collides with what the server holds: an identifier whose file holds another item."""


class QueueFull(EngineError):
    """More work waits than the server takes on: retrying shortly helps."""

    code = "queue_full"


class NotReady(EngineError):
    code = "not_ready"


class Unavailable(EngineError):
    """A part the server cannot run without is gone (a device process, every decode worker): it is restarting."""


class OutOfMemory(EngineError):
    code = "out_of_memory"


class StorageFailed(EngineError):
    """What the server writes for a consumer (the encoder-cache files) could not be written."""


class InferenceFailed(EngineError):
    """A fault inside a batch: only that batch's requests fail."""

    code = "inference_failed"


class DeliveryFailed(EngineError):
    """The features could not be handed to the consumer that waits for them (a receiver that does not take them)."""


class TimedOut(EngineError):
    """Something the request waits on from elsewhere did not come in time (a part's receivers registering)."""


class ClientDisconnected(EngineError):
    """The client went away while its images waited: they were dropped from the queue (answered 499)."""

    code = "client_disconnected"


# ---- errors across processes ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ErrorRecord:
    """An exception as it crosses a pipe: its kind (the class's name, a key of `error_kinds()`), the message a
    client may be told, its code and param where it has them, and `detail`, the full text for the log where it says
    more than the message (an image error's decoder words). `ErrorRecord.of(e)` on one side, `record.error()` on
    the other: the same class, message, code and param come back (a kind the map does not hold comes back as a
    RuntimeError that names it)."""

    kind: str
    message: str
    code: str | None = None
    param: str | None = None
    detail: str | None = None

    @classmethod
    def of(cls, error: BaseException) -> ErrorRecord:
        if isinstance(error, EngineError):
            return cls(type(error).__name__, error.message, error.code, error.param)
        public = getattr(error, "public", None)  # an ImageError: what the client is told, and the detail apart
        code = getattr(error, "code", None)
        return cls(
            type(error).__name__,
            public if isinstance(public, str) else str(error),
            code if isinstance(code, str) else None,
            None,
            str(error) if isinstance(public, str) and str(error) != public else None,
        )

    def error(self) -> Exception:
        from ...encoder.image_errors import ImageError

        kind = error_kinds().get(self.kind)
        if kind is None:
            return RuntimeError(f"{self.kind}: {self.message}")
        if issubclass(kind, EngineError):
            return kind(self.message, self.code, self.param)
        try:
            error = kind(self.detail or self.message)
        except Exception:  # a kind not made from a message alone (UnicodeDecodeError): named in a RuntimeError
            return RuntimeError(f"{self.kind}: {self.message}")
        if isinstance(error, ImageError):
            error.public = self.message
            if self.code is not None and error.code != self.code:
                error.code = self.code
        return error


class ImageLost(RuntimeError):
    """A spooled image could not be read back (its file is gone or short): its batch fails."""


@functools.cache
def error_kinds() -> dict[str, type[Exception]]:
    """The one map of the kinds of error that cross a pipe and come back as themselves: Python's built-in
    exceptions, the domain errors, the encoder's image and video errors, a spooled image that is gone, and torch's
    out-of-memory error (where torch is loaded: a process without it receives none). Built at the first record
    turned back into an error, in the process that receives it."""
    from ...encoder import image_errors

    if "torch" in sys.modules:  # the video errors (encoder.video imports torch) and torch's own
        from ...encoder import video  # noqa: F401
    kinds: list[type] = [c for c in vars(builtins).values() if isinstance(c, type) and issubclass(c, Exception)]
    kinds += [
        EngineError,
        *_subclasses(EngineError),
        image_errors.ImageError,
        *_subclasses(image_errors.ImageError),
        ImageLost,
    ]
    if "torch" in sys.modules:
        kinds.append(sys.modules["torch"].OutOfMemoryError)
    return {kind.__name__: kind for kind in kinds}


def _subclasses(base: type[Exception]) -> list[type[Exception]]:
    """`base`'s subclasses at any depth that this package defines."""
    out: list[type[Exception]] = []
    for sub in base.__subclasses__():
        if sub.__module__.startswith(PACKAGE):
            out += [sub, *_subclasses(sub)]
    return out


PACKAGE = __name__.split(".")[0] + "."
