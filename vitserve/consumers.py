"""Hand vitserve's features to the LLM server that skips its own vision tower (encoder disaggregation).

Each helper takes `EncodedImage` results (`Client.encode`'s in either layout, or `VisionEncoder.encode`'s) and
`EncodedVideo` ones (`encode_videos`'): a list, or one item, and builds what its consumer takes:
- vLLM offline (`LLM(..., enable_mm_embeds=True)`): `vllm_multi_modal_data`, the `multi_modal_data` dict. vLLM's
  Qwen-VL models (vllm/model_executor/models/qwen2_vl.py, `_parse_and_validate_image_input`) take
  `image_embeds` as every image's tokens concatenated, [Σ tokens, H], and split it per image by
  `prod(image_grid_thw) // merge**2`; `image_grid_thw` is [n_images, 3] int64 in patches. Videos likewise as
  `video_embeds` and `video_grid_thw`, with Qwen2.5-VL's `second_per_grid_ts` (seconds per temporal patch).
- vLLM's OpenAI server (`--enable-mm-embeds`): `vllm_image_embeds_part`, one chat content part per image
  (vllm/entrypoints/chat_utils.py: `ChatCompletionContentPartImageEmbedsParam`, a dict of base64 `torch.save`d
  tensors; "pass a separate content part for each multi-modal item").
- SGLang: `sglang_image_data` (and `sglang_video_data`), an item of format `precomputed_embedding`.
- transformers: `transformers_features` and `transformers_inputs`: `generate` with vitserve's features in place of
  the model's tower, the real grids, `mm_token_type_ids` and Qwen2.5-VL's `second_per_grid_ts` keeping the 3-D rope
  positions right. A Qwen3-VL prompt holds each video slice by slice (`<{t:.1f} seconds>`, then the slice's
  tokens between vision start and end, t from `EncodedVideo.timestamps`), as its processor writes it.

For Qwen3-VL every consumer takes the deepstack features on the width: `cat([tokens, ds0, ds1, ds2], -1)`, in
`deepstack_visual_indexes` order (`Features.packed`, encoder/features.py; what `layout="vllm"` returns already). The
prompt's image-token count must equal the grid's: vitserve's min/max pixels must match the LLM's processor settings.
"""

from __future__ import annotations

import base64
import contextlib
import io
import sys
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

from .client import EncodedImage, EncodedVideo
from .encoder.features import Features

Item = TypeVar("Item", bound=EncodedImage)  # an EncodedImage, or an EncodedVideo


def _listed(
    items: Item | Sequence[Item], kind: str | None = None, helper: str = "this helper", other: str = ""
) -> list[Item]:
    """`items` (one result, or an iterable of them) as a list, each an EncodedImage or an EncodedVideo, and where
    `kind` is given (`image`, `video`) of that kind only: else a TypeError that names the item, and `other`, the
    helper that takes it."""
    if isinstance(items, EncodedImage):
        items = [items]
    elif isinstance(items, (str, bytes, torch.Tensor, dict)) or not hasattr(items, "__iter__"):
        raise TypeError(
            f"{helper} takes vitserve's results (EncodedImage, EncodedVideo) or a list of them, not "
            f"{type(items).__name__}"
        )
    items = list(items)
    for i, item in enumerate(items):
        if not isinstance(item, EncodedImage):
            raise TypeError(
                f"{helper}: items[{i}] is a {type(item).__name__}, not vitserve's result (EncodedImage, EncodedVideo)"
            )
        is_video = isinstance(item, EncodedVideo)
        if kind is not None and is_video != (kind == "video"):
            given = "a video (EncodedVideo)" if is_video else "an image (EncodedImage)"
            raise TypeError(f"{helper} takes {kind}s: items[{i}] is {given}; {other}")
    return items


