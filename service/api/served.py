"""What the routes serve from: one record on the app's state, read by each route from its request."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from ..engine import Engine
from ..errors import NotServed, clip
from ..limits import RequestLimits
from ..settings import Settings
from ..sglang_tier import SGLangTier
from ..vllm_tier import VLLMTier


@dataclass
class Served:
    """The engine, the settings, what one request may hold, and the tiers that are on (None: off)."""

    engine: Engine
    settings: Settings
    limits: RequestLimits
    vllm: VLLMTier | None = None
    sglang: SGLangTier | None = None

    def check_model(self, name: str | None, *others: str | None) -> None:
        """`name` (a request's `model`) is the served model, its --model, or one of `others` (else a 404)."""
        if name is not None and name not in (self.settings.model_name, self.settings.model, *others):
            raise NotServed(f"model {clip(name)!r} is not served here; this server serves "
                            f"{self.settings.model_name!r}", "model_not_found", "model")


def served(request: Request) -> Served:
    return request.app.state.served
