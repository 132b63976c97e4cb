"""GPU-only: every Triton kernel against its torch twin, on fresh random inputs of the towers' real widths."""

from __future__ import annotations

import pytest
import torch

from vitserve.encoder import kernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DTYPES = [torch.bfloat16, torch.float16]


def rand(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def reference(fn, *args):
    saved, kernels._DISABLED = kernels._DISABLED, True
    try:
        return fn(*args)
    finally:
        kernels._DISABLED = saved


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1024, 1152, 1280, 4608, 5120])
@pytest.mark.parametrize("rms", [True, False])
def test_add_norm(dtype, d, rms):
    for n in (1, 37, 4096):
        x, delta = rand(n, d, dtype=dtype, scale=3), rand(n, d, dtype=dtype)
        w, b = rand(d, dtype=dtype) + 1, (None if rms else rand(d, dtype=dtype))
        res, out = kernels.add_norm(x, delta, w, b, 1e-6)
        ref_res, ref_out = reference(kernels.add_norm, x, delta, w, b, 1e-6)
        assert torch.equal(res, ref_res)  # the residual add rounds exactly like torch's
        eps = torch.finfo(dtype).eps  # statistics summed in another order: at most a rounding step apart
        torch.testing.assert_close(out, ref_out, rtol=2 * eps, atol=2 * eps)
        torch.testing.assert_close(
            kernels.norm(x, w, b, 1e-6), reference(kernels.norm, x, w, b, 1e-6), rtol=2 * eps, atol=2 * eps
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, hd", [(16, 80), (16, 72), (16, 64), (4, 16)])
def test_rotary_qk(dtype, heads, hd):
    n = 999
    qkv = rand(n, 3 * heads * hd, dtype=dtype, scale=2)
    angles = torch.rand(n, hd // 2, device="cuda") * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q, k, v = kernels.rotary_qk(qkv, cos, sin, heads)
    rq, rk, rv = reference(kernels.rotary_qk, qkv, cos, sin, heads)
    assert q.is_contiguous() and k.is_contiguous() and torch.equal(v, rv)
    torch.testing.assert_close(q, rq)
    torch.testing.assert_close(k, rk)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["quick_gelu", "gelu_pytorch_tanh", "silu"])
def test_act(dtype, kind):
    x = rand(777, 4352, dtype=dtype, scale=4)
    eps = torch.finfo(dtype).eps  # fp32 inside with one final rounding: within two rounding steps of torch's
    torch.testing.assert_close(kernels.act(x, kind), reference(kernels.act, x, kind), rtol=2 * eps, atol=2 * eps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    x = rand(1234, 2 * 3456, dtype=dtype, scale=3)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(
        kernels.gated_act(x, "silu"), reference(kernels.gated_act, x, "silu"), rtol=2 * eps, atol=2 * eps
    )
