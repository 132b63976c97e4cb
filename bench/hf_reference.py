"""transformers' own towers built from our configs, loaded with the same published-layout tensors (benchmarks and
GPU checks only: the library never imports transformers)."""

from __future__ import annotations

import torch

from vitserve.encoder.config import VisionConfig


def vision_config(cfg: VisionConfig) -> dict:
    """The `vision_config` of a transformers config.json for this tower."""
    out = dict(
        depth=cfg.depth,
        num_heads=cfg.num_heads,
        hidden_act=cfg.hidden_act,
        patch_size=cfg.patch_size,
        temporal_patch_size=cfg.temporal_patch_size,
        spatial_merge_size=cfg.spatial_merge_size,
        in_channels=cfg.in_channels,
        rope_parameters={"rope_theta": cfg.rope_theta},
    )
    if cfg.family == "qwen2_vl":
        return out | dict(
            embed_dim=cfg.hidden_size,
            hidden_size=cfg.out_hidden_size,
            mlp_ratio=cfg.intermediate_size // cfg.hidden_size,
        )
    out |= dict(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, out_hidden_size=cfg.out_hidden_size
    )
    if cfg.family == "qwen2_5_vl":
        return out | dict(window_size=cfg.window_size, fullatt_block_indexes=list(cfg.fullatt_block_indexes))
    return out | dict(
        num_position_embeddings=cfg.num_position_embeddings, deepstack_visual_indexes=list(cfg.deepstack_visual_indexes)
    )


def hf_vision_tower(cfg: VisionConfig, tensors: dict[str, torch.Tensor], device, dtype, attn: str = "sdpa"):
    import transformers as tf

    if cfg.family == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as Tower

        config = tf.Qwen2VLConfig
    elif cfg.family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as Tower

        config = tf.Qwen2_5_VLConfig
    else:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Tower

        config = tf.Qwen3VLConfig
    vcfg = config(vision_config=vision_config(cfg)).vision_config
    with torch.device(device):  # built where it runs (buffers such as rotary inv_freq are computed there)
        tower = Tower._from_config(vcfg, attn_implementation=attn).to(dtype)
    tower.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}, strict=True)
    return tower.eval().requires_grad_(False)
