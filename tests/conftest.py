"""Shared fixtures: tiny full checkpoints written by transformers' own `save_pretrained`, and the transformers
towers that serve as the reference. Nothing here downloads."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

TEXT = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)

# Same towers as encoder.config's tiny-* built-ins (so dummy and real loading are tested on identical shapes).
VISION = {
    "qwen2_vl": dict(depth=2, embed_dim=64, num_heads=4, mlp_ratio=2, hidden_size=32, patch_size=14),
    "qwen2_5_vl": dict(
        depth=4,
        hidden_size=64,
        num_heads=4,
        intermediate_size=90,
        out_hidden_size=32,
        window_size=112,
        fullatt_block_indexes=[1, 3],
        patch_size=14,
    ),
    "qwen3_vl": dict(
        depth=4,
        hidden_size=64,
        num_heads=4,
        intermediate_size=96,
        out_hidden_size=32,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0, 2],
        patch_size=16,
    ),
}
FAMILIES = list(VISION)
# the special tokens inside the tiny vocabulary (the published ids are 151652-151656)
TOKENS = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)


def hf_model(family: str, seed: int = 0):
    """A tiny full transformers model (text + vision) with non-trivial random weights."""
    import transformers as tf

    config_cls, model_cls = {
        "qwen2_vl": (tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration),
        "qwen3_vl": (tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration),
    }[family]
    # a 16-wide head: its 8 rotary frequencies split over (time, height, width) as 2 + 3 + 3
    text = dict(
        TEXT, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    )
    torch.manual_seed(seed)
    model = model_cls(config_cls(text_config=text, vision_config=VISION[family], **TOKENS)).eval()
    with torch.no_grad():  # randomise norms and biases too, so a swapped or dropped one cannot go unnoticed
        for name, p in model.model.visual.named_parameters():
            if p.dim() == 1:
                p.copy_(
                    (1.0 if name.endswith("weight") and "norm" in name or "ln_q" in name else 0.0)
                    + 0.1 * torch.randn_like(p)
                )
    return model


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, object]]:
    """family -> (checkpoint dir, transformers tower in float32 sdpa). Plus '<family>-sharded' saved in shards."""
    out = {}
    for family in FAMILIES:
        model = hf_model(family)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        out[family] = (str(path), model.model.visual)
        sharded = tmp_path_factory.mktemp(family + "-sharded")
        model.save_pretrained(sharded, max_shard_size="20KB")
        out[family + "-sharded"] = (str(sharded), model.model.visual)
    return out


@pytest.fixture(scope="session")
def encoders():
    """Tiny towers with seeded dummy weights, by name, shared by the service tests."""
    from vitserve.encoder import VisionEncoder

    return {
        name: VisionEncoder.from_pretrained(name, load_format="dummy") for name in ("tiny-qwen2.5-vl", "tiny-qwen3-vl")
    }
