"""Stop signals: the server's main process acts on them; the processes it runs leave them to it.

systemd (KillMode=control-group), `kill -- -PGID`, timeout(1) and Ctrl-C signal every process of the server, not
only its main one. The main process drains on the first signal, and the drain needs its decode workers, device
processes and front ends to answer what was admitted: each of those ignores SIGTERM and SIGINT (`leave_to_owner`),
is told to stop by the process that owns it, and exits on its own once that process is gone."""

from __future__ import annotations

import signal
import time

REPEAT_SECONDS = 1.0  # a signal within this of the first is the same stop: timeout(1) sends its command two


def leave_to_owner() -> None:
    """This process ignores SIGTERM and SIGINT (its children inherit that): its owner decides when it stops."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


class StopSignals:
    """The main process's stop signals: the first drains the server; another one, `REPEAT_SECONDS` or more after it,
    exits at once. One that comes sooner is the same stop (timeout(1) signals its command, then its whole process
    group, the command again), so a drain is never cut short by the signal that started it."""

    def __init__(self) -> None:
        self.first: float | None = None

    def add(self) -> bool:
        """Count a signal; True when it means exit now."""
        now = time.monotonic()
        if self.first is None:
            self.first = now
            return False
        return now - self.first >= REPEAT_SECONDS
