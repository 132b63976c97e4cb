"""Attention backends on the towers' shapes (issue 14): correctness inside CUDA graphs and speed, one table.

For every backend that runs here (encoder.attention: flash, cudnn, fa4) and head size (16 x 80: Qwen2/2.5; 16 x 72:
Qwen3):
- correctness: packed q, k, v with NaN in every padding row (fa4: large finite values) and a strided v (a view of a
  fused qkv buffer, as in the tower); each layout's real rows against float32 per-segment SDPA, eager and from a CUDA
  graph captured on another layout with the same capacity and replayed after the new `cu_seqlens` is written in place
  (zero-length tail segments, padding rows after the last segment). Pass: finite real rows, error within 2x flash's.
- speed: ms per call from graph replays, at the exact shape (segments = images, max_seqlen = the longest) and as a
  budget graph runs it (a fixed segment capacity, max_seqlen = the budget), plus how the time grows with unused
  capacity, and what a first call costs (cuDNN graph build, FA4 compile).

    PYTHONPATH=$PWD python3 bench/attention_probe.py --out attention_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from vitserve.encoder import attention
from vitserve.encoder.runner import capture_graph

HEADS = 16
LAYOUTS = {  # name: (segment lengths, budget-style capacity, budget-style max_seqlen, padding rows)
    "1x9216": ([9216], 4, 9216, 0),
    "1x7056": ([7056], 4, 7168, 112),
    "8x1024": ([1024] * 8, 16, 8192, 0),
    "1024+4096+256+2816": ([1024, 4096, 256, 2816], 16, 8192, 256),
    "16x256": ([256] * 16, 16, 4096, 64),
    "64x64": ([64] * 64, 256, 4096, 0),
    "windows 36x256": ([256] * 36, 576, 256, 0),
    "windows 1024x64+": ([64] * 1000 + [16] * 24, 1024, 256, 0),
}
CAPACITY = {"16x256": [256] * 16, "8x1024": [1024] * 8, "1x9216": [9216]}  # at max_seqlen 16384, capacities below
CAPACITIES = (16, 64, 256, 1024)


def cu_of(lengths, capacity):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    cu += [cu[-1]] * (capacity + 1 - len(cu))
    return torch.tensor(cu, dtype=torch.int32, device="cuda")


def qkv(rows, real, head_dim, seed, padding=float("nan")):
    """q, k contiguous and v a strided view of one [rows, 3, H, D] buffer; `padding` in every row from `real` on
    (NaN, or for fa4, which weights rows past a segment's end zero, a large finite value: attention.py)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    buf = torch.randn(rows, 3, HEADS, head_dim, device="cuda", generator=gen).bfloat16()
    buf[real:] = padding
    return buf[:, 0].contiguous(), buf[:, 1].contiguous(), buf[:, 2]


def reference(q, k, v, lengths):
    out, start = [], 0
    for n in lengths:
        if n:
            seg = [t[start : start + n].float().transpose(0, 1)[None] for t in (q, k, v)]
            out.append(F.scaled_dot_product_attention(*seg)[0].transpose(0, 1))
        start += n
    return torch.cat(out)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def graph_of(backend, cu, max_seqlen, q, k, v, calls=1):
    """A CUDA graph of one bind (as a tower forward does) and `calls` attention calls; returns it and the outputs."""

    def forward():
        layout = backend.bind(cu, max_seqlen, None)
        return [layout(q, k, v) for _ in range(calls)]

    return capture_graph(forward)


def replay_ms(g, calls, reps=30):
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        s.record()
        for _ in range(reps):
            g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / reps / calls)
    return sorted(times)[2]


def check(backend, head_dim, seed=0):
    """Per layout: eager error, and graph error after a replay on another layout of the same capacity."""
    rows_out = []
    for name, (lengths, capacity, max_seqlen, pad) in LAYOUTS.items():
        real = sum(lengths)
        rows = real + pad
        q, k, v = qkv(rows, real, head_dim, seed, 3e4 if backend.name == "fa4" else float("nan"))
        ref = reference(q, k, v, lengths)
        cu = cu_of(lengths, capacity)
        eager = backend.bind(cu, max(lengths), None)(q, k, v)[:real]
        # graph: captured on a one-segment layout over the same rows, replayed with this layout's offsets
        cu_static = cu_of([real], capacity)
        g, (out,) = graph_of(backend, cu_static, max_seqlen, q, k, v)
        cu_static.copy_(cu)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        graph = out[:real]
        rows_out.append(
            dict(
                layout=name,
                head_dim=head_dim,
                eager_err=rel(eager, ref),
                graph_err=rel(graph, ref),
                eager_finite=bool(torch.isfinite(eager).all()),
                graph_finite=bool(torch.isfinite(graph).all()),
            )
        )
    return rows_out


