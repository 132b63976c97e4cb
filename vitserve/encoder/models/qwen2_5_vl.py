"""Qwen2.5-VL tower: RMSNorm blocks, SwiGLU MLP (gate and up fused at load), window attention except in the
`fullatt_block_indexes` blocks (the windows themselves are planned in plan.py)."""

from __future__ import annotations

import torch

from ..config import VisionConfig
from ..layers import MLP_ALIGN, GatedMLP, VisionTower, rms_norm, round_up
from .layout import QWEN2_MERGER, convert_shared, linear_layout, pad_cols, pad_rows, tower_layout


def build(cfg: VisionConfig) -> VisionTower:
    return VisionTower(
        cfg, rms_norm, lambda: GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act), patch_bias=False
    )


def hf_layout(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    d, i = cfg.hidden_size, cfg.intermediate_size

    def mlp(p):
        return (
            linear_layout(p + "gate_proj", i, d)
            | linear_layout(p + "up_proj", i, d)
            | linear_layout(p + "down_proj", d, i)
        )

    return tower_layout(cfg, norm_bias=False, patch_bias=False, merger_names=QWEN2_MERGER, mlp_layout=mlp)


def convert(hf: dict[str, torch.Tensor], cfg: VisionConfig) -> dict[str, torch.Tensor]:
    out, width = convert_shared(hf, cfg, QWEN2_MERGER), round_up(cfg.intermediate_size, MLP_ALIGN)
    for i in range(cfg.depth):
        p = f"blocks.{i}.mlp."
        for kind in ("weight", "bias"):
            gate, up = (pad_rows(hf[f"{p}{name}.{kind}"], width) for name in ("gate_proj", "up_proj"))
            out[f"{p}gate_up.{kind}"] = torch.cat([gate, up])
        out[p + "down.weight"] = pad_cols(hf[p + "down_proj.weight"], width)
        out[p + "down.bias"] = hf[p + "down_proj.bias"]
    return out
