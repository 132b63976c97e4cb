"""The records a front end and the core of a server with several front ends (service/hub.py, service/core.py)
exchange over the front end's pipe: small ones only (names of spool files, grids, cache keys, states), one
dataclass per message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..ground.errors import ErrorRecord
from .lifecycle import State

if TYPE_CHECKING:  # (the records stay import-light)
    from ...encoder.features import Features
    from ..devices.device_protocol import Output
    from .loader import ModelInfo

SCRAPE_SECONDS = 2.0  # a front end that does not answer a scrape within this is left out of it


# ---- the records between a front end and the core ---------------------------------------------------------------
@dataclass
class Status:
    """Core -> front end: the server's state, why it failed, and once loaded the model."""

    state: State
    error: str | None = None
    model: ModelInfo | None = None
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
    float32: bool = False  # answered in float32 (WorkItem.float32)


@dataclass
class Done:
    """Core -> front end: an image's answer (a device_protocol.Output, or its error's ErrorRecord);
    `keep`: the cache holds its file (the front end maps it and leaves it)."""

    id: int
    output: Features | Output | None = None  # an Output record (the core's devices answer in records)
    error: ErrorRecord | None = None
    keep: bool = False
    queue_s: float = 0.0
    inference_s: float = 0.0


@dataclass
class Submit:
    """Front end -> core: decoded items for the queue."""

    items: list[Item]


@dataclass
class Lookup:
    """Front end -> core: cache keys to look up (misses are claimed for this front end)."""

    id: int
    keys: list[bytes]


@dataclass
class Looked:
    """Core -> front end: per key of a Lookup, an Output record (a hit), WAIT (another computes it: a Settled
    follows), or None (claimed: this front end computes it)."""

    id: int
    answers: list


@dataclass
class Settled:
    """Core -> front end: the end of a claim that key `index` of Lookup `id` waited on (an Output record, or None:
    compute it)."""

    id: int
    index: int
    output: Features | Output | None = None  # an Output record, as Done's


@dataclass
class Evicted:
    """Core -> every front end: cache keys whose entries the core has evicted (their files removed): a front end
    that kept an entry's mapping (`HubBackend.known`) lets its pages go."""

    keys: list[bytes]


@dataclass
class StoredEntry:
    """A cache entry: its key, and its Output record (its file, its grid set)."""

    key: bytes
    output: Output


@dataclass
class Stored:
    """Core -> every front end but the one that asked: the cache entries a batch stored, so that a later hit on one
    of them is answered by whichever front end gets it, from the entry's file, without a Lookup
    (`HubBackend.named`)."""

    entries: list[StoredEntry]


@dataclass
class Touched:
    """Front end -> core: cache keys this front end answered from entries it knew (`HubBackend.known`, `named`),
    so that the core's LRU counts those hits as its own lookups would; nothing is answered."""

    keys: list[bytes]


@dataclass
class Drop:
    """Front end -> core: items (by id) whose client went away."""

    ids: list[int]


@dataclass
class Release:
    """Front end -> core: claims let go unanswered."""

    keys: list[bytes]


@dataclass
class PlansLookup:
    """Front end -> core: video keys whose header plans (encoder.video.VideoPlan) any front end has read."""

    id: int
    keys: list[bytes]


@dataclass
class Plans:
    """Core -> front end: per key of a PlansLookup, its plan or None."""

    id: int
    plans: list


@dataclass
class KeepPlans:
    """Front end -> core: videos' header plans just read, by video key, for every front end."""

    keys: list[bytes]
    plans: list


@dataclass
class Up:
    """Front end -> core: it has started (a death from now on is restarted at once)."""


@dataclass
class Answers:
    """Core -> front end: a batch's answers for this front end."""

    answers: list[Done]


@dataclass
class Scrape:
    """Front end -> core: gather the whole server's /stats or /metrics (`kind`), answered by a Scraped."""

    id: int
    kind: str


@dataclass
class Collect:
    """Core -> front end: its part of a scrape, answered by a Collected."""

    id: int
    kind: str


@dataclass
class Collected:
    """Front end -> core: its part of a scrape (its /stats dict or /metrics text)."""

    id: int
    part: object


@dataclass
class Scraped:
    """Core -> front end: the whole server's /stats dict or /metrics text."""

    id: int
    answer: object
