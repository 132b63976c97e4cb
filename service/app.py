"""FastAPI routes and error handlers: requests in, the engine's `encode` called once, responses out."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import re
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import UploadFile

from .. import __version__
from ..encoder.preprocess import Base64Data
from ..encoder.video import sniff

from .engine import NOT_READY, Encoded, Engine, State
from .errors import ClientDisconnected, EngineError, clip
from .gate import Gate
from .http_errors import ServiceError, add_error_handlers, validation_error
from .json_body import Text, read_json
from .limits import RequestLimits
from .outputs import (OFF_LOOP_BYTES, PartsResponse, answer_bytes, answered, embedding_data, encode_data,
                      json_response, laid_out, safetensors_parts)
from .schemas import ChatRequest, EmbeddingRequest, EncodeForm, EncodeRequest, check_uuid_counts
from .settings import Settings
from .sglang_tier import CALL_LIMITS, REGISTRATION_LIMITS, EncodeCall, Registration, SGLangTier, bounded
from .vllm_tier import Item, Options, VLLMTier, chat_completion, chat_items, chat_options


log = logging.getLogger("vitserve.app")


def request_body(model: type[BaseModel], form: type[BaseModel] | None = None) -> dict:
    """The OpenAPI entry of a body parsed by `read_json` (FastAPI documents only the ones it parses), and of a
    multipart form: image files plus `form`'s fields."""
    content = {"application/json": {"schema": model.model_json_schema()}}
    if form is not None:
        schema = form.model_json_schema()
        schema["properties"] = {"images": {"type": "array", "items": {"type": "string", "format": "binary"},
                                           "description": "image files (any file field name)"},
                                **schema["properties"]}
        schema["required"] = ["images"]
        content["multipart/form-data"] = {"schema": schema}
    return {"requestBody": {"required": True, "content": content}}


URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]{0,15})://")  # file://, ftp://...: a URL, never base64


def decode_input(item: str | Text, index: int, allow_url: bool, field: str = "input",
                 kind: str = "image") -> Base64Data | str:
    """A data URI, bare base64, or (when enabled) an http(s) URL left for the fetcher; `kind`: image or video (the
    data URI's media type). Only the item's head is read here: its payload is not copied (a `Text` stays a view of
    the request's body)."""
    param = f"{field}[{index}]"
    head = item[:5120] if isinstance(item, str) else item.head(5120)
    if head.startswith(("http://", "https://")):
        if not allow_url:
            raise ServiceError(400, f"{param}: {kind} URLs are disabled on this server; send a data URI or base64",
                               "url_fetch_disabled", param)
        return str(item)
    if scheme := URL_SCHEME.match(head):
        raise ServiceError(400, f"{param}: {scheme[1]}:// URLs are not read; send a data URI or base64"
                                + (", or an http(s) URL" if allow_url else ""), "invalid_url", param)
    start = 0
    if head.startswith("data:"):
        comma = head.find(",", 0, 1024)  # a data URI's header is short
        media = head[5:comma if comma >= 0 else 1024].split(";")
        if kind == "image" and media[0].startswith("video/"):
            raise ServiceError(400, f"{param}: this is a video, not an image: send it in `videos` (/v1/encode) or "
                                    "with modality video (/v1/embeddings)", "video_input", param)
        if kind == "video" and media[0].startswith("image/"):
            raise ServiceError(400, f"{param}: this is an image, not a video: send it in `images` (/v1/encode) or "
                                    "without modality video (/v1/embeddings)", "not_a_video", param)
        if comma < 0 or not media[0].startswith(f"{kind}/") or "base64" not in media[1:]:
            raise ServiceError(400, f"{param}: expected data:{kind}/<type>;base64,<data>, got media type "
                                    f"{clip(';'.join(media))!r}", "invalid_media_type", param)
        start = comma + 1
    if not head[start:start + 4096].strip():  # (a payload that opens with 4 KB of whitespace is no image either)
        raise ServiceError(400, f"{param}: empty {kind}", f"invalid_{kind}", param)
    if isinstance(item, str):
        return Base64Data(item, start)  # decoded by a decode worker
    return Base64Data(item.view, start, item.shared)  # (read by it in place, where the body is shared)


