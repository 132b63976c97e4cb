"""The front end's figures (issue 26), each against real `vitserve serve` subprocesses (dummy weights): the
front end's ceiling, what a request body and a large cached answer cost the server, the LLM-handoff load, and
bench_http.py's and bench/cache.py's figures beside them. Prints a table, writes JSON (--out).

Parts (--parts, comma-separated; all by default), and the server each runs against:
- ceiling (server `cut`: the tower cut to --ceiling-depth blocks, bench_multi_gpu's shallow_checkpoint with the same
  image sizes and output width, so nearly no GPU work; the embedding cache off): the mix as pooled base64 answers
  from /v1/embeddings, --ceiling-concurrency keep-alive connections spread over --ceiling-processes client
  processes (bench/loadgen.py: prebuilt requests, no HTTP library per request); images/s over the whole run and
  steady (the middle 80% of the answers), p50/p99, and the cores the server's process tree used.
- body (server `cached`, the cache on): the server-side cost of a JSON request body on a cache hit. A noise PNG of
  each --body-sizes size, base64 in a /v1/embeddings body, sent as prebuilt bytes over one keep-alive `http.client`
  connection: the first request warms the cache, then the median of --hits hits; GET /health the same way, the
  floor.
- cached (server `cached`): a large cached answer: one 448² image's token features and deepstack as safetensors from
  /v1/encode, float32 and bfloat16, the median of --hits hits (12.8 MB in float32 for Qwen3-VL-8B).
- cache (server `cached`): bench/cache.py's miss and hit (448² JPEG, float32 token features), --cache-requests pairs.
- http (server `plain`: the full tower, the cache off): bench_http.py's loads with its own clients (httpx,
  bench_http.drive): 1 client (--low-requests; p50 by phase) and --http-concurrency clients in --http-processes
  processes (--http-requests).
- handoff (server `plain`): the LLM-handoff load: /v1/encode, bfloat16 token features and deepstack as safetensors,
  the mix, --handoff-processes client processes of --handoff-concurrency connections in all (bench/loadgen.py);
  images/s and MB/s of answers; where the server's cores went (its own process, the core with several front ends;
  the front ends and, of them, their event loops; the device processes; the decode workers), its batches over the
  load and their p50 queue, inference and serialize times.
- fast (server `fast`: --preprocess fast, the cache off): bench_http's 1-client load.
`--engine` adds the runner alone on the same mix (bench_http.engine_throughput), for the HTTP and handoff shares.
`--profile DIR` records py-spy over the server's process tree during the ceiling and the handoff and prints where
the cores went: by role and function, and the busiest threads.

The servers a run needs start concurrently (their start-up is most of a run's time; an idle server costs nothing
measurable) and each stops once its parts are done. Every server gets --server-flags after the flags above, and
runs from --server-tree when given (another checkout: an A/B whose clients stay this tree's).

    PYTHONPATH=$PWD python3 bench/frontend.py --model Qwen/Qwen3-VL-8B-Instruct --engine --out frontend.json
    PYTHONPATH=$PWD python3 bench/frontend.py --server-tree ../old --out old.json
    # a side-by-side table of several runs (shares use the engine figure of a run of the same model):
    PYTHONPATH=$PWD python3 bench/frontend.py --combine this=frontend.json old=old.json --out both.json
    # on a CPU, the tiny model and small counts: bench/gpu_frontend.sh with CPU=1 shows them
"""

from __future__ import annotations

import argparse
import base64
import collections
import http.client
import io
import json
import multiprocessing
import os
import re
import signal
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cache as cache_bench  # noqa: E402
from bench_http import drive, engine_throughput, image_files, py_spy  # noqa: E402
from bench_multi_gpu import cpu_seconds, shallow_checkpoint  # noqa: E402
from loadgen import request_bytes, run_load  # noqa: E402

from vitserve.service.entry.launch import start_server, stop_server  # noqa: E402

PARTS = ("ceiling", "body", "cached", "cache", "http", "handoff", "fast")
SERVER_OF = {
    "ceiling": "cut",
    "body": "cached",
    "cached": "cached",
    "cache": "cached",
    "http": "plain",
    "handoff": "plain",
    "fast": "fast",
}
JSON = {"content-type": "application/json"}
SAFETENSORS = JSON | {"accept": "application/octet-stream"}


