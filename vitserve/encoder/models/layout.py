"""Published checkpoint layout: the vision tensors' names and shapes (`visual.` prefix stripped), and their
conversion into the towers' fused, padded parameters (layers.py).

A family module states only what is its own (MLP kind, merger names, norm and patch-embed biases); the names and
conversions two or more families share are here, so that the strict layout check (checkpoint.check_layout) and
the conversion read the same table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import VisionConfig
from ..layers import MLP_ALIGN, round_up

MERGER_PARTS = ("norm", "fc1", "fc2")  # our merger's parameters under `merger.` (layers.PatchMerger)
QWEN2_MERGER = ("ln_q", "mlp.0", "mlp.2")  # their published names in Qwen2-VL and Qwen2.5-VL checkpoints


def linear_layout(name: str, out_dim: int, in_dim: int, bias: bool = True) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (out_dim, in_dim), **({f"{name}.bias": (out_dim,)} if bias else {})}


def norm_layout(name: str, dim: int, bias: bool) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (dim,), **({f"{name}.bias": (dim,)} if bias else {})}


def gelu_mlp_layout(cfg: VisionConfig, fc1: str, fc2: str):
    """`mlp_layout` for fc1 -> activation -> fc2 MLPs (Qwen2-VL, Qwen3-VL), given their published names."""
    d, i = cfg.hidden_size, cfg.intermediate_size
    return lambda prefix: linear_layout(prefix + fc1, i, d) | linear_layout(prefix + fc2, d, i)


def tower_layout(cfg: VisionConfig, *, norm_bias: bool, patch_bias: bool, mlp_layout, merger_names) -> dict:
    """Every vision tensor of a published checkpoint: the parts all families share, plus the family's MLP
    (`mlp_layout(prefix)`) and merger names (`merger_names`: the published names of MERGER_PARTS under `merger.`)."""
    d, p = cfg.hidden_size, cfg.patch_size
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (d, cfg.in_channels, cfg.temporal_patch_size, p, p)
    }
    if patch_bias:
        shapes["patch_embed.proj.bias"] = (d,)
    if cfg.num_position_embeddings:
        shapes["pos_embed.weight"] = (cfg.num_position_embeddings, d)
    for i in range(cfg.depth):
        b = f"blocks.{i}."
        shapes |= norm_layout(b + "norm1", d, norm_bias) | norm_layout(b + "norm2", d, norm_bias)
        shapes |= linear_layout(b + "attn.qkv", 3 * d, d) | linear_layout(b + "attn.proj", d, d)
        shapes |= mlp_layout(b + "mlp.")
    wide = d * cfg.merge_unit
    norm, fc1, fc2 = merger_names
    shapes |= norm_layout(f"merger.{norm}", d, norm_bias)
    shapes |= linear_layout(f"merger.{fc1}", wide, wide) | linear_layout(f"merger.{fc2}", cfg.out_hidden_size, wide)
    for j in range(len(cfg.deepstack_visual_indexes)):
        s = f"deepstack_merger_list.{j}."
        shapes |= norm_layout(s + "norm", wide, True)
        shapes |= linear_layout(s + "linear_fc1", wide, wide) | linear_layout(
            s + "linear_fc2", cfg.out_hidden_size, wide
        )
    return shapes


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, rows - t.shape[0]))


def pad_cols(t: torch.Tensor, cols: int) -> torch.Tensor:
    return F.pad(t, (0, cols - t.shape[1]))


def convert_shared(hf: dict[str, torch.Tensor], cfg: VisionConfig, merger_names) -> dict[str, torch.Tensor]:
    """Rename every tensor that needs no fusing or padding (`merger_names`: as for `tower_layout`); the Conv3d patch
    embedding becomes a [D, C*T*p*p] GEMM weight. MLP tensors are left to the family's `convert`."""
    renames = {f"merger.{old}.": f"merger.{new}." for old, new in zip(merger_names, MERGER_PARTS) if old != new}
    out = {}
    for name, t in hf.items():
        if ".mlp." in name and name.startswith("blocks."):
            continue
        for old, new in renames.items():
            name = name.replace(old, new)
        name = name.replace("deepstack_merger_list.", "deepstack_mergers.").replace(".linear_fc", ".fc")
        out[name] = t.reshape(cfg.hidden_size, -1) if name == "patch_embed.proj.weight" else t
    return out


def convert_gelu_mlp(hf: dict, cfg: VisionConfig, fc1: str, fc2: str) -> dict[str, torch.Tensor]:
    """fc1/fc2 MLPs (Qwen2-VL, Qwen3-VL), given their published names, with the hidden width zero-padded to
    MLP_ALIGN."""
    width, out = round_up(cfg.intermediate_size, MLP_ALIGN), {}
    for i in range(cfg.depth):
        p = f"blocks.{i}.mlp."
        out[p + "fc1.weight"] = pad_rows(hf[p + fc1 + ".weight"], width)
        out[p + "fc1.bias"] = pad_rows(hf[p + fc1 + ".bias"], width)
        out[p + "fc2.weight"] = pad_cols(hf[p + fc2 + ".weight"], width)
        out[p + "fc2.bias"] = hf[p + fc2 + ".bias"]
    return out
