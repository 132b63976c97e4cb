"""Shared tensor layers of the Qwen-VL vision towers, and the tower itself.

Pure tensor code: every shape comes from the inputs' shapes or the config, every per-batch fact from `TowerInputs`
(built by plan.py), and nothing here syncs with the host. The three families differ only in the pieces they plug in
(norm, MLP, patch-embed bias, learned positions, windows, deepstack), chosen in models/; how published checkpoints
map onto these parameters is models/layout.py's job.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from . import attention, kernels
from .config import VisionConfig
from .plan import TowerInputs

MLP_ALIGN = 64  # MLP widths are zero-padded to a multiple of this: 3420 -> 3456 runs ~3x faster in cuBLAS on H100/H200


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


class RMSNorm(nn.Module):
    """Qwen2.5's RMSNorm: statistics in float32, weight applied in the input dtype (as transformers does)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    bias = None  # the fused kernels take (weight, bias, eps) for both norm kinds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.norm(x, self.weight, None, self.eps)


class LayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.norm(x, self.weight, self.bias, self.eps)


def layer_norm(dim: int) -> LayerNorm:
    return LayerNorm(dim, eps=1e-6)


def rms_norm(dim: int) -> RMSNorm:
    return RMSNorm(dim, eps=1e-6)


class MLP(nn.Module):
    """fc1 -> activation -> fc2 (Qwen2-VL, Qwen3-VL). The hidden width may be zero-padded: act(0) = 0 there."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1 = nn.Linear(dim, round_up(hidden, MLP_ALIGN))
        self.fc2 = nn.Linear(round_up(hidden, MLP_ALIGN), dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(kernels.act(self.fc1(x), self.act))


class GatedMLP(nn.Module):
    """SwiGLU with gate and up projections fused into one GEMM (Qwen2.5-VL); padded rows are zero in both halves."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.hidden = round_up(hidden, MLP_ALIGN)
        self.gate_up = nn.Linear(dim, 2 * self.hidden)
        self.down = nn.Linear(self.hidden, dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(kernels.gated_act(self.gate_up(x), self.act))


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """2D axial rotary tables [N, head_dim] in float32, laid out [row freqs, col freqs, row freqs, col freqs]."""
    freqs = (positions.float()[:, :, None] * inv_freq).flatten(1)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, cos, sin, attend) -> torch.Tensor:
        """`attend`: a segment layout bound by the tower's attention backend (attention.py)."""
        q, k, v = kernels.rotary_qk(self.qkv(x), cos, sin, self.num_heads)
        return self.proj(attend(q, k, v).reshape(x.shape[0], -1))


class Block(nn.Module):
    """Pre-norm block in residual-stream form: it takes the running residual and the previous block's output
    (`delta`) and returns the new pair, so each residual add is fused with the norm that follows it."""

    def __init__(self, cfg: VisionConfig, norm, mlp: nn.Module):
        super().__init__()
        self.norm1 = norm(cfg.hidden_size)
        self.norm2 = norm(cfg.hidden_size)
        self.attn = Attention(cfg.hidden_size, cfg.num_heads)
        self.mlp = mlp

    def forward(self, residual, delta, cos, sin, attend):
        n1, n2 = self.norm1, self.norm2
        if delta is None:
            h = kernels.norm(residual, n1.weight, n1.bias, n1.eps)
        else:
            residual, h = kernels.add_norm(residual, delta, n1.weight, n1.bias, n1.eps)
        residual, h = kernels.add_norm(residual, self.attn(h, cos, sin, attend), n2.weight, n2.bias, n2.eps)
        return residual, self.mlp(h)


