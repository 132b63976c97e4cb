"""What a response carries: embeddings as float lists, base64 of their raw little-endian bytes, or one safetensors
body (tensors `images.{i}.embeddings` and `images.{i}.deepstack.{j}`), the format `vitserve encode` writes too.

A token answer is megabytes (Qwen3-VL-8B, one 448² image with its deepstack features: 12.8 MB in float32; a
1400x1400 image on a 3584-wide tower in float32 base64: 48 MB of text), so no format copies it whole more than it
must. A tensor already in the answer's dtype goes out as a view of its own memory (`raw_bytes`), one in another dtype
as the view of its one converted copy; base64 is SIMD (pybase64), straight from that memory; JSON bodies are rendered
around it (`render_json` serializes the small structure and splices each `Base64` in as it is); and `PartsResponse`
hands the pieces to the HTTP protocol one after another, never joined into one string (service/http.py writes a
Content-Length body's pieces to the socket as they are). The tensors answered are never written afterwards (the cache
holds them read-only), so a view stays valid for as long as the socket needs it. Items that share one output (the
same image twice in a request, both answered by one cache entry) each come out whole: the body holds the shared
memory twice. The safetensors body is written here, not by `safetensors.torch.save`, which refuses tensors that share
memory.

Each item is a `Features` (encoder/features.py: tokens, deepstack, grid, a video's timing), as the engine answers
it (`Encoded.outputs`); `laid_out` puts one in a consumer's layout (`vllm`: `Features.packed`). Conversions and
packing run on the calling thread alone (`converted`, `Features.packed`; encoder/features.py says why). An answer
whose build converts, packs or encodes `OFF_LOOP_BYTES` or more (`work_bytes`) is built off the event loop
(service/api/encoding.py runs `build` in a thread): conversions and base64 release the GIL. One whose build touches
no byte of its tensors (safetensors in their own dtype, not packed: a cache hit's usual answer) is built on the loop,
in microseconds, without the thread's two hand-offs.
"""

from __future__ import annotations

import itertools
import json
import struct
from collections.abc import Sequence

import pybase64
import torch
import torch.nn.functional as F
from pydantic_core import to_json
from starlette.responses import Response

from ...encoder.features import Features, converted, raw_view
from ...encoder.json_splice import placeholder, spliced
from ...encoder.vision_encoder import DTYPES

OUTPUT_DTYPES = {name: DTYPES[name] for name in dict.fromkeys(str(t).removeprefix("torch.") for t in DTYPES.values())}
OFF_LOOP_BYTES = 2**20  # an answer whose build works over this many bytes or more is built in a thread


def laid_out(item: Features, layout: str) -> Features:
    """An item in a consumer's layout. `vllm`: one tensor, the deepstack features after the tokens on the width
    (`Features.packed`), as vLLM's and SGLang's Qwen3-VL take precomputed embeddings; the same as `tokens` for towers
    without deepstack."""
    if layout == "vllm" and item.deepstack:
        return Features(item.packed(), [], item.grid, item.timing)
    return item


def raw_bytes(t: torch.Tensor) -> memoryview:
    """`raw_view` as a flat byte memoryview (its len is its byte count): a body piece that keeps the tensor alive."""
    # (numpy types its buffer protocol for Python 3.12+ only)
    return memoryview(raw_view(t))  # type: ignore[arg-type]


def embedding_data(items: list[Features], normalize: bool, encoding: str, mean: bool) -> list[dict]:
    """/v1/embeddings' `data`: per item its index, its shape and grid (tokens; a pooled vector has neither), and its
    `embedding` (`embedding_payload`; L2-normalized per row in float32 where asked)."""
    data = []
    for i, item in enumerate(items):
        embeddings = item.tokens
        if normalize:
            embeddings = F.normalize(converted(embeddings, torch.float32), dim=-1)
        entry = {"object": "embedding", "index": i}
        if not mean:
            entry |= {"shape": list(embeddings.shape), "grid_thw": item.grid}
        data.append(entry | {"embedding": embedding_payload(embeddings, encoding)})
    return data


def encode_data(items: list[Features], dtype: str, deepstack: bool, ids: list[str] | None) -> list[dict]:
    """/v1/encode's `data`, of items in the answer's layout already (`laid_out`): per item its index among its kind,
    modality, grid, shape, dtype, its tokens and (where asked and any) deepstack features as base64 of `dtype`'s
    raw bytes, a video's timing, and with the vLLM tier its `ec_id`."""
    counts = {"image": itertools.count(), "video": itertools.count()}  # an item's place among its kind
    out, data = OUTPUT_DTYPES[dtype], []
    for i, item in enumerate(items):
        modality = "video" if item.timing else "image"
        entry = {
            "index": next(counts[modality]),
            "modality": modality,
            "grid_thw": item.grid,
            "shape": list(item.tokens.shape),
            "dtype": dtype,
            "embeddings": b64(converted(item.tokens, out)),
            "deepstack": [b64(converted(d, out)) for d in item.deepstack] if item.deepstack and deepstack else None,
        }
        data.append(entry | (item.timing or {}) | ({"ec_id": ids[i]} if ids is not None else {}))
    return data


