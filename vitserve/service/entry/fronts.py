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

    def share(n: int) -> int:
        return max(1, math.ceil(n / fronts))

    limits, decoding = settings.limits, settings.decoding
    return dataclasses.replace(
        settings,
        server=dataclasses.replace(settings.server, max_connections=share(settings.server.max_connections)),
        limits=dataclasses.replace(
            limits,
            max_concurrent_requests=share(limits.max_concurrent_requests),
            body_memory=share(limits.body_memory),
            decode_memory=share(limits.decode_memory),
            url_fetch_memory=share(limits.url_fetch_memory),
            video_decode_work=share(limits.video_decode_work),
        ),
        decoding=dataclasses.replace(
            decoding,
            decode_workers=max(1, decoding.worker_count() // fronts),
            video_decode_workers=decoding.video_decode_workers and max(1, decoding.video_decode_workers // fronts),
        ),
        tiers=dataclasses.replace(settings.tiers, ec_storage_bytes=share(settings.tiers.ec_storage_bytes)),
    )


def serve_front(index: int, settings: Settings, sock: socket.socket, conn) -> None:
    """A front end's process: this server's app on the shared socket, with the core behind its engine. Signals are
    the core's: it drains the front end with a Status record, and one whose core is gone exits."""
    from ..ground.logs import configure_logging
    from ..ground.signals import leave_to_owner
    from ..pipeline.engine import Engine
    from ..pipeline.videos import videos_unavailable
    from .server import run_server

    leave_to_owner()
    import torch

    configure_logging(settings.logging.log_format, settings.logging.log_level, bar=False, source=f"api{index}")
    torch.set_num_threads(1)  # a front end runs no tower: its torch work is small, and OpenMP's barrier waits
    videos_unavailable(say=index == 0)  # what the server cannot do, said once: its front ends all find the same
    engine = Engine(settings, core=conn)
    code = run_server(settings, engine, sockets=[sock])
    os._exit(code)
