"""vLLM's encoder tier at the edge (service/tiers/vllm_tier.py): POST /v1/chat/completions, the request of vLLM's
disaggregated-encoder proxy. The tier is also the app's `Served.files` (service/api/served.py): with
--ec-shared-storage every encode writes its items' files."""

from __future__ import annotations

from typing import cast

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ...encoder.media import MediaBytes
from ..api.encoding import answer_beside_files, encode_media, encode_with_identifiers
from ..api.inputs import decode_input
from ..api.json_body import Text, read_json
from ..api.outputs import json_response
from ..api.responses import ChatCompletion, errors
from ..api.schemas import ChatRequest, request_body
from ..api.served import served
from ..ground.errors import NotServed
from ..pipeline.loader import ModelInfo
from .vllm_tier import chat_completion, chat_items, chat_options

router = APIRouter()


@router.post(
    "/v1/chat/completions",
    openapi_extra=request_body(ChatRequest),
    responses={200: {"model": ChatCompletion}, **errors(400, 404, 409, 413, 422, 429, 501, 503, 507)},
)
async def chat_completions(request: Request) -> Response:
    """vLLM's disaggregated-encoder proxy's request to an encoder instance: the messages' media encoded and written
    for vLLM, `ec_transfer_params` back."""
    api, tier = served(request), request.app.state.vllm
    if tier is None:
        raise NotServed(
            "/v1/chat/completions serves vLLM's encoder tier: start the server with --ec-shared-storage",
            "encoder_tier_off",
        )
    body = await read_json(request, ChatRequest, api.limits.part_values, ("url",), api.engine.decoder.bodies)
    api.check_model(body.model, api.settings.tiers.ec_model_id)  # (the consumer's model string names it too)
    items, options = chat_items(body), chat_options(body)
    images: list[MediaBytes | str] = []
    videos: list[MediaBytes | str] = []
    for item in items:
        given = images if item.modality == "image" else videos
        item.data = decode_input(
            cast("str | Text", item.data),  # a part's URL: its JSON string (chat_items)
            len(given),
            api.settings.server.allow_url_fetch,
            f"{item.modality}s",
            item.modality,
        )
        given.append(item.data)
    order = [item.modality == "video" for item in items]
    result, ids = await encode_with_identifiers(
        api, items, lambda: encode_media(api, request, images, videos, options, order), body.mm_processor_kwargs
    )
    params = tier.transfer_params(
        ids,
        items,
        [f.grid for f in result.outputs],
        [f.timing for f in result.outputs],
        cast(ModelInfo, api.engine.model).config.family == "qwen3_vl",  # (loaded: the request was admitted)
    )
    content = chat_completion(body.model, params, request.state.tokens)
    return await answer_beside_files(api, request, result, lambda: json_response(content), ids)