def answer_bytes(items: list[Features]) -> int:
    """The bytes of every item's tensors in an answer, in the dtype the engine returned them."""
    return sum(item.nbytes for item in items)


def work_bytes(items: list[Features], dtype: str, layout: str = "tokens", raw: bool = True) -> int:
    """The tensor bytes that building /v1/encode's answer of `items` reads and writes: none for a `raw` (safetensors)
    answer whose tensors are in `dtype` already and are not packed (`laid_out`): its pieces are views of their
    memory; else all of them (converted, packed, or base64-encoded)."""
    out = OUTPUT_DTYPES[dtype]
    packs = layout == "vllm" and any(item.deepstack for item in items)
    if raw and not packs and all(t.dtype == out for item in items for t in (item.tokens, *item.deepstack)):
        return 0
    return answer_bytes(items)


class Base64:
    """Base64 text (ASCII bytes) of a tensor's raw bytes: a JSON string value that `render_json` splices in as it
    is (base64 has nothing to escape)."""

    __slots__ = ("data",)

    def __init__(self, t: torch.Tensor):
        # (numpy types its buffer protocol for Python 3.12+ only)
        self.data = pybase64.b64encode(raw_view(t))  # type: ignore[arg-type]

    def __str__(self) -> str:
        return self.data.decode("ascii")


def b64(t: torch.Tensor) -> Base64:
    return Base64(t)


def embedding_payload(t: torch.Tensor, encoding: str):
    """OpenAI's `embedding`, always flat (OpenAI's type is `list[float]`; a token matrix goes row by row, its shape
    said beside it): a float list, or base64 of the raw little-endian float32 bytes."""
    t = converted(t, torch.float32)
    return t.reshape(-1).tolist() if encoding == "float" else Base64(t)


def render_json(content) -> list[bytes]:
    """`content` as JSON (pydantic's serializer; NaN and infinity become null, as in JavaScript), in pieces: the
    structure between the `Base64` values, and those values themselves (json_splice)."""
    blobs: list[bytes] = []

    def stand_in(value):
        if not isinstance(value, Base64):
            raise TypeError(f"{type(value).__name__} is not JSON serializable")
        blobs.append(value.data)
        return placeholder(len(blobs) - 1)

    return spliced(to_json(content, inf_nan_mode="null", fallback=stand_in), blobs)


class PartsResponse(Response):
    """A response whose body goes out as the pieces it was built from (bytes, or byte memoryviews of tensors), with
    one Content-Length for them all."""

    def __init__(
        self,
        parts: Sequence[bytes | memoryview],
        status_code: int = 200,
        headers=None,
        media_type: str = "application/json",
    ):
        self.parts = parts
        super().__init__(None, status_code, headers, media_type)
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.raw_headers.append((b"content-length", str(sum(len(p) for p in parts)).encode()))

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for i, part in enumerate(self.parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < len(self.parts) - 1})


def json_response(content, status_code: int = 200, headers=None) -> PartsResponse:
    return PartsResponse(render_json(content), status_code, headers)


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def safetensors_parts(
    items: list[Features], dtype: str, metadata: dict[str, str], deepstack: bool = True
) -> list[bytes | memoryview]:
    """Every item's tokens and deepstack features in `dtype` as one safetensors file, with string `metadata`, in pieces:
    the header, then each tensor's raw little-endian bytes in header order (`raw_bytes` of the tensor, or of its
    conversion to `dtype`: a tensor shared by several items is a piece of each)."""
    out_dtype = OUTPUT_DTYPES[dtype]
    header: dict = {"__metadata__": metadata}
    parts: list[bytes | memoryview] = [b""]
    offset = 0
    for i, item in enumerate(items):
        named = [(f"images.{i}.embeddings", item.tokens)]
        named += [(f"images.{i}.deepstack.{j}", d) for j, d in enumerate(item.deepstack if deepstack else [])]
        for name, t in named:
            data = raw_bytes(converted(t, out_dtype))
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[out_dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + len(data)],
            }
            parts.append(data)
            offset += len(data)
    parts[0] = safetensors_header(header)
    return parts


def safetensors_header(header: dict) -> bytes:
    """A safetensors file's first bytes: its header's length and JSON, padded so that the data starts 8-aligned (as
    safetensors pads it)."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def safetensors_body(items: list[Features], dtype: str, metadata: dict[str, str], deepstack: bool = True) -> bytes:
    """`safetensors_parts` as one bytes object (a file's content)."""
    return b"".join(safetensors_parts(items, dtype, metadata, deepstack))