# ---- the servers ---------------------------------------------------------------------------------------------------
def engine_alone(model: str, device: str, images: int) -> float:
    """The runner alone on the mix, images/s (bench_http.engine_throughput), in a spawned child process (`--engine`):
    the load's client processes fork from the main process, which so holds no model and no CUDA context, as on the
    side of an A/B that does not measure the engine."""
    from vitserve.encoder import VisionEncoder

    encoder = VisionEncoder.from_pretrained(model, device=device, dtype="bfloat16", load_format="dummy")
    return engine_throughput(encoder, image_files(), images, 4096)


def server_flags(name: str, args) -> list[str]:
    cut = f"/tmp/vitserve-frontend-{Path(args.model).name}-depth{args.ceiling_depth}"
    model = shallow_checkpoint(args.model, args.ceiling_depth, cut) if name == "cut" else args.model
    own = {
        "cut": ["--cache-bytes", "0"],
        "cached": [],
        "plain": ["--cache-bytes", "0"],
        "fast": ["--cache-bytes", "0", "--preprocess", "fast"],
    }[name]
    return [
        "--model",
        model,
        "--load-format",
        "dummy",
        "--device",
        args.device,
        "--log-level",
        "warning",
        *own,
        *args.server_flags.split(),
    ]


def start_servers(names: list[str], args, cwd) -> dict:
    """name -> (process, url), or name -> the error that kept it from starting; all started at once."""

    def start(name):
        try:
            return start_server(*server_flags(name, args), timeout=args.start_timeout, cwd=cwd)
        except RuntimeError as e:
            return str(e)[-2000:]

    t = time.perf_counter()
    with ThreadPoolExecutor(len(names)) as pool:
        servers = dict(zip(names, pool.map(start, names)))
    print(f"servers {', '.join(names)} ready in {time.perf_counter() - t:.1f} s", flush=True)
    return servers


def stop(server) -> None:
    """SIGTERM, and SIGKILL if it has not exited 30 s later."""
    if isinstance(server, tuple):
        stop_server(server[0])


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (front ends, device processes, decode workers)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in open(f"/proc/{p}/task/{task}/children").read().split()]
        except OSError:
            pass
    return found


def tree_cpu(pid: int) -> dict[int, float]:
    seconds = {}
    for p in process_tree(pid):
        try:
            seconds[p] = cpu_seconds(f"/proc/{p}/stat")
        except OSError:
            pass
    return seconds


def role(pid: int, server: int) -> str:
    """What a process of the server's tree is: the server's own process (with several front ends, the core), a front
    end (a spawned process with children: its decode pool), a device process (spawned, childless), or a decode
    worker or fork server."""
    if pid == server:
        return "server"
    try:
        command = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return "decode"
    if b"spawn_main" in command:
        return "front end" if len(process_tree(pid)) > 1 else "device"
    return "decode"


def with_server_cores(proc, measure, profile: str | None = None) -> dict:
    """`measure()`'s result, with the cores the server's process tree used over its wall time, in all and by role
    (`role`), and of them the front ends' event loops (their main threads). `profile`: a py-spy raw profile of the
    whole tree over the measure written there, and its summary (`profile_summary`) in the result."""
    before, t = tree_cpu(proc.pid), time.perf_counter()
    roles = {p: role(p, proc.pid) for p in before}
    fronts = [p for p, r in roles.items() if r == "front end"]
    loops = {p: cpu_seconds(f"/proc/{p}/task/{p}/stat") for p in fronts}
    spy = py_spy(proc.pid, profile, "--subprocesses", "--rate", str(SPY_RATE)) if profile else None
    result = measure()
    wall, after = time.perf_counter() - t, tree_cpu(proc.pid)
    if spy is not None:
        spy.send_signal(signal.SIGINT)  # py-spy writes its profile when interrupted
        spy.wait(timeout=120)
        result["profile"] = profile_summary(profile, roles, wall)
    used = {p: v - before.get(p, 0.0) for p, v in after.items()}
    result["server_cores"] = sum(used.values()) / wall
    by_role: dict[str, float] = {}
    for p, v in used.items():
        by_role[roles.get(p, "decode")] = by_role.get(roles.get(p, "decode"), 0.0) + v / wall
    try:
        by_role["front-end loops"] = sum(cpu_seconds(f"/proc/{p}/task/{p}/stat") - loops[p] for p in fronts) / wall
    except OSError:
        pass
    result["server_cores_by_role"] = by_role
    return result


