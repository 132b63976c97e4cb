"""SGLang's encoder tier at the edge (service/sglang_tier.py): POST /encode, one part of a request a --language-only
SGLang server dispatches, and POST /scheduler_receive_url, a receiver's registration. Answers `null`, or an error in
SGLang's form (service/http_errors.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from ..api.encoding import encode_media
from ..api.http_errors import ServiceError, validation_error
from ..api.inputs import decode_input
from ..api.json_body import read_json
from ..api.responses import NULL, SGLangError, errors
from ..api.schemas import request_body
from ..api.served import Served, served
from ..ground.errors import ClientDisconnected, EngineError, NotServed
from .sglang_schemas import EncodeCall, Registration, bounded
from .sglang_tier import SGLangTier
from .vllm_tier import Options

router = APIRouter()
ANSWERS = {
    **NULL,
    **{status: {"model": SGLangError} for status in (400, 403, 413, 429, 502, 503, 504)},
    **errors(404),
}  # (a tier that is off answers in OpenAI's envelope)


def tier(request: Request) -> tuple[Served, SGLangTier]:
    """What the route serves from and the tier, where the server runs SGLang's tier (else a 404)."""
    api, sglang = served(request), request.app.state.sglang
    if sglang is None:
        raise NotServed(
            "/encode and /scheduler_receive_url serve SGLang's encoder tier: start the server with --sglang-encoder",
            "encoder_tier_off",
        )
    return api, sglang


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


@router.post("/encode", openapi_extra=request_body(EncodeCall), responses=ANSWERS)
async def sglang_encode(request: Request) -> Response:
    """The part's items encoded, the features pushed to the part's receivers, `null` back."""
    api, sglang = tier(request)

    async def serve():
        call = await read_json(request, EncodeCall, api.limits.part_values, ("url",), api.engine.decoder.bodies)
        bounded(call)
        request.state.sglang_req_id = call.req_id
        items = [
            decode_input(item.url, i, api.settings.server.allow_url_fetch, "mm_items", call.kind)
            for i, item in enumerate(call.mm_items)
        ]
        images, videos = (items, []) if call.kind == "image" else ([], items)
        await sglang.serve(
            call,
            lambda: encode_media(
                api, request, images, videos, Options(), image_field="mm_items", video_field="mm_items"
            ),
            lambda: api.engine.model.config.family,
        )

    return await sglang_call(request, serve)


@router.post("/scheduler_receive_url", openapi_extra=request_body(Registration), responses=ANSWERS)
async def sglang_receive_url(request: Request) -> Response:
    """A receiver of a part (an SGLang scheduler rank) registers where it listens."""
    api, sglang = tier(request)

    async def serve():
        body = await read_json(request, Registration, 16)
        bounded(body)
        request.state.sglang_req_id = body.req_id
        await sglang.register(body, request.client.host if request.client else None)

    return await sglang_call(request, serve)
