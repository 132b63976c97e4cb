"""What the routes serve from: one record on the app's state, read by each route from its request."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from fastapi import Request

from ...encoder.features import Features
from ..ground.errors import NotServed, clip
from ..ground.limits import RequestLimits
from ..ground.media import MediaItem
from ..ground.settings import Settings
from ..pipeline.engine import Engine


class ItemFiles(Protocol):
    """Where every encoded item is also written, under an identifier of its own (vLLM's encoder tier, when on):
    the identifiers are computed beside the encode, the files written beside the answer."""

    async def identifiers(self, items: list[MediaItem], kwargs: dict | None = None) -> list[str]: ...

    async def write(self, identifiers: list[str], items: list[Features]) -> None: ...

    def written(self, job: asyncio.Future) -> None: ...


@dataclass
class Served:
    """The engine, the settings, what one request may hold, and where the items are also written (None: nowhere).
    A tier's own state is the tier's (its routes read it from the app's state)."""

    engine: Engine
    settings: Settings
    limits: RequestLimits
    files: ItemFiles | None = None

    def check_model(self, name: str | None, *others: str | None) -> None:
        """`name` (a request's `model`) is the served model, its --model, or one of `others` (else a 404)."""
        if name is not None and name not in (self.settings.model.name, self.settings.model.model, *others):
            raise NotServed(
                f"model {clip(name)!r} is not served here; this server serves {self.settings.model.name!r}",
                "model_not_found",
                "model",
            )


def served(request: Request) -> Served:
    return request.app.state.served
