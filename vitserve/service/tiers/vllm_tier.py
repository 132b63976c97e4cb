"""vitserve as vLLM's encoder tier (`--ec-shared-storage DIR`; docs/llm.md): every item that /v1/encode or
/v1/chat/completions encodes is also written as vLLM's ECExampleConnector reads it (service/ec_storage.py), named by
the identifier vLLM's consumer looks it up by (service/vllm_hash.py), so that vLLM skips its own tower for it.

* /v1/encode: the answer as always, each item with its `ec_id`; `multi_modal_uuids` names the items (vLLM's
  uuids), else an image is named by vLLM's content hash of its bytes (a video or a URL needs a uuid).
* /v1/chat/completions: the request vLLM's disaggregated-encoder proxy sends its encoder instances (a chat message
  whose content parts are `image_url` / `video_url` with a `uuid` each); the answer is what the proxy reads of a
  vLLM producer's: `ec_transfer_params`, per identifier its modality, its indices among the request's media parts
  and the metadata that sizes its placeholder (`image_grid_thw` / `video_grid_thw`, and Qwen3-VL's video
  `timestamps`), in a chat completion that generates nothing.
The files are written beside the answer's serialization. The chat answer is sent once they are in place (the proxy
sends the request on to vLLM as soon as it has it); /v1/encode's is not held for them (its answer is the embeddings).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid as uuidlib
from concurrent.futures import ThreadPoolExecutor
from typing import cast

from PIL import Image
from pydantic import ConfigDict, ValidationError

from ...encoder.features import Features
from ...encoder.image_errors import InvalidBase64
from ...encoder.vision_encoder import DTYPES
from ..api.schemas import MAX_PIXELS, ChatMediaURL, ChatRequest, VideoOptions
from ..ground.errors import Conflict, InputRejected, StorageFailed, clip
from ..ground.media import MediaItem
from ..ground.settings_media import TierSettings
from .ec_storage import ECStorage, check_identifier
from .vllm_hash import digest_shaped, hash_factors, mm_hash

log = logging.getLogger("vitserve.ec")
MEDIA_PARTS = {"image_url": "image", "video_url": "video"}
# mm_processor_kwargs this server applies (per request, within its limits), as vLLM's Qwen processors read them
PROCESSOR_OPTIONS = {"max_pixels", "fps", "num_frames", "max_frames"}


class Options(VideoOptions):
    """A chat request's processing options (from its mm_processor_kwargs), validated as /v1/encode's body fields
    of the same names are."""

    model_config = ConfigDict(extra="forbid")
    max_pixels: int | None = MAX_PIXELS


def chat_items(body: ChatRequest) -> list[MediaItem]:
    """The media parts of a chat request's messages, in order (text parts are skipped); another kind of part (audio)
    or a part without its URL is a 400."""
    items = []
    for m, message in enumerate(body.messages):
        for p, part in enumerate(message.content if isinstance(message.content, list) else []):
            param = f"messages[{m}].content[{p}]"
            if part.type == "text":
                continue
            if part.type not in MEDIA_PARTS:
                raise InputRejected(
                    f"{param}: a {clip(part.type)!r} part; this encoder takes image_url and video_url",
                    "unsupported_content",
                    param,
                )
            media = getattr(part, part.type)
            url = media.url if isinstance(media, ChatMediaURL) else media
            if url is None:
                raise InputRejected(f"{param}: no url (an encoder needs the medium itself)", "missing_url", param)
            items.append(MediaItem(MEDIA_PARTS[part.type], url, part.uuid, param))
    if not items:
        raise InputRejected("the messages hold no image_url or video_url part", "no_media", "messages")
    return items


def chat_options(body: ChatRequest) -> Options:
    """The request's mm_processor_kwargs as this server's options (top level, or in `images_kwargs` /
    `videos_kwargs`), validated as /v1/encode validates them; one it cannot apply, or media_io_kwargs (how vLLM would
    load the media), is a 400: the features would not be the ones the consumer's identifier promises."""
    if body.media_io_kwargs:
        raise InputRejected(
            "media_io_kwargs is not supported: this server loads media with its own settings",
            "unsupported_media_io_kwargs",
            "media_io_kwargs",
        )
    kwargs, where = {}, {}
    for key, value in (body.mm_processor_kwargs or {}).items():
        if key not in ("images_kwargs", "videos_kwargs"):
            kwargs[key], where[key] = value, f"mm_processor_kwargs.{clip(key)}"
    for scoped in ("images_kwargs", "videos_kwargs"):
        given = (body.mm_processor_kwargs or {}).get(scoped)
        if given is not None and not isinstance(given, dict):
            raise InputRejected(
                f"mm_processor_kwargs.{scoped} must be an object",
                "invalid_mm_processor_kwargs",
                f"mm_processor_kwargs.{scoped}",
            )
        for key, value in (given or {}).items():
            kwargs[key], where[key] = value, f"mm_processor_kwargs.{scoped}.{clip(key)}"
    unknown = sorted(set(kwargs) - PROCESSOR_OPTIONS)
    if unknown:
        listed = ", ".join(repr(clip(key)) for key in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        raise InputRejected(
            f"mm_processor_kwargs {listed} not supported (this server applies {', '.join(sorted(PROCESSOR_OPTIONS))})",
            "unsupported_mm_processor_kwargs",
            where[unknown[0]],
        )
    try:
        return Options.model_validate({k: v for k, v in kwargs.items() if v is not None})
    except ValidationError as e:
        first = e.errors(include_url=False, include_input=False)[0]
        field = first["loc"][0] if first["loc"] else None
        param = where.get(field, "mm_processor_kwargs") if isinstance(field, str) else "mm_processor_kwargs"
        raise InputRejected(f"{param}: {first['msg']}", "invalid_mm_processor_kwargs", param) from None


class VLLMTier:
    """The encoder-cache files of one front end: identifiers computed and files written off the event loop. `model`:
    --model, the consumer's model string unless --ec-model-id names another."""

    def __init__(self, tiers: TierSettings, model: str, dtype: str):
        ec_dtype = DTYPES[dtype if tiers.ec_dtype == "auto" else tiers.ec_dtype]
        directory = cast(str, tiers.ec_shared_storage)  # the tier is made where it is given (create_app)
        self.storage = ECStorage(directory, tiers.ec_storage_bytes, int(tiers.ec_file_mode, 8), ec_dtype)
        self.model_id = tiers.ec_model_id or model
        self.algorithm = tiers.ec_hash_algorithm
        self.pool = ThreadPoolExecutor(4, thread_name_prefix="vitserve-ec-io")
        self.write_failures = 0
        mm_hash("image", self.model_id, self.algorithm, uuid="x", mm_processor_kwargs={"x": 1})  # the digest loads

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict:
        """The tier's figures for /stats and /metrics: its storage's, and the writes that failed."""
        return self.storage.stats() | {"write_failures": self.write_failures}

    def _identifier(self, item: MediaItem, kwargs: dict | None) -> str:
        """Runs in the pool: an item's identifier (its base64 decoded and hashed where it has no uuid)."""
        data = None  # (a uuid is the identifier: the bytes are not read)
        if item.uuid is None:
            try:
                data = item.media.decode()
            except InvalidBase64 as e:
                raise InputRejected(f"{item.param}: {e}", "invalid_base64", item.param) from None
        try:
            return mm_hash(
                item.modality, self.model_id, self.algorithm, data=data, uuid=item.uuid, mm_processor_kwargs=kwargs
            )
        except (OSError, Image.DecompressionBombError):  # PIL cannot (or will not) read it, nor can vLLM's loader
            raise InputRejected(
                f"{item.param}: not an image vLLM's loader reads, so it has no identifier there",
                "unidentified_image",
                item.param,
            ) from None

    async def identifiers(self, items: list[MediaItem], kwargs: dict | None = None) -> list[str]:
        """vLLM's identifier of each item (its uuid, or a hash: in the pool). A video or a URL without a uuid, or a
        uuid that cannot name a folder or has a content hash's shape, is a 400 (before anything is decoded)."""
        for item in items:
            if item.uuid is None and (item.modality == "video" or isinstance(item.data, str)):
                what = "a video" if item.modality == "video" else "an image URL"
                how = (
                    "give the part a `uuid`"
                    if item.param.startswith("messages")
                    else f"give it one in multi_modal_uuids.{item.modality} (a field of the JSON body or of the "
                    "multipart form, JSON there; the client's uuids=)"
                )
                raise InputRejected(
                    f"{item.param}: {what} needs a uuid to be named for vLLM (its own identifier "
                    f"of it depends on what vLLM's loader makes of it): {how}",
                    "uuid_required",
                    item.param,
                )
            if item.uuid is not None:
                try:
                    check_identifier(item.uuid)
                except ValueError as e:
                    raise InputRejected(f"{item.param}: {e}", "invalid_uuid", item.param) from None
                if digest_shaped(item.uuid, self.algorithm):
                    raise InputRejected(
                        f"{item.param}: a uuid of {len(item.uuid)} hex digits has the shape of an "
                        f"item's {self.algorithm} content hash, whose file it could name; use "
                        "another",
                        "invalid_uuid",
                        item.param,
                    )
        if all(item.uuid is not None for item in items) and not any(
            hash_factors(item.modality, kwargs) for item in items
        ):
            return [cast(str, item.uuid) for item in items]  # (each has one)
        loop = asyncio.get_running_loop()
        return list(
            await asyncio.gather(*(loop.run_in_executor(self.pool, self._identifier, item, kwargs) for item in items))
        )

    def written(self, job: asyncio.Future) -> None:
        """A write nobody waits for, done: its failure logged (the storage counts the files)."""
        if not job.cancelled() and job.exception() is not None:
            log.error("encoder-cache files not written: %s", job.exception())

    async def write(self, identifiers: list[str], items: list[Features]) -> None:
        """Write every item's file (side by side, in the pool). An identifier whose file holds another item, or
        whose folder is not this server's, is a 409 `ec_id_taken` (nothing is replaced); a storage failure is a 507
        `ec_write_failed`."""
        loop = asyncio.get_running_loop()
        jobs = [
            loop.run_in_executor(self.pool, self.storage.write, identifier, item)
            for identifier, item in dict(zip(identifiers, items)).items()
        ]
        try:
            await asyncio.gather(*jobs)
        except FileExistsError as e:
            raise Conflict(f"the encoder cache holds another item under that identifier: {e}", "ec_id_taken") from None
        except (OSError, ValueError) as e:
            self.write_failures += 1
            raise StorageFailed(f"the encoder cache could not be written: {e}", "ec_write_failed") from None

    @staticmethod
    def transfer_params(identifiers: list[str], items: list[MediaItem], grids: list, timing: list, qwen3: bool) -> dict:
        """`ec_transfer_params` as a vLLM producer reports them (its connector's `request_finished`): per
        identifier, its modality, the indices of its items among the request's media parts, and the metadata that
        sizes its placeholder (`grids`, and for Qwen3-VL a video's `timestamps` from `timing`, in the items'
        order)."""
        params: dict = {}
        for i, (identifier, item, grid, video) in enumerate(zip(identifiers, items, grids, timing)):
            entry = params.setdefault(identifier, {"modality": item.modality, "item_indices": [], "metadata": {}})
            entry["item_indices"].append(i)
            entry["metadata"] = {f"{item.modality}_grid_thw": list(grid)}
            if video is not None and qwen3:
                entry["metadata"]["timestamps"] = list(video["timestamps"])
        return params


def chat_completion(model: str | None, params: dict, tokens: int) -> dict:
    """A chat completion that generates nothing, with the producer's `ec_transfer_params`."""
    return {
        "id": f"chatcmpl-{uuidlib.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens},
        "ec_transfer_params": params,
    }
