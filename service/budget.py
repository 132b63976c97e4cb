"""A server-wide memory budget that users wait on: what the decoder and the gate count their memory against."""

from __future__ import annotations

import asyncio
import collections
import time


class MemoryBudget:
    """Memory in flight on the whole server, in bytes: decoding images (`--decode-memory`) or request bodies
    (`--body-memory`). A user takes its share before it holds the memory and gives it back after; one that does not
    fit waits, while smaller ones that fit go ahead of it, unless it has waited over `patience` seconds (then it goes
    next). A user larger than the whole budget takes all of it."""

    def __init__(self, limit: int, patience: float = 1.0):
        self.limit, self.patience, self.used = limit, patience, 0
        self._waiters: collections.deque[tuple[int, float, asyncio.Future]] = collections.deque()

    def try_acquire(self, cost: int) -> bool:
        """Take `cost` if it fits now, ahead of no waiter; else take nothing."""
        if self.used + cost <= self.limit and not self._waiters:
            self.used += cost
            return True
        return False

    async def acquire(self, cost: int) -> int:
        cost = min(cost, self.limit)
        now = time.monotonic()
        if self.used + cost <= self.limit and not any(now - since > self.patience for _, since, _ in self._waiters):
            self.used += cost
            return cost
        waiter = (cost, time.monotonic(), asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            await waiter[2]
        except asyncio.CancelledError:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif not waiter[2].cancelled():  # granted as it was cancelled
                self.release(cost)
            raise
        return cost

    def release(self, cost: int) -> None:
        self.used -= cost
        now = time.monotonic()
        for waiter in list(self._waiters):
            cost, since, future = waiter
            if self.used + cost <= self.limit:
                self._waiters.remove(waiter)
                self.used += cost
                future.set_result(None)
            elif now - since > self.patience:
                break  # it has waited long enough: nobody goes ahead of it any more
