"""The message this tier pushes for a part (docs/sglang.md, What goes over the wire): SGLang's two frames, a pickle of
its `EmbeddingData` without the tensor (`meta_frame`), then the features' raw bytes (`embedding_frame`): every item's
tokens, one item after the other, in the model's dtype, with Qwen3-VL's deepstack features after the tokens on the
width (`cat([tokens, ds0, ds1, ds2], -1)`), each item's rows as its `Features` packs them. The pickle is written
without sglang: the two classes it names are stand-ins here, written under SGLang's class paths, and everything else
in it is builtins and torch, which the receiver's allowlisting unpickler accepts."""

from __future__ import annotations

import enum
import io
import pickle
from collections.abc import Sequence
from typing import cast

import numpy as np
import torch

from ...encoder.features import Features
from ..pipeline.engine import Encoded
from .sglang_schemas import EncodeCall

# the pickle's class paths, as SGLang's receiver looks them up (and its unpickler allows them): EmbeddingData moved
# to sglang.srt.disaggregation.encoder.receiver in 0.5.19 (sglang.srt.disaggregation.encode_receiver before);
# Modality is accepted under sglang.srt.managers.schedule_batch by every release since 0.5.10
EMBEDDING_DATA = ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData")
MODALITY = ("sglang.srt.managers.schedule_batch", "Modality")
SGLANG_VERSION = "0.5.23"  # the release whose wire format this is (the same since 0.5.19)
PROTOCOL = 4  # pickle protocol: SGLang's (Python's default)


class EmbeddingData:
    """Stands for SGLang's `EmbeddingData` in the pickle: only its name and its `__dict__` travel (unpickling
    makes the receiver's own class without calling its `__init__`)."""

    def __init__(self, state: dict):
        self.__dict__.update(state)


class Modality(enum.Enum):
    """Stands for SGLang's `Modality` in the pickle: an enum member travels as its class and value."""

    IMAGE = 1
    VIDEO = 2
    AUDIO = 3


class _Writer(pickle._Pickler):  # the Python pickler: the C one cannot write a class under another path
    NAMES = {EmbeddingData: EMBEDDING_DATA, Modality: MODALITY}

    def save_global(self, obj, name=None):
        if obj not in self.NAMES:
            return super().save_global(obj, name)
        module, qualname = self.NAMES[obj]
        self.save(module)
        self.save(qualname)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def dumps(obj) -> bytes:
    """`obj` pickled with the stand-ins under SGLang's class paths."""
    out = io.BytesIO()
    _Writer(out, PROTOCOL).dump(obj)
    return out.getvalue()


def embedding_frame(items: list[Features], dtype: torch.dtype) -> tuple[memoryview, list[int]]:
    """The features of a part's items as one `[rows, width]` tensor's raw little-endian bytes, and that shape: each
    item's packed rows (`Features.rows`) after the previous item's. One item without deepstack in `dtype` already
    is its own memory; otherwise each piece is copied once into place."""
    rows = [item.rows(dtype) for item in items]
    count, width = sum(r.count for r in rows), items[0].width
    if len(rows) == 1 and len(rows[0].views) == 1:
        # (numpy types its buffer protocol for Python 3.12+ only)
        return memoryview(rows[0].views[0].reshape(-1)), [count, width]  # type: ignore[arg-type]
    out = np.empty((count, rows[0].row_bytes), np.uint8)
    start = 0
    for r in rows:
        r.copy_into(out[start : start + r.count])
        start += r.count
    # (numpy types its buffer protocol for Python 3.12+ only)
    return memoryview(out.reshape(-1)), [count, width]  # type: ignore[arg-type]


def meta_frame(call: EncodeCall, items: list[Features], family: str, dtype: torch.dtype, shape: list[int]) -> bytes:
    """SGLang's `EmbeddingData` of a part, without its tensor (`embedding` None; `dtype` and `shape` say what the
    second frame holds), pickled: the part's `req_id` as given, its grids (int64 `[items, 3]`, in patches) and
    modality, and for videos the metadata SGLang's prompt needs: Qwen3-VL's `video_timestamps` (per video, a time in
    seconds per temporal patch), Qwen2.5-VL's `second_per_grid_ts` (float32, per video); None where it does not
    apply, as SGLang's encoder sends them."""
    videos = [item.timing for item in items if item.timing is not None]
    timestamps = [[float(t) for t in v["timestamps"]] for v in videos] if videos and family == "qwen3_vl" else None
    seconds = (
        torch.tensor([float(v["second_per_grid_t"]) for v in videos], dtype=torch.float32)
        if videos and family == "qwen2_5_vl"
        else None
    )
    return dumps(
        EmbeddingData(
            {
                "req_id": call.req_id,
                "num_parts": call.num_parts,
                "part_idx": call.part_idx,
                # (an answer's Features have their grids: the backend sets them)
                "grid_dim": torch.tensor(
                    [list(cast("Sequence[int]", item.grid)) for item in items], dtype=torch.int64
                ).reshape(-1, 3),
                "modality": Modality[call.modality],
                "embedding": None,
                "send_time": None,
                "dtype": dtype,
                "shape": shape,
                "_mr_ptr": None,
                "error_msg": None,
                "error_code": None,
                "video_timestamps": timestamps,
                "second_per_grid_ts": seconds,
            }
        )
    )


def message(call: EncodeCall, result: Encoded, family: str, dtype: torch.dtype) -> list:
    """A part's two frames: its `EmbeddingData` pickled, and its features' bytes."""
    items = result.outputs
    features, shape = embedding_frame(items, dtype)
    return [meta_frame(call, items, family, dtype, shape), features]