def _split(items, helper: str) -> tuple[list[EncodedImage], list[EncodedVideo]]:
    """The images and the videos of a prompt's items, each in order."""
    items = _listed(items, helper=helper)
    return [i for i in items if not isinstance(i, EncodedVideo)], [i for i in items if isinstance(i, EncodedVideo)]


def vllm_features(item: EncodedImage) -> torch.Tensor:
    """One image's features as vLLM and SGLang take them: [tokens, out_hidden x (1 + deepstack layers)]."""
    if not isinstance(item, EncodedImage):
        raise TypeError(f"vllm_features takes one result (EncodedImage, EncodedVideo), not {type(item).__name__}")
    return Features(item.embeddings, list(item.deepstack or [])).packed()


def grid_tensor(items: EncodedImage | Sequence[EncodedImage]) -> torch.Tensor:
    return torch.tensor([list(item.grid_thw) for item in _listed(items, helper="grid_tensor")], dtype=torch.int64)


def vllm_multi_modal_data(items: EncodedImage | list[EncodedImage]) -> dict:
    """vLLM's offline `multi_modal_data` for the images and videos of one prompt, each in prompt order."""
    images, videos = _split(items, "vllm_multi_modal_data")
    out = {}
    if images:
        out["image"] = {
            "image_embeds": torch.cat([vllm_features(i) for i in images]),
            "image_grid_thw": grid_tensor(images),
        }
    if videos:
        out["video"] = {
            "video_embeds": torch.cat([vllm_features(v) for v in videos]),
            "video_grid_thw": grid_tensor(videos),
            "second_per_grid_ts": second_per_grid_ts(videos),
        }
    return out


def second_per_grid_ts(videos: list[EncodedVideo]) -> torch.Tensor:
    """Qwen2.5-VL's seconds per temporal patch, one per video (float32)."""
    videos = _listed(videos, "video", "second_per_grid_ts", "an image has no time")
    return torch.tensor([v.second_per_grid_t for v in videos], dtype=torch.float32)