SPY_RATE = 100  # py-spy's samples per second of each thread


def profile_summary(path: str, roles: dict[int, str], wall: float, top: int = 12) -> dict:
    """A raw py-spy profile of the server's tree read as cores: per role (`role`), the cores its threads were
    sampled busy, and the functions where they were (the innermost frame, its file, no line), the busiest first;
    and the busiest threads (role, process, thread name): a thread near 1 core is a limit no other core lifts."""
    busy: dict[str, float] = collections.Counter()
    where: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    threads: dict[str, float] = collections.Counter()
    for line in open(path, errors="replace"):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        pids = [int(m.group(1)) for f in frames if (m := re.match(r"process (\d+):", f))]  # the tree, root first
        if not count.isdigit() or not pids:
            continue
        name = roles.get(pids[-1], "decode")
        thread = next((m.group(1) for f in frames if (m := re.match(r"thread \(\d+\): ?(.*)", f))), "?")
        leaf = re.sub(r":\d+\)$", ")", frames[-1].strip())
        cores = int(count) / SPY_RATE / wall
        busy[name] += cores
        where[name][leaf] += cores
        threads[f"{name} {pids[-1]} {thread or 'unnamed'}"] += cores
    return dict(
        roles={
            name: dict(cores=round(busy[name], 3), functions={f: round(c, 3) for f, c in where[name].most_common(top)})
            for name in sorted(busy, key=busy.get, reverse=True)
        },
        threads={t: round(c, 3) for t, c in collections.Counter(threads).most_common(top)},
    )


def profile_text(summary: dict, top: int = 8) -> str:
    lines = []
    for name, part in summary["roles"].items():
        lines.append(f"  {name}: {part['cores']:.2f} cores sampled busy")
        lines += [f"    {c:6.2f}  {f[:100]}" for f, c in list(part["functions"].items())[:top]]
    lines.append("  the busiest threads:")
    lines += [f"    {c:6.2f}  {t}" for t, c in list(summary["threads"].items())[:top]]
    return "\n".join(lines)


# ---- the requests --------------------------------------------------------------------------------------------------
def noise_png(nbytes: float, seed: int = 0) -> bytes:
    """An RGB noise PNG of about `nbytes` (noise does not compress: 3 bytes a pixel)."""
    side = max(16, round((nbytes / 3) ** 0.5))
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def size_bytes(text: str) -> float:
    """118K, 1.15M, 4.6M: decimal kilo- and megabytes."""
    return float(text.rstrip("KMkm")) * {"k": 1e3, "m": 1e6}.get(text[-1].lower(), 1)


