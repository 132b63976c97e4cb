"""POST /v1/embeddings: OpenAI's embeddings of images (or videos, `modality: video`): one pooled vector per item, or
its token matrix."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .encoding import answer, encode_images, encode_media
from .inputs import decode_input
from .json_body import read_json
from .outputs import embedding_data, json_response
from .responses import EmbeddingAnswer, errors
from .schemas import EmbeddingRequest, request_body
from .served import served

router = APIRouter()


@router.post(
    "/v1/embeddings",
    openapi_extra=request_body(EmbeddingRequest),
    responses={200: {"model": EmbeddingAnswer}, **errors(400, 404, 413, 422, 429, 501, 503)},
)
async def embeddings(request: Request) -> Response:
    api = served(request)
    body = await read_json(request, EmbeddingRequest, api.limits.images, ("input",), api.engine.decoder.bodies)
    api.check_model(body.model)
    inputs = body.input if isinstance(body.input, list) else [body.input]
    kind = body.modality or "image"
    items = [decode_input(item, i, api.settings.server.allow_url_fetch, "input", kind) for i, item in enumerate(inputs)]
    mean = body.pooling == "mean"  # taken on the device: only the vectors come back
    # the tokens' embeddings are float32 (as the means are): widened on the device. A video's mean is taken over its
    # slices' tokens in float32 (Features.join), so it takes the float32 slices too: one entry with token requests
    if kind == "video":
        result = await encode_media(api, request, [], items, body, mean_pooling=mean, video_field="input", float32=True)
    else:
        result = await encode_images(api, request, items, "input", mean, body.max_pixels, float32=not mean)

    def build() -> Response:
        tokens = request.state.tokens
        data = embedding_data(result.outputs, body.normalize, body.encoding_format, mean)
        return json_response(
            {
                "object": "list",
                "data": data,
                "model": api.settings.model.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    return await answer(api, request, result, build)
