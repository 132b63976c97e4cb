"""End-to-end benchmark (issue 5): the real HTTP server against the engine alone, on the same mix of real image files.

1. CPU cost per image (this process): decode, resize, normalize + patchify, response serialization.
2. Engine-only throughput: preprocessed images through the runner in server-sized batches, pipelined like the
   server's worker (launch the next batch before collecting the last).
3. `vitserve serve` as a subprocess, driven by concurrent asyncio clients: throughput and p50/p99 latency at low load
   (one client) and at saturating load, and the low-load latency by phase, from the answers' headers (decode, queue,
   inference, serialize; server_rest, the server's time beyond them, from x-server-time: parsing, hashing, the cache,
   the hand-offs between its processes; http_and_rest, the client's time beyond the server's: HTTP and the client,
   or for a server without x-server-time everything beyond the phases). The clients are httpx's, each request's
   body built as vitserve.client builds it (the image's base64 spliced into the JSON as bytes, json_splice).
Images: the photos shipped by scikit-image (`skimage.data`) when importable, else examples/ resized.

    PYTHONPATH=$PWD python3 bench/bench_http.py --out bench_http.json
    # the server from another checkout of the project (A/B against an older commit; the clients stay these):
    PYTHONPATH=$PWD python3 bench/bench_http.py --server-tree ../old --no-engine --out old.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import glob
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from PIL import Image

from vitserve.encoder import VisionEncoder
from vitserve.encoder.preprocess import load_image, normalize_lut, preprocess_image, resize_rgb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vitserve.encoder.json_splice import json_bytes, placeholder  # noqa: E402
from vitserve.service.api.outputs import embedding_payload, render_json  # noqa: E402
from vitserve.service.entry.launch import start_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JSON = {"content-type": "application/json"}
PHASES = ("decode", "queue", "inference", "serialize")  # the answers' x-<phase>-time headers, ms


def image_files() -> list[tuple[str, bytes]]:
    try:
        import skimage

        paths = sorted(glob.glob(os.path.join(os.path.dirname(skimage.__file__), "data", "*.[pj][np]g")))
    except ImportError:
        paths = []
    files = [(os.path.basename(p), open(p, "rb").read()) for p in paths if os.path.getsize(p) < 8 * 2**20]
    if len(files) < 4:  # fallback: the shipped sample at several sizes, as JPEG and PNG
        base = Image.open(ROOT / "examples" / "sample.jpg")
        for i, (w, h) in enumerate([(224, 224), (640, 480), (1024, 768), (300, 900), (1280, 720), (512, 512)]):
            buf = io.BytesIO()
            base.resize((w, h)).save(buf, "PNG" if i % 2 else "JPEG")
            files.append((f"sample-{w}x{h}", buf.getvalue()))
    return files


def cpu_costs(enc: VisionEncoder, files) -> dict:
    """Host CPU per image: decode and resize (in the server's worker processes), normalize + patchify (host-side
    equivalent; the server does it on the device), and response serialization as the server does it (pooled vector,
    token matrix: float32 base64 JSON)."""
    cfg, rows = enc.preprocess_config, []
    for _, data in files:
        t0 = time.perf_counter()
        img = load_image(data)
        t1 = time.perf_counter()
        resize_rgb(img, cfg)
        t2 = time.perf_counter()
        pixels, grid = preprocess_image(img, cfg)
        t3 = time.perf_counter()
        tokens = torch.randn(grid[1] * grid[2] // enc.config.merge_unit, enc.config.out_hidden_size).bfloat16()
        t4 = time.perf_counter()  # as the server renders an answer (service.outputs)
        b"".join(render_json({"data": [{"embedding": embedding_payload(tokens.float().mean(0), "base64")}]}))
        t5 = time.perf_counter()
        b"".join(render_json({"data": [{"embedding": embedding_payload(tokens, "base64")}]}))
        t6 = time.perf_counter()
        rows.append(
            dict(
                decode=t1 - t0,
                resize=t2 - t1,
                normalize_patchify_on_host=(t3 - t2) - (t2 - t1),
                serialize_pooled=t5 - t4,
                serialize_tokens=t6 - t5,
            )
        )
    return {k: 1e3 * statistics.mean(r[k] for r in rows) for k in rows[0]}


def server_batches(arrays: list, patch_size: int, max_patches: int) -> list[list]:
    """uint8 images ([H, W, 3]) or video slices ([T, H, W, 3]) in arrival order, cut into batches of at most
    `max_patches` patches, as the server's queue cuts them."""
    batches, batch, patches = [], [], 0
    for a in arrays:
        n = (a.shape[-3] // patch_size) * (a.shape[-2] // patch_size)
        if batch and patches + n > max_patches:
            batches.append(batch)
            batch, patches = [], 0
        batch.append(a)
        patches += n
    return batches + [batch]


def run_batches(runner, batches: list[list], lut) -> None:
    """One pass of the batches through the runner, pipelined as the server's device loop runs them (the next
    launched before the last is collected)."""
    pending = None
    for batch in batches:
        launch = runner.launch_images(batch, lut)
        if pending is not None:
            runner.collect(pending)
        pending = launch
    runner.collect(pending)


def engine_throughput(enc: VisionEncoder, files, images: int, max_batch_tokens: int, barrier=None) -> float:
    """The runner alone on the server's inputs (resized uint8 images), in server-sized batches, pipelined
    (`barrier`: wait there after the warm-up, so that several devices' threads time the same interval)."""
    cfg = enc.preprocess_config
    prepared = [resize_rgb(load_image(data), cfg) for _, data in files]
    lut = normalize_lut(cfg.image_mean, cfg.image_std)
    batches = server_batches(
        [prepared[i % len(prepared)] for i in range(images)], cfg.patch_size, max_batch_tokens * enc.config.merge_unit
    )
    run_batches(enc.runner, batches, lut)  # warm
    if barrier is not None:
        barrier.wait()
    t = time.perf_counter()
    run_batches(enc.runner, batches, lut)
    return images / (time.perf_counter() - t)


async def _drive(
    url: str, uris: list[str], model: str, indices: list[int], concurrency: int, pooling: str | None = None
) -> list:
    latencies, failures, cpu = [], 0, time.process_time()
    extra = {"pooling": pooling} if pooling else {}
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=concurrency)) as client:

        async def one(i):
            nonlocal failures
            async with sem:
                t = time.perf_counter()
                # the body built as vitserve.client builds it: the image's base64 spliced into the JSON as bytes
                body = {"model": model, "input": [placeholder(0)], "encoding_format": "base64", **extra}
                content = json_bytes(body, [uris[i % len(uris)].encode()])
                r = await client.post("/v1/embeddings", content=content, headers=JSON)
                phases = {p: float(r.headers[f"x-{p}-time"]) for p in PHASES if f"x-{p}-time" in r.headers}
                if "x-server-time" in r.headers:  # the server's whole time: what of it the phases leave
                    phases["server_rest"] = float(r.headers["x-server-time"]) - sum(phases.values())
                latencies.append((i % len(uris), time.perf_counter() - t, time.time(), phases))
                failures += r.status_code != 200

        await asyncio.gather(*(one(i) for i in indices))
    return [latencies, failures, time.process_time() - cpu]