def request_order(order: list[bool]) -> list[int]:
    """Per item of a request (`order`: whether it is a video), its place among the request's images, then its
    videos."""
    images = order.count(False)
    image_at, video_at = iter(range(images)), iter(range(images, len(order)))
    return [next(video_at) if is_video else next(image_at) for is_video in order]


def in_order(result: Encoded, order: list[bool]) -> Encoded:
    """`result`, the images' items first, then the videos', in the request's order: `order` says per item whether it
    is a video."""
    where = request_order(order)
    return dataclasses.replace(result, outputs=[result.outputs[i] for i in where],
                               grids=[result.grids[i] for i in where],
                               videos=result.videos and [result.videos[i] for i in where])


def create_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    engine = engine or Engine(settings)
    limits = RequestLimits.of(settings)
    tier = VLLMTier(settings, engine.dtype) if settings.ec_shared_storage else None
    sglang = (SGLangTier(engine.dtype, settings.sglang_timeout, receivers=settings.sglang_receivers)
              if settings.sglang_encoder else None)
    if tier is not None:
        engine.tiers["ec_storage"] = tier.stats
    if sglang is not None:
        engine.tiers["sglang"] = sglang.stats

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        if tier is not None:
            log.info("vLLM encoder tier on: /v1/chat/completions, files in %s (up to %d bytes)",
                     settings.ec_shared_storage, settings.ec_storage_bytes)
        if sglang is not None:
            log.info("SGLang encoder tier on: /encode and /scheduler_receive_url, features pushed to %s",
                     settings.sglang_receivers or "any address but loopback, link-local and multicast ones")
        yield
        engine.drain()
        await engine.stop()
        if tier is not None:
            tier.close()
        if sglang is not None:
            await sglang.close()

    app = FastAPI(title="vitserve", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.settings = settings

    add_error_handlers(app)

    def noted(request: Request, result: Encoded) -> Encoded:
        """The request's counts and phases on its state, for its access line."""
        unit = engine.model.config.merge_unit
        request.state.images, request.state.tokens = len(result.grids), sum(math.prod(g) // unit for g in result.grids)
        for phase in ("decode", "queue", "inference"):
            setattr(request.state, f"{phase}_ms", round(getattr(result, f"{phase}_s") * 1e3, 2))
        request.state.cache_hits = result.cache_hits
        return result

    async def while_connected(request: Request, run) -> Encoded:
        """`run(disconnected)`, with a future that resolves if the client leaves first."""
        disconnected = asyncio.ensure_future(_wait_disconnect(request))
        try:
            return await run(disconnected)
        finally:
            disconnected.cancel()

    async def encode_images(request: Request, images: list, field: str, mean_pooling: bool = False,
                            max_pixels: int | None = None) -> Encoded:
        limits.check_images(len(images), field)
        client = request.scope["state"].get("client")
        return noted(request, await while_connected(request, lambda disconnected: engine.encode(
            images, mean_pooling, disconnected, field, max_pixels, client)))

    async def encode_videos(request: Request, videos: list, field: str, options: dict, mean_pooling: bool = False,
                            max_pixels: int | None = None) -> Encoded:
        if engine.videos_unavailable:  # the server's condition, not the request's fault
            raise ServiceError(501, f"this server cannot decode videos: {engine.videos_unavailable}",
                               "videos_unavailable", field)
        limits.check_videos(len(videos), field)
        return await while_connected(request, lambda disconnected: engine.encode_videos(
            videos, options, mean_pooling, disconnected, field, max_pixels))

    async def encode_all(request: Request, images: list, videos: list, body, mean_pooling: bool = False,
                         image_field: str = "images", video_field: str = "videos",
                         order: list[bool] | None = None) -> Encoded:
        """A request's images and videos side by side; one Encoded with the images' items first, then the videos'
        (`videos`: None per image, then each video's timing), or in the request's `order` (per item whether it is a
        video); the request's counts and phases on its state."""
        jobs = []
        if images:
            jobs.append(encode_images(request, images, image_field, mean_pooling, body.max_pixels))
        if videos:
            jobs.append(encode_videos(request, videos, video_field, body.video_options(), mean_pooling,
                                      body.max_pixels))
        tasks = [asyncio.ensure_future(job) for job in jobs]
        try:
            parts = await asyncio.gather(*tasks)
        except BaseException:  # one failed (or the request is gone): the other's work is not needed
            for task in tasks:
                task.cancel()
            raise
        if len(parts) == 1 and not videos:
            return parts[0]
        image, video = (parts[0], parts[1]) if images else (None, parts[0])
        result = Encoded((image.outputs if image else []) + video.outputs, (image.grids if image else []) + video.grids,
                         max(p.decode_s for p in parts), max(p.queue_s for p in parts),
                         max(p.inference_s for p in parts), image.cache_hits if image else 0,
                         [None] * len(images) + video.videos)
        return noted(request, result if order is None else in_order(result, order))

    async def answer(request: Request, result: Encoded, build) -> Response:
        """The response `build()` makes (in a thread for an answer of `OFF_LOOP_BYTES` or more: its conversions
        and base64 are bytes work), timed as the serialize phase; every phase in the headers (ms)."""
        start = time.perf_counter()
        response = await asyncio.to_thread(build) if answer_bytes(answered(result)) >= OFF_LOOP_BYTES else build()
        seconds = time.perf_counter() - start
        engine.metrics.serialize_seconds.observe(seconds)
        engine.metrics.record("serialize", seconds)
        request.state.serialize_ms = round(seconds * 1e3, 2)
        response.headers.update({
            "x-decode-time": f"{result.decode_s * 1e3:.2f}", "x-queue-time": f"{result.queue_s * 1e3:.2f}",
            "x-inference-time": f"{result.inference_s * 1e3:.2f}", "x-serialize-time": f"{seconds * 1e3:.2f}",
            "x-cache-hits": str(result.cache_hits)})
        return response

    def check_model(name: str | None, *others: str | None) -> None:
        """`name` (a request's `model`) is the served model, its --model, or one of `others` (else a 404)."""
        if name is not None and name not in (settings.model_name, settings.model, *others):
            raise ServiceError(404, f"model {clip(name)!r} is not served here; this server serves "
                                    f"{settings.model_name!r}", "model_not_found", "model")

    @app.post("/v1/embeddings", openapi_extra=request_body(EmbeddingRequest))
    async def embeddings(request: Request):
        body = await read_json(request, EmbeddingRequest, limits.images, ("input",), engine.decoder.bodies)
        check_model(body.model)
        inputs = body.input if isinstance(body.input, list) else [body.input]
        kind = body.modality or "image"
        items = [decode_input(item, i, settings.allow_url_fetch, "input", kind) for i, item in enumerate(inputs)]
        mean = body.pooling == "mean"  # taken on the device: only the vectors come back
        if kind == "video":
            result = await encode_all(request, [], items, body, mean, video_field="input")
        else:
            result = await encode_images(request, items, "input", mean, body.max_pixels)

        def build() -> Response:
            tokens = request.state.tokens
            data = embedding_data(answered(result), body.normalize, body.encoding_format, mean)
            return json_response({"object": "list", "data": data, "model": settings.model_name,
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

        return await answer(request, result, build)

    @app.post("/v1/encode", openapi_extra=request_body(EncodeRequest, EncodeForm))
    async def encode(request: Request):
        if request.headers.get("content-type", "").startswith("multipart/form-data"):
            form = await request.form(max_files=limits.form_files, max_fields=64)
            files = [await v.read() for _, v in form.multi_items() if isinstance(v, UploadFile)]
            fields = {k: v for k, v in form.multi_items() if not isinstance(v, UploadFile)}
            await form.close()
            if not files:
                raise ServiceError(400, "multipart body has no file parts", "no_images", "images")
            is_video = await asyncio.to_thread(lambda: [sniff(bytes(f[:512])) is not None for f in files])
            images = [f for f, v in zip(files, is_video) if not v]
            videos = [f for f, v in zip(files, is_video) if v]
            order = is_video  # the answer keeps the files' order
            for name in ("dtype", "layout"):
                if name in request.query_params:
                    fields.setdefault(name, request.query_params[name])
            try:
                body = EncodeForm.model_validate(fields)
                check_uuid_counts(body.multi_modal_uuids, {"image": len(images), "video": len(videos)})
            except ValidationError as e:
                raise RequestValidationError(e.errors()) from None
            except ValueError as e:
                raise ServiceError(422, str(e), "invalid_request", "multi_modal_uuids") from None
        else:
            body = await read_json(request, EncodeRequest, limits.items, ("images", "videos"), engine.decoder.bodies)
            images = [decode_input(item, i, settings.allow_url_fetch, "images") for i, item in enumerate(body.images)]
            videos = [decode_input(item, i, settings.allow_url_fetch, "videos", "video")
                      for i, item in enumerate(body.videos)]
            order = [False] * len(images) + [True] * len(videos)  # the images, then the videos
        check_model(body.model)
        uuids = getattr(body, "multi_modal_uuids", None) or {}
        items = [Item(kind, data, (uuids.get(kind) or [None] * len(given))[i], f"{kind}s[{i}]")
                 for kind, given in (("image", images), ("video", videos)) for i, data in enumerate(given)]
        items = [items[i] for i in request_order(order)]  # in the answer's order (so are their identifiers)
        result, ids = await encode_for_tier(request, items, lambda: encode_all(request, images, videos, body,
                                                                                  order=order))

        def build() -> Response:
            tokens = request.state.tokens
            answers = [laid_out(item, body.layout) for item in answered(result)]
            if "application/octet-stream" in request.headers.get("accept", ""):
                metadata = {"model": settings.model_name, "grid_thw": json.dumps(result.grids), "dtype": body.dtype,
                            "tokens": str(tokens), "layout": body.layout}
                if result.videos:  # per item: null for an image, a video's timing
                    metadata["videos"] = json.dumps(result.videos)
                if ids is not None:
                    metadata["ec_ids"] = json.dumps(ids)
                return PartsResponse(safetensors_parts(answers, body.dtype, metadata, body.deepstack),
                                     media_type="application/octet-stream")
            data = encode_data(answers, body.dtype, body.deepstack, ids)
            return json_response({"object": "list", "model": settings.model_name, "layout": body.layout,
                                  "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                                  "cache_hits": result.cache_hits})

        return await answer_beside_files(request, result, build, ids, wait=False)

    async def encode_for_tier(request: Request, items: list[Item], encode, kwargs: dict | None = None):
        """`encode()`'s result and, with --ec-shared-storage, the items' vLLM identifiers (computed beside the
        encode; a bad item's own error comes first), else None."""
        if tier is None:
            return await encode(), None
        identifiers = asyncio.ensure_future(tier.identifiers(items, kwargs))
        try:
            result = await encode()
        except BaseException:
            identifiers.cancel()
            raise
        return result, await identifiers

    async def answer_beside_files(request: Request, result: Encoded, build, ids: list[str] | None,
                                  wait: bool = True) -> Response:
        """`answer`, with the items' encoder-cache files written beside its serialization (where `ids`). `wait`:
        the answer is sent once the files are in place too (whoever has it finds them: the proxy's request); else
        as soon as it is built (/v1/encode: its answer is the embeddings, never slowed by the files), the files
        following within milliseconds (a failure is logged and counted)."""
        if ids is None:
            return await answer(request, result, build)
        files = asyncio.ensure_future(tier.write(ids, answered(result)))
        if not wait:
            files.add_done_callback(tier.written)
            return await answer(request, result, build)
        try:
            response = await answer(request, result, build)
        finally:
            await files
        return response

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatRequest))
    async def chat_completions(request: Request):
        """vLLM's disaggregated-encoder proxy's request to an encoder instance (service/vllm_tier.py): the
        messages' media encoded and written for vLLM, `ec_transfer_params` back."""
        if tier is None:
            raise ServiceError(404, "/v1/chat/completions serves vLLM's encoder tier: start the server with "
                                    "--ec-shared-storage", "encoder_tier_off")
        body = await read_json(request, ChatRequest, limits.part_values, ("url",), engine.decoder.bodies)
        check_model(body.model, settings.ec_model_id)  # (the consumer's model string names it too)
        items, options = chat_items(body), chat_options(body)
        images, videos = [], []
        for item in items:
            given = images if item.modality == "image" else videos
            item.data = decode_input(item.data, len(given), settings.allow_url_fetch, f"{item.modality}s",
                                     item.modality)
            given.append(item.data)
        result, ids = await encode_for_tier(request, items, lambda: encode_all(request, images, videos, options),
                                            body.mm_processor_kwargs)
        order = [i for kind in ("image", "video") for i, item in enumerate(items) if item.modality == kind]
        grids, timing = [None] * len(items), [None] * len(items)
        for position, i in enumerate(order):  # encode_all answers the images first, then the videos
            grids[i], timing[i] = result.grids[position], (result.videos or [None] * len(order))[position]
        params = tier.transfer_params(ids, items, grids, timing, engine.model.config.family == "qwen3_vl")
        content = chat_completion(body.model, params, request.state.tokens)
        return await answer_beside_files(request, result, lambda: json_response(content), [ids[i] for i in order])

    def check_sglang() -> None:
        if sglang is None:
            raise ServiceError(404, "/encode and /scheduler_receive_url serve SGLang's encoder tier: start the "
                                    "server with --sglang-encoder", "encoder_tier_off")

    async def sglang_call(request: Request, serve) -> Response:
        """`serve()`'s answer (`null`), or its error in SGLang's form (with the `req_id` that `serve` leaves in the
        request's state); a departed client gets nothing (499)."""
        request.state.sglang_req_id = None
        try:
            await serve()
        except ClientDisconnected:
            return Response(status_code=499)
        except (ServiceError, EngineError) as e:
            error = e if isinstance(e, ServiceError) else ServiceError.of(e)
            return error.sglang_response(request.state.sglang_req_id)
        except RequestValidationError as e:
            return validation_error(e, 400).sglang_response(request.state.sglang_req_id)
        return JSONResponse(None)

    @app.post("/encode", openapi_extra=request_body(EncodeCall))
    async def sglang_encode(request: Request):
        """One part of a request that a --language-only SGLang server dispatches to its encoders
        (service/sglang_tier.py): its items encoded, the features pushed to the part's receivers, `null` back."""
        check_sglang()

        async def serve():
            call = await read_json(request, EncodeCall, limits.part_values, ("url",), engine.decoder.bodies)
            bounded(call, CALL_LIMITS)
            request.state.sglang_req_id = call.req_id
            items = [decode_input(item.url, i, settings.allow_url_fetch, "mm_items", call.kind)
                     for i, item in enumerate(call.mm_items)]
            images, videos = (items, []) if call.kind == "image" else ([], items)
            await sglang.serve(call, lambda: encode_all(request, images, videos, Options(), image_field="mm_items",
                                                        video_field="mm_items"), lambda: engine.model.config.family)

        return await sglang_call(request, serve)

    @app.post("/scheduler_receive_url", openapi_extra=request_body(Registration))
    async def sglang_receive_url(request: Request):
        """A receiver of a part (an SGLang scheduler rank) registers where it listens (service/sglang_tier.py)."""
        check_sglang()

        async def serve():
            body = await read_json(request, Registration, 16)
            bounded(body, REGISTRATION_LIMITS)
            request.state.sglang_req_id = body.req_id
            await sglang.register(body, request.client.host if request.client else None)

        return await sglang_call(request, serve)

    @app.get("/v1/models")
    async def models():
        cfg = engine.model.config if engine.model else None
        return {"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": int(engine.started), "owned_by": "vitserve",
            "root": settings.model, "family": cfg.family if cfg else None,
            "embedding_dim": cfg.out_hidden_size if cfg else None, "ready": engine.state is State.READY,
            "deepstack_layers": len(cfg.deepstack_visual_indexes) if cfg else None,
            "max_images_per_request": limits.images, "max_videos_per_request": limits.videos,
            "capabilities": {"images": True, "videos": engine.videos_unavailable is None}}]}

    @app.get("/health")
    async def health():
        if engine.state is State.FAILED:
            return JSONResponse({"status": "failed", "error": engine.error}, status_code=503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if engine.state is not State.READY:
            reason = NOT_READY.get(engine.state, f"failed: {engine.error}")
            return JSONResponse({"status": engine.state.value, "reason": reason}, status_code=503)
        return {"status": "ready"}

    @app.get("/stats")
    async def stats():
        return await engine.server_stats()

    @app.get("/metrics")
    async def metrics():
        return Response(await engine.server_metrics(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(Gate, settings=settings, metrics=engine.metrics, engine=engine)
    return app


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
