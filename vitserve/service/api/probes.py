"""The probes: liveness (/health), readiness (/ready), the served model (/v1/models), /stats and /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..pipeline.engine import NOT_READY, State
from .responses import Health, ModelList, Readiness, Stats
from .served import served

router = APIRouter()


@router.get("/v1/models", responses={200: {"model": ModelList}})
async def models(request: Request):
    api = served(request)
    engine, settings = api.engine, api.settings
    cfg = engine.model.config if engine.model else None
    return {
        "object": "list",
        "data": [
            {
                "id": settings.model.name,
                "object": "model",
                "created": int(engine.started),
                "owned_by": "vitserve",
                "root": settings.model.model,
                "family": cfg.family if cfg else None,
                "embedding_dim": cfg.out_hidden_size if cfg else None,
                "ready": engine.state is State.READY,
                "deepstack_layers": len(cfg.deepstack_visual_indexes) if cfg else None,
                "max_images_per_request": api.limits.images,
                "max_videos_per_request": api.limits.videos,
                "capabilities": {"images": True, "videos": engine.videos_unavailable is None},
            }
        ],
    }


@router.get("/health", responses={200: {"model": Health}, 503: {"model": Health}})
async def health(request: Request):
    engine = served(request).engine
    if engine.state is State.FAILED:
        return JSONResponse({"status": "failed", "error": engine.error}, status_code=503)
    return {"status": "ok"}


@router.get("/ready", responses={200: {"model": Readiness}, 503: {"model": Readiness}})
async def ready(request: Request):
    engine = served(request).engine
    if engine.state is not State.READY:
        reason = NOT_READY.get(engine.state, f"failed: {engine.error}")
        return JSONResponse({"status": engine.state.value, "reason": reason}, status_code=503)
    return {"status": "ready"}


@router.get("/stats", responses={200: {"model": Stats}})
async def stats(request: Request):
    return await served(request).engine.server_stats()


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"description": "Prometheus exposition text (text/plain; version=0.0.4)"}},
)
async def metrics(request: Request):
    return Response(await served(request).engine.server_metrics(), media_type=CONTENT_TYPE_LATEST)
