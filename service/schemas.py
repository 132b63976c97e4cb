"""Request bodies. Unknown fields are refused (422) so a typo never silently changes what is computed."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from ..encoder.vision_encoder import DTYPES
from .outputs import OUTPUT_DTYPES


def canonical_dtype(value):
    """A dtype as a request may write it, the CLI's aliases included (fp32, fp16, bf16, half), as its canonical name;
    anything else is left for the Literal to refuse."""
    return str(DTYPES[value]).removeprefix("torch.") if isinstance(value, str) and value in DTYPES else value


DType = Annotated[Literal[tuple(OUTPUT_DTYPES)], BeforeValidator(canonical_dtype),
                  Field(description="float32, float16 or bfloat16 (or fp32, fp16, bf16, half)")]

MAX_PIXELS = Field(default=None, gt=0, description="cap on the resized image's pixels for this request (at most the "
                                                   "server's own, which also applies when this is larger)")


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request; `input` items are images (data URIs, base64, or URLs when enabled)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[str] = Field(min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    pooling: Literal["mean", "none"] = "mean"  # extension: mean = one vector per image; none = the token matrix
    normalize: bool = False  # extension: L2-normalize each returned vector (the pooled one, or each token)
    max_pixels: int | None = MAX_PIXELS
    user: str | None = None
    modality: Literal["image"] | None = None  # Infinity's field, accepted for compatibility
    dimensions: int | None = None

    @field_validator("dimensions")
    @classmethod
    def no_dimensions(cls, v):
        if v is not None:
            raise ValueError("dimensions is not supported: the output size is the model's embedding size")
        return v


class EncodeRequest(BaseModel):
    """Native request: images for an LLM prefill, token embeddings (and Qwen3 deepstack features) back."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    images: list[str] = Field(min_length=1)
    dtype: DType = "float32"
    deepstack: bool = True
    layout: Literal["tokens", "vllm"] = "tokens"  # vllm: one tensor per image, deepstack concatenated on the width
    max_pixels: int | None = MAX_PIXELS


class EncodeForm(BaseModel):
    """The multipart form of /v1/encode: image files in any file field (`images` by convention), and these fields."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    dtype: DType = "float32"
    deepstack: bool = True
    layout: Literal["tokens", "vllm"] = "tokens"
    max_pixels: int | None = MAX_PIXELS
