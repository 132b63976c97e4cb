"""Where a tower's GPU time goes (issue 5): kernel time by kind (GEMM, attention, fused Triton, other) for our eager
path (the same kernels a graph replays), then the kernels themselves measured alone: each GEMM shape at the measured
matmul ceiling, and attention backends on the same shapes. Prints tables and writes JSON.

    PYTHONPATH=$PWD python3 bench/profile_tower.py --out profile.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import gpu_ms, matmul_tflops  # noqa: E402
from vitserve.encoder import VisionEncoder  # noqa: E402
from vitserve.encoder.layers import MLP_ALIGN, round_up  # noqa: E402
from vitserve.encoder.plan import make_plan, to_device  # noqa: E402

CASES = {
    "Qwen/Qwen2.5-VL-7B-Instruct": {"8×448²": [(32, 32)] * 8, "1344²": [(96, 96)]},
    "Qwen/Qwen2-VL-7B-Instruct": {"8×448²": [(32, 32)] * 8, "1344²": [(96, 96)]},
    "Qwen/Qwen3-VL-8B-Instruct": {"8×512²": [(32, 32)] * 8, "1344²": [(84, 84)]},
}
KINDS = [
    ("attention", re.compile(r"flash|fmha|attn|sdpa|cudnn", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas", re.I)),
    ("fused", re.compile(r"^_\w+_kernel$|triton", re.I)),
]


def kind_of(name: str) -> str:
    return next((k for k, pattern in KINDS if pattern.search(name)), "other")


def kernel_breakdown(enc, grids) -> dict:
    cfg = enc.config
    grids = [(1, h, w) for h, w in grids]
    n = sum(h * w for _, h, w in grids)
    inputs = to_device(make_plan(grids, cfg), torch.randn(n, cfg.patch_dim), enc.device, enc.dtype)
    with torch.inference_mode():
        for _ in range(2):
            enc.tower(inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            enc.tower(inputs)
            torch.cuda.synchronize()
    kernels = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            kernels[e.name][0] += e.time_range.elapsed_us() / 1e3
            kernels[e.name][1] += 1
    by_kind = defaultdict(float)
    for name, (ms, _) in kernels.items():
        by_kind[kind_of(name)] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:12]
    return {
        "patches": n,
        "total_ms": sum(by_kind.values()),
        "by_kind_ms": dict(by_kind),
        "top": [{"kernel": k[:110], "kind": kind_of(k), "ms": v[0], "count": v[1]} for k, v in top],
    }


def gemm_table(enc, ceiling: float, m: int = 8192) -> list[dict]:
    cfg, d = enc.config, enc.config.hidden_size
    width = round_up(cfg.intermediate_size, MLP_ALIGN)
    mlp = (
        [("gate_up", d, 2 * width), ("down", width, d)]
        if cfg.hidden_act == "silu"
        else [("fc1", d, width), ("fc2", width, d)]
    )
    rows = []
    u = cfg.merge_unit
    for name, k, nout in [
        ("qkv", d, 3 * d),
        ("proj", d, d),
        *mlp,
        ("merger.fc1", u * d, u * d),
        ("merger.fc2", u * d, cfg.out_hidden_size),
    ]:
        rows_m = m // u if name.startswith("merger") else m
        x = torch.randn(rows_m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(nout, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        b = torch.randn(nout, device="cuda", dtype=torch.bfloat16)
        ms = gpu_ms(lambda x=x, w=w, b=b: F.linear(x, w, b), warmup=5, reps=30)
        tflops = 2 * rows_m * k * nout / ms / 1e9
        rows.append(
            {"gemm": name, "m": rows_m, "k": k, "n": nout, "ms": ms, "tflops": tflops, "of_ceiling": tflops / ceiling}
        )
        if cfg.hidden_act == "gelu_pytorch_tanh" and name == "fc1":  # cuBLASLt's bias + GELU(tanh) epilogue
            from vitserve.encoder import kernels

            sep = gpu_ms(lambda x=x, w=w, b=b: kernels.act(F.linear(x, w, b), "gelu_pytorch_tanh"), warmup=5, reps=30)
            fused = gpu_ms(lambda x=x, w=w, b=b: torch._addmm_activation(b, x, w.t(), use_gelu=True), warmup=5, reps=30)
            ref = kernels.ACT_REFERENCE["gelu_pytorch_tanh"](F.linear(x.float(), w.float(), b.float()))
            err = lambda y: ((y.float() - ref).norm() / ref.norm()).item()  # noqa: E731
            rows.append(
                {
                    "gemm": "fc1+gelu",
                    "linear_then_act_ms": sep,
                    "epilogue_ms": fused,
                    "err_linear_then_act": err(kernels.act(F.linear(x, w, b), "gelu_pytorch_tanh")),
                    "err_epilogue": err(torch._addmm_activation(b, x, w.t(), use_gelu=True)),
                }
            )
    return rows


def attention_table(heads: int, head_dim: int) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.varlen import varlen_attn

    rows = []
    for frames, n in [(1, 1024), (1, 4096), (1, 9216), (8, 1024)]:
        total = frames * n
        q, k, v = (torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cu = torch.arange(0, total + 1, n, device="cuda", dtype=torch.int32)
        row = {
            "frames": frames,
            "seq": n,
            "heads": heads,
            "head_dim": head_dim,
            "flops": 4 * frames * n * n * heads * head_dim,
            "varlen_ms": gpu_ms(lambda q=q, k=k, v=v, cu=cu, n=n: varlen_attn(q, k, v, cu, cu, n, n)),
        }
        dense = [t.view(frames, n, heads, head_dim).transpose(1, 2) for t in (q, k, v)]
        for name, backend in (("cudnn_ms", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash_ms", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    row[name] = gpu_ms(lambda dense=dense: F.scaled_dot_product_attention(*dense))
            except RuntimeError as e:
                row[name] = f"unavailable: {str(e)[:80]}"
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=list(CASES))
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--out", default="profile.json")
    args = ap.parse_args()
    ceiling = matmul_tflops()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16 matmul ceiling {ceiling:.0f} TFLOP/s")
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "matmul_tflops": ceiling,
        "models": {},
    }
    for name in args.models:
        enc = VisionEncoder.from_pretrained(
            name,
            device="cuda",
            dtype="bfloat16",
            load_format="dummy",
            capture=False,
            attention_backend=args.attention_backend,
        )
        cfg = enc.config
        print(f"{name}: attention {enc.runner.stats.attention}")
        out = {
            "cases": {case: kernel_breakdown(enc, grids) for case, grids in CASES[name].items()},
            "gemms": gemm_table(enc, ceiling),
            "attention": attention_table(cfg.num_heads, cfg.head_dim),
        }
        result["models"][name] = out
        print(f"\n== {name}")
        for case, r in out["cases"].items():
            kinds = ", ".join(f"{k} {v:.2f} ({v / r['total_ms']:.0%})" for k, v in sorted(r["by_kind_ms"].items()))
            print(f"{case}: {r['patches']} patches, kernels {r['total_ms']:.2f} ms: {kinds}")
            for t in r["top"]:
                print(f"   {t['ms']:7.3f} ms x{t['count']:<4d} {t['kind']:9s} {t['kernel']}")
        for g in out["gemms"]:
            print("   gemm " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in g.items()))
        for a in out["attention"]:
            print("   attn " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in a.items()))
        enc = None
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
