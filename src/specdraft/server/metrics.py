"""Prometheus metrics of one app, in its own CollectorRegistry (two apps in a process never mix).

Requests by route and status and their latency; what became of each draft request (answered, timed out,
cancelled by its client, refused for overload, a full queue or shutdown, failed) and the work dropped for the
abandoned ones; the drafts their stop rule ended early and the tokens not drafted; the scheduler's iterations (rows
decoded together, prefill tokens, time); the queue; the prefix cache (context tokens reused instead of computed,
hits, evictions, its budget and use, read from the cache when scraped); and the process itself (resident memory,
CPU seconds, open files: prometheus_client's process collector).
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from specdraft.model.prefix_cache import PrefixCacheStats

ROUTES = ("/draft", "/health", "/metrics", "/openapi.json")
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
WAIT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITERATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specdraft_requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=r)
        self.latency = Histogram("specdraft_request_seconds", "HTTP request latency by route, from the request's "
                                 "arrival to its response", ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.outcomes = Counter("specdraft_draft_outcomes", "what became of each POST /draft: answered, timed_out, "
                                "cancelled (the client went away), refused_overload, refused_queue_full, "
                                "refused_shutdown, failed", ["outcome"], registry=r)
        self.dropped_requests = Counter("specdraft_dropped", "requests the scheduler dropped because nobody waited "
                                        "for them any more, by where they were (queued: never computed; running: "
                                        "stopped mid-draft) and why", ["where", "outcome"], registry=r)
        self.rows = Histogram("specdraft_iteration_rows", "rows decoded together in one scheduler iteration",
                              buckets=ROW_BUCKETS, registry=r)
        self.queue_wait = Histogram("specdraft_queue_wait_seconds", "time from enqueue to the start of its prefill",
                                    buckets=WAIT_BUCKETS, registry=r)
        self.iteration_seconds = Histogram("specdraft_iteration_seconds", "model time per scheduler iteration (one "
                                           "decode step of the live rows + budgeted prefill)",
                                           buckets=ITERATION_BUCKETS, registry=r)
        self.tokens = Counter("specdraft_draft_tokens", "draft tokens returned", registry=r)
        self.stopped_drafts = Counter("specdraft_drafts_stopped", "drafts ended short of num_tokens by their "
                                      "request's stop_confidence", registry=r)
        self.stopped_tokens = Counter("specdraft_draft_tokens_not_drafted", "tokens stopped drafts did not draft "
                                      "(num_tokens less the tokens returned): the decode steps saved", registry=r)
        self.context_tokens = Counter("specdraft_context_tokens", "context tokens computed (prefilled); those copied "
                                      "from the prefix cache instead: specdraft_context_tokens_reused", registry=r)
        self.failures = Counter("specdraft_iteration_failures", "scheduler iterations whose model call raised",
                                registry=r)
        self.queue_depth = Gauge("specdraft_queue_depth", "requests waiting for the worker", registry=r)
        self.running = Gauge("specdraft_rows_running", "requests in the lanes (prefilling or decoding)", registry=r)
        self.ready = Gauge("specdraft_ready", "1 once the weights are loaded and the worker runs", registry=r)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        self._prefix_cache = PrefixCacheCollector()
        r.register(self._prefix_cache)

    def watch_prefix_cache(self, stats: Callable[[], PrefixCacheStats]) -> None:
        """Scrape the prefix cache's counters and use from ``stats`` (until then: no cache, all zero)."""
        self._prefix_cache.stats = stats

    # scheduler.Observer, called from the worker thread (prometheus_client metrics are thread-safe)
    def iteration(self, seconds: float, rows: int, prefill_tokens: int, ok: bool) -> None:
        self.iteration_seconds.observe(seconds)
        if rows:
            self.rows.observe(rows)
        self.context_tokens.inc(prefill_tokens)
        if not ok:
            self.failures.inc()

    def admitted(self, queue_waits: list[float]) -> None:
        for w in queue_waits:
            self.queue_wait.observe(w)

    def dropped(self, outcome: str, running: bool) -> None:
        self.dropped_requests.labels("running" if running else "queued", outcome).inc()

    def depth(self, waiting: int, running: int) -> None:
        self.queue_depth.set(waiting)
        self.running.set(running)

    # the HTTP side
    def outcome(self, outcome: str, tokens: int = 0) -> None:
        self.outcomes.labels(outcome).inc()
        self.tokens.inc(tokens)

    def stopped(self, tokens_not_drafted: int) -> None:
        self.stopped_drafts.inc()
        self.stopped_tokens.inc(tokens_not_drafted)

    def request_done(self, path: str, status: int, seconds: float) -> None:
        route = path if path in ROUTES else "other"
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PrefixCacheCollector(Collector):
    """The prefix cache's figures, read from the cache at each scrape (it counts them itself, under its lock)."""

    def __init__(self) -> None:
        self.stats: Callable[[], PrefixCacheStats] | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.stats() if self.stats is not None else None
        value = (lambda name: getattr(s, name)) if s is not None else (lambda name: 0)
        yield CounterMetricFamily("specdraft_context_tokens_reused", "context tokens copied from the prefix cache "
                                  "instead of computed", value=value("reused_tokens"))
        yield CounterMetricFamily("specdraft_prefix_cache_lookups", "prefills that looked for their context's "
                                  "prefix in the cache", value=value("lookups"))
        yield CounterMetricFamily("specdraft_prefix_cache_hits", "prefills that reused at least one cached block",
                                  value=value("hits"))
        yield CounterMetricFamily("specdraft_prefix_cache_evictions", "blocks evicted (least recently used first) "
                                  "to stay within the budget", value=value("evicted_blocks"))
        yield GaugeMetricFamily("specdraft_prefix_cache_budget_bytes", "the prefix cache's budget (0: no cache)",
                                value=value("budget_bytes"))
        yield GaugeMetricFamily("specdraft_prefix_cache_bytes", "bytes of KV the prefix cache holds",
                                value=value("used_bytes"))
        yield GaugeMetricFamily("specdraft_prefix_cache_blocks", "blocks the prefix cache holds", value=value("blocks"))
