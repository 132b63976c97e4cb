"""The timeline of a request's hand-offs (service/ground/timeline.py): off by default, and with VITSERVE_TIMELINE
set, every process of a real server (front ends, decode workers, the core, the device process) writes the points
a request passes, in the order it passes them, on one clock."""

from __future__ import annotations

import base64
import glob
import http.client
import json
import os
from urllib.parse import urlsplit

from helpers import STARTUP_S, png

from vitserve.service.entry import launch
from vitserve.service.ground import timeline

# the points of a request served by two front ends, the core and a device process, in order
PATH = [
    "request",
    "parsed",
    "decode",
    "headers",
    "worker decode",
    "worker decoded",
    "decoded",
    "core queued",
    "batch sent",
    "device batch",
    "device read",
    "device launched",
    "device ran",
    "device written",
    "batch answered",
    "core answered",
    "answered",
    "answering",
]


def test_mark_writes_nothing_when_off_and_its_points_in_order_when_on(tmp_path, monkeypatch):
    monkeypatch.setattr(timeline, "DIRECTORY", None)
    timeline.mark("nowhere")
    monkeypatch.setattr(timeline, "DIRECTORY", str(tmp_path))
    for point in ("first", "second point"):
        timeline.mark(point)
    lines = (tmp_path / f"{os.getpid()}.txt").read_text().splitlines()
    assert [line.split(" ", 2)[1:] for line in lines] == [
        [str(os.getpid()), "first"],
        [str(os.getpid()), "second point"],
    ]
    assert int(lines[0].split()[0]) <= int(lines[1].split()[0])
    assert os.listdir(tmp_path) == [f"{os.getpid()}.txt"]  # (the mark made while off wrote no file)


def test_a_servers_processes_write_a_requests_points_in_order(tmp_path, monkeypatch):
    """One request through two front ends, a decode worker, the core and a device process (on the CPU): its points,
    in time order over every process's file, are the path from its arrival to its answer, from four processes."""
    monkeypatch.setenv("VITSERVE_TIMELINE", str(tmp_path))
    proc, url = launch.start_server(
        "--model", "tiny-qwen2.5-vl", "--load-format", "dummy", "--device", "cpu", "--device-processes",
        "--api-servers", "2", "--cache-bytes", "0", timeout=STARTUP_S, capture_log=True,
    )  # fmt: skip
    try:
        for line in glob.glob(str(tmp_path / "*.txt")):  # (what starting wrote: no request has come)
            assert "request" not in open(line).read()
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        image = "data:image/png;base64," + base64.b64encode(png(96, 64)).decode()
        conn.request("POST", "/v1/embeddings", json.dumps({"model": "tiny-qwen2.5-vl", "input": [image]}))
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        launch.stop_server(proc)
    points = sorted(
        (int(ns), pid, point)
        for path in glob.glob(str(tmp_path / "*.txt"))
        for ns, pid, point in (line.rstrip("\n").split(" ", 2) for line in open(path))
    )
    assert [point for _, _, point in points] == PATH
    by_point = {point: pid for _, pid, point in points}
    front, worker, core, device = (by_point[p] for p in ("request", "worker decode", "core queued", "device batch"))
    assert len({front, worker, core, device}) == 4
    assert by_point["answering"] == front and by_point["batch answered"] == core
