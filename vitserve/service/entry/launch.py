"""Start a `vitserve serve` subprocess and wait until it is ready, and stop it: for benchmarks, tests and users' own
tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess(subprocess.Popen):
    """A `vitserve serve` process (`start_server`): `log`, its output lines (where captured), and `log_reader`, the
    thread that reads them."""

    log: list[str]
    log_reader: threading.Thread


def start_server(
    *flags: str, port: int | None = None, timeout: float = 600, capture_log: bool = False, **popen
) -> tuple[ServerProcess, str]:
    """`vitserve serve --host 127.0.0.1 --port PORT FLAGS...` (this interpreter's), once `/ready` answers 200.
    `capture_log`: its output lines collect in `proc.log`, drained continuously by `proc.log_reader` (a full pipe
    would block the server's logging), which ends once the server has exited. RuntimeError when it exits or is not
    ready in `timeout` seconds."""
    port = port or free_port()
    if capture_log:
        popen |= dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc = ServerProcess(
        [sys.executable, "-m", "vitserve", "serve", "--host", "127.0.0.1", "--port", str(port), *flags],
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
        **popen,
    )
    proc.log = []

    def read_log() -> None:
        if capture_log and proc.stdout is not None:  # (a pipe where the log is captured)
            proc.log.extend(proc.stdout)

    proc.log_reader = threading.Thread(target=read_log, daemon=True)
    proc.log_reader.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            time.sleep(0.2)
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready:\n" + "".join(proc.log))
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    proc.log_reader.join(5)  # (what it logged so far says where its start-up stood)
    raise RuntimeError(f"the server was not ready within {timeout} s:\n" + "".join(proc.log[-40:]))


def stop_server(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM (the server drains: it answers what it admitted), and SIGKILL if it has not exited `timeout` s later."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
