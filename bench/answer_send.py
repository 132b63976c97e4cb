"""How a large answer in a spool file is best sent: a front end's answer to a cache hit is a mapped file (Qwen3-VL-8B's
448² float32 tokens and deepstack: 12.8 MB) written to the socket as a view of its mapping; `os.sendfile` from the
file would skip the copy into the socket's buffers. Over loopback, one keep-alive connection, a client in another
process reading each answer into a buffer of its own (`recv_into`), the time from its request's first byte to the
answer's last, in alternated rounds of each way:

- `loop-write`: a protocol on uvloop (asyncio's loop where uvloop is absent) writes the header and the mapping's
  view to its transport (the server's way);
- `loop-sendfile`: the same protocol sends what the socket takes with `os.sendfile` on the loop, the rest as a view;
- `thread-sendfile`: the protocol hands the socket to a thread that sends the file with `os.sendfile`, waiting for
  the socket's room itself (uvloop's transport has no sendfile, and no writer can be added to its descriptor);
- `blocking-sendall` / `blocking-sendfile`: a thread on a blocking socket, no event loop (the floor of each way).

    python bench/answer_send.py [--mb 12.8] [--hits 15] [--rounds 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import multiprocessing
import os
import select
import socket
import statistics
import threading
import time

WAYS = ("loop-write", "loop-sendfile", "thread-sendfile", "blocking-sendall", "blocking-sendfile")


def sendfile_all(sock: int, fd: int, offset: int, count: int) -> None:
    """`count` bytes of `fd` from `offset` to a socket; a non-blocking one's room is waited for with poll."""
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    end = offset + count
    while offset < end:
        try:
            offset += os.sendfile(sock, fd, offset, end - offset)
        except BlockingIOError:
            if any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(30_000)):
                raise ConnectionError("the client closed") from None


class Answers(asyncio.Protocol):
    """Answers each request (its first byte: the way's index) with the header and the whole file."""

    def __init__(self, fd: int, view: memoryview, header: bytes):
        self.fd, self.view, self.header = fd, view, header

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        way = WAYS[data[0]]
        self.transport.write(self.header)
        if way == "loop-write":
            self.transport.write(self.view)
        elif way == "loop-sendfile":
            sent = 0
            if self.transport.get_write_buffer_size() == 0:  # the header went out: the file may follow it
                try:
                    sent = os.sendfile(self.transport.get_extra_info("socket").fileno(), self.fd, 0, len(self.view))
                except BlockingIOError:
                    pass
            self.transport.write(self.view[sent:])
        else:  # thread-sendfile
            self.transport.pause_reading()
            sock = self.transport.get_extra_info("socket").fileno()
            done = asyncio.get_running_loop().run_in_executor(None, sendfile_all, sock, self.fd, 0, len(self.view))
            done.add_done_callback(lambda _: self.transport.resume_reading())


def blocking_server(listener: socket.socket, fd: int, view: memoryview, header: bytes) -> None:
    conn, _ = listener.accept()
    while data := conn.recv(64):
        conn.sendall(header)
        if WAYS[data[0]] == "blocking-sendall":
            conn.sendall(view)
        else:
            sendfile_all(conn.fileno(), fd, 0, len(view))


def serve(path: str, nbytes: int, ports) -> None:
    fd = os.open(path, os.O_RDONLY)
    view = memoryview(mmap.mmap(fd, nbytes, prot=mmap.PROT_READ))
    header = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % nbytes
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=blocking_server, args=(listener, fd, view, header), daemon=True).start()

    async def main():
        server = await asyncio.get_running_loop().create_server(lambda: Answers(fd, view, header), "127.0.0.1", 0)
        ports.put((server.sockets[0].getsockname()[1], listener.getsockname()[1]))
        await asyncio.Event().wait()

    try:  # the loop the server runs on (uvicorn[standard] brings uvloop)
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())


def timed(conn: socket.socket, way: int, buffer: memoryview, nbytes: int) -> tuple[float, int]:
    """Seconds from the request's first byte to the answer's last, and where its body starts in `buffer`."""
    start = time.perf_counter()
    conn.sendall(bytes([way]))
    got, end = 0, None
    while end is None or got < end:
        got += conn.recv_into(buffer[got:])
        if end is None and (at := bytes(buffer[: min(got, 256)]).find(b"\r\n\r\n")) >= 0:
            end = at + 4 + nbytes
    return time.perf_counter() - start, end - nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=12.845056, help="the answer's size (Qwen3-VL-8B 448² float32)")
    parser.add_argument("--hits", type=int, default=15, help="answers timed per way and round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json")
    args = parser.parse_args()
    nbytes = int(args.mb * 1e6)
    path = f"/dev/shm/vitserve-answer-send-{os.getpid()}"
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
    ports: multiprocessing.Queue = multiprocessing.get_context("fork").Queue()
    server = multiprocessing.get_context("fork").Process(target=serve, args=(path, nbytes, ports), daemon=True)
    server.start()
    try:
        loop_port, blocking_port = ports.get(timeout=30)
        conns = {p: socket.create_connection(("127.0.0.1", p)) for p in (loop_port, blocking_port)}
        buffer = memoryview(bytearray(nbytes + 256))
        expected = open(path, "rb").read()
        times: dict[str, list[list[float]]] = {way: [] for way in WAYS}
        for r in range(args.rounds + 1):  # the first round warms each way
            for way in WAYS if r % 2 else WAYS[::-1]:
                conn = conns[blocking_port if way.startswith("blocking") else loop_port]
                hits = []
                for _ in range(args.hits):
                    seconds, body = timed(conn, WAYS.index(way), buffer, nbytes)
                    hits.append(seconds)
                assert buffer[body : body + nbytes] == expected, way  # the last answer, whole
                if r:
                    times[way].append(hits)
    finally:
        server.kill()
        os.unlink(path)
    print(f"{nbytes / 1e6:.1f} MB over loopback, medians of {args.hits} per round, ms")
    print(f"| way | {' | '.join(f'round {r + 1}' for r in range(args.rounds))} |")
    print("|---|" + "---|" * args.rounds)
    rows = {}
    for way, rounds in times.items():
        medians = [statistics.median(h) * 1e3 for h in rounds]
        rows[way] = medians
        print(f"| {way} | {' | '.join(f'{m:.2f}' for m in medians)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(answer_bytes=nbytes, hits=args.hits, median_ms_by_round=rows), f, indent=1)


if __name__ == "__main__":
    main()
