"""Qwen2-VL tower: LayerNorm blocks, fc1 -> quick_gelu -> fc2, no patch-embed bias, full attention everywhere."""

from __future__ import annotations

import torch

from ..config import VisionConfig
from ..layers import MLP, VisionTower, layer_norm
from .layout import QWEN2_MERGER, convert_gelu_mlp, convert_shared, gelu_mlp_layout, tower_layout


def build(cfg: VisionConfig) -> VisionTower:
    return VisionTower(
        cfg, layer_norm, lambda: MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act), patch_bias=False
    )


def hf_layout(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    return tower_layout(
        cfg, norm_bias=True, patch_bias=False, merger_names=QWEN2_MERGER, mlp_layout=gelu_mlp_layout(cfg, "fc1", "fc2")
    )


def convert(hf: dict[str, torch.Tensor], cfg: VisionConfig) -> dict[str, torch.Tensor]:
    return convert_shared(hf, cfg, QWEN2_MERGER) | convert_gelu_mlp(hf, cfg, "fc1", "fc2")