class OneConnection:
    """Prebuilt requests over one keep-alive `http.client` connection, timed from the request's first byte to its
    answer's last."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)

    def send(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        start = time.perf_counter()
        self.conn.request(method, path, body=body, headers=headers or {})
        r = self.conn.getresponse()
        data = r.read()
        return time.perf_counter() - start, r, data

    def median_ms(
        self, method: str, path: str, body: bytes | None, headers: dict | None, hits: int, cached: bool = True
    ) -> tuple[float, int, float | None]:
        """The median of `hits` timed requests (each a cache hit when `cached`) after one untimed: ms, the answer's
        bytes, and the median of the server's own ms (`x-server-time`: to its answer built, before it is sent; None
        where it does not say)."""
        _, r, data = self.send(method, path, body, headers)
        assert r.status == 200, (r.status, data[:300])
        times, server = [], []
        for _ in range(hits):
            seconds, r, data = self.send(method, path, body, headers)
            assert r.status == 200 and (not cached or r.getheader("x-cache-hits") == "1"), (
                r.status,
                r.getheader("x-cache-hits"),
                data[:300],
            )
            times.append(seconds)
            if r.getheader("x-server-time") is not None:
                server.append(float(r.getheader("x-server-time")))
        return statistics.median(times) * 1e3, len(data), statistics.median(server) if server else None

    def close(self):
        self.conn.close()


# ---- the parts -----------------------------------------------------------------------------------------------------
def ceiling(url: str, proc, uris: list[str], args) -> dict:
    payloads = [
        request_bytes("POST", "/v1/embeddings", json.dumps({"input": [u], "encoding_format": "base64"}).encode(), JSON)
        for u in uris
    ]
    run_load(
        url,
        payloads,
        max(2 * len(payloads), args.ceiling_concurrency),
        args.ceiling_concurrency,
        args.ceiling_processes,
    )  # warm: every image, every connection
    return with_server_cores(
        proc,
        lambda: run_load(url, payloads, args.ceiling_requests, args.ceiling_concurrency, args.ceiling_processes),
        args.profile and os.path.join(args.profile, "ceiling.txt"),
    )


def body_costs(url: str, args) -> dict:
    conn, rows = OneConnection(url), {}
    try:
        for seed, label in enumerate(args.body_sizes.split(",")):
            image = noise_png(size_bytes(label), seed)
            body = json.dumps({"input": [data_uri(image)], "encoding_format": "base64"}).encode()
            ms, _, server = conn.median_ms("POST", "/v1/embeddings", body, JSON, args.hits)
            rows[label] = dict(
                image_bytes=len(image),
                body_bytes=len(body),
                median_ms=ms,
                server_ms=server,
                ms_per_mb_of_body=ms / (len(body) / 1e6),
            )
        health, _, _ = conn.median_ms("GET", "/health", None, None, args.hits, cached=False)
    finally:
        conn.close()
    return dict(hits=args.hits, sizes=rows, health_median_ms=health)


def cached_answer(url: str, args) -> dict:
    conn, rows = OneConnection(url), {}
    uri = cache_bench.image(20_000)
    try:
        for dtype in ("float32", "bfloat16"):
            body = json.dumps({"images": [uri], "dtype": dtype}).encode()
            ms, nbytes, server = conn.median_ms("POST", "/v1/encode", body, SAFETENSORS, args.hits)
            rows[dtype] = dict(median_ms=ms, server_ms=server, answer_bytes=nbytes)
    finally:
        conn.close()
    return dict(hits=args.hits, image="448x448 JPEG", **rows)


def http_loads(url: str, uris: list[str], args) -> dict:
    drive(url, uris, args.model, 32, 8)  # warm, as bench_http.py
    low = drive(url, uris, args.model, args.low_requests, 1)
    high = drive(url, uris, args.model, args.http_requests, args.http_concurrency, args.http_processes)
    return dict(low_load=low, saturating=high)


def handoff(url: str, proc, uris: list[str], args) -> dict:
    payloads = [
        request_bytes("POST", "/v1/encode", json.dumps({"images": [u], "dtype": "bfloat16"}).encode(), SAFETENSORS)
        for u in uris
    ]
    run_load(url, payloads, max(2 * len(payloads), 32), min(16, args.handoff_concurrency), 1)  # warm
    before = httpx.get(url + "/stats", timeout=30).json()
    result = with_server_cores(
        proc,
        lambda: run_load(url, payloads, args.handoff_requests, args.handoff_concurrency, args.handoff_processes),
        args.profile and os.path.join(args.profile, "handoff.txt"),
    )
    result["batches"] = batches_between(before, httpx.get(url + "/stats", timeout=30).json())
    return result


def batches_between(before: dict, after: dict) -> dict:
    """The server's batches between two /stats: how many and their mean size (/stats' batch_size_histogram), and its
    recent latencies by phase (/stats' `latency`: decode, queue, inference, serialize, request)."""
    sizes = {
        int(k): v - before.get("batch_size_histogram", {}).get(k, 0)
        for k, v in after.get("batch_size_histogram", {}).items()
    }
    count = sum(sizes.values())
    return {
        "batches": count,
        "mean_size": sum(k * v for k, v in sizes.items()) / count if count else 0.0,
        "latency": after.get("latency", {}),
    }


def fast_low(url: str, uris: list[str], args) -> dict:
    drive(url, uris, args.model, 16, 4)  # warm
    return dict(low_load=drive(url, uris, args.model, args.low_requests, 1))


def cores_text(by_role: dict) -> str:
    """Cores by role, short: s(erver) f(ront ends) l(oops) d(evices) w (decode workers)."""
    short = {"server": "s", "front end": "f", "front-end loops": "l", "device": "d", "decode": "w"}
    return " ".join(f"{short[k]}{v:.1f}" for k, v in by_role.items() if k in short)


def with_server(hit: dict) -> str:
    """A hit's median ms and, in parentheses, the server's own (to its answer built: the rest is the send and the
    client's read); "–" where the server did not say or the run is older."""
    server = hit.get("server_ms")
    return f"{hit['median_ms']:.2f} ({server:.2f})" if server is not None else f"{hit['median_ms']:.2f} (–)"


def phases_text(latency: dict) -> str:
    """The p50 ms of the queue, inference and serialize phases (/stats' `latency`)."""
    return " / ".join(f"{(latency.get(k) or {}).get('p50_ms') or 0:.1f}" for k in ("queue", "inference", "serialize"))


# ---- the table -----------------------------------------------------------------------------------------------------
def figures(r: dict, engine: float | None) -> list[tuple[str, str]]:
    """The issue's figures from one run's result, as (label, text) rows; a part not run, or whose server failed,
    shows as '–' or 'failed'."""
    parts, rows = r.get("parts", {}), []

    def row(label, part, text):
        value = parts.get(part)
        if value is None:
            rows.append((label, "–"))
        elif "error" in value:
            rows.append((label, "failed"))
        else:
            try:
                rows.append((label, text(value)))
            except (KeyError, TypeError, ZeroDivisionError):
                rows.append((label, "?"))

    def rate(x):
        return f"{x['images_per_s']:.1f} ({x['steady_images_per_s'] or 0:.1f})"

    share = (lambda x: f"{x / engine:.1%}") if engine else (lambda x: "–")

    def shares(x):  # from the first request sent to the last answer, and over the whole run (client start-up in)
        load = x.get("load_images_per_s") or x["images_per_s"]
        return f"{share(load)} ({share(x['images_per_s'])})"

    rows.append(("engine only, images/s", f"{engine:.1f}" if engine else "–"))
    row("HTTP, saturating: images/s (steady)", "http", lambda p: rate(p["saturating"]))
    row("HTTP / engine (whole run)", "http", lambda p: shares(p["saturating"]))
    row(
        "HTTP, saturating: failures, p50 / p99 ms",
        "http",
        lambda p: f"{p['saturating']['failures']}, {p['saturating']['p50_ms']:.0f} / {p['saturating']['p99_ms']:.0f}",
    )
    row("LLM handoff: images/s (steady)", "handoff", rate)
    row("LLM handoff: answers MB/s", "handoff", lambda p: f"{p['answer_mb_per_s']:.0f}")
    row("LLM handoff / engine (whole run)", "handoff", shares)
    row(
        "LLM handoff: failures, server / busiest client cores",
        "handoff",
        lambda p: f"{p['failures']}, {p['server_cores']:.1f} / {p['client_cpu_busiest']:.2f}",
    )
    row("LLM handoff: server cores by role", "handoff", lambda p: cores_text(p["server_cores_by_role"]))
    row(
        "LLM handoff: batches, mean size",
        "handoff",
        lambda p: f"{p['batches']['batches']}, {p['batches']['mean_size']:.1f}",
    )
    row("LLM handoff: p50 ms queue / inference / serialize", "handoff", lambda p: phases_text(p["batches"]["latency"]))
    row("front-end ceiling: images/s (steady)", "ceiling", rate)
    row("front-end ceiling: p50 / p99 ms", "ceiling", lambda p: f"{p['p50_ms']:.0f} / {p['p99_ms']:.0f}")
    row(
        "front-end ceiling: failures, server / busiest client cores",
        "ceiling",
        lambda p: f"{p['failures']}, {p['server_cores']:.1f} / {p['client_cpu_busiest']:.2f}",
    )
    for label in (parts.get("body") or {}).get("sizes", {}):
        row(f"image {label} in a JSON body, hit ms (server's)", "body", lambda p, k=label: with_server(p["sizes"][k]))
    row("/health, ms", "body", lambda p: f"{p['health_median_ms']:.2f}")
    for dtype in ("float32", "bfloat16"):
        row(
            f"cached 448² tokens {dtype}: ms (server's; MB)",
            "cached",
            lambda p, d=dtype: f"{with_server(p[d])[:-1]}; {p[d]['answer_bytes'] / 1e6:.1f})",
        )
    row("bench/cache.py 448²: hit / miss p50 ms", "cache", lambda p: f"{p['hit_p50_ms']:.2f} / {p['miss_p50_ms']:.2f}")
    row(
        "the same, lean client: hit / miss p50 ms",
        "cache",
        lambda p: f"{p['lean_hit_p50_ms']:.2f} / {p['lean_miss_p50_ms']:.2f}" if "lean_hit_p50_ms" in p else "–",
    )
    row(
        "the same, its hit on a new connection: p50 / p99 ms",
        "cache",
        lambda p: (
            f"{p['lean_new_hit_p50_ms']:.2f} / {p['lean_new_hit_p99_ms']:.2f}" if "lean_new_hit_p50_ms" in p else "–"
        ),
    )
    row("1 client p50 ms, exact", "http", lambda p: f"{p['low_load']['p50_ms']:.1f}")
    row("1 client p50 ms, fast", "fast", lambda p: f"{p['low_load']['p50_ms']:.1f}")
    return rows


def print_table(columns: dict[str, list[tuple[str, str]]]) -> None:
    labels = [label for label, _ in next(iter(columns.values()))]
    for rows in columns.values():
        labels += [label for label, _ in rows if label not in labels]
    width = max(len(label) for label in labels)
    cols = {name: dict(rows) for name, rows in columns.items()}
    size = max(18, *(len(n) for n in cols))
    print(f"{'':{width}s}  " + "  ".join(f"{n:>{size}s}" for n in cols))
    for label in labels:
        print(f"{label:{width}s}  " + "  ".join(f"{c.get(label, '–'):>{size}s}" for c in cols.values()))


def combine(specs: list[str], out: str | None) -> None:
    """NAME=FILE runs side by side; a run without an engine figure takes one from a run of the same model."""
    runs = {}
    for spec in specs:
        name, path = spec.split("=", 1)
        try:
            runs[name] = json.load(open(path))
        except (OSError, ValueError) as e:
            runs[name] = {"model": "?", "parts": {}, "error": str(e)}
    engines = {r["model"]: r["engine_images_per_s"] for r in runs.values() if r.get("engine_images_per_s")}
    columns = {}
    for name, r in runs.items():
        engine = r.get("engine_images_per_s") or engines.get(r.get("model"))
        columns[name] = figures(r, engine)
    print_table(columns)
    if out:
        json.dump({"runs": runs, "figures": {n: dict(rows) for n, rows in columns.items()}}, open(out, "w"), indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="Qwen/Qwen2.5-VL-7B-Instruct")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--server-flags", default="", help="extra `vitserve serve` flags for every server")
    ap.add_argument("--server-tree", default=None, help="serve from this checkout of the project instead")
    ap.add_argument("--start-timeout", type=float, default=600, help="seconds for a server to be ready")
    ap.add_argument("--engine", action="store_true", help="measure the runner alone on the mix, for the shares")
    ap.add_argument("--engine-images", type=int, default=768)
    ap.add_argument("--ceiling-depth", type=int, default=1, help="blocks of the cut tower")
    ap.add_argument("--ceiling-requests", type=int, default=4096)
    ap.add_argument("--ceiling-concurrency", type=int, default=256, help="connections, all processes together")
    ap.add_argument("--ceiling-processes", type=int, default=8)
    ap.add_argument("--body-sizes", default="118K,1.15M,4.6M", help="the noise PNGs' sizes, decimal K and M")
    ap.add_argument("--hits", type=int, default=20, help="timed cache hits per body and per cached answer")
    ap.add_argument("--cache-requests", type=int, default=30, help="bench/cache.py's miss-and-hit pairs")
    ap.add_argument("--low-requests", type=int, default=64, help="1-client requests (http, fast)")
    ap.add_argument("--http-requests", type=int, default=1024)
    ap.add_argument("--http-concurrency", type=int, default=128)
    ap.add_argument("--http-processes", type=int, default=8)
    ap.add_argument("--handoff-requests", type=int, default=768)
    ap.add_argument("--handoff-concurrency", type=int, default=128, help="connections, all processes together")
    ap.add_argument("--handoff-processes", type=int, default=8)
    ap.add_argument("--combine", nargs="+", metavar="NAME=FILE", help="only print these runs side by side")
    ap.add_argument("--profile", default=None, help="a folder: py-spy profiles of the server's tree (ceiling, handoff)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    if args.combine:
        return combine(args.combine, args.out)
    parts = [p for p in PARTS if p in args.parts.split(",")]
    assert parts and len(parts) == len(set(args.parts.split(","))), f"--parts: of {', '.join(PARTS)}"
    begin = time.perf_counter()
    files = image_files()
    uris = [data_uri(d) for _, d in files]
    engine = None
    if args.engine:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
            engine = child.submit(engine_alone, args.model, args.device, args.engine_images).result()
        print(f"engine only: {engine:.1f} images/s ({time.perf_counter() - begin:.1f} s)", flush=True)
    cwd = cache_bench.serve_from(args.server_tree)
    names = list(dict.fromkeys(SERVER_OF[p] for p in parts))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops the servers
    servers = start_servers(names, args, cwd)
    results: dict[str, dict] = {}
    result = dict(
        model=args.model,
        device=args.device,
        date=time.strftime("%Y-%m-%d"),
        images=[n for n, _ in files],
        server_tree=args.server_tree,
        server_flags=args.server_flags,
        engine_images_per_s=engine,
        args=vars(args),
        parts=results,
    )
    try:
        for part in parts:
            server = servers[SERVER_OF[part]]
            if not isinstance(server, tuple):
                results[part] = {"error": server}
                print(f"{part}: its server did not start: {server[-300:]}", flush=True)
                continue
            proc, url = server
            t = time.perf_counter()
            try:
                results[part] = {
                    "ceiling": lambda: ceiling(url, proc, uris, args),
                    "body": lambda: body_costs(url, args),
                    "cached": lambda: cached_answer(url, args),
                    "cache": lambda: cache_bench.measure(url, args.cache_requests),
                    "http": lambda: http_loads(url, uris, args),
                    "handoff": lambda: handoff(url, proc, uris, args),
                    "fast": lambda: fast_low(url, uris, args),
                }[part]()
            except Exception as e:  # one part's failure is reported; the others still run
                results[part] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            results[part]["seconds"] = time.perf_counter() - t
            print(f"{part}: {results[part]['seconds']:.1f} s", flush=True)
            if args.out:  # after every part: a run cut short keeps what it measured
                json.dump(result, open(args.out, "w"), indent=1)
            if not any(SERVER_OF[p] == SERVER_OF[part] for p in parts[parts.index(part) + 1 :]):
                t = time.perf_counter()
                stop(servers.pop(SERVER_OF[part]))
                print(f"server {SERVER_OF[part]} stopped in {time.perf_counter() - t:.1f} s", flush=True)
    finally:
        for server in servers.values():
            stop(server)
    print(
        f"{args.model} on {args.device}, server flags {args.server_flags!r}, {time.perf_counter() - begin:.0f} s"
        + (f", served from {args.server_tree}" if args.server_tree else "")
    )
    print_table({"": figures(result, engine)})
    for part in ("ceiling", "handoff"):
        if "profile" in results.get(part, {}):
            print(f"{part}, where the server's cores went (py-spy):\n" + profile_text(results[part]["profile"]))
    if args.out:
        json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
