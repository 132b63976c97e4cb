"""Where a lone request's time goes between the processes of a server: the points it passes (its arrival, the decode
worker's start and end, the core's queue, the device process's batch, ...), each process writing its own on one
clock. bench/timeline.py serves requests one at a time with it on and prints the time between the points.

Off unless the environment variable VITSERVE_TIMELINE names a directory when the server starts (its processes
inherit it): then each process appends `<monotonic ns> <pid> <point>` lines to `<directory>/<pid>.txt` as it
passes a point. CLOCK_MONOTONIC is one clock for every process of a machine. A point costs a few microseconds with
it on and a test of a constant with it off. Points of requests served side by side interleave: the timeline of a
request is read from a server that serves one at a time."""

from __future__ import annotations

import os
import time

DIRECTORY = os.environ.get("VITSERVE_TIMELINE") or None
_file: tuple[int, int] | None = None  # (the process that opened it, its descriptor): a forked child opens its own


def mark(point: str) -> None:
    """This process passes `point` now (nothing when the timeline is off)."""
    if DIRECTORY is None:
        return
    global _file
    pid = os.getpid()
    if _file is None or _file[0] != pid:
        _file = (pid, os.open(os.path.join(DIRECTORY, f"{pid}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
    os.write(_file[1], f"{time.monotonic_ns()} {pid} {point}\n".encode())
