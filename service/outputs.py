"""What a response carries: embeddings as float lists, base64 of their raw little-endian bytes, or one safetensors
body (tensors `images.{i}.embeddings` and `images.{i}.deepstack.{j}`), the format `vitserve encode` writes too.

Every format copies each tensor out on its own, so items that share one output (the same image twice in a request,
both answered by one cache entry) come out whole and equal: the safetensors body is written here, not by
`safetensors.torch.save`, which refuses tensors that share memory.

Responses are built on the event loop that every request shares, and a token matrix in float32 base64 is megabytes
(a 1400x1400 image on a 3584-wide tower: 48 MB of text). So base64 is SIMD (pybase64), straight from the tensor's
memory, and JSON bodies are rendered around it: `render_json` serializes the small structure and splices each
`Base64` in as it is, and `PartsResponse` sends the pieces one after another, never copying them into one string.
"""

from __future__ import annotations

import json
import secrets
import struct

import numpy as np
import pybase64
import torch
from pydantic_core import to_json
from starlette.responses import Response

from ..encoder.vision_encoder import DTYPES

OUTPUT_DTYPES = {name: DTYPES[name] for name in dict.fromkeys(str(t).removeprefix("torch.") for t in DTYPES.values())}


def raw_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's little-endian bytes as a flat uint8 array (float32/float16/bfloat16), without a copy where the
    tensor is contiguous already (it is, on every little-endian host)."""
    t = t.contiguous()
    array = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()  # numpy has no bfloat16
    return array.astype(array.dtype.newbyteorder("<"), copy=False).reshape(-1).view(np.uint8)


class Base64:
    """Base64 text (ASCII bytes) of a tensor's raw bytes: a JSON string value that `render_json` splices in as it
    is (base64 has nothing to escape)."""

    __slots__ = ("data",)

    def __init__(self, t: torch.Tensor):
        self.data = pybase64.b64encode(raw_view(t))

    def __str__(self) -> str:
        return self.data.decode("ascii")


def b64(t: torch.Tensor) -> Base64:
    return Base64(t)


def embedding_payload(t: torch.Tensor, encoding: str):
    """OpenAI's `embedding`, always flat (OpenAI's type is `list[float]`; a token matrix goes row by row, its shape
    said beside it): a float list, or base64 of the raw little-endian float32 bytes."""
    return t.float().reshape(-1).tolist() if encoding == "float" else Base64(t.float())


_MARK = "\x00vitserve-" + secrets.token_hex(8) + "-"  # a placeholder no other value of a response can hold


def render_json(content) -> list[bytes]:
    """`content` as JSON (pydantic's serializer; NaN and infinity become null, as in JavaScript), in pieces: the
    structure between the `Base64` values, and those values themselves."""
    blobs: list[bytes] = []

    def placeholder(value):
        if not isinstance(value, Base64):
            raise TypeError(f"{type(value).__name__} is not JSON serializable")
        blobs.append(value.data)
        return f"{_MARK}{len(blobs) - 1}"

    text = to_json(content, inf_nan_mode="null", fallback=placeholder)
    if not blobs:
        return [text]
    mark = to_json(_MARK)[1:-1]  # the placeholder as JSON writes it (its NUL escaped)
    pieces = text.split(mark)
    parts = [pieces[0]]
    for piece in pieces[1:]:
        index, rest = piece.split(b'"', 1)
        parts += [blobs[int(index)], b'"' + rest]
    return parts


class PartsResponse(Response):
    """A response whose body goes out as the pieces it was built from, with one Content-Length for them all."""

    def __init__(self, parts: list[bytes], status_code: int = 200, headers=None,
                 media_type: str = "application/json"):
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


def safetensors_parts(outputs: list, dtype: str, metadata: dict[str, str], deepstack: bool = True) -> list[bytes]:
    """Every image's (tokens, deepstack list) in `dtype` as one safetensors file, with string `metadata`, in pieces:
    the header, then each tensor's raw little-endian bytes (its own copy, shared memory or not), in header order."""
    out_dtype = OUTPUT_DTYPES[dtype]
    header: dict = {"__metadata__": metadata}
    parts, offset = [b""], 0
    for i, (embeddings, features) in enumerate(outputs):
        named = [(f"images.{i}.embeddings", embeddings)]
        named += [(f"images.{i}.deepstack.{j}", d) for j, d in enumerate(features if deepstack else [])]
        for name, t in named:
            data = raw_view(t.to(out_dtype)).tobytes()
            header[name] = {"dtype": SAFETENSORS_DTYPES[out_dtype], "shape": list(t.shape),
                            "data_offsets": [offset, offset + len(data)]}
            parts.append(data)
            offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned, as safetensors pads it
    parts[0] = struct.pack("<Q", len(text)) + text
    return parts


def safetensors_body(outputs: list, dtype: str, metadata: dict[str, str], deepstack: bool = True) -> bytes:
    """`safetensors_parts` as one bytes object (a file's content)."""
    return b"".join(safetensors_parts(outputs, dtype, metadata, deepstack))
