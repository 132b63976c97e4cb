"""Prometheus collectors, all named vitserve_*, on a registry of the app's own (so several apps can coexist)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("vitserve_requests", "HTTP requests by endpoint and outcome", ["endpoint", "outcome"],
                                registry=r)
        self.images = Counter("vitserve_images", "Images encoded", registry=r)
        self.queue_seconds = Histogram("vitserve_queue_seconds", "Time an image waited for its batch",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.preprocess_seconds = Histogram("vitserve_preprocess_seconds", "Decode + preprocess time per image",
                                            buckets=LATENCY_BUCKETS, registry=r)
        self.inference_seconds = Histogram("vitserve_inference_seconds", "Device time per batch (incl. copies)",
                                           buckets=LATENCY_BUCKETS, registry=r)
        self.request_seconds = Histogram("vitserve_request_seconds", "End-to-end request time", ["endpoint"],
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("vitserve_queue_depth", "Images waiting for a batch", registry=r)
        self.requests_in_flight = Gauge("vitserve_requests_in_flight", "Admitted requests not yet answered",
                                        registry=r)
        self.batch_tokens = Histogram("vitserve_batch_tokens", "Vision tokens per batch", buckets=TOKEN_BUCKETS,
                                      registry=r)
        self.batch_images = Histogram("vitserve_batch_images", "Images per batch", buckets=(1, 2, 4, 8, 16, 32, 64),
                                      registry=r)
        self.dropped = Counter("vitserve_dropped_images", "Queued images dropped because their client went away",
                               registry=r)
        self.ready = Gauge("vitserve_ready", "1 when the model is loaded, graphs captured and not draining", registry=r)

    def watch_runner(self, runner_stats) -> None:
        """Graph-cache figures read from the runner's own counters at scrape time (never out of step)."""
        self.registry.register(_RunnerCollector(runner_stats))


class _RunnerCollector:
    def __init__(self, stats_fn):
        self.stats_fn = stats_fn

    def collect(self):
        stats = self.stats_fn()
        replays = CounterMetricFamily("vitserve_graph_replays", "CUDA graph replays (or padded eager runs on CPU)",
                                      labels=["budget"])
        padded = CounterMetricFamily("vitserve_graph_padded_patches", "Padding patches run", labels=["budget"])
        real = CounterMetricFamily("vitserve_graph_real_patches", "Real patches run in budgets", labels=["budget"])
        for budget, s in stats["budgets"].items():
            replays.add_metric([budget], s["replays"])
            padded.add_metric([budget], s["padded_patches"])
            real.add_metric([budget], s["real_patches"])
        yield replays
        yield padded
        yield real
        yield CounterMetricFamily("vitserve_eager_fallbacks", "Images run eagerly (larger than the largest budget)",
                                  value=stats["eager_fallbacks"])
        yield GaugeMetricFamily("vitserve_graph_pool_bytes", "CUDA graph memory pool", value=stats["pool_bytes"])
        yield GaugeMetricFamily("vitserve_graph_capture_seconds", "Time to capture all budgets",
                                value=stats["capture_seconds"])
