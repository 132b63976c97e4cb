"""The consumers' helpers check what they are given: an image helper refuses a video and a video helper an image
(each naming the item and the helper that takes it), anything but vitserve's results is refused, and a prompt's
placeholders must match its items. Results made here: no server, no model."""

from __future__ import annotations

import types

import pytest
import torch

from vitserve.client import EncodedImage, EncodedVideo
from vitserve.consumers import (
    grid_tensor,
    second_per_grid_ts,
    sglang_image_data,
    sglang_video_data,
    transformers_inputs,
    vllm_features,
    vllm_image_embeds_part,
    vllm_multi_modal_data,
)

IMAGE = EncodedImage(torch.randn(4, 8), (1, 4, 4))
VIDEO = EncodedVideo(
    torch.randn(8, 8), (2, 4, 4), [], frame_indices=[0, 1, 2, 3], fps=2.0, timestamps=[0.5, 1.5], second_per_grid_t=1.0
)


@pytest.mark.parametrize(
    "helper, given, message",
    [
        (sglang_image_data, [IMAGE, VIDEO], "sglang_image_data takes images: items[1] is a video"),
        (sglang_image_data, VIDEO, "items[0] is a video (EncodedVideo); send the videos as video_data"),
        (
            sglang_video_data,
            IMAGE,
            "sglang_video_data takes videos: items[0] is an image (EncodedImage); send the images",
        ),
        (sglang_video_data, [VIDEO, IMAGE], "items[1] is an image"),
        (
            vllm_image_embeds_part,
            VIDEO,
            "takes one image (EncodedImage), not a video (EncodedVideo): vllm_multi_modal_data takes videos",
        ),
        (vllm_image_embeds_part, [IMAGE], "not a list: one part per image"),
        (second_per_grid_ts, [VIDEO, IMAGE], "second_per_grid_ts takes videos: items[1] is an image"),
        (vllm_multi_modal_data, [IMAGE, torch.zeros(4, 8)], "items[1] is a Tensor, not vitserve's result"),
        (vllm_multi_modal_data, torch.zeros(4, 8), "not Tensor"),
        (
            grid_tensor,
            5,
            "grid_tensor takes vitserve's results (EncodedImage, EncodedVideo) or a list of them, not int",
        ),
        (vllm_features, [IMAGE], "vllm_features takes one result (EncodedImage, EncodedVideo), not list"),
    ],
)
def test_a_helper_refuses_what_it_does_not_take(helper, given, message):
    with pytest.raises(TypeError) as error:
        helper(given)
    assert message in str(error.value)


def test_what_each_helper_takes_it_builds_from():
    """The same items, each in its own helper: nothing taken from the wrong kind."""
    (images,), (videos,) = sglang_image_data([IMAGE, IMAGE]), sglang_video_data(VIDEO)
    assert images["modality"] == "IMAGE" and images["feature"].shape == (8, 8)
    assert videos["modality"] == "VIDEO" and torch.equal(videos["feature"], VIDEO.embeddings)
    assert vllm_image_embeds_part(IMAGE)["type"] == "image_embeds"
    mixed = vllm_multi_modal_data([VIDEO, IMAGE])
    assert torch.equal(mixed["image"]["image_embeds"], IMAGE.embeddings)
    assert torch.equal(mixed["video"]["video_embeds"], VIDEO.embeddings)


def test_a_prompt_holds_a_placeholder_per_item():
    config = types.SimpleNamespace(model_type="qwen2_5_vl", image_token_id=7, video_token_id=8)
    out = transformers_inputs([1, 7, 2, 8], [IMAGE, VIDEO], config)
    assert out["input_ids"].shape[1] == 2 + IMAGE.num_tokens + VIDEO.num_tokens
    with pytest.raises(ValueError, match=r"text_ids hold 1 image token\(s\) \(7\) for 2 image\(s\) given"):
        transformers_inputs([1, 7, 2, 8], [IMAGE, IMAGE, VIDEO], config)
    with pytest.raises(ValueError, match=r"hold 2 video slice token\(s\) \(8\) for 3 video slice\(s\)"):
        qwen3 = types.SimpleNamespace(model_type="qwen3_vl", image_token_id=7, video_token_id=8)
        transformers_inputs([8, 8], [EncodedVideo(torch.randn(12, 8), (3, 4, 4))], qwen3)
