"""POST /v1/encode: images and videos (JSON, or files of a multipart form) to token embeddings for an LLM's prefill,
as JSON or one safetensors body; the items in the request's order."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from ...encoder.video import sniff
from ..ground.errors import InputRejected
from ..ground.media import MediaItem
from .encoding import answer_beside_files, encode_media, encode_with_identifiers
from .http_errors import ServiceError
from .inputs import decode_input
from .json_body import read_json
from .outputs import PartsResponse, encode_data, json_response, laid_out, safetensors_parts, work_bytes
from .responses import EncodeAnswer, errors, json_and_binary
from .schemas import EncodeForm, EncodeRequest, check_uuid_counts, request_body
from .served import Served, served

router = APIRouter()
SAFETENSORS = (
    "one safetensors body: tensors images.{i}.embeddings and images.{i}.deepstack.{j}, metadata grid_thw, "
    "model, dtype, tokens, layout (and videos, ec_ids)"
)


@dataclass
class EncodeInput:
    """A /v1/encode request as read: its fields, its images and videos, and per item in the request's order whether
    it is a video."""

    body: EncodeRequest | EncodeForm
    images: list
    videos: list
    order: list[bool]


async def form_input(api: Served, request: Request) -> EncodeInput:
    """A multipart request: its file parts (images and videos, told apart by their content) in their order, its
    fields (`dtype` and `layout` also from the query) validated as EncodeForm."""
    form = await request.form(max_files=api.limits.form_files, max_fields=64)
    files = [await v.read() for _, v in form.multi_items() if isinstance(v, UploadFile)]
    fields = {k: v for k, v in form.multi_items() if not isinstance(v, UploadFile)}
    await form.close()
    if not files:
        raise InputRejected("multipart body has no file parts", "no_images", "images")
    is_video = await asyncio.to_thread(lambda: [sniff(bytes(f[:512])) is not None for f in files])
    images = [f for f, v in zip(files, is_video) if not v]
    videos = [f for f, v in zip(files, is_video) if v]
    for name in ("dtype", "layout"):
        if name in request.query_params:
            fields.setdefault(name, request.query_params[name])
    try:
        body = EncodeForm.model_validate(fields)
        check_uuid_counts(body.multi_modal_uuids, {"image": len(images), "video": len(videos)})
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
    except ValueError as e:  # the body's validation, as a JSON body's is (the edge's 422)
        raise ServiceError(422, str(e), "invalid_request", "multi_modal_uuids") from None
    return EncodeInput(body, images, videos, is_video)  # the answer keeps the files' order


async def json_input(api: Served, request: Request) -> EncodeInput:
    """A JSON request: its `images`, then its `videos` (the answer's order)."""
    body = await read_json(request, EncodeRequest, api.limits.items, ("images", "videos"), api.engine.decoder.bodies)
    allow_url = api.settings.server.allow_url_fetch
    images = [decode_input(item, i, allow_url, "images") for i, item in enumerate(body.images)]
    videos = [decode_input(item, i, allow_url, "videos", "video") for i, item in enumerate(body.videos)]
    return EncodeInput(body, images, videos, [False] * len(images) + [True] * len(videos))


def tier_items(given: EncodeInput) -> list[MediaItem]:
    """The request's items for the vLLM tier, in the answer's order, each with its uuid (`multi_modal_uuids`, per
    modality in the order of its items)."""
    uuids = given.body.multi_modal_uuids or {}
    by_kind = {"image": iter(enumerate(given.images)), "video": iter(enumerate(given.videos))}
    items = []
    for is_video in given.order:
        kind: Literal["image", "video"] = "video" if is_video else "image"
        i, data = next(by_kind[kind])
        items.append(MediaItem(kind, data, (uuids.get(kind) or [None] * (i + 1))[i], f"{kind}s[{i}]"))
    return items


@router.post(
    "/v1/encode",
    openapi_extra=request_body(EncodeRequest, EncodeForm),
    responses={**json_and_binary(EncodeAnswer, SAFETENSORS), **errors(400, 404, 413, 422, 429, 501, 503, 507)},
)
async def encode(request: Request) -> Response:
    api = served(request)
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        given = await form_input(api, request)
    else:
        given = await json_input(api, request)
    body = given.body
    api.check_model(body.model)
    result, ids = await encode_with_identifiers(
        api,
        tier_items(given),
        lambda: encode_media(
            api, request, given.images, given.videos, body, given.order, float32=body.dtype == "float32"
        ),
    )

    raw = "application/octet-stream" in request.headers.get("accept", "")

    def build() -> Response:
        tokens = request.state.tokens
        answers = [laid_out(item, body.layout) for item in result.outputs]
        if raw:
            metadata = {
                "model": api.settings.model.name,
                "grid_thw": json.dumps([item.grid for item in answers]),
                "dtype": body.dtype,
                "tokens": str(tokens),
                "layout": body.layout,
            }
            if any(item.timing is not None for item in answers):  # per item: null for an image, a video's timing
                metadata["videos"] = json.dumps([item.timing for item in answers])
            if ids is not None:
                metadata["ec_ids"] = json.dumps(ids)
            return PartsResponse(
                safetensors_parts(answers, body.dtype, metadata, body.deepstack), media_type="application/octet-stream"
            )
        data = encode_data(answers, body.dtype, body.deepstack, ids)
        return json_response(
            {
                "object": "list",
                "model": api.settings.model.name,
                "layout": body.layout,
                "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "cache_hits": result.cache_hits,
            }
        )

    work = work_bytes(result.outputs, body.dtype, body.layout, raw)
    return await answer_beside_files(api, request, result, build, ids, wait=False, work=work)
