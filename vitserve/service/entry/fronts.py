"""A front end of a server with several (`--api-servers N`, service/core.py): its share of the server's limits, and
its process: the app on the shared socket, with the core behind its engine (a hub.HubBackend)."""

from __future__ import annotations

import dataclasses
import math
import os
import socket

from ..ground.settings import Settings


def front_settings(settings: Settings, fronts: int) -> Settings:
    """One front end's share of the server's limits (connections, requests in flight, memory budgets, decode
    workers, the encoder-cache files' space): each is split evenly, so that the server's totals hold."""
    share = lambda n: max(1, math.ceil(n / fronts))  # noqa: E731
    return dataclasses.replace(
        settings, decode_workers=max(1, settings.decode_worker_count() // fronts),
        max_concurrent_requests=share(settings.max_concurrent_requests),
        max_connections=share(settings.max_connections), body_memory=share(settings.body_memory),
        decode_memory=share(settings.decode_memory), url_fetch_memory=share(settings.url_fetch_memory),
        video_decode_work=share(settings.video_decode_work),
        video_decode_workers=settings.video_decode_workers and max(1, settings.video_decode_workers // fronts),
        ec_storage_bytes=share(settings.ec_storage_bytes))


def serve_front(index: int, settings: Settings, sock: socket.socket, conn) -> None:
    """A front end's process: this server's app on the shared socket, with the core behind its engine. Signals are
    the core's: it drains the front end with a Status record, and one whose core is gone exits."""
    from ..ground.logs import configure_logging
    from ..ground.signals import leave_to_owner
    from ..pipeline.engine import Engine
    from .server import run_server

    leave_to_owner()
    import torch

    configure_logging(settings.log_format, settings.log_level, bar=False, source=f"api{index}")
    torch.set_num_threads(1)  # a front end runs no tower: its torch work is small, and OpenMP's barrier waits
    engine = Engine(settings, core=conn)
    code = run_server(settings, engine, sockets=[sock])
    os._exit(code)
