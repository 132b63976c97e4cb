"""Start `vitserve serve` for a benchmark and wait until it is ready (shared by the bench scripts)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*flags: str, port: int | None = None, timeout: float = 600, **popen) -> tuple[subprocess.Popen, str]:
    """`vitserve serve --host 127.0.0.1 --port PORT FLAGS...` from the repository, once `/ready` answers 200."""
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                             *flags], cwd=ROOT, env=os.environ | {"PYTHONUNBUFFERED": "1"}, **popen)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server was not ready within {timeout} s")
