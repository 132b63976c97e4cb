"""Hand vitserve's features to the LLM server that skips its own vision tower (encoder disaggregation).

Each helper takes `EncodedImage` results (`Client.encode`'s in either layout, or `VisionEncoder.encode`'s): a list,
or one image's, and builds what its consumer takes:
- vLLM offline (`LLM(..., enable_mm_embeds=True)`): `vllm_multi_modal_data`, the `multi_modal_data` dict. vLLM's
  Qwen-VL models (vllm/model_executor/models/qwen2_vl.py, `_parse_and_validate_image_input`) take
  `image_embeds` as every image's tokens concatenated, [Σ tokens, H], and split it per image by
  `prod(image_grid_thw) // merge**2`; `image_grid_thw` is [n_images, 3] int64 in patches.
- vLLM's OpenAI server (`--enable-mm-embeds`): `vllm_image_embeds_part`, one chat content part per image
  (vllm/entrypoints/chat_utils.py: `ChatCompletionContentPartImageEmbedsParam`, a dict of base64 `torch.save`d
  tensors; "pass a separate content part for each multi-modal item").
- SGLang: `sglang_image_data`, an `image_data` item of format `precomputed_embedding`.
- transformers: `transformers_features` and `transformers_inputs`: `generate` with vitserve's features in place of
  the model's tower, the real grids and `mm_token_type_ids` keeping the 3-D rope positions right.

For Qwen3-VL every consumer takes the deepstack features on the width: `cat([tokens, ds0, ds1, ds2], -1)`, in
`deepstack_visual_indexes` order (what `layout="vllm"` returns already). The prompt's image-token count must equal
the grid's: vitserve's min/max pixels must match the LLM's processor settings.
"""

from __future__ import annotations

import base64
import contextlib
import io
import sys

import torch

from .client import EncodedImage


def _listed(items: EncodedImage | list[EncodedImage]) -> list[EncodedImage]:
    return [items] if isinstance(items, EncodedImage) else list(items)


def vllm_features(item: EncodedImage) -> torch.Tensor:
    """One image's features as vLLM and SGLang take them: [tokens, out_hidden x (1 + deepstack layers)]."""
    return torch.cat([item.embeddings, *item.deepstack], dim=-1) if item.deepstack else item.embeddings


def grid_tensor(items: EncodedImage | list[EncodedImage]) -> torch.Tensor:
    return torch.tensor([list(item.grid_thw) for item in _listed(items)], dtype=torch.int64)


def vllm_multi_modal_data(items: EncodedImage | list[EncodedImage]) -> dict:
    """vLLM's offline `multi_modal_data` for the images of one prompt, in prompt order."""
    items = _listed(items)
    return {"image": {"image_embeds": torch.cat([vllm_features(i) for i in items]),
                      "image_grid_thw": grid_tensor(items)}}


def _saved(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(t.contiguous(), buf)
    return base64.b64encode(buf.getvalue()).decode()


def vllm_image_embeds_part(item: EncodedImage) -> dict:
    """One chat content part for vLLM's OpenAI server (`torch.save` + base64 of the features and the grid)."""
    return {"type": "image_embeds", "image_embeds": {"image_embeds": _saved(vllm_features(item)),
                                                     "image_grid_thw": _saved(grid_tensor([item])[0])}}


def sglang_image_data(items: EncodedImage | list[EncodedImage]) -> list[dict]:
    """SGLang's `image_data` for the images of one prompt: their features concatenated, with their grids."""
    items = _listed(items)
    return [{"format": "precomputed_embedding", "feature": torch.cat([vllm_features(i) for i in items]),
             "image_grid_thw": grid_tensor(items), "modality": "IMAGE"}]


def transformers_inputs(text_ids: list[int], items: EncodedImage | list[EncodedImage], config) -> dict:
    """`generate`/`forward` keyword arguments for a prompt whose `text_ids` hold one `config.image_token_id` per
    image (as a chat template writes them): each expanded to the image's token count, with `mm_token_type_ids`,
    the grids, and a placeholder `pixel_values` (what makes the model ask for image features)."""
    items = _listed(items)
    ids, kinds, images = [], [], iter(items)
    for token in text_ids:
        if token == config.image_token_id:
            n = next(images).num_tokens
            ids += [token] * n
            kinds += [1] * n
        else:
            ids.append(token)
            kinds.append(0)
    input_ids = torch.tensor([ids])
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "mm_token_type_ids": torch.tensor([kinds], dtype=torch.int32), "image_grid_thw": grid_tensor(items),
            "pixel_values": torch.zeros(1, 1)}


@contextlib.contextmanager
def transformers_features(model, items: EncodedImage | list[EncodedImage]):
    """Within it, the transformers Qwen-VL `model` (…ForConditionalGeneration) takes `items` as its image features
    instead of running its tower on `pixel_values` (its `get_image_features`, overridden on the instance). The
    features must be in the tokens layout (deepstack apart)."""
    items = _listed(items)
    inner = getattr(model, "model", model)
    dtype, device = model.dtype, model.device
    embeds = tuple(i.embeddings.to(device, dtype) for i in items)
    layers = len(items[0].deepstack) if items else 0
    deepstack = [tuple(i.deepstack[j].to(device, dtype) for i in items) for j in range(layers)]

    module = sys.modules[type(inner).__module__]  # its own output type (Qwen3-VL's carries the deepstack features)
    output = getattr(module, "BaseModelOutputWithDeepstackFeatures", None)
    if output is None:
        from transformers.modeling_outputs import BaseModelOutputWithPooling as output

    def get_image_features(pixel_values=None, image_grid_thw=None, **kwargs):
        return output(pooler_output=embeds, **({"deepstack_features": deepstack} if layers else {}))

    inner.get_image_features = get_image_features
    try:
        yield model
    finally:
        del inner.get_image_features
