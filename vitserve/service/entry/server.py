"""One HTTP server process: an engine's app under uvicorn, with the drain on SIGTERM and the exit on failure."""

from __future__ import annotations

import logging
import os

from ..ground.settings import Settings
from ..ground.signals import StopSignals


def run_server(settings: Settings, engine, sockets=None, serving=lambda: None) -> int:
    """Serve `engine`'s app with uvicorn (on `sockets`, else bound to --host and --port) until SIGTERM or a failure;
    the exit status. `serving()` is called before uvicorn accepts on the sockets (the early probes stop)."""
    import uvicorn

    from ..api.http import connection_limit, guarded_h11
    from ..pipeline.engine import State
    from .app import create_app

    app = create_app(settings, engine)
    stops = StopSignals()

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            """First SIGTERM/SIGINT: not ready, stop accepting, answer everything in flight, exit 0. Another one a
            second or more later: exit now (StopSignals). (Unlike uvicorn's own handler, the signal is not re-raised
            after a graceful shutdown.) A front end leaves signals to its core, which tells it to drain."""
            if not engine.backend.takes_signals:
                return
            engine.drain()
            if stops.add():
                self.force_exit = True
            self.should_exit = True

        async def startup(self, sockets=None) -> None:
            serving()
            await super().startup(sockets)

        async def on_tick(self, counter: int) -> bool:
            """Exit once the engine drains (a signal; in a front end, its core's word), answering what it admitted,
            or has failed (a model that did not load, a lost device): for a restart."""
            return await super().on_tick(counter) or engine.state in (State.DRAINING, State.FAILED)

    config = uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        log_config=None,
        lifespan="on",
        log_level=settings.logging.log_level,
        access_log=False,
        timeout_keep_alive=settings.server.timeout_keep_alive,
        http=guarded_h11(settings.server.header_timeout, connection_limit(settings.server.max_connections)),
        h11_max_incomplete_event_size=settings.server.max_header_bytes,
    )
    server = Server(config)
    server.run(sockets=sockets)
    if server.force_exit:  # "exit now": no interpreter teardown (seconds, with torch and a process pool loaded)
        engine.abandon()
        logging.shutdown()
        os._exit(1)
    return 1 if engine.state is State.FAILED else 0
