"""Triton kernels (CUDA only). Each is tested against its torch twin in encoder.kernels on the GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_norm_kernel(
    res_ptr,
    delta_ptr,
    out_res_ptr,
    out_ptr,
    w_ptr,
    b_ptr,
    D,
    eps,
    HAS_DELTA: tl.constexpr,
    RMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(res_ptr + row * D + cols, mask=mask, other=0.0)
    if HAS_DELTA:  # residual add rounded to the storage dtype, as a separate torch add would be
        x = x.to(tl.float32) + tl.load(delta_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(out_res_ptr.dtype.element_ty)
        tl.store(out_res_ptr + row * D + cols, x, mask=mask)
    xf = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        var = tl.sum(xf * xf, axis=0) / D
        h = (xf * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)  # weight applied in input dtype
        y = w * h
    else:
        mean = tl.sum(xf, axis=0) / D
        xc = tl.where(mask, xf - mean, 0.0)
        var = tl.sum(xc * xc, axis=0) / D
        y = xc * tl.rsqrt(var + eps) * w + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_norm(residual, delta, weight, bias, eps):
    residual = residual.contiguous()
    n, d = residual.shape
    out = torch.empty_like(residual)
    out_res = torch.empty_like(residual) if delta is not None else residual
    _add_norm_kernel[(n,)](
        residual,
        delta.contiguous() if delta is not None else residual,
        out_res,
        out,
        weight,
        bias if bias is not None else weight,
        d,
        eps,
        HAS_DELTA=delta is not None,
        RMS=bias is None,
        BLOCK=triton.next_power_of_2(d),
        num_warps=4 if d <= 2048 else 8,
    )
    return out_res, out


@triton.jit
def _rotary_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    qk_ptr,
    N,
    D: tl.constexpr,
    HD: tl.constexpr,
    HALF: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """ROWS rows of q (program axis 1 = 0) or k (= 1) per program, each row's H x HD values as one flat vector: lane
    j = e % HD of a head pairs with e + HALF (j < HALF: x * cos - partner * sin) or e - HALF (x * cos + partner *
    sin). Every load is contiguous along the row, with the widths known at compile time, so they vectorize: 1.2 ms
    per Qwen2.5 forward at 8192 patches on an H200, against 1.9 ms for one program per row gathering by head."""
    which = tl.program_id(1)
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    e = tl.arange(0, BLOCK_D)[None, :]
    mask = (rows < N) & (e < D)
    j = e % HD
    first = j < HALF
    src = qkv_ptr + rows * 3 * D + which * D
    x = tl.load(src + e, mask=mask, other=0.0).to(tl.float32)
    after = tl.load(src + e + HALF, mask=mask & first, other=0.0).to(tl.float32)
    before = tl.load(src + e - HALF, mask=mask & (j >= HALF), other=0.0).to(tl.float32)
    half = e % HALF  # cos/sin are [freqs, freqs]: read the first half for both
    cos = tl.load(cos_ptr + rows * HD + half, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + rows * HD + half, mask=mask, other=0.0)
    out = x * cos + tl.where(first, -after, before) * sin
    tl.store(qk_ptr + (which * N + rows) * D + e, out.to(qk_ptr.dtype.element_ty), mask=mask)


def rotary_qk(qkv, cos, sin, num_heads):
    n = qkv.shape[0]
    d = qkv.shape[1] // 3
    hd = d // num_heads
    qk = torch.empty(2, n, num_heads, hd, dtype=qkv.dtype, device=qkv.device)
    rows = 4
    _rotary_kernel[(triton.cdiv(n, rows), 2)](
        qkv.contiguous(),
        cos.contiguous(),
        sin.contiguous(),
        qk,
        n,
        d,
        hd,
        hd // 2,
        ROWS=rows,
        BLOCK_D=triton.next_power_of_2(d),
        num_warps=8,
    )
    return qk[0], qk[1]


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _activate(x, KIND: tl.constexpr):
    if KIND == 0:  # quick_gelu
        return x * tl.sigmoid(1.702 * x)
    elif KIND == 1:  # gelu_pytorch_tanh
        return 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
    else:  # silu
        return x * tl.sigmoid(x)


_KINDS = {"quick_gelu": 0, "gelu_pytorch_tanh": 1, "silu": 2}


@triton.jit
def _act_kernel(x_ptr, out_ptr, numel, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _activate(x, KIND).to(out_ptr.dtype.element_ty), mask=mask)


def act(x, kind):
    x = x.contiguous()
    out = torch.empty_like(x)
    block = 2048
    _act_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), KIND=_KINDS[kind], BLOCK=block, num_warps=8)
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded like torch's F.silu
    tl.store(out_ptr + row * inter + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up):
    gate_up = gate_up.contiguous()
    n, two_i = gate_up.shape
    out = torch.empty(n, two_i // 2, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(n, triton.cdiv(two_i // 2, block))](gate_up, out, two_i // 2, BLOCK=block, num_warps=4)
    return out
