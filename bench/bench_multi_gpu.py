"""Multi-GPU scaling (issue 6, on a 2-GPU machine): the real server with --devices cuda:0 and then cuda:0,cuda:1,
saturated by multi-process clients with the same image mix; reports images/s for each and the ratio (target ≥ 1.8).

Beside the throughput it reports where the host time goes, to tell a host-bound run from a device-bound one: the
server's CPU use (whole process, and its main thread, which runs the event loop and holds the GIL for it) and the
busiest client process's, each as a fraction of the wall time; `--profile DIR` also records a py-spy profile (its
front ends, device and decode processes included) of the server per leg (every thread's samples, and with `-gil` only
the thread holding the GIL).

`--depth N --legs cuda:0` measures the front end's ceiling on one GPU: the model's tower cut to N blocks (dummy
weights, same image sizes and output width) costs the GPU a fraction of the real one, while HTTP, JSON, decoding and
batching cost the same, so the server's images/s is the most that any number of GPUs could be fed.
Every leg serves with the embedding cache off (`--cache-bytes 0`): the mix repeats, and with the cache on every
image after the warm-up would be a hit, answered without decoding or the device. (`bench/frontend.py` measures
the front end's ceiling with a tower of one block and leaner clients.)

    PYTHONPATH=$PWD python3 bench/bench_multi_gpu.py --out multi_gpu.json
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_http import drive, engine_throughput, image_files, py_spy  # noqa: E402
from hf_reference import vision_config  # noqa: E402

from vitserve.encoder import VisionEncoder  # noqa: E402
from vitserve.encoder.config import builtin_config  # noqa: E402
from vitserve.service.entry.launch import start_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(stat_path: str) -> float:
    """utime + stime of a process or thread, from /proc/.../stat."""
    fields = open(stat_path).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def engine_only(model: str, devices: list[str], files, images: int) -> float:
    """Images/s of the runners alone, one thread per device in this process (as the server's workers), each on
    `images` images: what the devices can do without HTTP, decoding or batching."""
    encoders = [VisionEncoder.from_pretrained(model, device=d, dtype="bfloat16", load_format="dummy") for d in devices]
    barrier, rates = threading.Barrier(len(devices)), [0.0] * len(devices)

    def run(k):
        if encoders[k].device.type == "cuda":
            torch.cuda.set_device(encoders[k].device)
        rates[k] = engine_throughput(encoders[k], files, images, 4096, barrier)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(devices))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    encoders.clear()
    torch.cuda.empty_cache()
    return sum(rates)


def histogram_sums(url: str) -> dict[str, float]:
    """Every _sum and _count of the server's Prometheus histograms, labels summed over."""
    sums: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name.endswith(("_sum", "_count")) and not line.startswith("#"):
            sums[name] = sums.get(name, 0.0) + float(line.split()[-1])
    return sums


def server_phases(before: dict, after: dict) -> dict:
    """Mean seconds per image (per batch for inference, per request for the whole request) between two
    `histogram_sums`, and mean images per batch: where a request's time goes inside the server."""
    diff = {k: after[k] - before.get(k, 0.0) for k in after}
    return {
        k: diff[f"vitserve_{k}_sum"] / max(diff[f"vitserve_{k}_count"], 1)
        for k in (
            "request_seconds",
            "decode_seconds",
            "preprocess_seconds",
            "queue_seconds",
            "inference_seconds",
            "batch_images",
        )
    }


def shallow_checkpoint(model: str, depth: int, directory: str) -> str:
    """A checkpoint directory (config.json alone, for dummy weights) of `model`'s tower cut to `depth` blocks."""
    cfg = builtin_config(model)
    cfg = dataclasses.replace(
        cfg,
        depth=depth,
        fullatt_block_indexes=(depth - 1,) if cfg.fullatt_block_indexes else (),
        deepstack_visual_indexes=tuple(range(min(depth, len(cfg.deepstack_visual_indexes)))),
    )
    vision = vision_config(cfg)
    os.makedirs(directory, exist_ok=True)
    with open(f"{directory}/config.json", "w") as f:
        json.dump(dict(model_type=cfg.family, vision_config=vision), f)
    return directory


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-VL-7B-Instruct")
    ap.add_argument("--requests", type=int, default=3072)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--client-processes", type=int, default=8)
    ap.add_argument("--pooling", choices=["mean", "none"], default=None, help="default: the server's (mean)")
    ap.add_argument("--legs", default="cuda:0;cuda:0,cuda:1", help="device lists to compare, separated by ';'")
    ap.add_argument("--profile", default=None, help="directory for a py-spy profile of the server per leg")
    ap.add_argument("--server-flags", default="", help="extra `vitserve serve` flags for every leg")
    ap.add_argument("--no-engine", action="store_true", help="skip the engine-only measurement")
    ap.add_argument(
        "--depth", type=int, default=None, help="serve the tower cut to this many blocks (front-end ceiling)"
    )
    ap.add_argument("--out", default="multi_gpu.json")
    args = ap.parse_args()
    legs = args.legs.split(";")
    needed = max(sum(d.startswith("cuda") for d in leg.split(",")) for leg in legs)
    assert torch.cuda.device_count() >= needed, f"needs {needed} GPUs"
    model = args.model
    if args.depth:
        model = shallow_checkpoint(args.model, args.depth, f"/tmp/vitserve-depth{args.depth}")
    files = image_files()
    uris = ["data:image/png;base64," + base64.b64encode(d).decode() for _, d in files]
    engine = {
        devices: 0.0 if args.no_engine else engine_only(model, devices.split(","), files, args.requests // 2)
        for devices in legs
    }
    print("engine only, images/s:", {k: round(v, 1) for k, v in engine.items()}, flush=True)
    results = {}
    for port, devices in enumerate(legs, start=8781):
        proc, url = start_server(
            "--model",
            model,
            "--load-format",
            "dummy",
            "--devices",
            devices,
            "--log-level",
            "warning",
            "--cache-bytes",
            "0",
            *args.server_flags.split(),
            port=port,
        )
        try:
            drive(url, uris, model, 64, 16, pooling=args.pooling)  # warm
            spy = None
            if args.profile:
                os.makedirs(args.profile, exist_ok=True)
                name = devices.replace(",", "_").replace(":", "")
                spy = [
                    py_spy(proc.pid, f"{args.profile}/{name}{suffix}.txt", "--subprocesses", *flags, duration=4)
                    for suffix, flags in (("", []), ("-gil", ["--gil"]))
                ]
            sums = histogram_sums(url)
            cpu0 = cpu_seconds(f"/proc/{proc.pid}/stat"), cpu_seconds(f"/proc/{proc.pid}/task/{proc.pid}/stat")
            t0 = time.perf_counter()
            result = drive(
                url, uris, model, args.requests, args.concurrency, args.client_processes, pooling=args.pooling
            )
            wall = time.perf_counter() - t0
            cpu1 = cpu_seconds(f"/proc/{proc.pid}/stat"), cpu_seconds(f"/proc/{proc.pid}/task/{proc.pid}/stat")
            for p in spy or []:
                p.wait(timeout=60)
            result["server_cpu"] = (cpu1[0] - cpu0[0]) / wall  # cores busy in the server process (not its workers)
            result["server_main_thread_cpu"] = (cpu1[1] - cpu0[1]) / wall
            result["engine_only_images_per_s"] = engine[devices]
            result["server_means"] = server_phases(sums, histogram_sums(url))
            stats = httpx.get(url + "/stats").json()
            result["per_device"] = {d: v["images"] for d, v in stats["devices"].items()}
            result["device_processes"] = stats["device_processes"]
            results[devices] = result
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        print(devices, results[devices], flush=True)
    print(
        f"{'devices':16s} {'mode':>9s} {'engine':>7s} {'images/s':>9s} {'steady':>7s} {'p50 ms':>8s} {'p99 ms':>8s} "
        f"{'server':>7s} {'main':>6s} {'client':>7s}"
    )
    for devices, r in results.items():
        mode = "processes" if r["device_processes"] else "threads"
        print(
            f"{devices:16s} {mode:>9s} {engine[devices]:7.1f} {r['images_per_s']:9.1f} {r['steady_images_per_s']:7.1f} "
            f"{r['p50_ms']:8.1f} {r['p99_ms']:8.1f} {r['server_cpu']:7.2f} "
            f"{r['server_main_thread_cpu']:6.2f} {r['client_cpu_busiest']:7.2f}"
        )
    names = [n for n, _ in files]
    for devices, r in results.items():
        m = r["server_means"]
        slow = sorted(r["p50_ms_by_image"].items(), key=lambda kv: -kv[1])[:3]
        print(
            f"{devices}: server means: request {m['request_seconds'] * 1e3:.0f} ms, decode wall "
            f"{m['decode_seconds'] * 1e3:.1f} ms (work {m['preprocess_seconds'] * 1e3:.1f}), queue "
            f"{m['queue_seconds'] * 1e3:.1f} ms, batch {m['inference_seconds'] * 1e3:.1f} ms for "
            f"{m['batch_images']:.1f} images; slowest p50: " + ", ".join(f"{names[int(k)]} {v:.0f} ms" for k, v in slow)
        )
    ratio = results[legs[-1]]["images_per_s"] / results[legs[0]]["images_per_s"]
    steady = results[legs[-1]]["steady_images_per_s"] / results[legs[0]]["steady_images_per_s"]
    print(
        f"{legs[-1]} / {legs[0]}: {ratio:.2f}x over HTTP, {steady:.2f}x steady (target 1.8x for two GPUs over "
        f"one); engine only {engine[legs[-1]] / max(engine[legs[0]], 1e-9):.2f}x"
    )
    json.dump(
        dict(
            model=args.model,
            depth=args.depth,
            device=torch.cuda.get_device_name() if needed else "cpu",
            date=time.strftime("%Y-%m-%d"),
            pooling=args.pooling,
            server_flags=args.server_flags,
            results=results,
            ratio=ratio,
            steady_ratio=steady,
        ),
        open(args.out, "w"),
        indent=1,
    )


if __name__ == "__main__":
    main()
