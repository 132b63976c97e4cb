"""Where a lone request's time goes between a server's processes: a real server with its timeline on
(VITSERVE_TIMELINE, service/ground/timeline.py), one client sending bench_http's images one request at a time
(`/v1/embeddings`, base64 JSON, as its 1-client load does; the server runs the checkout this script imports: another
one first on PYTHONPATH for an A/B), then each step between two points the requests pass
(the front end's parse, the decode worker, the core's queue, the device process's batch, ...) as its median and p90
over the requests, in the order the requests pass them. Prints the table, writes JSON.

    PYTHONPATH=$PWD python3 bench/timeline.py --model Qwen/Qwen3-VL-8B-Instruct --device cuda:0 --out timeline.json
    PYTHONPATH=$PWD python3 bench/timeline.py   # tiny-qwen3-vl on the CPU: two front ends and a device process
"""

from __future__ import annotations

import argparse
import base64
import collections
import glob
import http.client
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_http import image_files  # noqa: E402

import vitserve  # noqa: E402
from vitserve.encoder.json_splice import json_bytes, placeholder  # noqa: E402
from vitserve.service.entry.launch import start_server, stop_server  # noqa: E402


def read_points(directory: str) -> list[tuple[int, str]]:
    """Every process's (ns, point) lines, in time order."""
    points = []
    for path in glob.glob(os.path.join(directory, "*.txt")):
        for line in open(path):
            ns, _, point = line.rstrip("\n").split(" ", 2)
            points.append((int(ns), point))
    return sorted(points)


def steps(points: list[tuple[int, str]], skip: int = 0) -> dict[str, list[float]]:
    """The requests' steps: the points from one `request` to the next, after the first `skip` requests, each step
    `a -> b` (consecutive points) with its milliseconds per request, in the order of the requests' most common
    path."""
    requests: list[list[tuple[int, str]]] = []
    for ns, point in points:
        if point == "request":
            requests.append([])
        if requests:
            requests[-1].append((ns, point))
    requests = requests[skip:]
    paths = collections.Counter(tuple(p for _, p in r) for r in requests)
    if not paths:
        return {}
    path = paths.most_common(1)[0][0]
    out: dict[str, list[float]] = {f"{a} -> {b}": [] for a, b in zip(path, path[1:])}
    for r in requests:
        if tuple(p for _, p in r) == path:
            for (t0, a), (t1, b) in zip(r, r[1:]):
                out[f"{a} -> {b}"].append((t1 - t0) / 1e6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-qwen3-vl")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--warm", type=int, default=20, help="requests left out of the figures")
    ap.add_argument("--server-flags", default="", help="extra `vitserve serve` flags")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    flags = args.server_flags.split()
    if args.device == "cpu" and not flags:  # the GPU server's shape: front ends, a device process
        flags = ["--api-servers", "2", "--device-processes"]
    directory = tempfile.mkdtemp(prefix="vitserve-timeline-")
    os.environ["VITSERVE_TIMELINE"] = directory
    # (as bench_http sends them: data URIs, the type named png whatever the image; PIL reads what it is)
    uris = [("data:image/png;base64," + base64.b64encode(data).decode()).encode() for _, data in image_files()]
    proc, url = start_server(
        "--model", args.model, "--load-format", "dummy", "--device", args.device, "--cache-bytes", "0",
        "--log-level", "warning", *flags, cwd=Path(vitserve.__file__).resolve().parents[1],
    )  # fmt: skip
    server_ms = []
    try:
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
        for i in range(args.requests):
            body = json_bytes({"model": args.model, "input": [placeholder(0)]}, [uris[i % len(uris)]])
            conn.request("POST", "/v1/embeddings", body=body, headers={"content-type": "application/json"})
            answer = conn.getresponse()
            answer.read()
            if answer.status != 200:
                raise SystemExit(f"request {i}: {answer.status}")
            if i >= args.warm:
                server_ms.append(float(answer.getheader("x-server-time")))
        conn.close()
    finally:
        stop_server(proc)
    table = {step: ms for step, ms in steps(read_points(directory), args.warm).items() if ms}
    rows = {
        step: {"p50_ms": statistics.median(ms), "p90_ms": statistics.quantiles(ms, n=10)[-1], "requests": len(ms)}
        for step, ms in table.items()
    }
    print(f"a lone request's steps: {args.model} on {args.device} {' '.join(flags)}, {len(server_ms)} requests")
    print(f"{'step':48s} {'p50 ms':>8s} {'p90 ms':>8s}")
    for step, row in rows.items():
        print(f"{step:48s} {row['p50_ms']:8.3f} {row['p90_ms']:8.3f}")
    print(f"{'sum of the p50s':48s} {sum(r['p50_ms'] for r in rows.values()):8.3f}")
    print(f"{'x-server-time p50':48s} {statistics.median(server_ms):8.3f}")
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "model": args.model,
                    "device": args.device,
                    "flags": flags,
                    "steps": rows,
                    "server_ms_p50": statistics.median(server_ms),
                },
                indent=1,
            )  # fmt: skip
        )


if __name__ == "__main__":
    main()