class PatchMerger(nn.Module):
    """One token per merge group (`cfg.merge_unit` patches): norm (before the concat, or after it for Qwen3's
    deepstack) -> fc1 -> GELU -> fc2."""

    def __init__(self, cfg: VisionConfig, norm, postshuffle: bool = False):
        super().__init__()
        self.width = cfg.hidden_size * cfg.merge_unit
        self.postshuffle = postshuffle
        self.norm = norm(self.width if postshuffle else cfg.hidden_size)
        self.fc1 = nn.Linear(self.width, self.width)
        self.fc2 = nn.Linear(self.width, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.fc2(kernels.act(self.fc1(x), "gelu"))


class VisionTower(nn.Module):
    """Patch embedding -> blocks -> merger (+ deepstack mergers) over one packed batch described by TowerInputs.

    Returns the merged tokens [total / merge_unit, out_hidden] in raster order (padding rows included, for the
    caller to drop) and the deepstack features, one [total / merge_unit, out_hidden] per deepstack layer (empty list
    otherwise).
    `attention` and `window_attention` are the attention backends (attention.py) of full-attention and window
    layers: exact SDPA until `set_attention` picks others.
    """

    def __init__(self, cfg: VisionConfig, norm, make_mlp, patch_bias: bool):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=patch_bias)  # Conv3d as one GEMM
        self.pos_embed = (
            nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size) if cfg.num_position_embeddings else None
        )
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        self.blocks = nn.ModuleList(Block(cfg, norm, make_mlp()) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, norm)
        self.deepstack_mergers = nn.ModuleList(
            PatchMerger(cfg, layer_norm, postshuffle=True) for _ in cfg.deepstack_visual_indexes
        )
        self.windowed = cfg.window_size > 0
        self.full_attention_layers = set(cfg.fullatt_block_indexes) if self.windowed else set(range(cfg.depth))
        self.deepstack_layers = {layer: j for j, layer in enumerate(cfg.deepstack_visual_indexes)}
        self.attention = self.window_attention = attention.SDPA()

    def set_attention(self, name: str, device, dtype) -> None:
        """Use the attention backend called `name` (attention.BACKENDS; auto: the fastest that runs here, chosen
        apart for full attention and for Qwen2.5's windows)."""
        device, heads, head_dim = torch.device(device), self.cfg.num_heads, self.cfg.head_dim
        self.attention = attention.select(name, device, dtype, heads, head_dim)
        self.window_attention = (
            attention.select(name, device, dtype, heads, head_dim, windows=True)
            if self.windowed and name == "auto"
            else self.attention
        )

    def _inv_freq(self, device=None) -> torch.Tensor:
        quarter = self.cfg.head_dim // 2  # half the head dim rotates by row, half by column
        return 1.0 / self.cfg.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float, device=device) / quarter)

    def reset_buffers(self, device) -> None:
        """Recompute non-persistent buffers (after loading weights into a tower built on the meta device)."""
        self.inv_freq = self._inv_freq(device)

    def forward(self, inp: TowerInputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = inp.pixel_values if inp.patch_order is None else inp.pixel_values[inp.patch_order]
        proj = cast(nn.Linear, self.patch_embed.proj)  # set in __init__ (Module's __getattr__ says Tensor | Module)
        x = proj(x.to(proj.weight.dtype))
        if self.pos_embed is not None:
            # learned positions: every plan of the tower has their indices and weights (make_plan)
            assert inp.interp_indices is not None and inp.interp_weights is not None
            learned = (self.pos_embed.weight[inp.interp_indices] * inp.interp_weights[..., None]).sum(1)
            x = x + learned.to(x.dtype)
        cos, sin = rotary_cos_sin(inp.positions, self.inv_freq)
        full = self.attention.bind(inp.cu_seqlens, inp.max_seqlen, inp.seqlens)
        window = None
        if self.windowed:
            assert inp.cu_window_seqlens is not None  # a windowed tower's plans have windows (make_plan)
            window = self.window_attention.bind(inp.cu_window_seqlens, inp.max_window_seqlen, inp.window_seqlens)
        deepstack, delta = [], None
        for i, block in enumerate(self.blocks):
            x, delta = block(x, delta, cos, sin, full if i in self.full_attention_layers else window)
            if i in self.deepstack_layers:
                deepstack.append(self.deepstack_mergers[self.deepstack_layers[i]](x + delta))
        merged = self.merger(x + delta)
        if inp.token_order is not None:
            merged = merged[inp.token_order]
        return merged, deepstack
