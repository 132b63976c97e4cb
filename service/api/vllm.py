"""vLLM's encoder tier at the edge (service/vllm_tier.py): POST /v1/chat/completions, the request of vLLM's
disaggregated-encoder proxy, and the steps any encode takes with --ec-shared-storage (the items' identifiers beside
the encode, their files beside the answer)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..engine import Encoded
from ..errors import NotServed
from ..json_body import read_json
from ..outputs import json_response
from ..schemas import ChatRequest, request_body
from ..media import MediaItem
from ..vllm_tier import chat_completion, chat_items, chat_options
from .encoding import answer, encode_media
from .inputs import decode_input
from .responses import ChatCompletion, errors
from .served import Served, served

router = APIRouter()


async def encode_for_tier(served: Served, items: list[MediaItem], encode, kwargs: dict | None = None):
    """`encode()`'s result and, with --ec-shared-storage, the items' vLLM identifiers (computed beside the encode; a
    bad item's own error comes first), else None."""
    if served.vllm is None:
        return await encode(), None
    identifiers = asyncio.ensure_future(served.vllm.identifiers(items, kwargs))
    try:
        result = await encode()
    except BaseException:
        identifiers.cancel()
        raise
    return result, await identifiers


async def answer_beside_files(served: Served, request: Request, result: Encoded, build, ids: list[str] | None,
                              wait: bool = True) -> Response:
    """`answer`, with the items' encoder-cache files written beside its serialization (where `ids`). `wait`: the
    answer is sent once the files are in place too (whoever has it finds them: the proxy's request); else as soon as
    it is built (/v1/encode: its answer is the embeddings, never slowed by the files), the files following within
    milliseconds (a failure is logged and counted)."""
    if ids is None:
        return await answer(served, request, result, build)
    files = asyncio.ensure_future(served.vllm.write(ids, result.outputs))
    if not wait:
        files.add_done_callback(served.vllm.written)
        return await answer(served, request, result, build)
    try:
        response = await answer(served, request, result, build)
    finally:
        await files
    return response


@router.post("/v1/chat/completions", openapi_extra=request_body(ChatRequest),
             responses={200: {"model": ChatCompletion}, **errors(400, 404, 409, 413, 422, 429, 501, 503, 507)})
async def chat_completions(request: Request) -> Response:
    """vLLM's disaggregated-encoder proxy's request to an encoder instance: the messages' media encoded and written
    for vLLM, `ec_transfer_params` back."""
    api = served(request)
    if api.vllm is None:
        raise NotServed("/v1/chat/completions serves vLLM's encoder tier: start the server with --ec-shared-storage",
                        "encoder_tier_off")
    body = await read_json(request, ChatRequest, api.limits.part_values, ("url",), api.engine.decoder.bodies)
    api.check_model(body.model, api.settings.ec_model_id)  # (the consumer's model string names it too)
    items, options = chat_items(body), chat_options(body)
    images, videos = [], []
    for item in items:
        given = images if item.modality == "image" else videos
        item.data = decode_input(item.data, len(given), api.settings.allow_url_fetch, f"{item.modality}s",
                                 item.modality)
        given.append(item.data)
    order = [item.modality == "video" for item in items]
    result, ids = await encode_for_tier(api, items, lambda: encode_media(api, request, images, videos, options,
                                                                         order), body.mm_processor_kwargs)
    params = api.vllm.transfer_params(ids, items, [f.grid for f in result.outputs], [f.timing for f in result.outputs],
                                      api.engine.model.config.family == "qwen3_vl")
    content = chat_completion(body.model, params, request.state.tokens)
    return await answer_beside_files(api, request, result, lambda: json_response(content), ids)
