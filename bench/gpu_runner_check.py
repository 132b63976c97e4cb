"""GPU check of the graph runner (issue 3): for each family at real size (dummy weights, bf16) and each attention
backend installed, many random batches replayed from CUDA graphs against our eager forward, plus capture time and
pool size for the default budgets.

    PYTHONPATH=$PWD python3 bench/gpu_runner_check.py --out runner_check.json

Per image: `same_plan` compares the graph replay with an eager forward over the very same padded buffers (must be
<= 1e-3: only graph replay differs); `exact_plan` compares with an eager forward of that image alone, unpadded
(different GEMM shapes, so bf16 rounding differs: reported, and bounded by the tower's own bf16 noise, 3e-2).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import sys
import time

import torch

from vitserve.encoder import VisionEncoder
from vitserve.encoder.plan import make_plan, to_device

MODELS = ["Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen3-VL-8B-Instruct"]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def batches(rng: random.Random, n: int):
    out = [
        ("same-total A", [(1, 16, 32)]),
        ("same-total B", [(1, 32, 16)]),
        ("same-total C", [(1, 8, 64)]),
        ("same-total D", [(1, 16, 16), (1, 16, 16)]),
        ("fills 4096 exactly", [(1, 64, 64)]),
        ("fills 16384 exactly", [(1, 128, 128)]),
        ("16 images", [(1, 16, 16)] * 16),
    ]
    for i in range(n):
        k = rng.randint(1, 16)
        out.append((f"random {i}", [(1, 2 * rng.randint(2, 40), 2 * rng.randint(2, 40)) for _ in range(k)]))
    out += [
        ("over largest budget (eager)", [(1, 136, 136)]),
        ("grows past all earlier", [(1, 126, 130)]),
        ("after growth, small again", [(1, 4, 6), (1, 10, 8)]),
    ]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runner_check.json")
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--attention-backends", nargs="*", default=["flash", "cudnn", "fa4"])
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rng = random.Random(0)
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, families=[])
    ok = True
    for name, backend in itertools.product(MODELS, args.attention_backends):
        t0 = time.perf_counter()
        try:
            enc = VisionEncoder.from_pretrained(
                name, device="cuda", dtype="bfloat16", load_format="dummy", attention_backend=backend
            )
        except ValueError as e:
            print(f"{backend}: {e}")
            continue
        load_s = time.perf_counter() - t0
        runner, cfg = enc.runner, enc.config
        worst_same, worst_exact, nan, count = 0.0, 0.0, False, 0
        for label, grids in batches(rng, args.batches):
            n = sum(t * h * w for t, h, w in grids)
            px = torch.randn(n, cfg.patch_dim)
            runner.use_graphs = False
            eager = runner.run(px, grids)
            runner.use_graphs = True
            graph = runner.run(px, grids)
            start = 0
            for grid, (g, _), (e, _) in zip(grids, graph, eager):
                rows = grid[0] * grid[1] * grid[2]
                with torch.inference_mode():
                    alone, _ = enc.tower(
                        to_device(make_plan([grid], cfg), px[start : start + rows], enc.device, enc.dtype)
                    )
                start += rows
                nan |= not bool(torch.isfinite(g).all())
                worst_same = max(worst_same, rel(g, e))
                worst_exact = max(worst_exact, rel(g, alone.cpu()))
                count += 1
        stats = runner.stats.as_dict()
        passed = worst_same <= 1e-3 and worst_exact <= 3e-2 and not nan and stats["eager_fallbacks"] >= 2
        ok &= passed
        fam = dict(
            model=name,
            attention=backend,
            load_and_capture_s=round(load_s, 2),
            capture_s=stats["capture_seconds"],
            pool_mib=round(stats["pool_bytes"] / 2**20, 1),
            images=count,
            worst_same_plan=worst_same,
            worst_exact_plan=worst_exact,
            any_nan=nan,
            passed=passed,
            stats=stats,
        )
        report["families"].append(fam)
        print(
            f"{name:28s} {backend:5s} images {count:4d} same-plan {worst_same:.2e} exact-plan {worst_exact:.2e} "
            f"nan {nan} "
            f"capture {stats['capture_seconds']:.2f}s pool {fam['pool_mib']} MiB eager {stats['eager_fallbacks']} "
            f"{'PASS' if passed else 'FAIL'}",
            flush=True,
        )
        del enc, runner
        torch.cuda.empty_cache()
    report["all_passed"] = ok
    json.dump(report, open(args.out, "w"), indent=1)
    print("ALL PASSED" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
