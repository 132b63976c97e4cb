"""The towers' GEMMs against alternatives to plain cuBLAS (issue 14): prints a table, writes JSON.

For each family's linear layers at 8192 rows (bf16, bias): F.linear (cuBLASLt with its bias epilogue); the same
GEMM without bias (what folding the bias into the next fused kernel would leave); the residual add taken by cuBLAS
(addmm with the residual as C, beta 1) against linear + add; and a persistent Triton GEMM with TMA loads and a
bias epilogue, autotuned over a few Hopper tile shapes. Times are medians of graph-replayed calls; errors are
relative to a float32 product of the same bf16 operands.

    PYTHONPATH=$PWD python3 bench/gemm_probe.py --out gemm_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vitserve.encoder import builtin_config
from vitserve.encoder.layers import MLP_ALIGN, round_up

MODELS = ["Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen3-VL-8B-Instruct"]


def configs():
    out = []
    for bm, bn, bk, stages, warps in [
        (128, 128, 64, 4, 8),
        (128, 256, 64, 3, 8),
        (128, 128, 128, 3, 8),
        (256, 128, 64, 3, 8),
        (128, 64, 64, 4, 4),
        (64, 128, 64, 4, 4),
    ]:
        out.append(triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_stages=stages, num_warps=warps))
    return out


@triton.jit
def _tile(tile, num_m, num_in_group, GROUP_M: tl.constexpr):
    group = tile // num_in_group
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    return first_m + tile % size_m, (tile % num_in_group) // size_m


@triton.autotune(configs=configs(), key=["M", "N", "K"])
@triton.jit
def _linear_persistent(
    a_ptr,
    w_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    NUM_SMS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    num_in_group = GROUP_M * num_n
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile(tile, num_m, num_in_group, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BK)):
            a = a_desc.load([pid_m * BM, ki * BK])
            w = w_desc.load([pid_n * BN, ki * BK])
            acc = tl.dot(a, w.T, acc)
        cols = pid_n * BN + tl.arange(0, BN)
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        c_desc.store([pid_m * BM, pid_n * BN], acc.to(c_ptr.dtype.element_ty))


_SMS = None


def triton_linear(x, w, b):
    global _SMS
    if _SMS is None:
        _SMS = torch.cuda.get_device_properties(x.device).multi_processor_count
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = lambda meta: (min(_SMS, triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"])),)  # noqa: E731
    _linear_persistent[grid](x, w, b, out, m, n, k, NUM_SMS=_SMS)
    return out


def graph_ms(fn, calls=20, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / calls)
    return sorted(times)[reps // 2]


def shapes(cfg):
    d, width = cfg.hidden_size, round_up(cfg.intermediate_size, MLP_ALIGN)
    mlp = (
        [("gate_up", d, 2 * width), ("down", width, d)]
        if cfg.hidden_act == "silu"
        else [("fc1", d, width), ("fc2", width, d)]
    )
    return [("qkv", d, 3 * d), ("proj", d, d), *mlp]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--out", default="gemm_probe.json")
    args = ap.parse_args()
    big = [torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    ceiling = 2 * 8192**3 / graph_ms(lambda: big[0] @ big[1], calls=5, reps=10) / 1e9
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
        f"bf16 matmul ceiling {ceiling:.0f} TFLOP/s"
    )
    rows, seen = [], set()
    print(
        f"{'gemm':18s} {'m':>5s} {'k':>5s} {'n':>5s} {'cublas':>7s} {'no bias':>7s} {'triton':>7s} {'of ceil':>7s} "
        f"{'best':>7s} {'err cublas':>10s} {'err triton':>10s} {'lin+add':>7s} {'addmm':>7s}"
    )
    for model in MODELS:
        cfg = builtin_config(model)
        for name, k, n in shapes(cfg):
            if (k, n) in seen:
                continue
            seen.add((k, n))
            m = args.rows
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
            bias = torch.randn(n, device="cuda").bfloat16()
            residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) if n == k else None
            ref = F.linear(x.float(), w.float(), bias.float())
            err = lambda y: ((y.float() - ref).norm() / ref.norm()).item()  # noqa: E731
            row = dict(model=model, gemm=name, m=m, k=k, n=n, flops=2 * m * k * n)
            row["cublas_ms"] = graph_ms(lambda: F.linear(x, w, bias))
            row["cublas_no_bias_ms"] = graph_ms(lambda: F.linear(x, w))
            row["err_cublas"] = err(F.linear(x, w, bias))
            try:
                t0 = time.perf_counter()
                y = triton_linear(x, w, bias)
                torch.cuda.synchronize()
                row["triton_tune_s"] = time.perf_counter() - t0
                row["err_triton"] = err(y)
                row["triton_ms"] = graph_ms(lambda: triton_linear(x, w, bias))
                row["triton_config"] = str(_linear_persistent.best_config)
            except Exception as e:
                row["triton_error"] = f"{type(e).__name__}: {e}"[:300]
                row["triton_ms"], row["err_triton"] = float("nan"), float("nan")
            if residual is not None:
                row["linear_add_ms"] = graph_ms(lambda: F.linear(x, w, bias) + residual)
                row["addmm_residual_ms"] = graph_ms(lambda: torch.addmm(residual, x, w.t()))
            best = min(row["cublas_ms"], row["triton_ms"]) if row["triton_ms"] == row["triton_ms"] else row["cublas_ms"]
            row["cublas_of_ceiling"] = row["flops"] / row["cublas_ms"] / 1e9 / ceiling
            rows.append(row)
            print(
                f"{model.split('/')[-1][:9]} {name:8s} {m:5d} {k:5d} {n:5d} {row['cublas_ms']:7.4f} "
                f"{row['cublas_no_bias_ms']:7.4f} {row['triton_ms']:7.4f} {row['cublas_of_ceiling']:7.0%} "
                f"{row['flops'] / best / 1e9 / ceiling:7.0%} {row['err_cublas']:10.2e} {row['err_triton']:10.2e} "
                f"{row.get('linear_add_ms', float('nan')):7.4f} {row.get('addmm_residual_ms', float('nan')):7.4f}",
                flush=True,
            )
            if "triton_error" in row:
                print("   triton:", row["triton_error"])
    json.dump(
        dict(
            device=torch.cuda.get_device_name(),
            torch=torch.__version__,
            triton=triton.__version__,
            matmul_tflops=ceiling,
            rows=rows,
        ),
        open(args.out, "w"),
        indent=1,
    )


if __name__ == "__main__":
    sys.exit(main())
