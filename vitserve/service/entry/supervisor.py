"""The supervisor of a server with several front ends (`--api-servers N`): it binds the port, starts the core's
devices and the front ends (processes on the one listening socket), starts again a front end that dies while the
others serve, and drains them all on SIGTERM (core.py says what the core does in between)."""

from __future__ import annotations

import collections
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time

from ..ground.settings import Settings
from ..ground.signals import StopSignals
from .core import Core, Link
from .fronts import front_settings, serve_front

log = logging.getLogger("vitserve.core")

RESTART_DELAYS = (1.0, 4.0)  # seconds before a front end that died before it was up starts again; then: failed


class Restarts:
    """When a front end that died starts again: at once where it had come up, else after each of `delays` in turn
    (a start that fails may pass: memory, processes); never once those are spent."""

    def __init__(self, delays: tuple[float, ...] = RESTART_DELAYS):
        self.delays = delays
        self.failed: collections.Counter[int] = collections.Counter()  # front end -> failed starts in a row

    def after(self, index: int, up: bool) -> float | None:
        """Seconds before front end `index`, which died (`up`: after it had come up), starts again; None: never."""
        if up:
            self.failed[index] = 0
            return 0.0
        self.failed[index] += 1
        return self.delays[self.failed[index] - 1] if self.failed[index] <= len(self.delays) else None


def start_front(core: Core, index: int, settings: Settings, sock: socket.socket, context) -> Link:
    """Start front end `index` on the listening socket, and the core's reader of its records."""
    parent, child = context.Pipe()
    # not a daemon: a front end has decode workers of its own; one whose core is gone exits (its link ends)
    process = context.Process(target=serve_front, args=(index, settings, sock, child), name=f"vitserve-api{index}")
    process.start()
    child.close()
    link = Link(index, parent, process)
    threading.Thread(target=core.serve_link, args=(link,), name=f"vitserve-link{index}", daemon=True).start()
    return link


def serve(settings: Settings, fronts: int, sock: socket.socket, serving=lambda: None) -> int:
    """`vitserve serve` with several front ends on `sock` (the listening socket): start the core and the front ends,
    and supervise them until SIGTERM (drained: exit 0) or a failure (exit 1). `serving()` is called when the first
    front end is up, before it accepts (the early probes stop). A front end that dies is started again
    (`Restarts`) while the others serve; the core keeps the listening socket for that until it drains."""
    core = Core(settings, fronts)
    if core.prefix is None:
        raise ValueError("--api-servers above 1 needs a spool directory (/dev/shm or --spool-dir)")
    core.front_up = serving
    stopping, forced, stops = threading.Event(), threading.Event(), StopSignals()

    def on_signal(sig, frame):
        if stops.add():
            forced.set()
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)  # before any process starts: from here a stop drains them
    signal.signal(signal.SIGINT, on_signal)
    context = multiprocessing.get_context("spawn")
    share = front_settings(settings, fronts)
    core.links = [start_front(core, i, share, sock, context) for i in range(fronts)]
    threading.Thread(target=core.load, name="vitserve-load", daemon=True).start()
    if supervise(core, stopping, lambda index: start_front(core, index, share, sock, context)) != 0:
        return _abandon(core)
    # drained: every front end hears it, answers what it admitted and exits; then the devices stop
    sock.close()  # the front ends hold it: once they have all closed it, the port is free
    core.life.drain()
    live = [link for link in core.links if link.process.is_alive()]
    while any(link.process.is_alive() for link in live):
        if forced.is_set():  # another signal, later: now
            return _abandon(core)
        time.sleep(0.05)
    core.stop()
    return 1 if any(link.process.exitcode for link in live) else 0


def supervise(core: Core, stopping: threading.Event, restart) -> int:
    """Watch the processes until `stopping` (0) or a failure (1): a front end that dies is started again by
    `restart(index)` after its delay (`Restarts`); a device process that dies fails the server."""
    restarts, due = Restarts(), {}  # due: front end -> when it starts again
    while not stopping.wait(0.2):
        if core.failed.is_set():
            return 1
        now = time.monotonic()
        for link in list(core.links):
            if link.index in due or link.process.is_alive():
                continue  # its reader thread lets go of what it held (Core.lost) once it has read all it sent
            delay = restarts.after(link.index, link.up)
            if delay is None:
                core.fail(
                    f"front end {link.index} exited (exit code {link.process.exitcode}) before it was up, "
                    f"{len(restarts.delays) + 1} times in a row; the server is restarting"
                )
                break
            log.warning(
                "front end %d exited (exit code %s); starting it again%s",
                link.index,
                link.process.exitcode,
                f" in {delay:g} s" if delay else "",
            )
            due[link.index] = now + delay
        for index, when in list(due.items()):
            if when <= now and not core.failed.is_set():
                del due[index]
                core.links[index] = restart(index)
                core.replaced += 1
        if dead := next((w.device.process for w in core.backend.workers if not w.device.process.is_alive()), None):
            core.fail(f"the process serving {dead.name} exited (exit code {dead.exitcode}); the server is restarting")
            return 1
    return 0


def _abandon(core: Core) -> int:
    """Exit now: every child killed, the spool files removed."""
    from ..decoding import spool

    for child in multiprocessing.active_children():
        child.kill()
    core.backend.cache.clear()
    spool.clear(core.prefix)
    for worker in core.backend.workers:
        spool.clear(worker.device.prefix)
    logging.shutdown()
    os._exit(1)
