"""Qwen2-VL tower: LayerNorm blocks, fc1 -> quick_gelu -> fc2, no patch-embed bias, full attention everywhere."""

from __future__ import annotations

import torch

from ..config import VisionConfig
from ..layers import MLP, MLP_ALIGN, VisionTower, convert_shared, layer_norm, linear_layout, pad_cols, pad_rows, \
    round_up, tower_layout

MERGER = ("ln_q", "mlp.0", "mlp.2")
MERGER_RENAMES = {"merger.ln_q.": "merger.norm.", "merger.mlp.0.": "merger.fc1.", "merger.mlp.2.": "merger.fc2."}


def build(cfg: VisionConfig) -> VisionTower:
    return VisionTower(cfg, layer_norm, lambda: MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act),
                       patch_bias=False)


def hf_layout(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    d, i = cfg.hidden_size, cfg.intermediate_size
    return tower_layout(cfg, norm_bias=True, patch_bias=False, merger_names=MERGER,
                        mlp_layout=lambda p: linear_layout(p + "fc1", i, d) | linear_layout(p + "fc2", d, i))


def convert_gelu_mlp(hf: dict, cfg: VisionConfig, fc1: str, fc2: str) -> dict[str, torch.Tensor]:
    """fc1/fc2 MLPs (Qwen2-VL, Qwen3-VL) with the hidden width zero-padded to MLP_ALIGN."""
    width, out = round_up(cfg.intermediate_size, MLP_ALIGN), {}
    for i in range(cfg.depth):
        p = f"blocks.{i}.mlp."
        out[p + "fc1.weight"] = pad_rows(hf[p + fc1 + ".weight"], width)
        out[p + "fc1.bias"] = pad_rows(hf[p + fc1 + ".bias"], width)
        out[p + "fc2.weight"] = pad_cols(hf[p + fc2 + ".weight"], width)
        out[p + "fc2.bias"] = hf[p + fc2 + ".bias"]
    return out


def convert(hf: dict[str, torch.Tensor], cfg: VisionConfig) -> dict[str, torch.Tensor]:
    return convert_shared(hf, cfg, MERGER_RENAMES) | convert_gelu_mlp(hf, cfg, "fc1", "fc2")