def timings(backend, head_dim):
    rows_out = []
    for name, (lengths, capacity, max_seqlen, pad) in LAYOUTS.items():
        real = sum(lengths)
        q, k, v = qkv(real + pad, real + pad, head_dim, 1)  # no NaN: padding rows hold numbers here
        flops = 4 * sum(n * n for n in lengths) * HEADS * head_dim
        row = dict(layout=name, head_dim=head_dim, flops=flops)
        for kind, (segments, m) in dict(exact=(len(lengths), max(lengths)), budget=(capacity, max_seqlen)).items():
            cu = cu_of(lengths, segments)
            t0 = time.perf_counter()
            backend.bind(cu, m, None)(q, k, v)
            torch.cuda.synchronize()
            row[f"{kind}_first_call_s"] = time.perf_counter() - t0
            g, _ = graph_of(backend, cu, m, q, k, v, calls=10)
            row[f"{kind}_ms"] = replay_ms(g, 10)
            row[f"{kind}_tflops"] = flops / row[f"{kind}_ms"] / 1e9
        rows_out.append(row)
    return rows_out


def capacity_scaling(backend, head_dim):
    out = []
    for name, lengths in CAPACITY.items():
        real = sum(lengths)
        q, k, v = qkv(real, real, head_dim, 2)
        for capacity in CAPACITIES:
            if capacity < len(lengths):
                continue
            g, _ = graph_of(backend, cu_of(lengths, capacity), 16384, q, k, v, calls=10)
            out.append(dict(layout=name, capacity=capacity, max_seqlen=16384, head_dim=head_dim, ms=replay_ms(g, 10)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", nargs="*", default=["flash", "cudnn", "fa4"])
    ap.add_argument("--out", default="attention_probe.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    result = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), backends={}
    )
    for name in args.backends:
        try:
            t0 = time.perf_counter()
            backend = attention.select(name, dev, torch.bfloat16, HEADS, 80)
            setup_s = time.perf_counter() - t0
        except ValueError as e:
            print(f"{name}: unavailable: {e}", flush=True)
            result["backends"][name] = dict(unavailable=str(e))
            continue
        info = dict(setup_s=setup_s)
        for key, fn in (("check", check), ("timings", timings), ("capacity", capacity_scaling)):
            info[key] = []
            for head_dim in (80, 72):
                try:
                    info[key] += fn(backend, head_dim)
                except Exception as e:  # reported, so one broken backend leaves the others' numbers
                    info[key].append(dict(head_dim=head_dim, error=f"{type(e).__name__}: {e}"[:400]))
                    print(f"{name} {key} hd{head_dim}: {type(e).__name__}: {e}"[:600], flush=True)
        if name == "cudnn":
            info["graphs_built"] = len(backend.graphs)
            info["cudnn_version"] = backend.cudnn.backend_version_string()
        result["backends"][name] = info
        json.dump(result, open(args.out, "w"), indent=1)
    # tables
    flash_err = {
        (r["layout"], r["head_dim"]): r for r in result["backends"].get("flash", {}).get("check", []) if "layout" in r
    }
    print(f"\n{'backend':7s} {'hd':>3s} {'layout':20s} {'eager err':>9s} {'graph err':>9s} {'x flash':>7s} ok")
    ok = True
    for name, info in result["backends"].items():
        for r in info.get("check", []):
            if "layout" not in r:
                print(f"{name:7s} {r['head_dim']:3d} ERROR {r['error']}")
                ok = False
                continue
            base = flash_err.get((r["layout"], r["head_dim"]), r)
            worst = max(r["eager_err"], r["graph_err"]) / max(base["eager_err"], base["graph_err"])
            passed = r["eager_finite"] and r["graph_finite"] and worst <= 2.0
            r["passed"] = passed
            ok &= passed
            print(
                f"{name:7s} {r['head_dim']:3d} {r['layout']:20s} {r['eager_err']:9.2e} {r['graph_err']:9.2e} "
                f"{worst:7.2f} {'PASS' if passed else 'FAIL'}"
            )
    print(
        f"\n{'backend':7s} {'hd':>3s} {'layout':20s} {'exact ms':>8s} {'budget ms':>9s} {'TFLOP/s':>7s} "
        f"{'1st call s':>10s}"
    )
    for name, info in result["backends"].items():
        for r in info.get("timings", []):
            if "layout" in r:
                print(
                    f"{name:7s} {r['head_dim']:3d} {r['layout']:20s} {r['exact_ms']:8.3f} {r['budget_ms']:9.3f} "
                    f"{r['budget_tflops']:7.0f} {r['exact_first_call_s']:10.3f}"
                )
    print(
        f"\n{'backend':7s} {'hd':>3s} {'layout':8s} "
        + " ".join(f"cap {c:>5d}" for c in CAPACITIES)
        + "  (ms, max_seqlen 16384)"
    )
    for name, info in result["backends"].items():
        for hd in (80, 72):
            for layout in CAPACITY:
                cells = {
                    r["capacity"]: r["ms"]
                    for r in info.get("capacity", [])
                    if r.get("layout") == layout and r["head_dim"] == hd
                }
                if cells:
                    print(
                        f"{name:7s} {hd:3d} {layout:8s} "
                        + " ".join(f"{cells[c]:9.3f}" if c in cells else " " * 9 for c in CAPACITIES)
                    )
    result["all_passed"] = ok
    json.dump(result, open(args.out, "w"), indent=1)
    print("ALL PASSED" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
