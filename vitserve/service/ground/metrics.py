"""Prometheus collectors, all named vitserve_* (plus process_*), on a registry of the app's own (so several apps can
coexist), and the recent latencies per phase that /stats reports as percentiles."""

from __future__ import annotations

import collections
import math
import platform
import threading

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no *_created series beside every counter and histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384)
PHASES = ("decode", "queue", "inference", "serialize", "request")  # what /stats reports percentiles of
RECENT = 2048  # latencies kept per phase for those percentiles


def outcome(status: int) -> str:
    """A response's outcome label: ok, client_error or server_error (fast failures apart from real work)."""
    return "ok" if status < 400 else "client_error" if status < 500 else "server_error"


def count_items(metrics: Metrics, device: str, batch: list) -> None:
    """A batch's items counted by modality: images, and video slices."""
    slices = sum(item.modality == "video" for item in batch)
    metrics.images.labels(device).inc(len(batch) - slices)
    if slices:
        metrics.video_slices.labels(device).inc(slices)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self._declare_counts(self.registry)
        self._declare_times(self.registry)
        self._declare_state(self.registry)
        self._runners = None
        self._tiers = None
        self._recent = {phase: collections.deque(maxlen=RECENT) for phase in PHASES}
        self._lock = threading.Lock()

    def _declare_counts(self, r: CollectorRegistry) -> None:
        """The build and the counts: requests, images, videos and what was decoded of them."""
        self.build = Info("vitserve_build", "The running vitserve: version, python, torch, model", registry=r)
        self.requests = Counter(
            "vitserve_requests", "HTTP requests by endpoint and status code", ["endpoint", "code"], registry=r
        )
        self.images = Counter("vitserve_images", "Images encoded (video slices apart)", ["device"], registry=r)
        self.videos = Counter(
            "vitserve_videos_decoded",
            "Videos decoded, by the decoder that decoded them (cpu, or "
            "nvdec with --video-decoder nvdec where the GPU's video engines took the video)",
            ["decoder"],
            registry=r,
        )
        self.video_slices = Counter(
            "vitserve_video_slices", "Video slices (a temporal patch of frames each) encoded", ["device"], registry=r
        )
        self.video_frames = Counter(
            "vitserve_video_frames", "Frames sampled from videos (decoded, converted and resized)", registry=r
        )
        self.video_seconds = Counter(
            "vitserve_video_seconds", "Seconds of video decoded (their declared durations)", registry=r
        )

    def _declare_times(self, r: CollectorRegistry) -> None:
        """The latencies: queueing, decoding, inference, serialization, whole requests."""
        self.queue_seconds = Histogram(
            "vitserve_queue_seconds", "Time an image waited for its batch", buckets=LATENCY_BUCKETS, registry=r
        )
        self.preprocess_seconds = Histogram(
            "vitserve_preprocess_seconds",
            "Decode + resize work per image, in its decode worker",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_seconds = Histogram(
            "vitserve_decode_seconds",
            "Wall time from handing an image (or a video, its "
            "header read) to the decode pool to getting its pixels back (pool queueing "
            "included)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inference_seconds = Histogram(
            "vitserve_inference_seconds",
            "Device time per batch (incl. copies)",
            ["device"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.serialize_seconds = Histogram(
            "vitserve_serialize_seconds",
            "Building a response body from its embeddings (conversion, base64, JSON or safetensors)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_seconds = Histogram(
            "vitserve_request_seconds",
            "End-to-end request time, by endpoint and outcome (ok, client_error, server_error)",
            ["endpoint", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def _declare_state(self, r: CollectorRegistry) -> None:
        """What is held now, and per batch: the queue, requests in flight, batches, the cache, memory, readiness."""
        self.queue_depth = Gauge("vitserve_queue_depth", "Images waiting for a batch", registry=r)
        self.requests_in_flight = Gauge("vitserve_requests_in_flight", "Admitted requests not yet answered", registry=r)
        self.batch_tokens = Histogram(
            "vitserve_batch_tokens", "Vision tokens per batch", buckets=TOKEN_BUCKETS, registry=r
        )
        self.batch_images = Histogram(
            "vitserve_batch_images",
            "Items (images and video slices) per batch",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.dropped = Counter(
            "vitserve_dropped_images",
            "Images dropped because their client went away (being decoded or waiting for a batch)",
            registry=r,
        )
        self.cache_hits = Counter("vitserve_cache_hits", "Images answered from the embedding cache", registry=r)
        self.cache_misses = Counter("vitserve_cache_misses", "Images encoded while the cache is on", registry=r)
        self.cache_known_hits = Counter(
            "vitserve_cache_known_hits",
            "Cache hits a front end answered from an entry it knew, without asking the core (several front ends)",
            registry=r,
        )
        self.cache_evictions = Counter("vitserve_cache_evictions", "Cache entries dropped for room", registry=r)
        self.cache_bytes = Gauge("vitserve_cache_bytes", "Bytes held by the embedding cache", registry=r)
        self.cache_entries = Gauge("vitserve_cache_entries", "Images held by the embedding cache", registry=r)
        self.memory_held = Gauge(
            "vitserve_memory_held_bytes",
            "Host memory counted against a budget: request bodies "
            "(--body-memory) and images being decoded (--decode-memory)",
            ["use"],
            registry=r,
        )
        self.ready = Gauge("vitserve_ready", "1 when the model is loaded, graphs captured and not draining", registry=r)

    def describe_build(self, **labels: str) -> None:
        from ... import __version__

        self.build.info({"version": __version__, "python": platform.python_version(), **labels})

    def record(self, phase: str, seconds: float) -> None:
        """One latency of `phase` for /stats's percentiles (the histograms are observed where it is measured)."""
        with self._lock:
            self._recent[phase].append(seconds)

    def recent(self) -> dict[str, list[float]]:
        """The recent latencies of each phase, in seconds."""
        with self._lock:
            return {phase: list(values) for phase, values in self._recent.items()}

    def percentiles(self) -> dict:
        """p50 and p99 in ms of the recent latencies of each phase (None before the first)."""
        return percentiles(self.recent())

    def watch_runners(self, stats_by_device) -> None:
        """Graph-cache figures read from the runners' own counters at scrape time (never out of step)."""
        if self._runners is not None:
            self.registry.unregister(self._runners)
        self._runners = _RunnerCollector(stats_by_device)
        self.registry.register(self._runners)

    def watch_tiers(self, figures) -> None:
        """The encoder tiers' figures (`figures()`: by tier, `TIER_SERIES`'s keys) read at scrape time."""
        if self._tiers is not None:
            self.registry.unregister(self._tiers)
        self._tiers = _TierCollector(figures)
        self.registry.register(self._tiers)


# the encoder tiers' series: (tier, figure) -> (name, type, help, labels)
TIER_SERIES = {
    ("ec_storage", "limit_bytes"): ("vitserve_ec_limit_bytes", "gauge", "What --ec-shared-storage's files may take"),
    ("ec_storage", "bytes"): ("vitserve_ec_bytes", "gauge", "Bytes of the encoder-cache files"),
    ("ec_storage", "files"): ("vitserve_ec_files", "gauge", "Encoder-cache files (items)"),
    ("ec_storage", "writes"): ("vitserve_ec_writes", "counter", "Encoder-cache files written"),
    ("ec_storage", "evictions"): ("vitserve_ec_evictions", "counter", "Encoder-cache files removed for room"),
    ("ec_storage", "write_failures"): (
        "vitserve_ec_write_failures",
        "counter",
        "Requests whose encoder-cache files could not be written",
    ),
    ("sglang", "parts_encoding"): ("vitserve_sglang_parts_encoding", "gauge", "SGLang parts an /encode serves"),
    ("sglang", "parts_waiting_for_encode"): (
        "vitserve_sglang_parts_waiting",
        "gauge",
        "SGLang parts whose receivers registered, with no /encode yet",
    ),
    ("sglang", "sockets"): ("vitserve_sglang_sockets", "gauge", "ZMQ sockets open to SGLang's receivers"),
    ("sglang", "deliveries"): ("vitserve_sglang_deliveries", "counter", "Messages handed to an SGLang receiver"),
    ("sglang", "delivery_failures"): (
        "vitserve_sglang_delivery_failures",
        "counter",
        "Messages an SGLang receiver's socket refused",
    ),
    ("sglang", "delivery_timeouts"): (
        "vitserve_sglang_delivery_timeouts",
        "counter",
        "Messages no SGLang receiver took within --sglang-timeout",
    ),
    ("sglang", "registration_timeouts"): (
        "vitserve_sglang_registration_timeouts",
        "counter",
        "SGLang parts whose receivers did not register within --sglang-timeout",
    ),
}


class _TierCollector:
    def __init__(self, figures):
        self.figures = figures

    def collect(self):
        for tier, values in self.figures().items():
            for key, value in values.items():
                if (tier, key) not in TIER_SERIES:
                    continue
                name, kind, help = TIER_SERIES[tier, key]
                family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, help)
                family.add_metric([], value)
                yield family


def percentiles(recent: dict[str, list[float]]) -> dict:
    """p50 and p99 in ms of each phase's latencies (None where there are none), and how many."""
    out = {}
    for phase, values in recent.items():
        values = sorted(values)
        pick = (
            (lambda q: round(values[min(len(values) - 1, int(q * len(values)))] * 1e3, 3))
            if values
            else (lambda q: None)
        )
        out[phase] = {"p50_ms": pick(0.5), "p99_ms": pick(0.99), "count": len(values)}
    return out


class _RunnerCollector:
    def __init__(self, stats_fn):
        self.stats_fn = stats_fn

    def collect(self):
        by_device = self.stats_fn()
        replays = CounterMetricFamily("vitserve_graph_replays", "CUDA graph replays", labels=["device", "budget"])
        padded = CounterMetricFamily(
            "vitserve_graph_padded_patches", "Padding patches run", labels=["device", "budget"]
        )
        real = CounterMetricFamily(
            "vitserve_graph_real_patches", "Real patches run in budgets", labels=["device", "budget"]
        )
        eager = CounterMetricFamily(
            "vitserve_eager_fallbacks",
            "Images run eagerly on a device with graphs, being larger than the largest budget",
            labels=["device"],
        )
        eager_runs = CounterMetricFamily(
            "vitserve_eager_runs",
            "Batches run eagerly (every batch where no graph "
            "runs: CPU, float32; else the images larger than the largest budget)",
            labels=["device"],
        )
        eager_patches = CounterMetricFamily(
            "vitserve_eager_patches", "Patches of the batches run eagerly", labels=["device"]
        )
        pool = GaugeMetricFamily("vitserve_graph_pool_bytes", "CUDA graph memory pool", labels=["device"])
        capture = GaugeMetricFamily("vitserve_graph_capture_seconds", "Time to capture all budgets", labels=["device"])
        for device, stats in by_device.items():
            for budget, s in stats["budgets"].items():
                replays.add_metric([device, budget], s["replays"])
                padded.add_metric([device, budget], s["padded_patches"])
                real.add_metric([device, budget], s["real_patches"])
            eager.add_metric([device], stats["eager_fallbacks"])
            eager_runs.add_metric([device], stats["eager_runs"])
            eager_patches.add_metric([device], stats["eager_patches"])
            pool.add_metric([device], stats["pool_bytes"])
            capture.add_metric([device], stats["capture_seconds"])
        yield from (replays, padded, real, eager, eager_runs, eager_patches, pool, capture)


def merged_metrics(texts: list[str]) -> str:
    """The exposition texts of every process's registry in one (the first: the process that holds the devices): the
    same series summed (counters, histograms, the gauges of what each holds), where one value stands for the server
    (its build, its readiness, the start time) the first's. One text is the server's as it is."""
    from prometheus_client.parser import text_string_to_metric_families

    if len(texts) == 1:
        return texts[0]

    families: dict[str, list] = {}  # name -> [type, help, {(sample name, labels): value}]
    own = {"vitserve_build_info", "vitserve_ready", "process_start_time_seconds", "process_max_fds"}
    for n, text in enumerate(texts):
        for family in text_string_to_metric_families(text):
            entry = families.setdefault(family.name, [family.type, family.documentation, {}])
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if sample.name in own:
                    entry[2].setdefault(key, sample.value) if n == 0 else None
                else:
                    entry[2][key] = entry[2].get(key, 0.0) + sample.value
    lines = []
    for name, (kind, help, samples) in families.items():
        name += "_total" if kind == "counter" else ""  # the parser names a counter without its suffix
        lines += [
            f"# HELP {name} {help.replace(chr(92), chr(92) * 2).replace(chr(10), chr(92) + 'n')}",
            f"# TYPE {name} {kind}",
        ]
        for (sample, labels), value in samples.items():
            text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            lines.append(f"{sample}{{{text}}} {_number(value)}" if text else f"{sample} {_number(value)}")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    return repr(float(value)) if not math.isinf(value) else ("+Inf" if value > 0 else "-Inf")
