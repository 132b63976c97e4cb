"""/stats of the whole server: the backend's part (devices, queue, batches, cache, lifecycle) and every front end's
part (requests, decoding, memory, tiers, latencies) summed; a server of one process has one front end."""

from __future__ import annotations

import collections

from ... import __version__
from ..ground.metrics import percentiles
from ..ground.settings import Settings


def front_stats(engine) -> dict:
    """A front end's part of /stats (an engine's: its requests, decoding, memory, tiers and latencies)."""
    count = lambda name: int(engine.metrics.registry.get_sample_value(name) or 0)  # noqa: E731
    return {
        "recent": engine.metrics.recent(),
        "requests_in_flight": engine.in_flight,
        "tiers": engine.tier_figures(),
        "decode_workers": engine.decoder.workers,
        "decode_workers_replaced": engine.decoder.workers_replaced,
        "memory": {
            "bodies": {"limit_bytes": engine.bodies.limit, "bytes": engine.bodies.used},
            "decode": {"limit_bytes": engine.decoder.budget.limit, "bytes": engine.decoder.budget.used},
        },
        "counters": {
            "hits": count("vitserve_cache_hits_total"),
            "misses": count("vitserve_cache_misses_total"),
            "known_hits": count("vitserve_cache_known_hits_total"),
        },
        "videos": {"available": engine.videos_unavailable is None, "reason": engine.videos_unavailable},
    }


def front_total(fronts: list[dict], name: str):
    return sum(part[name] for part in fronts)


def summed_tiers(fronts: list[dict]) -> dict[str, dict]:
    """Each front end's encoder tiers' figures, summed by tier."""
    tiers: dict[str, dict] = {}
    for part in fronts:
        for name, figures in part.get("tiers", {}).items():
            summed = tiers.setdefault(name, dict.fromkeys(figures, 0))
            for key, value in figures.items():
                summed[key] = summed.get(key, 0) + value
    return tiers


def server_stats(
    settings: Settings, backend: dict, fronts: list[dict], api_servers: int | None = None, api_servers_replaced: int = 0
) -> dict:
    """`backend`: LocalBackend.stats; `fronts`: each front end's Engine.collect("stats"); `api_servers`: the front
    ends the server runs (None: one process, which reports no front ends)."""
    recent: dict[str, list] = collections.defaultdict(list)
    for part in [backend, *fronts]:
        for phase, values in part["recent"].items():
            recent[phase] += values
    count = lambda name: sum(int(part["counters"].get(name, 0)) for part in fronts)  # noqa: E731
    memory = {
        use: {
            "limit_bytes": sum(p["memory"][use]["limit_bytes"] for p in fronts),
            "bytes": sum(p["memory"][use]["bytes"] for p in fronts),
        }
        for use in ("bodies", "decode")
    }
    cache = backend["cache"] | {"hits": count("hits"), "misses": count("misses"), "known_hits": count("known_hits")}
    cache = {
        key: cache[key]
        for key in ("enabled", "limit_bytes", "bytes", "entries", "hits", "misses", "known_hits", "evictions")
    }
    batching = settings.batching_stats(front_total(fronts, "decode_workers"))
    topology = {}
    if api_servers is not None:
        batching |= {"api_servers": api_servers}
        topology = {"api_servers_replaced": api_servers_replaced, "api_servers": len(fronts)}
    stats = {
        "version": __version__,
        "model": settings.model.name,
        "state": backend["state"],
        "error": backend["error"],
        "device": backend["device"],
        "devices": backend["devices"],
        "latency": percentiles(recent),
        "dtype": backend["dtype"],
        "family": backend["family"],
        "uptime_seconds": backend["uptime_seconds"],
        "load_seconds": backend["load_seconds"],
        "requests_in_flight": front_total(fronts, "requests_in_flight"),
        "queue_depth": backend["queue_depth"],
        "tiers": summed_tiers(fronts),
        "batch_size_histogram": backend["batch_size_histogram"],
        "spool": backend["spool"],
        "device_processes": backend["device_processes"],
        "decode_workers_replaced": front_total(fronts, "decode_workers_replaced"),
        **topology,
        "cache": cache,
        "batching": batching,
        "eager_runs": backend["eager_runs"],
        "memory": memory,
        "eager_fallbacks": backend["eager_fallbacks"],
    }
    if fronts:
        stats["videos"] = fronts[0]["videos"]
    return stats
