"""Fused elementwise kernels for the towers, each with its torch reference twin.

On CUDA (half precision, Triton importable) the fused Triton kernels run; everywhere else the torch references do,
with transformers' exact op order (so the CPU tests compare bit-for-bit-close against transformers' towers). The GPU
tests check every Triton kernel against its reference on fresh random inputs.

What is fused, and why: unfused, the elementwise ops of a block (fp32 upcasts for norms and rotary, SiLU then
multiply, residual adds, copies) move ~1 GB at 8192 patches and take as long as its GEMMs.
- `add_norm`: residual add + RMSNorm/LayerNorm in one pass (statistics in fp32), returning both.
- `rotary_qk`: q and k read straight from the fused qkv GEMM output, rotated in fp32, written contiguous.
- `gated_act` / `act`: SiLU(gate) * up, quick-GELU, tanh-GELU in one pass each.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

_DISABLED = os.environ.get("VITSERVE_DISABLE_TRITON", "0") == "1"
_triton = None


def _ops():
    """The Triton module, imported on first use on CUDA (CI has no Triton and never gets here)."""
    global _triton
    if _triton is None:
        from . import triton_ops

        _triton = triton_ops
    return _triton


def triton_enabled() -> bool:
    """Triton kernels may run (VITSERVE_DISABLE_TRITON is not 1, Triton importable); CUDA is the caller's test."""
    if _DISABLED:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    return not _DISABLED and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


# ---- torch references (transformers' op order) ----------------------------------------------------------------------


def norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    if bias is None:  # Qwen2.5 RMSNorm: statistics in fp32, weight applied in the input dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


ACT_REFERENCE = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]).to(x.dtype)


# ---- dispatch -------------------------------------------------------------------------------------------------------


def norm(x: torch.Tensor, weight, bias, eps: float) -> torch.Tensor:
    if use_triton(x):
        return _ops().add_norm(x, None, weight, bias, eps)[1]
    return norm_reference(x, weight, bias, eps)


def add_norm(residual: torch.Tensor, delta: torch.Tensor, weight, bias, eps: float):
    """(residual + delta, norm(residual + delta))."""
    if use_triton(residual):
        return _ops().add_norm(residual, delta, weight, bias, eps)
    residual = residual + delta
    return residual, norm_reference(residual, weight, bias, eps)


def rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int):
    """Split the fused qkv output [N, 3D] into rotated q, k (contiguous [N, H, hd]) and v (a view)."""
    n = qkv.shape[0]
    q, k, v = qkv.view(n, 3, num_heads, -1).unbind(1)
    if use_triton(qkv):
        q, k = _ops().rotary_qk(qkv, cos, sin, num_heads)
        return q, k, v
    return rotary_reference(q, cos, sin), rotary_reference(k, cos, sin), v


def act(x: torch.Tensor, kind: str) -> torch.Tensor:
    if use_triton(x) and kind in ("quick_gelu", "gelu_pytorch_tanh", "silu"):
        return _ops().act(x, kind)
    return ACT_REFERENCE[kind](x)


def gated_act(gate_up: torch.Tensor, kind: str) -> torch.Tensor:
    """act(gate) * up for a fused [N, 2I] gate|up GEMM output."""
    if use_triton(gate_up) and kind == "silu":
        return _ops().silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return ACT_REFERENCE[kind](gate) * up
