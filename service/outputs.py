"""What a response carries: embeddings as float lists, base64 of their raw little-endian bytes, or one safetensors
body (tensors `images.{i}.embeddings` and `images.{i}.deepstack.{j}`), the format `vitserve encode` writes too."""

from __future__ import annotations

import base64

import torch
from safetensors.torch import save as safetensors_save

from ..encoder.vision_encoder import DTYPES

OUTPUT_DTYPES = {name: DTYPES[name] for name in dict.fromkeys(str(t).removeprefix("torch.") for t in DTYPES.values())}


def raw_bytes(t: torch.Tensor) -> bytes:
    """Little-endian raw bytes of a float32/float16/bfloat16 tensor."""
    t = t.contiguous()
    array = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()  # numpy has no bfloat16
    return array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def b64(t: torch.Tensor) -> str:
    return base64.b64encode(raw_bytes(t)).decode()


def embedding_payload(t: torch.Tensor, encoding: str):
    """OpenAI's `embedding`: a float list, or base64 of the raw little-endian float32 bytes."""
    return t.float().tolist() if encoding == "float" else b64(t.float())


def safetensors_body(outputs: list, dtype: str, metadata: dict[str, str], deepstack: bool = True) -> bytes:
    """Every image's (tokens, deepstack list) in `dtype` as one safetensors file, with string `metadata`."""
    out_dtype, tensors = OUTPUT_DTYPES[dtype], {}
    for i, (embeddings, features) in enumerate(outputs):
        tensors[f"images.{i}.embeddings"] = embeddings.to(out_dtype).contiguous()
        for j, d in enumerate(features if deepstack else []):
            tensors[f"images.{i}.deepstack.{j}"] = d.to(out_dtype).contiguous()
    return safetensors_save(tensors, metadata=metadata)
