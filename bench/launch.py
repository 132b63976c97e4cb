"""A device's host time to launch a batch (`VisionEncoder.launch`: the resize's staging and kernels, the plan, the
uploads, the graphs' replay, all enqueued without waiting), against the device's time to run it, for a lone image
of bench_http's mix and for batches of 16, as a device process spends them (decoded full-size uint8 images, the
resize on the device; one thread of ATen); each captured budget's graph replayed alone (the host's share of a
launch that is one graph launch, per attention backend: `--attention-backend`); then cProfile's busiest functions
of the lone images' launches, and vitserve's own steps among them by cumulative time. Prints tables, writes JSON.

    PYTHONPATH=$PWD python3 bench/launch.py --model Qwen/Qwen3-VL-8B-Instruct --device cuda:0 --out launch.json
    PYTHONPATH=$PWD python3 bench/launch.py   # tiny-qwen3-vl on the CPU (eager: the same host steps but the graphs)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_http import image_files  # noqa: E402

from vitserve.encoder import VisionEncoder  # noqa: E402
from vitserve.encoder.preprocess import load_for_device  # noqa: E402


def host_and_device(enqueue, wait, repeat: int) -> dict:
    """Median ms of `enqueue()` on the host and of `wait(its result)` after it: the device's run of what was
    enqueued (the device idle before each, since the one before was waited for)."""
    host, device = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        pending = enqueue()
        enqueued = time.perf_counter()
        wait(pending)
        host.append(enqueued - start)
        device.append(time.perf_counter() - enqueued)
    return {"host_ms": 1e3 * statistics.median(host), "device_ms": 1e3 * statistics.median(device)}


def timed(encoder: VisionEncoder, batch: list[np.ndarray], repeat: int) -> dict:
    """`launch` of a batch (enqueued) against the device's run of it (`outputs`: waits for it)."""
    return host_and_device(lambda: encoder.launch(batch, mean_pooling=[True] * len(batch)), encoder.outputs, repeat)


def replay_times(encoder: VisionEncoder, repeat: int) -> list[dict]:
    """Each captured budget's replay alone (`CUDAGraph.replay`: one graph launch of the whole tower) against the
    device's run of it, on the budget's filler image (`GraphRunner.load_filler`); none without graphs."""
    rows = []
    for budget, graph in sorted(encoder.runner.graphs.items()):
        with torch.inference_mode():
            encoder.runner.load_filler(budget)
        torch.cuda.synchronize(encoder.device)
        rows.append(
            {"budget": budget} | host_and_device(graph.replay, lambda _: torch.cuda.synchronize(encoder.device), repeat)
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-qwen3-vl")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--attention-backend", default="auto", help="the encoder's (auto, sdpa, flash, cudnn, fa4)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # (a device process's: device_process._load)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    encoder = VisionEncoder.from_pretrained(
        args.model, device=args.device, dtype=dtype, load_format="dummy", attention_backend=args.attention_backend
    )
    images = [(name, load_for_device(data, False)) for name, data in image_files()]
    rows = []
    for name, image in images:
        timed(encoder, [image], 3)  # (its shapes planned, its budget replayed once)
        rows.append({"batch": name, "images": 1} | timed(encoder, [image], args.repeat))
    mix = [image for _, image in images] * (16 // len(images) + 1)
    timed(encoder, mix[:16], 3)
    rows.append({"batch": "16 of the mix", "images": 16} | timed(encoder, mix[:16], args.repeat))
    replays = replay_times(encoder, args.repeat)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.repeat):
        for _, image in images:
            encoder.outputs(encoder.launch([image], mean_pooling=[True]))
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
    ours = io.StringIO()  # the launch's own steps, by the time spent in each with what it calls
    pstats.Stats(profile, stream=ours).sort_stats("cumtime").print_stats("vitserve", 30)
    print(f"launch host time against the device's run: {args.model} on {args.device} ({dtype})")
    print(f"{'batch':30s} {'images':>6s} {'host ms':>8s} {'device ms':>10s}")
    for r in rows:
        print(f"{r['batch']:30s} {r['images']:6d} {r['host_ms']:8.2f} {r['device_ms']:10.2f}")
    if replays:
        print(f"\neach budget's graph replayed alone ({encoder.attention_backend} attention)")
        print(f"{'budget':>8s} {'host ms':>8s} {'device ms':>10s}")
        for r in replays:
            print(f"{r['budget']:8d} {r['host_ms']:8.3f} {r['device_ms']:10.3f}")
    print("\nthe lone images' launches and runs, cProfile, by own time:")
    print("\n".join(out.getvalue().splitlines()[4:40]))
    print("\nvitserve's own functions, by cumulative time:")
    print("\n".join(ours.getvalue().splitlines()[4:45]))
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"model": args.model, "device": args.device, "attention": encoder.attention_backend, "rows": rows}
                | {"replays": replays, "profile": out.getvalue(), "steps": ours.getvalue()},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
