"""`python -m vitserve.service.entry.healthcheck`: the container's health check. Exit 0 when the `vitserve serve`
process answers `/ready` with 200; else 1 (Docker's "unhealthy"), with one line saying why.

`/ready`, not `/health`: Docker's "healthy" gates `depends_on: condition: service_healthy`, and a server that is
still loading or capturing cannot answer yet (the image's `--start-period` covers the load); a draining server reads
unhealthy, which is right for a container that is stopping. The host and port are the server's own: its command
line and environment are read from /proc and parsed by its own parser (service.cli.build_parser), so `--port 9000`,
`VITSERVE_PORT=9000` and the defaults all lead to the port it bound. The server is PID 1 (the image's entrypoint),
else (an init such as tini as PID 1) the `vitserve serve` process of lowest PID; `--pid` names another."""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request

PROC = "/proc"
PATH = "/ready"
PROGRAMS = ("vitserve", "vitserve.service.entry.cli")  # the console script's name, `python -m` module names


def serve_args(argv: list[str]) -> list[str] | None:
    """The arguments after `serve` of a `vitserve serve` command line (the console script, run as is or by its
    interpreter, or `python -m vitserve`), else None."""
    for i, word in enumerate(argv):
        if (i <= 1 and os.path.basename(word) == "vitserve") or (word in PROGRAMS and argv[i - 1 : i] == ["-m"]):
            return argv[i + 2 :] if argv[i + 1 : i + 2] == ["serve"] else None
    return None


def _read(pid: int, name: str, proc: str) -> list[str]:
    with open(os.path.join(proc, str(pid), name), "rb") as f:
        return [os.fsdecode(part) for part in f.read().split(b"\0")[:-1]]


def servers(proc: str = PROC) -> list[int]:
    """The PIDs of the `vitserve serve` processes, lowest first (PID 1 first when it is one)."""
    found = []
    for pid in sorted(int(entry) for entry in os.listdir(proc) if entry.isdigit()):
        try:
            if serve_args(_read(pid, "cmdline", proc)) is not None:
                found.append(pid)
        except OSError:  # gone, or not ours to read
            pass
    return found


def address(pid: int, proc: str = PROC) -> tuple[str, int]:
    """The (host, port) the server of `pid` binds: its arguments parsed as it parsed them, its VITSERVE_* variables
    (from its environment; this process's own where that cannot be read) giving the defaults."""
    from .cli import build_parser

    args = serve_args(_read(pid, "cmdline", proc))
    if args is None:
        raise ValueError(f"process {pid} is not vitserve serve")
    try:
        environ = dict(item.partition("=")[::2] for item in _read(pid, "environ", proc))
    except OSError:
        environ = dict(os.environ)
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(environ)  # the parser reads each flag's default from its variable
    try:
        parsed = build_parser().parse_args(["serve", *args])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return parsed.host, parsed.port


def url_for(host: str, port: int) -> str:
    """Where a server bound to `host` answers from inside its container: loopback for a wildcard address."""
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def probe(url: str, timeout: float) -> tuple[bool, str]:
    """GET `url` (no proxy): (whether it answered 200, what it answered)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as reply:
            return reply.status == 200, f"{reply.status} {reply.read(200).decode(errors='replace')}"
    except urllib.error.HTTPError as e:
        return False, f"{e.code} {e.read(200).decode(errors='replace')}"
    except (OSError, ValueError) as e:  # refused, timed out, unreachable
        return False, repr(e)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vitserve.service.entry.healthcheck", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--pid", type=int, help="the server's PID (default: PID 1 if it is vitserve serve, else the lowest such PID)"
    )
    parser.add_argument("--timeout", type=float, default=4.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    pids = [args.pid] if args.pid else servers()
    if not pids:
        print("unhealthy: no vitserve serve process", file=sys.stderr)
        return 1
    try:
        url = url_for(*address(pids[0])) + PATH
    except (OSError, ValueError, SystemExit) as e:  # gone since, not a server, or its command line does not parse
        print(f"unhealthy: no address from process {pids[0]}: {e!r}", file=sys.stderr)
        return 1
    ok, answer = probe(url, args.timeout)
    print(f"{'healthy' if ok else 'unhealthy'}: {url} answered {answer}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
