"""Probe: what do zero-length segments and an inflated max_seqlen cost torch's flash varlen kernel? (design input
for the graph runner's segment capacities; prints a table, writes JSON)."""

import json
import sys

import torch
from torch.nn.attention.varlen import varlen_attn

H, D = 16, 80
dev = "cuda"


def run(lengths, max_seqlen, extra_empty=0, reps=50):
    n = sum(lengths)
    cu = torch.tensor([0] + lengths + [n] * extra_empty, dtype=torch.int32, device=dev).cumsum(0, dtype=torch.int32)
    cu = torch.tensor([0], device=dev, dtype=torch.int32)
    c = [0]
    for x in lengths:
        c.append(c[-1] + x)
    c += [c[-1]] * extra_empty
    cu = torch.tensor(c, dtype=torch.int32, device=dev)
    q, k, v = (torch.randn(n, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3):
        varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen)
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps / 10 * 1000  # us per call


rows = []
cases = [
    ("16384 one seg, max 16384", [16384], 16384, 0),
    ("16384 one seg + 4095 empty", [16384], 16384, 4095),
    ("16384 one seg + 64 empty", [16384], 16384, 64),
    ("256 windows of 64, max 64", [64] * 256, 64, 0),
    ("256 windows of 64, max 16384", [64] * 256, 16384, 0),
    ("256 windows of 64, max 256", [64] * 256, 256, 0),
    ("256 windows + 3840 empty, max 64", [64] * 256, 64, 3840),
    ("256 windows + 768 empty, max 64", [64] * 256, 64, 768),
    ("16 images of 1024, max 1024", [1024] * 16, 1024, 0),
    ("16 images of 1024, max 16384", [1024] * 16, 16384, 0),
    ("16 images of 1024 + 48 empty, max 16384", [1024] * 16, 16384, 48),
    ("1024 one seg, max 1024", [1024], 1024, 0),
    ("1024 one seg + 255 empty, max 1024", [1024], 1024, 255),
    ("1024 one seg, max 16384", [1024], 16384, 0),
]
for name, lengths, mx, extra in cases:
    us = run(lengths, mx, extra)
    rows.append(dict(case=name, us=us))
    print(f"{name:45s} {us:9.1f} us", flush=True)
json.dump(rows, open(sys.argv[1] if len(sys.argv) > 1 else "varlen_probe.json", "w"), indent=1)
