"""Big answers at memory speed (issue 26, item 3): what a large token answer costs the server, phase by phase.
Prints two tables, writes JSON.

1. Build: the response pieces of a Qwen3-VL-8B 448² answer (196 tokens x 4096 and 3 deepstack features of the same,
   bfloat16 as the engine returns them on CUDA), as the /v1/encode route builds them, for every dtype and body
   format; of it the dtype conversions alone (`converted`: by one thread), beside the same conversions by
   `Tensor.to` (ATen's OpenMP team: its barrier waits for the slowest member, which a busy host deschedules); then
   the HTTP framing of those pieces, by h11 as uvicorn calls it (`h11.Connection.send(Data)` joins what it writes
   into new bytes: a copy of a memoryview piece) and by the server's protocol (service/http.py, which hands a
   Content-Length body's pieces on as they are).
2. Spool: a device process's batch of such answers (--batch images, bfloat16 tokens and deepstack) written to
   their spool files as its answering thread does (device_protocol.written), by 1 to ANSWER_WRITERS writer threads:
   a tmpfs takes a new file's pages at a few GB/s per thread, the ceiling of one writer.
3. Server: a real `vitserve serve --load-format dummy --dtype bfloat16` on the CPU, of Qwen3-VL-8B's tower cut to
   3 blocks (its width and its 3 deepstack features: bench_multi_gpu.py's `shallow_checkpoint`), answering a 448²
   image from its cache: the same 12.8 MB in float32. Per dtype and body: the client's wall time, the server's (its
   access line's `ms`: from the request's first byte to the last piece of the answer handed to the socket) and, of
   it, the serialize phase (`x-serialize-time`) and the rest (the request, the cache, the HTTP send); and the CPU
   time per request of the server's main thread (its event loop, the kernel's socket copies included) and of the
   whole server process.

    PYTHONPATH=$PWD python3 bench/answers.py --out answers.json
    cd OLD_TREE && PYTHONPATH=$PWD python3 NEW_TREE/bench/answers.py --out old.json   # another checkout's code
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import re
import statistics
import sys
import time
from pathlib import Path

import h11
import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_multi_gpu import cpu_seconds, shallow_checkpoint  # noqa: E402

from vitserve.service.api import http as protocol  # noqa: E402
from vitserve.service.api import outputs  # noqa: E402
from vitserve.service.api.outputs import OUTPUT_DTYPES, b64, render_json, safetensors_parts  # noqa: E402
from vitserve.service.entry.launch import start_server  # noqa: E402

# an older tree (PYTHONPATH and cwd at its checkout) converted with `Tensor.to`, and named the connection privately
converted = getattr(outputs, "converted", torch.Tensor.to)
CountedConnection = getattr(protocol, "CountedConnection", None) or getattr(protocol, "_Counted")
try:  # the answer builders take each item's Features; an older tree took (tokens, deepstack) pairs
    from vitserve.encoder.features import Features  # noqa: E402

    def answer_items(outputs: list) -> list:
        return [Features(*output) for output in outputs]
except ImportError:
    answer_items = list

TOKENS, WIDTH, DEEPSTACK = 196, 4096, 3  # Qwen3-VL-8B, one 448² image


def median_ms(fn, repeat: int) -> tuple[float, float]:
    """Median wall ms of `fn()` over `repeat` runs (after one warm-up), and its mean CPU ms (this process's threads,
    ATen's OpenMP team included): on a shared host the wall time is what the others leave, the CPU time the cost."""
    fn()
    times = []
    cpu = time.process_time()
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, (time.process_time() - cpu) / repeat * 1e3


def build_pieces(outputs: list, dtype: str, body: str) -> list:
    """The pieces the /v1/encode route answers `outputs` with (its `build`, without the request around it)."""
    if body == "safetensors":
        return safetensors_parts(answer_items(outputs), dtype, {"model": "bench", "dtype": dtype})
    out = OUTPUT_DTYPES[dtype]
    data = [
        {
            "index": i,
            "shape": list(e.shape),
            "dtype": dtype,
            "embeddings": b64(converted(e, out)),
            "deepstack": [b64(converted(d, out)) for d in ds],
        }
        for i, (e, ds) in enumerate(outputs)
    ]
    return render_json({"object": "list", "data": data})


class _Protocol:  # what `CountedConnection` tells of a response's start: nothing to do here
    def sending(self, response):
        pass


def framed(pieces: list, guarded: bool) -> None:
    """What uvicorn does with each piece: `conn.send(h11.Data(...))`, on h11's connection or the server's wrapper."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
    conn.next_event(), conn.next_event()
    conn = CountedConnection(conn, _Protocol()) if guarded else conn
    size = sum(len(p) for p in pieces)
    conn.send(h11.Response(status_code=200, headers=[(b"content-length", str(size).encode())]))
    for piece in pieces:
        conn.send(h11.Data(data=piece))
    conn.send(h11.EndOfMessage())


def build_table(repeat: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    answer = [
        (
            torch.randn(TOKENS, WIDTH, generator=gen).bfloat16(),
            [torch.randn(TOKENS, WIDTH, generator=gen).bfloat16() for _ in range(DEEPSTACK)],
        )
    ]
    tensors = [answer[0][0], *answer[0][1]]
    rows = []
    for dtype in ("float32", "bfloat16"):
        for body in ("safetensors", "json"):
            pieces = build_pieces(answer, dtype, body)
            row = dict(dtype=dtype, body=body, mb=sum(len(p) for p in pieces) / 1e6)
            for name, fn in (
                ("build", lambda: build_pieces(answer, dtype, body)),
                ("convert", lambda: [converted(t, OUTPUT_DTYPES[dtype]) for t in tensors]),
                ("torch_to", lambda: [t.to(OUTPUT_DTYPES[dtype]) for t in tensors]),
                ("h11", lambda: framed(pieces, False)),
                ("protocol", lambda: framed(pieces, True)),
            ):
                row[f"{name}_ms"], row[f"{name}_cpu_ms"] = median_ms(fn, repeat)
            rows.append(row)
    return rows


def image_uri(seed: int, side: int) -> str:
    """A smooth image (a small PNG: the request stays cheap, the answer is what is timed)."""
    y, x = np.mgrid[0:side, 0:side]
    pixels = np.stack([(x + seed * 7) % 256, (y + seed * 13) % 256, (x + y) % 256], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def post(port: int, body: bytes, accept: str, request_id: str) -> tuple[float, bytes, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    try:
        start = time.perf_counter()
        conn.request(
            "POST",
            "/v1/encode",
            body,
            {"content-type": "application/json", "accept": accept, "x-request-id": request_id},
        )
        response = conn.getresponse()
        data = response.read()
        seconds = time.perf_counter() - start
        assert response.status == 200, data[:300]
        return seconds, data, dict(response.getheaders())
    finally:
        conn.close()


def server_table(repeat: int, images: int, side: int, server_flags: list[str]) -> list[dict]:
    model = shallow_checkpoint("Qwen/Qwen3-VL-8B-Instruct", 3, "/tmp/vitserve-answers-qwen3-8b-depth3")
    proc, url = start_server(
        "--model",
        model,
        "--load-format",
        "dummy",
        "--dtype",
        "bfloat16",
        "--max-batch-wait-ms",
        "0",
        *server_flags,
        timeout=600,
        capture_log=True,
    )
    port = int(url.rsplit(":", 1)[1])
    uris = [image_uri(seed, side) for seed in range(images)]
    rows, n = [], 0
    try:
        for dtype in ("float32", "bfloat16"):
            for body, accept in (("safetensors", "application/octet-stream"), ("json", "application/json")):
                request = json.dumps({"images": uris, "dtype": dtype}).encode()
                post(port, request, accept, "warm")  # a miss the first time: every image in the cache after it
                client, serialize, ids = [], [], []
                stat = f"/proc/{proc.pid}/stat", f"/proc/{proc.pid}/task/{proc.pid}/stat"
                cpu = [cpu_seconds(path) for path in stat]
                for _ in range(repeat):
                    n += 1
                    seconds, data, headers = post(port, request, accept, f"answers-{n}")
                    assert headers["x-cache-hits"] == str(images)
                    client.append(seconds * 1e3)
                    serialize.append(float(headers["x-serialize-time"]))
                    ids.append(f"answers-{n}")
                process_cpu, loop_cpu = (cpu_seconds(path) - before for path, before in zip(stat, cpu))
                rows.append(
                    dict(
                        dtype=dtype,
                        body=body,
                        mb=len(data) / 1e6,
                        ids=ids,
                        client_ms=statistics.median(client),
                        serialize_ms=statistics.median(serialize),
                        loop_cpu_ms=loop_cpu / repeat * 1e3,
                        process_cpu_ms=process_cpu / repeat * 1e3,
                    )
                )
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        proc.log_reader.join(timeout=10)
    server = {
        m.group(2): float(m.group(1))
        for line in proc.log
        for m in [re.search(r"POST /v1/encode 200 ms=([\d.]+).* request_id=(\S+)", line)]
        if m
    }
    for row in rows:
        row["server_ms"] = statistics.median(server[i] for i in row.pop("ids"))
        row["rest_ms"] = row["server_ms"] - row["serialize_ms"]
    return rows


def spool_table(repeat: int, batch: int) -> list[dict]:
    """A batch of `batch` Qwen3-VL-8B 448² answers written to spool files in /dev/shm (or the temporary directory) by
    1, 2, ... ANSWER_WRITERS threads; each run's files removed after it, as their readers remove them."""
    import itertools
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from vitserve.service.decoding import spool
    from vitserve.service.devices import device_protocol

    gen = torch.Generator().manual_seed(0)
    outputs = [
        (
            torch.randn(TOKENS, WIDTH, generator=gen).bfloat16(),
            [torch.randn(TOKENS, WIDTH, generator=gen).bfloat16() for _ in range(DEEPSTACK)],
        )
        for _ in range(batch)
    ]
    mb = batch * (1 + DEEPSTACK) * TOKENS * WIDTH * 2 / 1e6
    directory = "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()
    prefix = f"{directory}/vitserve-bench-{time.time_ns()}-"
    names = (f"{prefix}{n}" for n in itertools.count())
    rows = []
    for writers in sorted({1, 2, device_protocol.ANSWER_WRITERS}):
        with ThreadPoolExecutor(writers) as pool:

            def write_batch():
                records, error = device_protocol.written(outputs, names, pool)
                assert error is None and records is not None
                for record in records:
                    record.discard()

            ms, cpu_ms = median_ms(write_batch, repeat)
        rows.append(dict(writers=writers, images=batch, mb=mb, ms=ms, cpu_ms=cpu_ms, gb_per_s=mb / ms))
    spool.clear(prefix)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--images", type=int, default=1, help="distinct images in the server's request")
    ap.add_argument("--side", type=int, default=448, help="their side, pixels")
    ap.add_argument("--server-flags", default="", help="more `vitserve serve` flags")
    ap.add_argument("--skip-build", action="store_true")
    ap.add_argument("--skip-spool", action="store_true")
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--batch", type=int, default=16, help="answers in the spool table's batch")
    ap.add_argument("--out", default="answers.json")
    args = ap.parse_args()
    result = {"torch_threads": torch.get_num_threads(), "build": [] if args.skip_build else build_table(args.repeat)}
    if result["build"]:
        print(
            f"Qwen3-VL-8B 448² answer ({TOKENS}x{WIDTH} + {DEEPSTACK} deepstack, bf16 in), median wall ms / mean CPU ms"
        )
        print(
            f"{'dtype':10s} {'body':12s} {'MB':>5s} {'build':>12s} {'convert':>12s} {'torch .to':>12s} "
            f"{'h11 send':>12s} {'protocol':>12s}"
        )
        for r in result["build"]:
            cells = " ".join(
                f"{r[f'{k}_ms']:6.2f}/{r[f'{k}_cpu_ms']:5.2f}"
                for k in ("build", "convert", "torch_to", "h11", "protocol")
            )
            print(f"{r['dtype']:10s} {r['body']:12s} {r['mb']:5.1f} {cells}")
    if not args.skip_spool:
        result["spool"] = spool_table(max(3, args.repeat // 5), args.batch)
        print(f"\na batch of {args.batch} such answers (bfloat16) to spool files, median wall ms / mean CPU ms")
        print(f"{'writers':>8s} {'MB':>6s} {'ms':>8s} {'CPU ms':>8s} {'GB/s':>6s}")
        for r in result["spool"]:
            print(f"{r['writers']:8d} {r['mb']:6.1f} {r['ms']:8.2f} {r['cpu_ms']:8.2f} {r['gb_per_s']:6.2f}")
    if not args.skip_server:
        result["server"] = server_table(args.repeat, args.images, args.side, args.server_flags.split())
        print(f"\nQwen3-VL-8B (3 blocks) server, {args.images} cached {args.side}² image(s) per request, median ms")
        print(
            f"{'dtype':10s} {'body':12s} {'MB':>6s} {'client':>8s} {'server':>8s} {'serialize':>10s} {'rest':>8s} "
            f"{'loop CPU':>9s} {'all CPU':>8s}"
        )
        for r in result["server"]:
            print(
                f"{r['dtype']:10s} {r['body']:12s} {r['mb']:6.1f} {r['client_ms']:8.2f} {r['server_ms']:8.2f} "
                f"{r['serialize_ms']:10.2f} {r['rest_ms']:8.2f} {r['loop_cpu_ms']:9.2f} {r['process_cpu_ms']:8.2f}"
            )
    json.dump(result, open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