def _client_process(args):
    return asyncio.run(_drive(*args))


def drive(
    url: str,
    uris: list[str],
    model: str,
    requests: int,
    concurrency: int,
    processes: int = 1,
    pooling: str | None = None,
) -> dict:
    """`requests` at `concurrency`, from several client processes so the client's own GIL is not the limit;
    `client_cpu_busiest` is the busiest client process's CPU seconds over the wall time (near 1: client-bound).
    `images_per_s` counts the whole run, client start-up and tail included; `load_images_per_s` from the first
    request sent to the last answer (the server's ramp and tail in, the client processes' start out);
    `steady_images_per_s` the middle 80% of the answers (by time), where every client process is sending."""
    from loadgen import in_processes, load_rate

    processes = max(1, min(processes, concurrency))
    shares = [list(range(requests))[k::processes] for k in range(processes)]
    jobs = [(url, uris, model, share, max(1, concurrency // processes), pooling) for share in shares]
    results, wall = in_processes(_client_process, jobs)
    by_image: dict[int, list[float]] = {}
    phases: dict[str, list[float]] = {}
    phases_by_image: dict[int, dict[str, list[float]]] = {}
    for r in results:
        for image, seconds, _, times in r[0]:
            by_image.setdefault(image, []).append(seconds * 1e3)
            for phase, ms in (
                times | {"total": seconds * 1e3, "http_and_rest": seconds * 1e3 - sum(times.values())}
            ).items():
                phases.setdefault(phase, []).append(ms)
                phases_by_image.setdefault(image, {}).setdefault(phase, []).append(ms)
    done = np.sort([end for r in results for _, _, end, _ in r[0]])
    middle = done[len(done) // 10 : len(done) - len(done) // 10]
    lat = np.array([x for v in by_image.values() for x in v])
    return dict(
        requests=requests,
        concurrency=concurrency,
        client_processes=processes,
        failures=sum(r[1] for r in results),
        images_per_s=requests / wall,
        load_images_per_s=load_rate([(seconds, end) for r in results for _, seconds, end, _ in r[0]]),
        steady_images_per_s=float((len(middle) - 1) / (middle[-1] - middle[0])) if len(middle) > 1 else None,
        p50_ms=float(np.percentile(lat, 50)),
        p99_ms=float(np.percentile(lat, 99)),
        client_cpu_busiest=max(r[2] for r in results) / wall,
        phases_ms={
            k: {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99)), "mean": float(np.mean(v))}
            for k, v in phases.items()
        },
        p50_ms_by_image={k: float(np.percentile(v, 50)) for k, v in sorted(by_image.items())},
        p50_phases_ms_by_image={
            k: {p: round(float(np.median(v)), 2) for p, v in d.items()} for k, d in sorted(phases_by_image.items())
        },
    )


def py_spy(pid: int, output: str, *flags: str, duration: float | None = None) -> subprocess.Popen:
    """py-spy recording a raw profile of the busy threads of process `pid` into `output`, for `duration` seconds or
    until it is sent SIGINT (it writes the profile then); `flags`: more of its options (`--subprocesses`, `--gil`).
    It attaches within the second it is given before the load starts."""
    import shutil

    beside = Path(sys.executable).parent / "py-spy"  # (a virtual environment's, not on PATH)
    exe = shutil.which("py-spy") or (str(beside) if beside.exists() else "/tmp/site/bin/py-spy")  # (gpu_env.sh's)
    command = [exe, "record", "--pid", str(pid), "--format", "raw", "--output", output, "--nonblocking", "--threads"]
    command += [*flags] + (["--duration", str(duration)] if duration else [])
    spy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    return spy


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-VL-7B-Instruct")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--requests", type=int, default=1536)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--max-batch-tokens", type=int, default=4096)
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument(
        "--client-processes",
        type=int,
        default=8,
        help="client processes: one httpx process tops out near 50 requests/s of these payloads",
    )
    ap.add_argument("--decode-workers", type=int, default=None, help="the server's decode pool (default: cores)")
    ap.add_argument("--profile", default=None, help="py-spy raw profile of the server under saturating load")
    ap.add_argument("--server-flags", default="", help="extra `vitserve serve` flags")
    ap.add_argument("--server-tree", default=None, help="serve from this checkout of the project instead")
    ap.add_argument("--no-engine", action="store_true", help="skip the CPU costs and the engine-only throughput")
    ap.add_argument("--out", default="bench_http.json")
    args = ap.parse_args()
    files = image_files()
    costs, engine, grids = {}, None, []
    if not args.no_engine:
        enc = VisionEncoder.from_pretrained(args.model, device=args.device, dtype="bfloat16", load_format="dummy")
        costs = cpu_costs(enc, files)
        engine = engine_throughput(enc, files, args.requests, args.max_batch_tokens)
        grids = [preprocess_image(load_image(d), enc.preprocess_config)[1] for _, d in files]
        del enc
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(f"{len(files)} images ({', '.join(n for n, _ in files)}); grids {grids}")
        print("CPU ms per image: " + ", ".join(f"{k} {v:.2f}" for k, v in costs.items()))
        print(f"engine only: {engine:.1f} images/s")
    if args.server_tree:  # the server subprocess imports the project from there
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [
                str(Path(args.server_tree).resolve()),
                *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT],
            ]
        )
    extra = ["--decode-workers", str(args.decode_workers)] if args.decode_workers else []
    # the embedding cache off: the mix repeats, and every image would be a hit after the warm-up
    server, url = start_server(
        "--model",
        args.model,
        "--load-format",
        "dummy",
        "--device",
        args.device,
        "--max-batch-tokens",
        str(args.max_batch_tokens),
        "--log-level",
        "warning",
        "--cache-bytes",
        "0",
        *extra,
        *args.server_flags.split(),
        port=args.port,
        cwd=Path(args.server_tree).resolve() if args.server_tree else None,
    )
    try:
        uris = ["data:image/png;base64," + base64.b64encode(d).decode() for _, d in files]
        drive(url, uris, args.model, 32, 8)  # warm-up
        low = drive(url, uris, args.model, 64, 1)
        spy = py_spy(server.pid, args.profile, duration=6) if args.profile else None
        high = drive(url, uris, args.model, args.requests, args.concurrency, args.client_processes)
        if spy is not None:
            spy.wait(timeout=60)
        stats = httpx.get(url + "/stats").json()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    for name, r in (("low load (1 client)", low), (f"saturating ({args.concurrency} clients)", high)):
        print(
            f"{name:24s} {r['images_per_s']:7.1f} images/s ({r['steady_images_per_s'] or 0:.1f} steady)  "
            f"p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms  "
            f"failures {r['failures']}"
        )
    print(
        "low load by phase, ms (p50 / p99):  "
        + "  ".join(f"{k} {v['p50']:.1f} / {v['p99']:.1f}" for k, v in low["phases_ms"].items())
    )
    if engine:
        print(f"HTTP / engine-only throughput: {high['images_per_s'] / engine:.1%}")
    json.dump(
        dict(
            model=args.model,
            device=torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
            date=time.strftime("%Y-%m-%d"),
            images=[n for n, _ in files],
            grids=grids,
            cpu_ms_per_image=costs,
            engine_images_per_s=engine,
            low_load=low,
            saturating=high,
            http_over_engine=engine and high["images_per_s"] / engine,
            server_tree=args.server_tree,
            batch_size_histogram=stats["batch_size_histogram"],
            server_flags=args.server_flags,
            device_processes=stats["device_processes"],
        ),
        open(args.out, "w"),
        indent=1,
    )


if __name__ == "__main__":
    main()
