"""Benchmark (issue 3): GPU milliseconds per batch on Qwen2.5-VL-7B tower dims, bf16 — our graph runner vs our eager
tower vs transformers' eager tower — with the bf16 matmul ceiling and the FLOP floor measured in the same run.
Prints a table and writes JSON.

    PYTHONPATH=$PWD python3 bench/bench_runner.py --out bench_runner.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from hf_reference import hf_vision_tower  # noqa: E402

from encoder import VisionEncoder  # noqa: E402
from encoder.checkpoint import dummy_tensors  # noqa: E402
from encoder.layers import MLP_ALIGN, round_up  # noqa: E402
from encoder.plan import make_plan, to_device  # noqa: E402

CASES = {  # name -> grids (patches of 14 px)
    "224²": [(1, 16, 16)], "448²": [(1, 32, 32)], "448×896": [(1, 32, 64)], "896²": [(1, 64, 64)],
    "1344²": [(1, 96, 96)], "8×448²": [(1, 32, 32)] * 8, "32×224²": [(1, 16, 16)] * 32,
}


def gpu_ms(fn, warmup=3, reps=20) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def matmul_tflops() -> float:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = gpu_ms(lambda: a @ b, warmup=5, reps=20)
    return 2 * 8192**3 / ms / 1e9


def tower_flops(cfg, grids) -> float:
    """Matmul FLOPs of one forward (attention included, elementwise ops not), at the published (unpadded) widths."""
    d, i, n = cfg.hidden_size, cfg.intermediate_size, sum(t * h * w for t, h, w in grids)
    mlp = (3 if cfg.hidden_act == "silu" else 2) * 2 * d * i
    per_token = 2 * cfg.patch_dim * d + cfg.depth * (2 * d * 3 * d + 2 * d * d + mlp)
    attn = 0
    plan = make_plan(grids, cfg)
    for layer in range(cfg.depth):
        full = not cfg.window_size or layer in cfg.fullatt_block_indexes
        lengths = plan.full.lengths if full else plan.window.lengths
        attn += sum(4 * L * L * d for L in lengths)
    merger = n // 4 * (2 * 4 * d * 4 * d + 2 * 4 * d * cfg.out_hidden_size)
    return n * per_token + attn + merger


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-VL-7B-Instruct")
    ap.add_argument("--out", default="bench_runner.json")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    ceiling = matmul_tflops()
    enc = VisionEncoder.from_pretrained(args.model, device="cuda", dtype="bfloat16", load_format="dummy")
    cfg, runner = enc.config, enc.runner
    hf = None if args.skip_hf else hf_vision_tower(cfg, dummy_tensors(cfg, 0, "cuda"), "cuda", torch.bfloat16)
    rows = []
    print(f"{args.model} bf16 on {torch.cuda.get_device_name()}; matmul ceiling {ceiling:.0f} TFLOP/s; "
          f"capture {runner.stats.capture_seconds:.2f} s, pool {runner.stats.pool_bytes / 2**20:.0f} MiB")
    print(f"{'case':10s} {'patches':>7s} {'floor ms':>8s} {'graph ms':>8s} {'call ms':>8s} {'eager ms':>8s} "
          f"{'hf ms':>8s} {'graph %peak':>11s}")
    for name, grids in CASES.items():
        n = sum(t * h * w for t, h, w in grids)
        px = torch.randn(n, cfg.patch_dim)
        with torch.inference_mode():
            graph, budgets = 0.0, []
            for b in runner.pack(grids):  # GPU time of each replay alone, its metadata already loaded
                plan = make_plan([grids[i] for i in b.indices], cfg, pad_to=b.budget)
                runner._load(plan, torch.randn(plan.num_patches, cfg.patch_dim), b.budget)
                graph += gpu_ms(runner.graphs[b.budget].replay)
                budgets.append(b.budget)
            t0 = time.perf_counter()
            for _ in range(10):
                runner.run(px, grids)
            call = (time.perf_counter() - t0) / 10 * 1e3
            inputs = to_device(make_plan(grids, cfg), px, enc.device, enc.dtype)
            eager = gpu_ms(lambda: enc.tower(inputs), reps=10)
            hf_ms = float("nan")
            if hf is not None:
                pxd, thw = px.cuda().bfloat16(), torch.tensor(grids, device="cuda")
                hf_ms = gpu_ms(lambda: hf(pxd, thw), warmup=2, reps=5)
        flops = tower_flops(cfg, grids)
        floor = flops / ceiling / 1e9
        row = dict(case=name, patches=n, replays=budgets, flops=flops, floor_ms=floor, graph_ms=graph,
                   call_ms=call, eager_ms=eager, hf_eager_ms=hf_ms, graph_tflops=flops / graph / 1e9,
                   graph_frac_of_ceiling=flops / graph / 1e9 / ceiling)
        rows.append(row)
        print(f"{name:10s} {n:7d} {floor:8.2f} {graph:8.2f} {call:8.2f} {eager:8.2f} {hf_ms:8.2f} "
              f"{100 * row['graph_frac_of_ceiling']:10.1f}%", flush=True)
    json.dump(dict(model=args.model, device=torch.cuda.get_device_name(), torch=torch.__version__,
                   date=time.strftime("%Y-%m-%d"), matmul_tflops=ceiling, mlp_align=MLP_ALIGN,
                   padded_mlp=round_up(cfg.intermediate_size, MLP_ALIGN), capture_seconds=runner.stats.capture_seconds,
                   pool_bytes=runner.stats.pool_bytes, rows=rows), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
