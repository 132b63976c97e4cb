"""Qwen3-VL tower: LayerNorm blocks, fc1 -> gelu(tanh) -> fc2, patch-embed bias, learned positions bilinearly
resampled per image (taps planned in plan.py), and deepstack mergers on the `deepstack_visual_indexes` blocks."""

from __future__ import annotations

import torch

from ..config import VisionConfig
from ..layers import MLP, VisionTower, layer_norm
from .layout import convert_gelu_mlp, convert_shared, gelu_mlp_layout, tower_layout

MERGER = ("norm", "linear_fc1", "linear_fc2")


def build(cfg: VisionConfig) -> VisionTower:
    return VisionTower(
        cfg, layer_norm, lambda: MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act), patch_bias=True
    )


def hf_layout(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    return tower_layout(
        cfg,
        norm_bias=True,
        patch_bias=True,
        merger_names=MERGER,
        mlp_layout=gelu_mlp_layout(cfg, "linear_fc1", "linear_fc2"),
    )


def convert(hf: dict[str, torch.Tensor], cfg: VisionConfig) -> dict[str, torch.Tensor]:
    return convert_shared(hf, cfg, MERGER) | convert_gelu_mlp(hf, cfg, "linear_fc1", "linear_fc2")
