"""The server's lifecycle: one `State` and its moves, for a process with the devices and for a front end that
mirrors its core's.

    LOADING -> CAPTURING -> READY -> DRAINING        (FAILED from any state; DRAINING and FAILED are final)

`Lifecycle` holds the state and why it failed, sets `vitserve_ready`, and tells its listeners of every change (the
core sends its front ends a Status record each time). Any thread may move it.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import cast

log = logging.getLogger("vitserve.engine")


class State(str, enum.Enum):
    LOADING = "loading"
    CAPTURING = "capturing"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


NOT_READY = {
    State.LOADING: "loading model weights",
    State.CAPTURING: "capturing CUDA graphs",
    State.DRAINING: "draining: shutting down",
}
FINAL = (State.DRAINING, State.FAILED)


class Lifecycle:
    """`log`: where a failure is logged (the engine's logger, or the core's)."""

    def __init__(self, metrics, log: logging.Logger = log):
        self.metrics, self.log = metrics, log
        self.state = State.LOADING
        self.error: str | None = None  # why it failed
        self.listeners: list[Callable[[], None]] = []

    def _set(self, state: State, error: str | None = None) -> None:
        self.state, self.error = state, error
        self.metrics.ready.set(int(state is State.READY))
        for listener in self.listeners:
            listener()

    def capturing(self) -> None:
        """The weights are loaded: the devices capture their graphs."""
        if self.state is State.LOADING:
            self._set(State.CAPTURING)

    def ready(self) -> None:
        if self.state in (State.LOADING, State.CAPTURING):
            self._set(State.READY)

    def fail(self, reason: str) -> None:
        """The server cannot serve (its model did not load, or a part it cannot run without is gone): /health turns
        failed and the process exits non-zero, so a supervisor restarts it."""
        if self.state is not State.FAILED:
            self.log.error("%s", reason)
            self._set(State.FAILED, reason)

    def drain(self) -> None:
        """Stop admitting requests (ready -> 503); requests already admitted are still answered."""
        if self.state not in FINAL:
            self._set(State.DRAINING)
        self.metrics.ready.set(0)

    def mirror(self, state: State, error: str | None) -> None:
        """A front end takes its core's state."""
        if state is State.FAILED:
            self.fail(cast(str, error))  # a failed state carries its reason (`fail`)
        elif state is State.DRAINING:
            self.drain()
        elif self.state not in FINAL and state is not self.state:
            self._set(state)
