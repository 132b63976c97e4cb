"""A lean HTTP/1.1 load generator for the front-end benchmarks (bench/frontend.py): prebuilt request bytes sent over
keep-alive connections from several client processes, each an asyncio loop on raw streams with one connection per
concurrent client. No HTTP library runs per request (an answer is read with a Content-Length or chunked framing and
counted, not parsed), so a request costs the client tens of microseconds and what is measured is the server.

The kernel balances connections, not requests, across a server's front-end processes: every client holds its own
connection for the whole run, so a load of C clients is C connections.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from urllib.parse import urlsplit

import numpy as np

_PAYLOADS: list[bytes] = []  # the prebuilt requests; set before the client processes fork, which inherit them


def request_bytes(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    """One whole HTTP/1.1 request (keep-alive), ready to write."""
    head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body or method == "POST":
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


ANSWER_SECONDS = 120  # a request not answered by then is a failure (a hang shows in the figures, not as a stall)


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> tuple[int, int, bool]:
    """Send one request and read its answer: (status, bytes of the answer's body, whether the server keeps the
    connection open)."""
    writer.write(data)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    size = 0
    if "content-length" in headers:
        remaining = int(headers["content-length"])
        while remaining:
            piece = await reader.read(min(remaining, 1 << 20))
            if not piece:
                raise ConnectionError("the server closed the connection inside an answer")
            remaining -= len(piece)
            size += len(piece)
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            n = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if n == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
                    pass
                break
            await reader.readexactly(n + 2)
            size += n
    return status, size, headers.get("connection", "").lower() != "close"


async def _clients(host: str, port: int, indices: list[int], concurrency: int) -> tuple[list, int, float]:
    rows, failures, cpu = [], 0, time.process_time()
    work = iter(indices)

    async def client():
        nonlocal failures
        reader = writer = None
        for i in work:
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
                start = time.perf_counter()
                status, size, keep = await asyncio.wait_for(exchange(reader, writer, _PAYLOADS[i]), ANSWER_SECONDS)
                rows.append((i, time.perf_counter() - start, time.time(), status, size))
                failures += status != 200
                if not keep:
                    writer.close()
                    writer = None
            except (
                OSError,
                asyncio.IncompleteReadError,
                asyncio.TimeoutError,
                ConnectionError,
                ValueError,
                IndexError,
            ):  # a failure, counted; a request never answered counts after ANSWER_SECONDS
                failures += 1
                if writer is not None:
                    writer.close()
                writer = None
        if writer is not None:
            writer.close()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return rows, failures, time.process_time() - cpu


def _client_process(job):
    return asyncio.run(_clients(*job))


def in_processes(target, jobs: list) -> tuple[list, float]:
    """`target(job)` for each job, each in a client process of its own (forked; one job: here), and the wall time."""
    start = time.perf_counter()
    if len(jobs) == 1:
        results = [target(jobs[0])]
    else:
        with multiprocessing.get_context("fork").Pool(len(jobs)) as pool:
            results = pool.map(target, jobs)
    return results, time.perf_counter() - start


def load_rate(timed: list[tuple[float, float]]) -> float | None:
    """Answers per second from the first request sent to the last answer, of (seconds, wall-clock end) per
    answer."""
    if not timed:
        return None
    first = min(end - seconds for seconds, end in timed)
    return len(timed) / (max(end for _, end in timed) - first)


def run_load(url: str, payloads: list[bytes], requests: int, concurrency: int, processes: int) -> dict:
    """`requests` requests, the k-th sending `payloads[k % len(payloads)]`, from `processes` client processes of
    `concurrency / processes` keep-alive connections each. `images_per_s` counts the whole run (client start-up and
    tail included), `load_images_per_s` the server's part of it (from the first request sent to the last answer:
    its ramp and tail in, the client processes' start out), `steady_images_per_s` the middle 80% of the answers by
    time; `answer_mb_per_s` the answers' body
    bytes over the whole run (10^6 bytes per MB); `client_cpu_busiest` the busiest client process's CPU over the wall
    time (near 1: the clients are the limit)."""
    global _PAYLOADS
    _PAYLOADS = payloads
    parts = urlsplit(url)
    processes = max(1, min(processes, concurrency))
    indices = [k % len(payloads) for k in range(requests)]
    shares = [indices[p::processes] for p in range(processes)]
    jobs = [(parts.hostname, parts.port, share, max(1, concurrency // processes)) for share in shares]
    results, wall = in_processes(_client_process, jobs)
    rows = [row for r in results for row in r[0]]
    done = np.sort([row[2] for row in rows])
    middle = done[len(done) // 10 : len(done) - len(done) // 10]
    lat = np.array([row[1] * 1e3 for row in rows]) if rows else np.zeros(1)
    by_image: dict[int, list[float]] = {}
    for i, seconds, *_ in rows:
        by_image.setdefault(i, []).append(seconds * 1e3)
    return dict(
        requests=requests,
        concurrency=concurrency,
        client_processes=processes,
        answered=len(rows),
        failures=sum(r[1] for r in results),
        images_per_s=len(rows) / wall,
        wall_s=wall,
        load_images_per_s=load_rate([(row[1], row[2]) for row in rows]),
        steady_images_per_s=float((len(middle) - 1) / (middle[-1] - middle[0])) if len(middle) > 1 else None,
        p50_ms=float(np.percentile(lat, 50)),
        p99_ms=float(np.percentile(lat, 99)),
        answer_mb_per_s=sum(row[4] for row in rows) / wall / 1e6,
        answer_mb_mean=float(np.mean([row[4] for row in rows]) / 1e6) if rows else 0.0,
        client_cpu_busiest=max(r[2] for r in results) / wall,
        p50_ms_by_image={k: float(np.percentile(v, 50)) for k, v in sorted(by_image.items())},
    )
