"""Request bodies. Unknown fields are refused (422) so a typo never silently changes what is computed. (The answers'
models: service/api/responses.py.)"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Json, field_validator, model_validator

from ...encoder.vision_encoder import DTYPES
from .outputs import OUTPUT_DTYPES


def request_body(model: type[BaseModel], form: type[BaseModel] | None = None) -> dict:
    """The OpenAPI entry of a body parsed by `read_json` (FastAPI documents only the ones it parses), and of a
    multipart form: image files plus `form`'s fields."""
    content = {"application/json": {"schema": model.model_json_schema()}}
    if form is not None:
        schema = form.model_json_schema()
        schema["properties"] = {
            "images": {
                "type": "array",
                "items": {"type": "string", "format": "binary"},
                "description": "image files (any file field name)",
            },
            **schema["properties"],
        }
        schema["required"] = ["images"]
        content["multipart/form-data"] = {"schema": schema}
    return {"requestBody": {"required": True, "content": content}}


def canonical_dtype(value):
    """A dtype as a request may write it, the CLI's aliases included (fp32, fp16, bf16, half), as its canonical name;
    anything else is left for the Literal to refuse."""
    return str(DTYPES[value]).removeprefix("torch.") if isinstance(value, str) and value in DTYPES else value


if TYPE_CHECKING:  # a Literal of OUTPUT_DTYPES' names, made at run time: mypy sees a str
    DType = str
else:
    DType = Annotated[
        Literal[tuple(OUTPUT_DTYPES)],
        BeforeValidator(canonical_dtype),
        Field(description="float32, float16 or bfloat16 (or fp32, fp16, bf16, half)"),
    ]

MAX_PIXELS = Field(
    default=None,
    gt=0,
    description="cap on the resized image's pixels for this request (at most the "
    "server's own, which also applies when this is larger)",
)


class VideoOptions(BaseModel):
    """How a request's videos are sampled (transformers' video processor arguments), within the server's limits."""

    fps: float | None = Field(default=None, gt=0, le=240, description="frames sampled a second of video")
    num_frames: int | None = Field(
        default=None,
        gt=0,
        description="frames sampled from each video, evenly (instead of fps; at most --max-video-frames)",
    )
    max_frames: int | None = Field(
        default=None, gt=0, description="at most this many frames a video (and at most --max-video-frames)"
    )
    truncate_frames: bool = Field(
        default=False,
        description="a num_frames over a video's frames takes them all instead of a 400 (TEI's truncate, for frames)",
    )

    @model_validator(mode="after")
    def one_rate(self):
        if self.fps is not None and self.num_frames is not None:
            raise ValueError("fps and num_frames are mutually exclusive: give one")
        return self

    def video_options(self) -> dict:
        return {
            "fps": self.fps,
            "num_frames": self.num_frames,
            "max_frames": self.max_frames,
            "truncate_frames": self.truncate_frames,
        }


class EmbeddingRequest(VideoOptions):
    """OpenAI's embeddings request; `input` items are images (data URIs, base64, or URLs when enabled), or videos
    with `modality: "video"` (one pooled vector per video)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[str] = Field(min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    pooling: Literal["mean", "none"] = "mean"  # extension: mean = one vector per image; none = the token matrix
    normalize: bool = False  # extension: L2-normalize each returned vector (the pooled one, or each token)
    max_pixels: int | None = MAX_PIXELS
    user: str | None = None
    modality: Literal["image", "video"] | None = None  # Infinity's field: what `input` holds (default image)
    dimensions: int | None = None

    @field_validator("dimensions")
    @classmethod
    def no_dimensions(cls, v):
        if v is not None:
            raise ValueError("dimensions is not supported: the output size is the model's embedding size")
        return v


# with --ec-shared-storage: vLLM's uuids of the items by modality, in their order (the identifiers their files are
# named by; None: vLLM's own content hash of the image; a video needs one)
MultiModalUUIDs = dict[Literal["image", "video"], list[str | None]]


def check_uuid_counts(uuids: MultiModalUUIDs | None, counts: dict[Literal["image", "video"], int]) -> None:
    """ValueError where `multi_modal_uuids` has a modality's list, of another length than its items."""
    for modality, count in counts.items():
        given = (uuids or {}).get(modality)
        if given is not None and len(given) != count:
            raise ValueError(f"multi_modal_uuids.{modality} has {len(given)} entries for {count} {modality}s")


class EncodeRequest(VideoOptions):
    """Native request: images and videos for an LLM prefill, token embeddings (and Qwen3 deepstack features)
    back, with each video's timing."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    images: list[str] = []
    videos: list[str] = []
    dtype: DType = "float32"
    deepstack: bool = True
    layout: Literal["tokens", "vllm"] = "tokens"  # vllm: one tensor per image, deepstack concatenated on the width
    max_pixels: int | None = MAX_PIXELS
    multi_modal_uuids: MultiModalUUIDs | None = None

    @model_validator(mode="after")
    def something(self):
        if not self.images and not self.videos:
            raise ValueError("give images or videos (or both)")
        check_uuid_counts(self.multi_modal_uuids, {"image": len(self.images), "video": len(self.videos)})
        return self


class EncodeForm(VideoOptions):
    """The multipart form of /v1/encode: image and video files in any file field (told apart by their content), and
    these fields."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    dtype: DType = "float32"
    deepstack: bool = True
    layout: Literal["tokens", "vllm"] = "tokens"
    max_pixels: int | None = MAX_PIXELS
    # the same as EncodeRequest's, as JSON text: the files' order within each modality
    multi_modal_uuids: Json[MultiModalUUIDs] | None = None


class ChatMediaURL(BaseModel):
    model_config = ConfigDict(extra="allow")
    url: str | None = None


class ChatPart(BaseModel):
    """A chat message's content part: text (ignored), or `image_url` / `video_url` with vLLM's optional `uuid`."""

    model_config = ConfigDict(extra="allow")
    type: str
    image_url: ChatMediaURL | str | None = None
    video_url: ChatMediaURL | str | None = None
    uuid: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str = "user"
    content: str | list[ChatPart] | None = None


class ChatRequest(BaseModel):
    """vLLM's chat completion request as its disaggregated-encoder proxy sends it to an encoder instance: the media
    parts of the messages are encoded; the sampling fields an LLM would read are accepted and ignored (nothing is
    generated)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
