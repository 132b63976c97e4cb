"""vLLM's identifier of a multimodal item (`mm_hash`, `MultiModalFeatureSpec.identifier`), the key its encoder-cache
connectors look encoder outputs up by: what vitserve names the files it writes for vLLM (service/ec_storage.py).

As vLLM 0.31-0.34 compute it (vllm/multimodal/hasher.py `MultiModalHasher.hash_kwargs`, and
vllm/multimodal/processing/inputs.py `get_mm_hashes`):
* a client's uuid for the item (a chat content part's `uuid`, or `multi_modal_uuids`) is the identifier as it is,
  unless the request has hash factors (its `mm_processor_kwargs`, or `media_io_kwargs` for the modality): then the
  uuid is hashed with them;
* otherwise the item itself is hashed with the model id (the consumer's `--model` string) and those factors. An
  image loaded from a data URI or a URL is hashed as its encoded bytes (so the same picture as PNG and as JPEG has two
  identifiers), with vLLM's conversion settings beside them when its loader changed the image's mode (any mode but
  RGB, or RGB with a transparency key). A video's hash depends on vLLM's decoder's metadata: only a uuid names one.

The digest is blake3 (vLLM's default; the `ec` extra), sha256 or sha512 (`--mm-hasher-algorithm`) over the kwargs
sorted by name, each its framed name and a tagged value: a leaf is framed bytes (str as UTF-8, int and float as
numpy's int64/float64 bytes), a sequence or mapping is a tag, a count and its elements (a mapping's keys framed);
every frame is an 8-byte little-endian length and the bytes.

Hashed identifiers (an image's content, a uuid with factors) are digests: lowercase hex of the algorithm's length.
vLLM takes a uuid without factors as the identifier unchanged, so a uuid of that shape could equal another item's
hash; the encoder tier refuses such uuids (`digest_shaped`), which keeps the names from uuids and the names from
hashes apart.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any, Iterator

import numpy as np

ALGORITHMS = ("blake3", "sha256", "sha512")
DIGEST_HEX = {"blake3": 64, "sha256": 64, "sha512": 128}  # hex digits of a digest
MODALITIES = ("image", "video")
_NONE, _SEQUENCE, _MAPPING, _LEAF = b"\x00", b"\x01", b"\x02", b"\x03"
# vLLM's ImageMediaIO defaults: what it converts an image to, and the background transparency goes over
IO_CONFIG = {"image_mode": "RGB", "rgba_background_color": (255, 255, 255)}


def _framed(data: bytes) -> Iterator[bytes]:
    yield len(data).to_bytes(8, "little")
    yield data


class _Media:
    """A loaded medium as vLLM's hasher writes it (`MediaWithBytes`): a leaf that is itself a named item."""

    __slots__ = ("name", "value")

    def __init__(self, name: str, value: Any):
        self.name, self.value = name, value


def _leaf(value: Any) -> Iterator[bytes]:
    if isinstance(value, _Media):
        yield from _framed(value.name.encode())
        yield from _value(value.value)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        yield from _framed(bytes(value))
    elif isinstance(value, str):
        yield from _framed(value.encode())
    elif isinstance(value, (bool, int, float)):
        yield from _framed(np.array(value).tobytes())
    else:
        raise TypeError(f"no vLLM hash for a {type(value).__name__}")


def _value(value: Any) -> Iterator[bytes]:
    if value is None:
        yield _NONE
    elif isinstance(value, (list, tuple)):
        yield _SEQUENCE + len(value).to_bytes(8, "little")
        for element in value:
            yield from _value(element)
    elif isinstance(value, dict):
        yield _MAPPING + len(value).to_bytes(8, "little")
        for key, element in value.items():
            yield from _framed(str(key).encode())
            yield from _value(element)
    else:
        yield _LEAF
        yield from _leaf(value)


def _hasher(algorithm: str):
    if algorithm == "blake3":
        try:
            from blake3 import blake3
        except ImportError:
            raise RuntimeError("vLLM's default identifiers are blake3 digests: pip install 'vitserve[ec]'") from None
        return blake3(max_threads=1)
    if algorithm in ("sha256", "sha512"):
        return hashlib.new(algorithm)
    raise ValueError(f"unknown hash algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")


def hash_kwargs(algorithm: str, **kwargs: Any) -> str:
    """`MultiModalHasher.hash_kwargs`: the hex digest of the kwargs, sorted by name."""
    hasher = _hasher(algorithm)
    for key in sorted(kwargs):
        for chunk in _framed(key.encode()):
            hasher.update(chunk)
        for chunk in _value(kwargs[key]):
            hasher.update(chunk)
    return hasher.hexdigest()


def image_io_config(data: bytes) -> dict | None:
    """What vLLM's image loader hashes beside an image's bytes: None where it keeps the image as decoded (RGB, no
    transparency key), else its conversion settings. Read from the header (the mode and a PNG's tRNS key); EXIF
    rotation does not count, as in vLLM."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        keeps = image.mode == "RGB" and "transparency" not in image.info
    return None if keeps else IO_CONFIG


def hash_factors(modality: str, mm_processor_kwargs: dict | None = None, media_io_kwargs: dict | None = None) -> dict:
    """The request's hash factors for one modality, as vLLM scopes them: `media_io_kwargs` of that modality, and
    `mm_processor_kwargs` less the other modalities' scoped entries (`videos_kwargs` for an image, ...)."""
    scoped = {"image": "images_kwargs", "video": "videos_kwargs"}
    factors: dict = {}
    if media_io_kwargs and media_io_kwargs.get(modality):
        factors["media_io_kwargs"] = {modality: media_io_kwargs[modality]}
    if mm_processor_kwargs:
        others = {"images_kwargs", "videos_kwargs", "audio_kwargs"} - {scoped[modality]}
        kept = {k: v for k, v in mm_processor_kwargs.items() if k not in others}
        if kept:
            factors["mm_processor_kwargs"] = kept
    return factors


def digest_shaped(name: str, algorithm: str) -> bool:
    """Whether `name` could be a digest of `algorithm` (lowercase hex of its length): what names every hashed
    identifier, so a uuid of that shape could name another item's file."""
    return len(name) == DIGEST_HEX[algorithm] and all(c in "0123456789abcdef" for c in name)


def mm_hash(
    modality: str,
    model_id: str,
    algorithm: str = "blake3",
    *,
    data: bytes | None = None,
    uuid: str | None = None,
    mm_processor_kwargs: dict | None = None,
    media_io_kwargs: dict | None = None,
) -> str:
    """vLLM's identifier of one item: its `uuid` (as it is, or hashed with the request's factors), else, for an
    image, its encoded bytes `data` hashed with `model_id` and the factors. A video without a uuid raises
    ValueError: vLLM hashes it with its decoder's metadata, which is not known here."""
    if modality not in MODALITIES:
        raise ValueError(f"unknown modality {modality!r}")
    factors = hash_factors(modality, mm_processor_kwargs, media_io_kwargs)
    if uuid is not None:
        return uuid if not factors else hash_kwargs(algorithm, model_id=model_id, **{modality: uuid}, **factors)
    if modality == "video" or data is None:
        raise ValueError(f"a {modality} without a uuid has no identifier known outside vLLM")
    io_config = image_io_config(data)
    item = _Media("image", data if io_config is None else {"io_config": io_config, "data": data})
    return hash_kwargs(algorithm, model_id=model_id, image=item, **factors)
