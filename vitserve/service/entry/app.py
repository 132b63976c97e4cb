"""The FastAPI app: the engine and the tiers that are on, the routers of service/api/ over them, the error handlers
(service/http_errors.py) and the gate (service/gate.py)."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ... import __version__
from ..api import embeddings, encode, probes
from ..api.gate import Gate
from ..api.http_errors import add_error_handlers
from ..api.served import Served
from ..ground.limits import RequestLimits
from ..ground.settings import Settings
from ..pipeline.engine import Engine
from ..tiers import sglang_routes as sglang
from ..tiers import vllm_routes as vllm
from ..tiers.sglang_tier import SGLangTier
from ..tiers.vllm_tier import VLLMTier

log = logging.getLogger("vitserve.app")
ROUTERS = (embeddings.router, encode.router, vllm.router, sglang.router, probes.router)


def create_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    """The app serving `engine` (else one made from `settings`), with the tiers its settings turn on."""
    engine = engine or Engine(settings)
    vllm = VLLMTier(settings.tiers, settings.model.model, engine.dtype) if settings.tiers.ec_shared_storage else None
    sglang = (
        SGLangTier(engine.dtype, settings.tiers.sglang_timeout, receivers=settings.tiers.sglang_receivers)
        if settings.tiers.sglang_encoder
        else None
    )
    if vllm is not None:
        engine.tiers["ec_storage"] = vllm.stats
    if sglang is not None:
        engine.tiers["sglang"] = sglang.stats

    app = FastAPI(title="vitserve", version=__version__, lifespan=lifespan)
    app.state.served = Served(engine, settings, RequestLimits.of(settings.limits), files=vllm)
    app.state.engine, app.state.settings, app.state.vllm, app.state.sglang = engine, settings, vllm, sglang
    add_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    app.add_middleware(Gate, settings=settings, metrics=engine.metrics, engine=engine)
    return app


@asynccontextmanager
async def lifespan(app: FastAPI):
    """The engine started before the first request and, at the end, drained and stopped; then the tiers closed."""
    served: Served = app.state.served
    vllm, sglang = app.state.vllm, app.state.sglang
    await served.engine.start()
    if vllm is not None:
        log.info(
            "vLLM encoder tier on: /v1/chat/completions, files in %s (up to %d bytes)",
            served.settings.tiers.ec_shared_storage,
            served.settings.tiers.ec_storage_bytes,
        )
    if sglang is not None:
        log.info(
            "SGLang encoder tier on: /encode and /scheduler_receive_url, features pushed to %s",
            served.settings.tiers.sglang_receivers or "any address but loopback, link-local and multicast ones",
        )
    yield
    served.engine.drain()
    await served.engine.stop()
    if vllm is not None:
        vllm.close()
    if sglang is not None:
        await sglang.close()
