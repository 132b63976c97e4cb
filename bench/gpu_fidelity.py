"""GPU fidelity check (issue 2): for each family at real size with dummy weights, our bf16 tower against
transformers' fp32 tower on the same weights, next to transformers' own bf16 tower, once per attention backend
installed. Pass: our error <= 1.5x theirs.

    PYTHONPATH=$PWD python3 bench/gpu_fidelity.py --out fidelity.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from hf_reference import hf_vision_tower  # noqa: E402

from vitserve.encoder import builtin_config  # noqa: E402
from vitserve.encoder.checkpoint import build_tower, dummy_tensors  # noqa: E402
from vitserve.encoder.plan import make_plan, to_device  # noqa: E402

MODELS = ["Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen3-VL-8B-Instruct"]
CASES = {
    "448x448": [(1, 32, 32)],
    "640x480": [(1, 34, 46)],
    "mixed": [(1, 20, 28), (1, 12, 6), (1, 16, 16), (1, 2, 2), (1, 64, 40)],
    # videos: temporal patches (frame pairs) of one grid, attention within each; beside an image
    "video": [(6, 30, 54)],
    "video+image": [(4, 16, 24), (1, 32, 32), (2, 10, 14)],
}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fidelity.json")
    ap.add_argument("--models", nargs="*", default=MODELS)
    ap.add_argument("--attention-backends", nargs="*", default=["flash", "cudnn", "fa4"])
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must really be fp32
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    rows = []
    for name in args.models:
        cfg = builtin_config(name)
        tensors = dummy_tensors(cfg, seed=0)
        ref32 = hf_vision_tower(cfg, tensors, dev, torch.float32)
        ref16 = hf_vision_tower(cfg, tensors, dev, torch.bfloat16)
        towers = {}
        for backend in args.attention_backends:
            try:
                towers[backend] = build_tower(cfg, tensors, dev, torch.bfloat16, backend)
            except ValueError as e:
                print(f"{backend}: {e}")
        del tensors
        for (backend, ours), (case, grids) in itertools.product(towers.items(), [(c, CASES[c]) for c in args.cases]):
            n = sum(t * h * w for t, h, w in grids)
            gen = torch.Generator(device=dev).manual_seed(1)
            px = torch.randn(n, cfg.patch_dim, device=dev, generator=gen)
            grid_thw = torch.tensor(grids, device=dev)
            with torch.inference_mode():
                o32 = ref32(px, grid_thw)
                o16 = ref16(px.bfloat16(), grid_thw)
                plan = make_plan(grids, cfg)
                merged, deepstack = ours(to_device(plan, px, dev, torch.bfloat16))
            outs = [("pooler", o32.pooler_output, o16.pooler_output, merged)]
            for j, d in enumerate(getattr(o32, "deepstack_features", None) or []):
                outs.append((f"deepstack{j}", d, o16.deepstack_features[j], deepstack[j]))
            for what, r32, r16, mine in outs:
                e_hf, e_ours = rel(r16, r32), rel(mine, r32)
                row = dict(
                    model=name,
                    attention=backend,
                    case=case,
                    output=what,
                    tokens=n // cfg.merge_unit,
                    hf_bf16_err=e_hf,
                    ours_bf16_err=e_ours,
                    ratio=e_ours / e_hf,
                    finite=bool(torch.isfinite(mine).all()),
                    passed=bool(torch.isfinite(mine).all()) and e_ours <= 1.5 * e_hf,
                )
                rows.append(row)
                print(
                    f"{name:28s} {backend:5s} {case:8s} {what:10s} hf_bf16 {e_hf:.3e}  ours {e_ours:.3e}  "
                    f"ratio {row['ratio']:.2f}"
                    f"  {'PASS' if row['passed'] else 'FAIL'}",
                    flush=True,
                )
        del ref32, ref16, towers
        torch.cuda.empty_cache()
    result = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        time=time.strftime("%Y-%m-%d %H:%M"),
        rows=rows,
        all_passed=all(r["passed"] for r in rows),
    )
    json.dump(result, open(args.out, "w"), indent=1)
    print("ALL PASSED" if result["all_passed"] else "SOME FAILED")
    return 0 if result["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
