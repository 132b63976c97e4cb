"""The records a front end and the core of a server with several front ends (service/hub.py, service/core.py)
exchange over the front end's pipe: small ones only (names of spool files, grids, cache keys, states)."""

from __future__ import annotations

from dataclasses import dataclass

from .lifecycle import State
from .errors import EngineError, InferenceFailed, InputRejected, InputTooLarge, NotReady, OutOfMemory, Unavailable

ERRORS = {c.__name__: c for c in (EngineError, InferenceFailed, InputRejected, InputTooLarge, NotReady, OutOfMemory,
                                  Unavailable)}
SCRAPE_SECONDS = 2.0  # a front end that does not answer a scrape within this is left out of it


# ---- the records between a front end and the core ---------------------------------------------------------------
@dataclass
class Status:
    """Core -> front end: the server's state, why it failed, and once loaded the model."""

    state: State
    error: str | None = None
    model: object = None  # engine.ModelInfo
    devices: list | None = None


@dataclass
class Item:
    """Front end -> core: one decoded image for the queue (its spool file), and its cache key (None: not cached)."""

    id: int
    image: object  # spool.Spooled, or an EncodedJpeg for the device to decode
    grid: tuple[int, int, int]
    mean_pooling: bool
    param: str
    key: bytes | None
    modality: str = "image"  # or "video": a video's slice


@dataclass
class Done:
    """Core -> front end: an image's answer (a device_process.Output, or the error as (type, message, code, param));
    `keep`: the cache holds its file (the front end maps it and leaves it)."""

    id: int
    output: object = None
    error: tuple | None = None
    keep: bool = False
    queue_s: float = 0.0
    inference_s: float = 0.0


def error_record(e: EngineError) -> tuple:
    return type(e).__name__, e.message, e.code, e.param


def error_of(record: tuple) -> EngineError:
    kind, message, code, param = record
    return ERRORS.get(kind, EngineError)(message, code, param)
