"""Prometheus metrics of one app, in its own CollectorRegistry (two apps in a process never mix)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

ROUTES = ("/draft", "/health", "/metrics", "/openapi.json")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
WAIT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
DECODE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specdraft_requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=r)
        self.batch_size = Histogram("specdraft_batch_size", "requests per model step (one draft_batch call)",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.queue_wait = Histogram("specdraft_queue_wait_seconds", "time from enqueue to the start of its batch",
                                    buckets=WAIT_BUCKETS, registry=r)
        self.decode = Histogram("specdraft_decode_seconds", "model time per batch (prefill + n decode steps)",
                                buckets=DECODE_BUCKETS, registry=r)
        self.tokens = Counter("specdraft_draft_tokens", "draft tokens returned", registry=r)
        self.context_tokens = Counter("specdraft_context_tokens", "context tokens prefilled", registry=r)
        self.batch_failures = Counter("specdraft_batch_failures", "model steps that raised", registry=r)
        self.queue_depth = Gauge("specdraft_queue_depth", "requests waiting for the worker", registry=r)
        self.ready = Gauge("specdraft_ready", "1 once the weights are loaded and the worker runs", registry=r)

    # BatchObserver, called from the worker thread (prometheus_client metrics are thread-safe)
    def batch_started(self, size: int, queue_waits: list[float], queue_depth: int) -> None:
        self.batch_size.observe(size)
        for w in queue_waits:
            self.queue_wait.observe(w)
        self.queue_depth.set(queue_depth)

    def batch_finished(self, size: int, seconds: float, tokens: int, context_tokens: int, ok: bool) -> None:
        self.decode.observe(seconds)
        self.tokens.inc(tokens)
        self.context_tokens.inc(context_tokens)
        if not ok:
            self.batch_failures.inc()

    def request_done(self, path: str, status: int) -> None:
        self.requests.labels(path if path in ROUTES else "other", str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
