"""The answers every route gives, as models for `/openapi.json`. They document; they do not serialize: the
encoding routes build their bodies as bytes (service/outputs.py) and the probes return what they return, so each
model enters a route through `responses=` (never `response_model`), and tests check the real answers against it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ErrorBody(BaseModel):
    message: str
    type: str = Field(description="the status's kind: invalid_request_error, not_found_error, rate_limit_error, ...")
    param: str | None = Field(description="the input at fault, as the request wrote it (`images[1]`), if one")
    code: str = Field(description="machine-readable: docs/api.md's error table")


class ErrorAnswer(BaseModel):
    """An error in OpenAI's envelope."""

    error: ErrorBody


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    shape: list[int] | None = Field(None, description="pooling none: the token matrix's [tokens, width]")
    grid_thw: list[int] | None = Field(None, description="pooling none: the item's [t, h, w] patch grid")
    embedding: list[float] | list[list[float]] | str = Field(
        description="float: the vector (or, pooling none, one per token); base64: its little-endian float32 bytes"
    )


class EmbeddingAnswer(BaseModel):
    """/v1/embeddings' answer: one entry per input, in order."""

    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: Usage


class EncodedItem(BaseModel):
    """One item of /v1/encode's answer (a video's item adds its timing)."""

    model_config = ConfigDict(extra="allow")
    index: int = Field(description="the item's place among the request's images, or among its videos")
    modality: Literal["image", "video"]
    grid_thw: list[int]
    shape: list[int]
    dtype: str
    embeddings: str = Field(description="base64 of the raw little-endian [tokens, width] tensor in `dtype`")
    deepstack: list[str] | None = Field(description="base64 of each deepstack layer's tensor (Qwen3), else null")
    frame_indices: list[int] | None = Field(None, description="a video's sampled frames")
    fps: float | None = Field(None, description="a video's source frame rate")
    timestamps: list[float] | None = Field(None, description="a video's seconds of each slice")
    second_per_grid_t: float | None = Field(None, description="a video's seconds per slice")
    ec_id: str | None = Field(None, description="with --ec-shared-storage: the identifier vLLM reads the item by")


class EncodeAnswer(BaseModel):
    """/v1/encode's JSON answer: its items in the request's order."""

    object: Literal["list"]
    model: str
    layout: Literal["tokens", "vllm"]
    data: list[EncodedItem]
    usage: Usage
    cache_hits: int


class Capabilities(BaseModel):
    images: bool
    videos: bool


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    family: str | None
    embedding_dim: int | None
    ready: bool
    deepstack_layers: int | None
    max_images_per_request: int
    max_videos_per_request: int
    capabilities: Capabilities


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "failed"]
    error: str | None = Field(None, description="failed: why")


class Readiness(BaseModel):
    status: str = Field(description="ready, or the state that is not: loading, capturing, draining, failed")
    reason: str | None = Field(None, description="not ready: why")


class Stats(BaseModel):
    """/stats: the server's figures (docs/observability.md lists them all)."""

    model_config = ConfigDict(extra="allow")
    version: str
    model: str
    state: str
    error: str | None
    dtype: str | None
    family: str | None
    uptime_seconds: float
    requests_in_flight: int
    queue_depth: int
    latency: dict[str, Any]
    cache: dict[str, Any]
    batching: dict[str, Any]
    memory: dict[str, Any]
    tiers: dict[str, Any]


class ChatChoice(BaseModel):
    index: int
    message: dict[str, str]
    finish_reason: str


class ChatUsage(Usage):
    completion_tokens: int


class ChatCompletion(BaseModel):
    """/v1/chat/completions' answer: nothing generated; `ec_transfer_params` for vLLM's proxy."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str | None
    choices: list[ChatChoice]
    usage: ChatUsage
    ec_transfer_params: dict[str, Any] = Field(
        description="per identifier: modality, item_indices, metadata (grid, a Qwen3-VL video's timestamps)"
    )


class SGLangError(BaseModel):
    """An error as SGLang's encoder answers one."""

    status: Literal["error"]
    message: str
    req_id: str | None


def errors(*statuses: int) -> dict:
    """The `responses=` entries of errors in OpenAI's envelope."""
    return {status: {"model": ErrorAnswer} for status in statuses}


def json_and_binary(model: type[BaseModel], binary: str) -> dict:
    """A 200 answer in JSON (`model`) or, by the request's Accept, a binary body (`binary` says what it holds)."""
    return {
        200: {
            "model": model,
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary", "description": binary}}
            },
        }
    }


NULL = {200: {"description": "done", "content": {"application/json": {"schema": {"type": "null"}}}}}
