"""A server-wide memory budget that users wait on: what the decoder and the gate count their memory against."""

from __future__ import annotations

import asyncio
import collections
import time


class MemoryBudget:
    """Memory in flight on the whole server, in bytes: decoding images (`--decode-memory`) or request bodies
    (`--body-memory`). A user takes its share before it holds the memory and gives it back after; one that does not
    fit waits. A user larger than the whole budget takes all of it.

    Waiters are served by owner (a request), round-robin: each owner's turn grants its next waiter, in its own
    order, and the owner then goes last, so a request with many large images waiting takes one share per turn and
    another request's image waits for at most one turn of each request ahead of it, not for all their images.
    An owner whose next waiter does not fit lets the owners after it go ahead while they fit, until that waiter has
    waited over `patience` seconds: then nobody goes ahead of it, and it is next once enough is given back."""

    def __init__(self, limit: int, patience: float = 1.0):
        self.limit, self.patience, self.used = limit, patience, 0
        # owner -> its waiters (cost, since, future), the owners in turn order
        self._owners: collections.OrderedDict[object, collections.deque] = collections.OrderedDict()

    @property
    def waiting(self) -> int:
        """Users waiting for their share."""
        return sum(len(waiters) for waiters in self._owners.values())

    def try_acquire(self, cost: int) -> bool:
        """Take `cost` if it fits now, ahead of no waiter; else take nothing."""
        if self.used + cost <= self.limit and not self._owners:
            self.used += cost
            return True
        return False

    async def acquire(self, cost: int, owner: object = None) -> int:
        """Wait for `cost` bytes (at most the whole budget) and take them; the share taken, for `release`. `owner`:
        whose turn it waits in (None: a turn of its own)."""
        cost = min(cost, self.limit)
        waiter = (cost, time.monotonic(), asyncio.get_running_loop().create_future())
        waiters = self._owners.get(owner) if owner is not None else None
        if waiters is None:
            waiters = self._owners[object() if owner is None else owner] = collections.deque()
        waiters.append(waiter)
        self._grant()
        try:
            await waiter[2]
        except asyncio.CancelledError:
            if not waiter[2].cancelled():  # granted as it was cancelled
                self.release(cost)
            else:
                self._remove(waiter)
                self._grant()  # it may have been the one nobody went ahead of
            raise
        return cost

    def release(self, cost: int) -> None:
        self.used -= cost
        self._grant()

    def _remove(self, waiter: tuple) -> None:
        for owner, waiters in self._owners.items():
            if waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._owners[owner]
                return

    def _grant(self) -> None:
        """Grant what fits, owner by owner in turn order (see the class docstring). A pass grants each owner's next
        waiter where it fits (what one skipped still does not fit after: `used` only grows here), and passes repeat
        while one grants: a call costs a pass over the owners per waiter of one owner it grants, not per grant."""
        now, granted = time.monotonic(), True
        while granted:
            granted = False
            for owner in list(self._owners):
                waiters = self._owners[owner]
                while waiters and waiters[0][2].done():  # cancelled: its task has not run yet to take it out
                    waiters.popleft()
                if waiters and self.used + waiters[0][0] > self.limit:
                    if now - waiters[0][1] > self.patience:
                        return  # it has waited long enough: nobody goes ahead of it any more
                    continue
                if waiters:
                    cost, _, future = waiters.popleft()
                    self.used += cost
                    future.set_result(None)
                    self._owners.move_to_end(owner)  # its next waiter waits for its next turn
                    granted = True
                if not waiters:
                    del self._owners[owner]
