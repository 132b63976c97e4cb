"""Progress of the slow steps of loading (checkpoint shards read, weights converted, CUDA graphs captured), as log
records: the library draws nothing and depends on no handler.

A step logs when it starts, at most once every `interval` seconds while it runs, and when it ends: plain lines to
any handler. Each record also carries `progress = (step, done, total)`, so that a handler that knows it can draw a
bar instead (service.logs does on a terminal) or keep fewer lines."""

from __future__ import annotations

import itertools
import logging
import time

_steps = itertools.count()


class Progress:
    """One step of `total` units (bytes when `unit` is "MiB", shown in MiB), advanced as they are done."""

    def __init__(self, log: logging.Logger, what: str, total: int, unit: str = "", interval: float = 1.0):
        self.log, self.what, self.total, self.unit, self.interval = log, what, total, unit, interval
        self.step, self.done = next(_steps), 0
        self.start = self.last = time.perf_counter()
        self._record("")

    def advance(self, amount: int = 1, detail: str = "") -> None:
        """`amount` more units done (`detail`: what was just done, for the line)."""
        self.done = min(self.total, self.done + amount)
        now = time.perf_counter()
        if self.done == self.total or now - self.last >= self.interval:
            self.last = now
            self._record(detail)

    def _record(self, detail: str) -> None:
        if self.unit == "MiB":
            counts = f"{self.done / 2**20:.1f}/{self.total / 2**20:.1f} MiB"
        else:
            counts = f"{self.done}/{self.total}" + (f" {self.unit}" if self.unit else "")
        end = f" in {time.perf_counter() - self.start:.2f} s" if self.done == self.total else ""
        self.log.info(
            "%s: %s%s%s",
            self.what,
            counts,
            f" ({detail})" if detail else "",
            end,
            extra={"progress": (self.step, self.done, self.total)},
        )