def _saved(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(t.contiguous(), buf)
    return base64.b64encode(buf.getvalue()).decode()


def vllm_image_embeds_part(item: EncodedImage) -> dict:
    """One chat content part for vLLM's OpenAI server (`torch.save` + base64 of the features and the grid) for one
    image."""
    if not isinstance(item, EncodedImage) or isinstance(item, EncodedVideo):
        given = (
            "a video (EncodedVideo): vllm_multi_modal_data takes videos"
            if isinstance(item, EncodedVideo)
            else f"a {type(item).__name__}: one part per image, [vllm_image_embeds_part(i) for i in items]"
        )
        raise TypeError(f"vllm_image_embeds_part takes one image (EncodedImage), not {given}")
    return {
        "type": "image_embeds",
        "image_embeds": {"image_embeds": _saved(vllm_features(item)), "image_grid_thw": _saved(grid_tensor([item])[0])},
    }


def sglang_image_data(items: EncodedImage | list[EncodedImage]) -> list[dict]:
    """SGLang's `image_data` for the images of one prompt: their features concatenated, with their grids."""
    items = _listed(items, "image", "sglang_image_data", "send the videos as video_data (sglang_video_data)")
    return [
        {
            "format": "precomputed_embedding",
            "feature": torch.cat([vllm_features(i) for i in items]),
            "image_grid_thw": grid_tensor(items),
            "modality": "IMAGE",
        }
    ]


def sglang_video_data(videos: EncodedVideo | list[EncodedVideo]) -> list[dict]:
    """SGLang's `video_data` for the videos of one prompt: features concatenated, grids, seconds per temporal
    patch."""
    videos = _listed(videos, "video", "sglang_video_data", "send the images as image_data (sglang_image_data)")
    return [
        {
            "format": "precomputed_embedding",
            "feature": torch.cat([vllm_features(v) for v in videos]),
            "video_grid_thw": grid_tensor(videos),
            "second_per_grid_ts": second_per_grid_ts(videos),
            "modality": "VIDEO",
        }
    ]


def transformers_inputs(text_ids: list[int], items: EncodedImage | list[EncodedImage], config) -> dict:
    """`generate`/`forward` keyword arguments for a prompt whose `text_ids` hold one `config.image_token_id` per
    image and one `config.video_token_id` per video (per video slice for Qwen3-VL), as a chat template writes them:
    each expanded to its token count, with `mm_token_type_ids`, the grids, Qwen2.5-VL's `second_per_grid_ts`, and
    placeholder pixels (what makes the model ask for the features)."""
    images, videos = _split(items, "transformers_inputs")
    text_ids = [int(token) for token in text_ids]
    qwen3 = config.model_type.startswith("qwen3")
    parts = (
        [v.num_tokens // v.grid_thw[0] for v in videos for _ in range(v.grid_thw[0])]
        if qwen3
        else [v.num_tokens for v in videos]
    )
    for token, kind, count in (
        (config.image_token_id, "image", len(images)),
        (config.video_token_id, "video" + " slice" * qwen3, len(parts)),
    ):
        if text_ids.count(token) != count:
            raise ValueError(
                f"transformers_inputs: text_ids hold {text_ids.count(token)} {kind} token(s) "
                f"({token}) for {count} {kind}(s) given"
            )
    ids, kinds, image_iter, video_iter = [], [], iter(images), iter(parts)
    for token in text_ids:
        if token in (config.image_token_id, config.video_token_id):
            n, kind = (next(image_iter).num_tokens, 1) if token == config.image_token_id else (next(video_iter), 2)
            ids += [token] * n
            kinds += [kind] * n
        else:
            ids.append(token)
            kinds.append(0)
    input_ids = torch.tensor([ids])
    out = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": torch.tensor([kinds], dtype=torch.int32),
    }
    if images:
        out |= {"image_grid_thw": grid_tensor(images), "pixel_values": torch.zeros(1, 1)}
    if videos:
        out |= {"video_grid_thw": grid_tensor(videos), "pixel_values_videos": torch.zeros(1, 1)}
        if config.model_type == "qwen2_5_vl":
            out["second_per_grid_ts"] = second_per_grid_ts(videos)
    return out


@contextlib.contextmanager
def transformers_features(model, items: EncodedImage | list[EncodedImage]):
    """Within it, the transformers Qwen-VL `model` (…ForConditionalGeneration) takes `items` as its image and video
    features instead of running its tower on `pixel_values` and `pixel_values_videos` (its `get_image_features` and
    `get_video_features`, overridden on the instance). The features must be in the tokens layout (deepstack
    apart)."""
    inner = getattr(model, "model", model)
    dtype, device = model.dtype, model.device
    module = sys.modules[type(inner).__module__]  # its own output type (Qwen3-VL's carries the deepstack features)
    output: Any = getattr(module, "BaseModelOutputWithDeepstackFeatures", None)
    if output is None:
        from transformers.modeling_outputs import BaseModelOutputWithPooling as output

    def features(group: list[EncodedImage]):
        embeds = tuple(i.embeddings.to(device, dtype) for i in group)
        layers = len(group[0].deepstack) if group else 0
        deepstack = [tuple(i.deepstack[j].to(device, dtype) for i in group) for j in range(layers)]
        return output(pooler_output=embeds, **({"deepstack_features": deepstack} if layers else {}))

    images, videos = _split(items, "transformers_features")

    # named as the model's own: generate reads the signatures to pass (and drop) the pixel arguments
    def get_image_features(pixel_values=None, image_grid_thw=None, **kwargs):
        return features(images)

    def get_video_features(pixel_values_videos=None, video_grid_thw=None, **kwargs):
        return features(videos)

    inner.get_image_features, inner.get_video_features = get_image_features, get_video_features
    try:
        yield model
    finally:
        del inner.get_image_features, inner.get_video_features
